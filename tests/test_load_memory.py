"""What a load holds besides the model: stacked projections built layer by layer, no file pages
left mapped, the vocabulary kept encoded (``GGUFArray``), and nobody resetting the process's
peak-memory mark behind an outside reader's back."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hybridllm.errors import ModelLoadError
from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.gguf_array import LAZY_MIN_ELEMENTS, GGUFArray
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint

CPU = torch.device("cpu")


# ---- stacked projections as the load goes ---------------------------------------------------
def _built(module: torch.nn.Module) -> bool:
    return not any(t.is_meta for t in [*module.parameters(), *module.buffers()])


class _Watched:
    """A checkpoint that, at each read, records which layers' ``qkv_proj`` the model holds built."""

    def __init__(self, checkpoint) -> None:
        self._checkpoint = checkpoint
        self.model = None  # the skeleton, once the loader has made it
        self.reads: list[tuple[str, list[bool]]] = []  # (parameter name, layer -> qkv_proj built)

    def __getattr__(self, name):
        return getattr(self._checkpoint, name)

    def read(self, name):
        hf = self._checkpoint.parameter_names()[name]
        self.reads.append((hf, [_built(layer.self_attn.qkv_proj) for layer in self.model.model.layers]))
        return self._checkpoint.read(name)


@pytest.mark.parametrize("weights", ["float", "auto"])
def test_each_layers_projections_are_stacked_as_soon_as_their_parts_are_read(tiny_models, monkeypatch, weights):
    """A layer's q/k/v are stacked as soon as the last of them is read: at every later read the
    layer's ``qkv_proj`` is built (stacking them all at the end held every layer's parts beside
    the stacked copies: the model's projections twice at the load's peak)."""
    from hybridllm.loading import skeleton

    watched = _Watched(open_checkpoint(tiny_models["llama"][1]))

    def remember(*args, **kwargs):
        made = skeleton.prepare_skeleton(*args, **kwargs)
        watched.model = made.model
        return made

    for module in ("hybridllm.loading.loader", "hybridllm.loading.quantized_loader"):
        monkeypatch.setattr(f"{module}.prepare_skeleton", remember)
    model = load_model(watched, torch.float32, lambda name: CPU, weights=weights)
    parts = {f"model.layers.{i}.self_attn.{p}_proj.{leaf}"
             for i in range(len(model.model.layers)) for p in "qkv" for leaf in ("weight", "bias")}
    parts &= {hf for hf, _ in watched.reads}
    read, checked = set(), 0
    for hf, built in watched.reads:
        for layer in range(len(built)):
            mine = {p for p in parts if p.startswith(f"model.layers.{layer}.")}
            if mine <= read:
                assert built[layer], f"layer {layer}'s qkv_proj not stacked yet when {hf} was read"
                checked += 1
        read.add(hf)
    assert checked > 0
    assert all(_built(layer.self_attn.qkv_proj) for layer in model.model.layers)


