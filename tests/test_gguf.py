"""GGUF reading: header/metadata equal gguf-py's, and every supported tensor type dequantizes right."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridllm.formats.gguf_qk_permutation import permute_rows, unpermute_rows
from hybridllm.loading.gguf import GGUFFile

TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.02, "Q5_0": 0.15, "Q5_1": 0.12, "Q4_0": 0.3,
             "Q4_1": 0.25}


def _write(path, tensors: dict[str, tuple[np.ndarray, str | None]]):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (array, qtype) in tensors.items():
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    return path


class _RawFile(GGUFFile):
    """GGUFFile without the model-config step, to read files holding arbitrary tensors."""

    def _build_config(self):
        return None


@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_quantized_types_roundtrip(tmp_path, qtype):
    import gguf

    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    if qtype == "F32":
        stored = (x, None)
    elif qtype == "F16":
        stored = (x.astype(np.float16), None)
    else:
        stored = (gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype]), qtype)
    f = _RawFile(_write(tmp_path / "t.gguf", {"w": stored}))
    assert f.tensors["w"].type_name == qtype and f.tensors["w"].shape == (8, 256)
    out = f.dequantize("w").float().numpy()
    assert np.abs(out - x).max() <= TOLERANCE[qtype]
    if qtype not in ("F32", "F16"):
        np.testing.assert_array_equal(out, gguf.quants.dequantize(stored[0], gguf.GGMLQuantizationType[qtype]))


def _f16_bytes(value: float) -> bytes:
    return np.float16(value).tobytes()


def test_q4_k_block_decodes_to_known_values(tmp_path):
    # d=1, dmin=0, every 6-bit sub-block scale = 1 and min = 0, nibbles 3 (low) and 5 (high):
    # each 64-value chunk is 32 x 3 then 32 x 5.
    scales = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    block = _f16_bytes(1.0) + _f16_bytes(0.0) + scales + bytes([0x53] * 128)
    assert len(block) == 144
    f = _RawFile(_write(tmp_path / "q4k.gguf", {"w": (np.frombuffer(block * 2, np.uint8).reshape(2, 144), "Q4_K")}))
    expected = np.tile(np.array([3.0] * 32 + [5.0] * 32), 4)
    out = f.dequantize("w").numpy()
    assert out.shape == (2, 256)
    np.testing.assert_array_equal(out[0], expected)
    np.testing.assert_array_equal(out[1], expected)


def test_q6_k_block_decodes_to_known_values(tmp_path):
    # ql bytes 0x21, qh 0, scales 1, d=2: q = 1 for the first 64 of each 128, 2 for the next 64;
    # value = d * scale * (q - 32).
    block = bytes([0x21] * 128) + bytes(64) + bytes([1] * 16) + _f16_bytes(2.0)
    assert len(block) == 210
    f = _RawFile(_write(tmp_path / "q6k.gguf", {"w": (np.frombuffer(block, np.uint8).reshape(1, 210), "Q6_K")}))
    expected = np.tile(np.array([-62.0] * 64 + [-60.0] * 64), 2)
    np.testing.assert_array_equal(f.dequantize("w").numpy()[0], expected)


def test_q5_k_block_decodes_to_known_values(tmp_path):
    # As Q4_K, plus the fifth bit from qh: qh all 0xFF adds 16 to every value.
    scales = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    block = _f16_bytes(1.0) + _f16_bytes(0.0) + scales + bytes([0xFF] * 32) + bytes([0x53] * 128)
    assert len(block) == 176
    f = _RawFile(_write(tmp_path / "q5k.gguf", {"w": (np.frombuffer(block, np.uint8).reshape(1, 176), "Q5_K")}))
    expected = np.tile(np.array([19.0] * 32 + [21.0] * 32), 4)
    np.testing.assert_array_equal(f.dequantize("w").numpy()[0], expected)


def test_permutation_roundtrip():
    w = torch.randn(48, 10)
    assert torch.equal(unpermute_rows(permute_rows(w, 3), 3), w)
    assert not torch.equal(permute_rows(w, 3), w)


@pytest.mark.slow
def test_header_matches_gguf_py_on_default_model(default_model_path):
    import gguf

    ours = GGUFFile(default_model_path)
    ref = gguf.GGUFReader(str(default_model_path))
    assert set(ours.metadata) == set(ref.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "llama.rope.freq_base"):
        assert ours.metadata[key] == ref.fields[key].contents()
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes and info.type_name == t.tensor_type.name
    cfg = ours.config
    assert (cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _quantize_iq4_nl(rows: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of float rows (a test-side quantizer: the gguf package only dequantizes this
    type): per 32 values, a float16 scale and 4-bit indices into llama.cpp's non-linear grid."""
    blocks = rows.reshape(-1, 32).astype(np.float32)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    scale = scale.astype(np.float16)
    index = np.abs(blocks[:, :, None] / scale.astype(np.float32)[:, :, None] - IQ4_NL_VALUES).argmin(axis=2)
    packed = (index[:, :16] | (index[:, 16:] << 4)).astype(np.uint8)  # low nibbles: 0-15, high: 16-31
    out = np.concatenate([scale.view(np.uint8), packed], axis=1)  # (blocks, 2 + 16)
    return out.reshape(rows.shape[0], -1)


