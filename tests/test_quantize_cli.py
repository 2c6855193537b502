"""``hybridllm quantize``: GGUF files that llama.cpp reads and our loader keeps quantized; the
``--weights`` option of ``generate``."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from hybridllm.cli import app
from hybridllm.loading.gguf import GGUFFile

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def quantized_files(tiny_models, tmp_path_factory):
    """qtype -> a file written by ``hybridllm quantize`` from the tiny llama Hugging Face folder."""
    folder = tiny_models["llama"][0]
    root = tmp_path_factory.mktemp("quantize")
    out = {}
    for qtype in ("q4_0", "q4_1", "q8_0"):
        result = invoke("quantize", folder, root / f"tiny-{qtype}.gguf", "--type", qtype)
        assert result.exit_code == 0, result.output
        assert "wrote" in result.output
        out[qtype] = root / f"tiny-{qtype}.gguf"
    return out


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_quantize_writes_expected_types_and_we_keep_them(quantized_files, qtype):
    from hybridllm import LLM

    f = GGUFFile(quantized_files[qtype])
    types = Counter(info.type_name for name, info in f.tensors.items() if name.startswith("blk.") and len(info.shape) == 2)
    matrices = {name: info.type_name for name, info in f.tensors.items() if len(info.shape) == 2}
    assert matrices["blk.0.attn_q.weight"] == qtype.upper() and matrices["blk.1.ffn_down.weight"] == qtype.upper()
    assert matrices["token_embd.weight"] == "Q8_0" and matrices["output.weight"] == "Q8_0"
    assert all(info.type_name == "F32" for info in f.tensors.values() if len(info.shape) == 1)  # norms
    assert types == {qtype.upper(): 2 * 7}  # two layers of seven projections
    llm = LLM(quantized_files[qtype], weights="auto")
    # the native kernels keep the file's type as it is; PyTorch's path (no compiler) converts it
    kept = qtype if llm.runtime.runner.backend.name == "native" else ("int8" if qtype == "q8_0" else "int4")
    assert llm.weights_format == kept


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_llama_cpp_reads_the_file_like_we_do(quantized_files, qtype):
    llama_cpp = pytest.importorskip("llama_cpp")
    from hybridllm import LLM

    path = quantized_files[qtype]
    theirs = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    ids = list(range(5, 25))
    theirs.eval(ids)
    their_logits = np.array(theirs.scores[: len(ids)])
    ours = LLM(path, weights="float")
    with torch.inference_mode():
        our_logits = ours.model(torch.tensor([ids]), ours.new_cache(), start_pos=0, all_logits=True)[0].numpy()
    # llama.cpp quantizes activations to 8 bits, so the logits are close, not equal
    assert np.corrcoef(their_logits.ravel(), our_logits.ravel())[0, 1] > 0.999
    assert (their_logits.argmax(-1) == our_logits.argmax(-1)).mean() >= 0.75


def test_quantize_from_a_float_gguf(tiny_models, tmp_path):
    source = tiny_models["qwen2"][1]  # F32 GGUF with q/k/v biases
    out = tmp_path / "qwen2-q8.gguf"
    result = invoke("quantize", source, out, "--type", "Q8_0")
    assert result.exit_code == 0, result.output
    f = GGUFFile(out)
    assert f.tensors["blk.0.attn_q.weight"].type_name == "Q8_0"
    assert f.tensors["blk.0.attn_q.bias"].type_name == "F32"
    assert f.metadata["tokenizer.ggml.tokens"] == GGUFFile(source).metadata["tokenizer.ggml.tokens"]


def test_quantize_refuses_a_quantized_source(quantized_files, tmp_path):
    result = invoke("quantize", quantized_files["q4_1"], tmp_path / "again.gguf", "--type", "q4_0")
    assert result.exit_code == 2
    assert "already quantized" in result.output and "Q4_1" in result.output
    assert not (tmp_path / "again.gguf").exists()


@pytest.mark.parametrize("args,needle", [
    (["--type", "q3_k"], "unknown quantization type"),
    (["--type", "q4_0"], "does not exist"),
])
def test_quantize_errors(tiny_models, tmp_path, args, needle):
    dst = tmp_path / "out.gguf" if "q3_k" in args else tmp_path / "missing" / "out.gguf"
    result = invoke("quantize", tiny_models["llama"][0], dst, *args)
    assert result.exit_code == 2 and needle in result.output


def test_generate_weights_option(quantized_files):
    result = invoke("generate", "hello", "--model", quantized_files["q4_1"], "--weights", "int4", "--json",
                    "-n", "3", "--temperature", "0", "--ignore-eos", "--no-chat")
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output.strip().splitlines()[-1])["metrics"]
    assert metrics["weights_format"] == "int4"
    assert set(metrics["weight_bytes"]) == {"device", "host"}


def test_generate_rejects_an_unknown_weights_mode(quantized_files):
    result = invoke("generate", "hello", "--model", quantized_files["q4_1"], "--weights", "int2")
    assert result.exit_code == 2 and "weights" in result.output


READ_BACK_TEXTS = ("Hello world", "12345 and 1234567 digits", "  two  spaces,\tand a tab!\n\nnew lines",
                   "naïve café — 東京 😀", "don't STOP, it's fine")


@pytest.mark.parametrize("style,arch", [("llama-bpe", "llama3"), ("qwen2", "qwen2")])
def test_quantize_names_the_pre_tokenizer_and_llama_cpp_tokenizes_like_hf(tmp_path, style, arch):
    """A Llama-3-style and a Qwen2-style tokenizer written by ``quantize``: the file names the
    right pre-tokenizer and BOS rule, and llama.cpp, our reader and Hugging Face give the same ids."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tiny_models import build_hf_model
    from tokenizers import Tokenizer as HFTokenizer

    from hybridllm.loading.tokenizer import Tokenizer

    folder = tmp_path / style
    build_hf_model(folder, arch, tokenizer_style=style)
    out = tmp_path / f"{style}.gguf"
    result = invoke("quantize", folder, out, "--type", "q8_0")
    assert result.exit_code == 0, result.output
    metadata = GGUFFile(out).metadata
    assert metadata["tokenizer.ggml.pre"] == style
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    ours = Tokenizer.from_gguf_metadata(metadata)
    theirs = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    for text in READ_BACK_TEXTS:
        expected = hf.encode(text, add_special_tokens=True).ids  # Llama 3: BOS from the post-processor
        assert ours.encode(text, add_special_tokens=True) == expected, text
        # add_bos=True is llama.cpp's add_special: BOS only where the file says the model adds one
        assert theirs.tokenize(text.encode(), add_bos=True, special=False) == expected, text


