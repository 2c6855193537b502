"""lm-evaluation-harness on our engine: the in-process model, ``local-completions`` and
``local-chat-completions`` against ``hybridllm serve``, lm-eval's own ``hf`` backend on the same
GGUF, and ``hybridllm eval lm-eval``'s table.

A small multiple-choice task and a small generation task are written here (JSONL + task YAML,
``--include-path``); nothing is downloaded (``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE``).

Measured on the default model (SmolLM2-135M-Instruct, Q4_1), 12 items x 4 choices: the in-process
model and ``local-completions`` agree to ~1e-6 nats; against transformers float32 (``hf``) our
``--weights float`` differs by ~1e-6 mean and ~1e-5 at most, and the file's own 4-bit weights
(``auto``) by ~0.05 mean and ~0.15 at most, with the same accuracy.
"""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from hybridllm.cli import app
from hybridllm.eval.lm_eval_runs import (
    EvalConfiguration,
    MetricRow,
    configurations,
    format_table,
    metric_rows,
    parse_kv_list,
    parse_weights_list,
    with_deltas,
)

runner = CliRunner()

PREAMBLE = ("The following is a multiple choice question about general knowledge, of the kind asked in a quiz "
            "for school children. Read the question carefully, think about the facts that you know about the "
            "world, and then give the one answer that is correct.")
