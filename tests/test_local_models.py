"""Model names found on this machine (the Hugging Face cache, the default model's package) and the
llama.cpp-style words of the command line (-p, -c, --temp, --repeat-penalty, --version, models)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridllm.cli import app
from hybridllm.errors import ModelLoadError
from hybridllm.loading.gguf import GGUFCheckpoint
from hybridllm.loading.local_models import find_model, local_models
from hybridllm.loading.registry import open_checkpoint
from hybridllm.loading.safetensors import HFCheckpoint


@pytest.fixture()
def hub(tmp_path, tiny_models, monkeypatch) -> Path:
    """A Hugging Face cache with a GGUF repo (``org/tiny-gguf``) and a safetensors repo (``org/tiny-hf``)."""
    root = tmp_path / "hub"
    folder, gguf, _ = tiny_models["llama"]
    gguf_repo = root / "models--org--tiny-gguf"
    (gguf_repo / "snapshots" / "abc").mkdir(parents=True)
    (gguf_repo / "refs").mkdir()
    (gguf_repo / "refs" / "main").write_text("abc")
    shutil.copy(gguf, gguf_repo / "snapshots" / "abc" / "tiny-q.gguf")
    shutil.copytree(folder, root / "models--org--tiny-hf" / "snapshots" / "def")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_repo_ids_and_gguf_names_resolve_in_the_local_cache(hub):
    assert find_model("org/tiny-gguf") == hub / "models--org--tiny-gguf" / "snapshots" / "abc" / "tiny-q.gguf"
    assert isinstance(open_checkpoint("org/tiny-gguf"), GGUFCheckpoint)
    assert isinstance(open_checkpoint("org/tiny-hf"), HFCheckpoint)
    assert find_model("tiny-q") == find_model("tiny-q.gguf") == find_model("org/tiny-gguf")
    with pytest.raises(ModelLoadError, match="never downloads.*huggingface-cli download org/missing"):
        open_checkpoint("org/missing")
    with pytest.raises(ModelLoadError, match="hybridllm models"):
        open_checkpoint("no-such-model")


def test_local_models_lists_the_cache_with_type_and_architecture(hub):
    found = {model.name: model for model in local_models()}
    assert set(found) == {"tiny-q", "org/tiny-hf"}  # a GGUF by its file's name, a safetensors repo by its id
    gguf, hf = found["tiny-q"], found["org/tiny-hf"]
    assert (gguf.file_format, gguf.architecture, gguf.weight_type) == ("gguf", "llama", "F32")
    assert gguf.size_bytes == gguf.path.stat().st_size
    assert (hf.file_format, hf.architecture) == ("safetensors", "llama")
    assert hf.size_bytes > 0 and hf.source == "huggingface cache"


def test_models_command_lists_the_default_model_and_the_cache(hub, default_model_path):
    out = CliRunner().invoke(app, ["models", "--json"])
    assert out.exit_code == 0, out.output
    listed = json.loads(out.stdout)
    assert listed[0]["source"] == "default model" and listed[0]["path"] == str(default_model_path)
    assert listed[0]["weight_type"] == "Q4_1" and listed[0]["architecture"] == "llama"
    assert listed[0]["name"] == "SmolLM2-135M-Instruct.Q4_1"
    assert {"tiny-q", "org/tiny-hf"} <= {model["name"] for model in listed}


def test_version_flag():
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.stdout.strip().startswith("hybridllm ")


def test_llama_cpp_words_prompt_ctx_size_temp_repeat_penalty(hub):
    runner = CliRunner()
    base = ["generate", "-m", "org/tiny-gguf", "--temp", "0", "--repeat-penalty", "1.1", "-n", "3", "--json"]
    out = runner.invoke(app, [*base, "-p", "hello world"])
    assert out.exit_code == 0, out.output
    assert len(json.loads(out.stdout)["token_ids"]) == 3
    too_small = runner.invoke(app, [*base, "-p", "hello world", "-c", "2"])
    assert too_small.exit_code == 2 and "the context size is 2 tokens (--ctx-size" in too_small.output
    both = runner.invoke(app, [*base[:-1], "hello", "-p", "world"])
    assert both.exit_code == 2 and "not both" in both.output


def test_ctx_size_caps_the_window_and_sizes_the_kv(tiny_models):
    from hybridllm import LLM, SamplingParams

    llm = LLM(str(tiny_models["llama"][1]), ctx_size=32)
    assert llm.runtime.context_length == 32 and llm.runtime.kv_spec().max_tokens == 32
    result = llm.generate(list(range(1, 21)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert len(result.token_ids) == 12  # the window ends the request: 20 + 12 = 32 tokens


def test_serve_has_no_short_port_flag():
    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert "--port" in out.stdout and " -p " not in out.stdout


def test_one_name_per_model_in_models_the_server_and_find_model(hub, default_model_path):
    """A model's name is its file's (without .gguf) or its cached repo id: what `models` lists,
    what --model takes back, and the server's model id; never the file's general.name metadata."""
    from types import SimpleNamespace

    from hybridllm.loading.gguf import GGUFFile
    from hybridllm.loading.local_models import model_name
    from hybridllm.server.app import default_model_name

    assert model_name(default_model_path) == "SmolLM2-135M-Instruct.Q4_1"
    metadata_name = GGUFFile(default_model_path, header_only=True).metadata["general.name"]
    assert metadata_name != "SmolLM2-135M-Instruct.Q4_1"  # "Smollm2 135M 8k Lc100K Mix1 Ep2": not what we show
    for model in local_models(default_model_path):
        assert model.name == model_name(model.path)
        assert find_model(model.name, default_model_path) == model.path
        served = default_model_name(SimpleNamespace(checkpoint=SimpleNamespace(path=model.path)))
        assert served == model.name
    assert model_name(hub / "models--org--tiny-hf" / "snapshots" / "def") == "org/tiny-hf"  # not the snapshot hash


def test_ctx_size_cap_and_model_window_are_named_apart(tiny_models):
    from hybridllm import LLM
    from hybridllm.errors import ContextOverflowError

    capped = LLM(str(tiny_models["llama"][1]), ctx_size=16)
    with pytest.raises(ContextOverflowError, match=r"the context size is 16 tokens \(--ctx-size; the model's window is 512\)"):
        capped.generate(list(range(1, 21)))
    whole = LLM(str(tiny_models["llama"][1]), ctx_size=4096)  # a cap above the window: the window rules
    with pytest.raises(ContextOverflowError, match="the model's context window is 512 tokens; shorten it"):
        whole.generate(list(range(1, 600)))