@pytest.mark.parametrize("style,space_prefix", [("spm", True), ("gemma", False)])
def test_quantize_writes_sentencepiece_tokenizers_llama_cpp_reads(tmp_path, style, space_prefix):
    """A SentencePiece-style byte-fallback BPE (Llama 2 / Mistral / Phi-3 with a "▁" prefix, Gemma
    without): ``quantize`` writes it as llama.cpp's "llama" vocabulary with scores, byte tokens and
    the space-prefix flag, and llama.cpp, our reader and Hugging Face give the same ids."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tiny_models import build_hf_model
    from tokenizers import Tokenizer as HFTokenizer

    from hybridllm.loading.tokenizer import Tokenizer

    folder = tmp_path / style
    build_hf_model(folder, "llama", tokenizer_style=style)
    out = tmp_path / f"{style}.gguf"
    result = invoke("quantize", folder, out, "--type", "q8_0")
    assert result.exit_code == 0, result.output
    metadata = GGUFFile(out).metadata
    assert metadata["tokenizer.ggml.model"] == "llama" and metadata["tokenizer.ggml.pre"] == "default"
    assert bool(metadata["tokenizer.ggml.add_space_prefix"]) is space_prefix
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    ours = Tokenizer.from_gguf_metadata(metadata)
    theirs = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    for text in READ_BACK_TEXTS + (" leading space", "def add(a, b):\n    return a + b\n"):
        expected = hf.encode(text, add_special_tokens=True).ids
        assert ours.encode(text, add_special_tokens=True) == expected, text
        assert theirs.tokenize(text.encode(), add_bos=True, special=False) == expected, text


def test_quantize_refuses_an_unknown_pre_tokenizer_in_one_line(tiny_models, tmp_path):
    result = invoke("quantize", tiny_models["llama"][0], tmp_path / "x.gguf", "--pre", "klingon")
    assert result.exit_code != 0
    assert "unknown pre-tokenizer 'klingon'" in result.output and "llama-bpe" in result.output