ITEMS = [
    ("What is the capital of France?", ["Berlin", "Paris", "Madrid", "Rome"], 1),
    ("How many legs does a spider have?", ["Six", "Four", "Eight", "Ten"], 2),
    ("Which planet is known as the Red Planet?", ["Mars", "Venus", "Jupiter", "Saturn"], 0),
    ("What is the boiling point of water at sea level in degrees Celsius?", ["50", "90", "100", "120"], 2),
    ("Which animal is the largest mammal?", ["Elephant", "Blue whale", "Giraffe", "Hippopotamus"], 1),
    ("What gas do plants absorb from the air?", ["Oxygen", "Nitrogen", "Helium", "Carbon dioxide"], 3),
    ("Who wrote the play Romeo and Juliet?", ["William Shakespeare", "Charles Dickens", "Mark Twain", "Jane Austen"], 0),
    ("What is the freezing point of water in degrees Celsius?", ["0", "10", "-10", "32"], 0),
    ("How many days are in a week?", ["Five", "Six", "Seven", "Eight"], 2),
    ("Which ocean is the largest?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("What color is the sky on a clear day?", ["Green", "Blue", "Red", "Yellow"], 1),
    ("Which organ pumps blood through the body?", ["Lungs", "Liver", "Heart", "Kidney"], 2),
]
PROMPTS = ["The capital of France is", "Water freezes at a temperature of", "The first day of the week is"]
GEN_TOKENS = 12
THREADS = "1"  # the default model is small; one thread keeps runs steady on a shared CPU


def write_tasks(folder) -> None:
    """``tiny_mc`` (multiple choice) and ``tiny_gen`` (generate_until) in ``folder``."""
    with open(folder / "mc.jsonl", "w") as f:
        for question, choices, answer in ITEMS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for prompt in PROMPTS:
            f.write(json.dumps({"prompt": prompt, "target": ""}) + "\n")
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{PREAMBLE}\\n\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    (folder / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")


# ---- the table: no model -------------------------------------------------------------------------
def test_kv_list_shorthands_and_errors():
    assert parse_kv_list("dynamic, int8,int4,quantized") == [("dynamic", None), ("quantized", 8), ("quantized", 4),
                                                              ("quantized", None)]
    with pytest.raises(ValueError, match="unknown KV cache 'fp8'"):
        parse_kv_list("dynamic,fp8")
    with pytest.raises(ValueError, match="at least one"):
        parse_kv_list(" , ")
    assert parse_weights_list(None) == [None]
    assert parse_weights_list("int4,float,int4") == ["int4", "float"]
    with pytest.raises(ValueError, match="unknown weights mode 'q4'"):
        parse_weights_list("q4")


def test_the_reference_is_dynamic_kv_with_the_least_lossy_weights_and_runs_first():
    configs = configurations([None], parse_kv_list("int8,dynamic,int4"))
    assert configs[0] == EvalConfiguration(None, "dynamic")
    assert [c.kv_label for c in configs] == ["dynamic", "int8", "int4"]
    configs = configurations(["int4", "float"], parse_kv_list("int8"))
    assert configs[0] == EvalConfiguration("float", "dynamic")  # not listed: added as the reference
    assert len(configs) == 3 and all(c.kv_label == "int8" for c in configs[1:])


def test_metric_rows_deltas_and_table():
    results = {"tiny_mc": {"alias": "tiny_mc", "acc,none": 0.75, "acc_stderr,none": 0.13, "acc_norm,none": 0.5,
                           "acc_norm_stderr,none": "N/A"}}
    reference = metric_rows(results, EvalConfiguration(None, "dynamic"), reference=True)
    other = metric_rows({"tiny_mc": {"acc,none": 0.5, "acc_norm,none": 0.5}}, EvalConfiguration(None, "quantized", 4))
    assert [(r.metric, r.value, r.stderr) for r in reference] == [("acc", 0.75, 0.13), ("acc_norm", 0.5, None)]
    rows = with_deltas(reference + other)
    assert [r.delta for r in rows] == [0.0, 0.0, -0.25, 0.0]
    lines = format_table(rows)
    assert lines[0].split() == ["task", "metric", "weights", "kv", "value", "stderr", "delta"]
    assert lines[1].split() == ["tiny_mc", "acc", "auto", "dynamic", "0.7500", "0.1300", "reference"]
    assert lines[3].split() == ["tiny_mc", "acc", "auto", "int4", "0.5000", "-0.2500"]
    assert isinstance(rows[0], MetricRow) and rows[0].to_dict()["reference"] is True


def test_without_lm_eval_one_line_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails
    monkeypatch.delitem(sys.modules, "hybridllm.eval.lm_eval_model", raising=False)
    result = runner.invoke(app, ["eval", "lm-eval", "--tasks", "anything"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: lm-eval is not installed; install it with: pip install 'hybridllm[eval]'"


# ---- on the default model (slow) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, monkeypatch_module):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(folder)
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")  # lm-eval must not reach the network
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield patch


def evaluate(model, task_dir, tasks=("tiny_mc",), **kwargs):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=TaskManager(include_path=str(task_dir)),
                                   log_samples=True, verbosity="ERROR", **kwargs)


def per_item(output, task="tiny_mc") -> list[list[tuple[float, bool]]]:
    """Each document's (log-likelihood, is greedy) per choice."""
    samples = sorted(output["samples"][task], key=lambda s: s["doc_id"])
    return [[tuple(resp[0]) for resp in sample["resps"]] for sample in samples]


def differences(a, b) -> list[float]:
    return [abs(x[0] - y[0]) for doc_a, doc_b in zip(a, b) for x, y in zip(doc_a, doc_b)]


@pytest.fixture(scope="module")
def llm_auto():
    """The default model with its own 4-bit weights, as ``hybridllm serve`` runs it by default."""
    from hybridllm import LLM

    return LLM(device="cpu", threads=int(THREADS))


@pytest.fixture(scope="module")
def in_process(llm_auto, task_dir):
    from hybridllm.eval.lm_eval_model import HybridLLMEvalModel

    return evaluate(HybridLLMEvalModel(llm_auto.runtime, show_progress=False), task_dir)


@pytest.fixture(scope="module")
def served():
    from test_server import serve_process

    with serve_process("--device", "cpu", "--threads", THREADS, "--max-batch", "4") as running:
        yield running


@pytest.fixture(scope="module")
def served_model(served) -> str:
    """The served model's id (lm-eval sends it as ``model``)."""
    import httpx

    return httpx.get(f"{served[0]}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.slow
def test_in_process_model_scores_every_choice(in_process):
    items = per_item(in_process)
    assert len(items) == len(ITEMS) and all(len(doc) == 4 for doc in items)
    assert all(logprob < 0 for doc in items for logprob, _ in doc)
    assert in_process["results"]["tiny_mc"]["acc,none"] >= 0.5  # a 135M model knows most of these


@pytest.mark.slow
def test_local_completions_against_serve_agrees_with_in_process(served, served_model, in_process, task_dir,
                                                                default_model_path, tmp_path, caplog):
    """lm-eval's ``local-completions`` (echo, logprobs, token-id prompts) scores what the in-process model scores."""
    import transformers

    base, _ = served
    tokenizer_dir = tmp_path / "tokenizer"  # lm-eval tokenizes itself: the HF tokenizer of the same GGUF
    transformers.AutoTokenizer.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name
                                               ).save_pretrained(tokenizer_dir)
    with caplog.at_level("WARNING"):
        output = evaluate("local-completions", task_dir, model_args={
            "base_url": f"{base}/v1/completions", "model": served_model, "tokenizer": str(tokenizer_dir),
            "tokenizer_backend": "huggingface", "max_retries": 1, "num_concurrent": 4})
    assert not [r for r in caplog.records if "Retrying" in r.getMessage() or "failed" in r.getMessage()]
    served_items, ours = per_item(output), per_item(in_process)
    assert len(served_items) == len(ITEMS)
    assert max(differences(served_items, ours)) < 1e-3
    assert [[g for _, g in doc] for doc in served_items] == [[g for _, g in doc] for doc in ours]
    assert output["results"]["tiny_mc"]["acc,none"] == in_process["results"]["tiny_mc"]["acc,none"]


@pytest.mark.slow
def test_against_transformers_float32_on_the_same_gguf(in_process, task_dir, default_model_path):
    """lm-eval's own ``hf`` backend (transformers float32 dequantizes the GGUF): our 4-bit kernels stay
    within llama.cpp's distance of it, our float weights match it."""
    from hybridllm import LLM
    from hybridllm.eval.lm_eval_model import HybridLLMEvalModel

    hf = evaluate("hf", task_dir, model_args={"pretrained": str(default_model_path.parent),
                                              "gguf_file": default_model_path.name, "dtype": "float32",
                                              "add_bos_token": False, "device": "cpu"}, batch_size=8)
    reference = per_item(hf)
    auto = differences(per_item(in_process), reference)
    assert sum(auto) / len(auto) <= 0.25 and max(auto) <= 1.2
    accuracy = hf["results"]["tiny_mc"]["acc,none"]
    assert abs(in_process["results"]["tiny_mc"]["acc,none"] - accuracy) <= 1 / len(ITEMS) + 1e-9
    float_model = HybridLLMEvalModel(LLM(device="cpu", threads=int(THREADS), weights="float").runtime,
                                     show_progress=False)
    exact = differences(per_item(evaluate(float_model, task_dir)), reference)
    assert max(exact) < 1e-3  # measured ~1e-5: the same float32 arithmetic


@pytest.mark.slow
def test_generate_until_in_process_and_through_local_chat_completions(served, served_model, llm_auto, task_dir,
                                                                      caplog):
    """Greedy generation stops at the task's stop strings and its token budget, in process (raw
    prompts) and through ``local-chat-completions`` (the chat template, on the server)."""
    from hybridllm import SamplingParams
    from hybridllm.eval.lm_eval_model import HybridLLMEvalModel

    stops = [".", "\n"]
    in_process = evaluate(HybridLLMEvalModel(llm_auto.runtime, show_progress=False), task_dir, tasks=("tiny_gen",))
    expected = [llm_auto.generate(prompt, SamplingParams(max_tokens=GEN_TOKENS, temperature=0, stop=stops)).text
                for prompt in PROMPTS]
    texts = [sample["resps"][0][0] for sample in sorted(in_process["samples"]["tiny_gen"], key=lambda s: s["doc_id"])]
    assert texts == [llm_auto.tokenizer.decode(llm_auto.tokenizer.encode(t, add_special_tokens=False)) for t in expected]
    assert all(t and "." not in t and "\n" not in t for t in texts)

    base, _ = served
    with caplog.at_level("WARNING"):
        chat = evaluate("local-chat-completions", task_dir, tasks=("tiny_gen",), apply_chat_template=True,
                        model_args={"base_url": f"{base}/v1/chat/completions", "model": served_model,
                                    "max_retries": 1})
    assert not [r for r in caplog.records if "Retrying" in r.getMessage() or "failed" in r.getMessage()]
    expected = [llm_auto.generate([{"role": "user", "content": prompt}],
                                  SamplingParams(max_tokens=GEN_TOKENS, temperature=0, stop=stops)).text
                for prompt in PROMPTS]
    texts = [sample["resps"][0][0] for sample in sorted(chat["samples"]["tiny_gen"], key=lambda s: s["doc_id"])]
    assert texts == expected and all(texts)
    assert all("." not in t and "\n" not in t for t in texts)


@pytest.mark.slow
def test_cli_table_over_kv_formats(in_process, task_dir, tmp_path):
    """``eval lm-eval --kv-cache dynamic,int4``: one row per format, the dynamic one the
    reference with the in-process run's accuracy (int8 takes the same path: one lossy format keeps
    the suite short). A prefill chunk of 64 with no residual window
    makes the prompt's second chunk read the first 64 tokens back from the quantized cache."""
    out = tmp_path / "table.json"
    result = runner.invoke(app, ["eval", "lm-eval", "--tasks", "tiny_mc", "--include-path", str(task_dir),
                                 "--kv-cache", "dynamic,int4", "--device", "cpu", "--threads", THREADS,
                                 "--prefill-chunk", "64", "--kv-residual", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith(("task", "tiny_mc"))]
    assert lines[0].split() == ["task", "metric", "weights", "kv", "value", "stderr", "delta"]
    assert [line.split()[3] for line in lines[1:]] == ["dynamic", "int4"]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["reference"] == {"weights": "auto", "kv_cache": "dynamic"}
    assert rows[0]["reference"] and rows[0]["delta"] == 0.0
    assert rows[0]["value"] == in_process["results"]["tiny_mc"]["acc,none"]
    assert lines[1].split()[4] == f"{rows[0]['value']:.4f}" and lines[1].endswith("reference")
    for row, line in zip(rows[1:], lines[2:]):
        assert row["delta"] == pytest.approx(row["value"] - rows[0]["value"])
        assert line.split()[-1] == f"{row['delta']:+.4f}"
