"""``hybridllm eval perplexity``: windows, the NLL/KL arithmetic, chunking, the reference, the
CLI's JSON, KV flags, and the shipped evaluation text."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from hybridllm.cli import app
from hybridllm.eval.perplexity import default_text_path, evaluate_perplexity, load_text, windows

runner = CliRunner()
JSON_KEYS = {"perplexity", "reference_perplexity", "delta_percent", "kl_divergence", "tokens"}
SETUP_KEYS = {"model", "device", "text", "measured", "reference"}  # what was measured, against what


@pytest.fixture(scope="module")
def tiny_q4(tiny_models, tmp_path_factory):
    from tiny_models import save_as_gguf

    return save_as_gguf(tiny_models["llama"][0], tmp_path_factory.mktemp("ppl") / "tiny-q4_1.gguf", "Q4_1")


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 6)
    return path


def test_windows_are_non_overlapping_and_drop_single_tokens():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError):
        windows([1, 2, 3], 1)


def test_perplexity_equals_a_direct_computation(tiny_models, shared_llm):
    llm = shared_llm(model=tiny_models["llama"][1])
    ids = list(range(3, 60))
    result = evaluate_perplexity(llm.runtime, llm.runtime, ids, context=20, chunk=7)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for window in windows(ids, 20):
            logits = llm.model(torch.tensor([window]), llm.new_cache(), start_pos=0, all_logits=True)[0]
            logp = F.log_softmax(logits[:-1].float(), dim=-1)
            nll -= logp.gather(-1, torch.tensor(window[1:])[:, None]).sum().item()
            count += len(window) - 1
    assert result.tokens == count == (20 - 1) * 2 + (17 - 1)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert result.reference_perplexity == result.perplexity
    assert result.delta_percent == 0 and result.kl_divergence == 0


def test_int4_weights_against_the_float_reference(tiny_q4):
    from hybridllm import LLM

    test, ref = LLM(tiny_q4, weights="int4"), LLM(tiny_q4, weights="float")
    ids = list(range(3, 80))
    result = evaluate_perplexity(test.runtime, ref.runtime, ids, context=32, chunk=16)
    same = evaluate_perplexity(ref.runtime, ref.runtime, ids, context=32, chunk=32)
    assert result.reference_perplexity == pytest.approx(same.perplexity, rel=1e-4)  # chunking does not matter
    assert 0 < result.kl_divergence < 0.05
    assert result.delta_percent == pytest.approx(100 * (result.perplexity / result.reference_perplexity - 1))
    assert abs(result.delta_percent) < 10


def test_cli_json_has_exactly_the_promised_keys(tiny_q4, tiny_text):
    result = runner.invoke(app, ["eval", "perplexity", "--model", str(tiny_q4), "--text", str(tiny_text),
                                 "--context", "32", "--weights", "int4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert set(data) == JSON_KEYS | SETUP_KEYS
    assert data["tokens"] > 0 and data["kl_divergence"] > 0 and data["perplexity"] > 1
    assert data["model"] == "tiny-q4_1" and data["text"] == str(tiny_text)
    assert data["measured"] == {"weights": "int4", "weights_format": "int4", "dtype": "float32", "kv_cache": "dynamic"}
    assert data["reference"] == {"weights": "float", "weights_format": "float32", "dtype": "float32",
                                 "kv_cache": "dynamic"}


def test_without_flags_it_measures_the_served_weights_against_the_float_reference(tiny_q4, tiny_text):
    """No --weights or --device: what generate would serve (auto: the file's Q4_1 kept as it is, on
    --device auto) against the float32 reference, named in the header; the delta is not float vs float."""
    from hybridllm.config import resolve_device

    plain = runner.invoke(app, ["eval", "perplexity", "--model", str(tiny_q4), "--text", str(tiny_text)])
    assert plain.exit_code == 0, plain.output
    lines = plain.output.splitlines()
    assert lines[0].startswith(f"model      tiny-q4_1 on {resolve_device('auto')}, text ")
    assert lines[1] == "measured   weights auto -> q4_1, float32 compute, dynamic KV  (as generate and serve run it)"
    assert lines[2].startswith("reference  weights float -> float32, float32 compute, dynamic KV  (the same file")
    delta = next(line for line in lines if line.startswith("delta"))
    assert delta != "delta                +0.000 %" and delta != "delta                -0.000 %", delta
    data = json.loads(runner.invoke(app, ["eval", "perplexity", "--model", str(tiny_q4), "--text", str(tiny_text),
                                          "--json"]).output.strip().splitlines()[-1])
    assert data["device"] == resolve_device("auto") and data["measured"]["weights"] == "auto"
    assert data["measured"]["weights_format"] == "q4_1" and data["kl_divergence"] > 0
    assert data["delta_percent"] != 0 and data["perplexity"] != data["reference_perplexity"]


def test_cli_float_weights_are_the_reference_itself(tiny_q4, tiny_text):
    result = runner.invoke(app, ["eval", "perplexity", "--model", str(tiny_q4), "--text", str(tiny_text),
                                 "--context", "32", "--max-tokens", "40", "--weights", "float"])
    assert result.exit_code == 0, result.output
    assert "the measured configuration itself" in result.output
    assert "perplexity" in result.output and "delta                +0.000 %" in result.output


def test_cli_int8_activations_are_measured_and_named(tiny_q4, tiny_text):
    args = ["eval", "perplexity", "--model", str(tiny_q4), "--text", str(tiny_text), "--context", "64", "--json"]
    exact = json.loads(runner.invoke(app, args).output.strip().splitlines()[-1])
    result = runner.invoke(app, [*args, "--activations", "int8"])
    assert result.exit_code == 0, result.output
    one_digit = json.loads(result.output.strip().splitlines()[-1])
    assert one_digit["measured"] == {**exact["measured"], "activations": "int8"}
    assert one_digit["kl_divergence"] > 10 * exact["kl_divergence"] > 0


@pytest.mark.slow
def test_default_model_without_weight_flags_reports_its_q4_1_weights_delta():
    result = runner.invoke(app, ["eval", "perplexity", "--max-tokens", "256", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert data["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert data["measured"] == {"weights": "auto", "weights_format": "q4_1", "dtype": "float32", "kv_cache": "dynamic"}
    assert data["reference"]["weights_format"] == "float32"
    assert data["delta_percent"] != 0 and data["kl_divergence"] > 0


@pytest.mark.parametrize("kv_args", [["--kv-cache", "quantized", "--kv-bits", "4", "--kv-residual", "8"],
                                     ["--kv-cache", "tiered", "--kv-cold-bits", "4", "--kv-hot-window", "8",
                                      "--kv-page-size", "8"]])
def test_cli_passes_kv_flags(tiny_q4, tiny_text, kv_args):
    result = runner.invoke(app, ["eval", "perplexity", "--model", str(tiny_q4), "--text", str(tiny_text),
                                 "--context", "128", "--chunk", "8", "--json", *kv_args])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert data["kl_divergence"] > 0  # older KV tokens were read back at 4 bits


@pytest.mark.parametrize("args,needle", [
    (["--text", "/nonexistent/text.txt"], "not found"),
    (["--context", "1"], "context"),
    (["--weights", "int3"], "weights"),
    (["--max-tokens", "1"], "max-tokens"),
])
def test_cli_errors(tiny_q4, tiny_text, args, needle):
    base = ["eval", "perplexity", "--model", str(tiny_q4)]
    if "--text" not in args:
        base += ["--text", str(tiny_text)]
    result = runner.invoke(app, [*base, *args])
    assert result.exit_code == 2 and needle in result.output


def test_default_text_is_long_enough(default_model_path):
    from hybridllm.loading.gguf import GGUFFile
    from hybridllm.loading.tokenizer import Tokenizer

    path = default_text_path()
    assert path.parent.name == "eval"
    text = load_text()
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path).metadata)
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= 20_000
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    assert len(set(paragraphs)) == len(paragraphs) > 100  # prose, not repetition