def test_iq4_nl_file_loads_and_matches_transformers_on_its_values(tiny_models, tmp_path, monkeypatch):
    """A GGUF whose matrices are IQ4_NL (a type we read through the gguf package's table and
    dequantizer): our logits match transformers' with the same dequantized weights."""
    import gguf
    from tiny_models import build_hf_model

    from hybridllm import LLM
    from hybridllm.loading.gguf import GGML_TYPES
    from hybridllm.loading.gguf_vocab import tokenizer_metadata_from_hf
    from hybridllm.loading.gguf_writer import write_gguf
    from hybridllm.loading.safetensors import HFCheckpoint

    assert {"IQ4_NL", "IQ4_XS", "Q5_K", "Q6_K"} <= set(GGML_TYPES)
    folder = tmp_path / "hf"
    hf_model = build_hf_model(folder, "llama")
    original = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", lambda array, qtype: _quantize_iq4_nl(array)
                        if qtype == gguf.GGMLQuantizationType.IQ4_NL else original(array, qtype))
    checkpoint = HFCheckpoint(folder)
    tensors = {name: checkpoint.dequantize(name, checkpoint.read(name)) for name in checkpoint.parameter_names()}
    path = write_gguf(tmp_path / "iq4.gguf", checkpoint.config, tensors, tokenizer_metadata_from_hf(folder), "F32",
                      type_for=lambda name, t: "IQ4_NL" if name.endswith("proj.weight") else "F32")
    from hybridllm.loading.gguf import GGUFFile

    f = GGUFFile(path)
    assert f.tensors["blk.0.ffn_down.weight"].type_name == "IQ4_NL"
    state = hf_model.state_dict()
    for gguf_name, hf_name in f.hf_names().items():
        if f.tensors[gguf_name].type_name == "IQ4_NL":
            state[hf_name] = f.dequantize(gguf_name).to(state[hf_name].dtype)
    hf_model.load_state_dict(state)
    ids = list(range(5, 37))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
        llm = LLM(path)
        ours = llm.model(torch.tensor([ids]), llm.new_cache(), start_pos=0, all_logits=True)[0]
        float_llm = LLM(folder)
        unquantized = float_llm.model(torch.tensor([ids]), float_llm.new_cache(), start_pos=0, all_logits=True)[0]
    # The native kernels multiply IQ4_NL rows by int8 activations (llama.cpp's scheme), so ours
    # sits within that rounding of the float product; the 4-bit weights move the logits far more.
    activation_rounding = (ours - expected).abs().max()
    weight_rounding = (ours - unquantized).abs().max()
    assert activation_rounding < 2e-3
    assert weight_rounding > 10 * activation_rounding