# ---- file pages -------------------------------------------------------------------------------
def _mapped_kib(address: int) -> int:
    """KiB resident of the mapping holding ``address`` in this process."""
    inside = False
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if not parts[0].endswith(":"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            inside = lo <= address < hi
        elif inside and parts[0] == "Rss:":
            return int(parts[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_reading_every_tensor_leaves_no_file_page_mapped(default_model_path):
    """``read`` copies from the file, not the map, and the parsed header is unmapped: a load does not hold the
    file's pages on top of the weights it builds (the file's size at the load's peak)."""
    checkpoint = open_checkpoint(default_model_path)
    first = next(iter(checkpoint.tensors.values()))
    mapping = checkpoint.raw(first.name).ctypes.data - first.offset  # this file's map (a view faults nothing)
    total = 0
    for name in checkpoint.tensors:
        data = checkpoint.read(name)
        assert data.nbytes == checkpoint.tensors[name].nbytes
        total += data.nbytes
    assert total > 50 * 2**20
    assert _mapped_kib(mapping) <= 64  # none (a little slack for a fault-around elsewhere)
    np.testing.assert_array_equal(checkpoint.read(first.name), checkpoint.raw(first.name))
    assert _mapped_kib(mapping) > 0  # the check sees the map: reading it through the view faults pages in


# ---- the vocabulary kept encoded --------------------------------------------------------------
def _gguf_strings(values: list[str]) -> bytes:
    return b"".join(struct.pack("<Q", len(v.encode())) + v.encode() for v in values)


def test_gguf_array_reads_as_the_list_it_encodes(tmp_path):
    words = [f"tok{i}é" for i in range(3000)]
    strings, end = GGUFArray.strings_at(memoryview(b"xx" + _gguf_strings(words) + b"tail"), 2, len(words), tmp_path)
    assert end == 2 + len(_gguf_strings(words))
    assert len(strings) == 3000 and list(strings) == words and strings == words and strings == tuple(words)
    assert strings[0] == words[0] and strings[2999] == words[2999] and strings[-1] == words[-1]
    assert strings[10:13] == words[10:13]
    with pytest.raises(IndexError):
        strings[3000]
    numbers = np.arange(5000, dtype="<f4") / 3
    floats = GGUFArray(numbers.tobytes(), 5000, np.dtype("<f4"), tmp_path)
    assert list(floats) == numbers.tolist() and floats[4999] == numbers[4999].item() and floats != [1.0]


def test_gguf_array_errors_are_one_line_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFArray.strings_at(memoryview(_gguf_strings(["a", "bb"])[:-1]), 0, 2, tmp_path)
    bad = struct.pack("<Q", 2) + b"\xff\xfe"
    strings, _ = GGUFArray.strings_at(memoryview(bad), 0, 1, tmp_path)
    with pytest.raises(ModelLoadError, match="malformed GGUF string"):
        list(strings)


def test_the_default_models_vocabulary_stays_encoded_and_equals_gguf_py(default_model_path):
    """The file's large arrays come back as GGUFArrays equal to what gguf-py reads; short
    arrays stay lists."""
    import gguf

    ours = GGUFFile(default_model_path).metadata
    reference = gguf.GGUFReader(str(default_model_path)).fields
    tokens = ours["tokenizer.ggml.tokens"]
    assert isinstance(tokens, GGUFArray) and len(tokens) >= LAZY_MIN_ELEMENTS
    assert tokens == reference["tokenizer.ggml.tokens"].contents()
    assert ours["tokenizer.ggml.merges"] == reference["tokenizer.ggml.merges"].contents()
    assert ours["tokenizer.ggml.token_type"] == reference["tokenizer.ggml.token_type"].contents()
    assert all(not isinstance(v, GGUFArray) or len(v) >= LAZY_MIN_ELEMENTS for v in ours.values())


# ---- the peak-memory mark -----------------------------------------------------------------------
def test_building_an_engine_leaves_the_load_peak_for_an_outside_reader(tmp_path):
    """``HostPeakMemory`` resets the kernel's high-water mark at a request, never when built: a
    peak reached before it (a load's temporaries) is still in VmHWM for ``/usr/bin/time`` or
    tools/memory_vs_llama_cpp.py to read."""
    script = textwrap.dedent("""
        def hwm():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
        import os
        from hybridllm.engine.metrics import HostPeakMemory
        block = bytearray(os.urandom(1)) * (300 * 2**20)  # touched: 300 MiB resident
        del block
        before = hwm()
        memory = HostPeakMemory()
        after_build = hwm()
        lifetime = memory.peak()
        memory.reset()
        print(before, after_build, lifetime, memory.peak())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, after_build, lifetime, after_reset = map(int, done.stdout.split())
    assert before >= 300 * 2**20
    assert after_build >= before and lifetime >= before
    if after_reset < before:  # clear_refs works here: the request's mark starts again from the current RSS
        assert after_reset <= before - 200 * 2**20
