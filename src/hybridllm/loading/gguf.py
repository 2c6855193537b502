"""GGUF files: metadata -> ``ModelConfig``, tensor records -> Hugging Face-named tensors.

The header is parsed here (a small, strict reader: a truncated or malformed file is reported
as such, and it is ~50x faster than gguf-py's generic reader on a 49k-token vocabulary);
block dequantization uses gguf-py's reference implementation of llama.cpp's formats.

llama.cpp's converter permutes the rows of the Q and K projections of ``llama``-architecture
files (to the interleaved rotary layout its kernels use);
:func:`hybridllm.formats.gguf_qk_permutation.unpermute_rows` undoes it so the model keeps the
Hugging Face "rotate half" layout.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridllm.config import ARCHITECTURES, SUPPORTED_ARCH_TEXT, ModelConfig, RopeScaling
from hybridllm.errors import ModelLoadError, UnsupportedModelError
from hybridllm.formats.gguf_qk_permutation import PERMUTED_ARCHITECTURES, unpermute_rows
from hybridllm.loading.gguf_array import LAZY_MIN_ELEMENTS, GGUFArray

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32



def _readable_types() -> dict[str, tuple[int, int, int]]:
    """GGML tensor types we read: name -> (type id, elements per block, bytes per block).

    The ``gguf`` package's table (llama.cpp's type ids and block sizes), restricted to the types
    it can dequantize (a zero block is tried once per type): F32/F16/BF16, Q4_0 ... Q8_0, the
    K-quants, the IQ types (IQ4_NL, IQ4_XS, ...) and the ternary / FP4 ones. Types our kernels
    keep quantized are chosen later (``--weights auto``); the others run dequantized.
    """
    from gguf import GGML_QUANT_SIZES, quants

    readable = {}
    for qtype, (block, size) in GGML_QUANT_SIZES.items():
        try:
            quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError, KeyError):
            continue
        readable[qtype.name] = (int(qtype.value), int(block), int(size))
    return readable


GGML_TYPES: dict[str, tuple[int, int, int]] = _readable_types()
_TYPE_BY_ID = {type_id: name for name, (type_id, _, _) in GGML_TYPES.items()}

# GGUF architectures -> our ``ModelConfig.arch`` (Mistral files use the ``llama`` architecture).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3": "gemma3_text"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Families whose checkpoint is stacked (Phi-3): one q/k/v matrix, and ``ffn_up`` holds gate then up.
_STACKED_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_qkv.bias": "self_attn.qkv_proj.bias",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# The Gemma block: ``ffn_norm`` is the norm before the MLP; the norms after attention and the MLP.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# llama.cpp scales Gemma's attention by (hidden / heads) ** -0.5 in its 27B models (known by their
# layer count) and by head_dim ** -0.5 otherwise; its converter writes no query_pre_attn_scalar.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
QUERY_PRE_ATTN_SCALAR = "{arch}.attention.query_pre_attn_scalar"  # ours, written where it differs
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS = "rope_freqs.weight"  # llama3 per-dimension rotary divisors: config, not a parameter
# Phi-3 128K variants' longrope divisors (llama.cpp's converter writes them as tensors): config too.
LONGROPE_LONG, LONGROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
CONFIG_TENSORS = (ROPE_FREQS, LONGROPE_LONG, LONGROPE_SHORT)

# Scalar value types of GGUF key/value pairs: id -> struct format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                  7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


def hf_tensor_name(gguf_name: str, stacked_checkpoint: bool = False, gemma_layout: bool = False) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None when it is not a parameter we know.

    ``stacked_checkpoint``: the family stores q/k/v and gate/up stacked (``ArchFamily.stacked_checkpoint``);
    ``gemma_layout``: the Gemma block's norms (``ArchFamily.gemma_layout``).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block_names = _STACKED_BLOCK_NAMES if stacked_checkpoint else _GEMMA_BLOCK_NAMES if gemma_layout else _BLOCK_NAMES
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in block_names:
        return f"model.layers.{match.group(1)}.{block_names[match.group(2)]}"
    return None


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor record: its GGUF name, type, shape (row-major, outermost first), file offset."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int  # absolute offset of its data in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class _Cursor:
    """Sequential little-endian reader over a buffer that reports truncation as ModelLoadError."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF file (header ends at byte {len(self.buf)})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        try:
            return bytes(self.take(length)).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: malformed GGUF string at byte {self.pos}: {exc}") from None

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary: one tight loop, no per-string call chain)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length_of = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                if pos + 8 > end:
                    raise ModelLoadError(f"{self.path}: truncated GGUF file (header ends at byte {end})")
                (length,) = length_of(buf, pos)
                if pos + 8 + length > end:
                    raise ModelLoadError(f"{self.path}: truncated GGUF file (header ends at byte {end})")
                out.append(str(buf[pos + 8:pos + 8 + length], "utf-8"))
                pos += 8 + length
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: malformed GGUF string at byte {pos}: {exc}") from None
        self.pos = pos
        return out

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            elem_type, count = self.scalar("<I"), self.scalar("<Q")
            lazy = count >= LAZY_MIN_ELEMENTS  # a vocabulary and its like: kept encoded (gguf_array.py)
            if elem_type in _NUMPY_SCALARS:
                dtype = np.dtype(_NUMPY_SCALARS[elem_type]).newbyteorder("<")
                data = self.take(count * dtype.itemsize)
                return GGUFArray(bytes(data), count, dtype, self.path) if lazy else np.frombuffer(data, dtype).tolist()
            if elem_type == _STRING and lazy:
                array, self.pos = GGUFArray.strings_at(self.buf, self.pos, count, self.path)
                return array
            if elem_type == _STRING:
                return self.strings(count)
            return [self.value(elem_type) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: malformed GGUF file (unknown value type {type_id} at byte {self.pos})")


class GGUFFile:
    """A memory-mapped GGUF file: its metadata, tensor records and model config.

    Raises:
        ModelLoadError: the file is missing, not GGUF, or truncated.
        UnsupportedModelError: the architecture or a tensor type is not supported.
    """

    def __init__(self, path: str | os.PathLike, *, header_only: bool = False) -> None:
        """Memory-map and parse ``path``; ``header_only`` skips building the model config (to
        describe a file whose architecture this engine does not run)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        with open(self.path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                raise ModelLoadError(f"{self.path}: empty file, not a GGUF model")
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = len(self._mmap)
        self.metadata, self.tensors = self._parse_header(memoryview(self._mmap))
        self._unmap_pages()  # the header is parsed; tensors are read from the file (`read`)
        self.config = None if header_only else self._build_config()

    def close(self) -> None:
        self._mmap.close()

    # ---- header -------------------------------------------------------------------------
    def _parse_header(self, buf: memoryview) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        cur = _Cursor(buf, self.path)
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (bad magic bytes)")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]  # GGUF order: innermost first
            type_id, offset = cur.scalar("<I"), cur.scalar("<Q")
            raw_infos.append((name, dims, type_id, offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in raw_infos:
            type_name = _TYPE_BY_ID.get(type_id)
            if type_name is None:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {name} has unsupported type {_ggml_type_label(type_id)}; "
                    f"supported types: {', '.join(GGML_TYPES)}"
                )
            _, block, block_bytes = GGML_TYPES[type_name]
            shape = tuple(reversed(dims))
            n_elements = int(np.prod(shape))
            if dims[0] % block:
                raise ModelLoadError(f"{self.path}: tensor {name} row of {dims[0]} is not a multiple of {block}")
            info = GGUFTensorInfo(name, type_name, shape, data_start + offset, n_elements // block * block_bytes)
            if info.offset + info.nbytes > self.file_size:
                raise ModelLoadError(
                    f"{self.path}: truncated GGUF file: tensor {name} needs bytes up to "
                    f"{info.offset + info.nbytes} but the file has {self.file_size}"
                )
            tensors[name] = info
        return metadata, tensors

    # ---- config -------------------------------------------------------------------------
    def _build_config(self) -> ModelConfig:
        md = self.metadata
        gguf_arch = md.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: architecture {gguf_arch!r} is not supported; supported: {SUPPORTED_ARCH_TEXT}"
            )
        family = ARCHITECTURES[GGUF_ARCHITECTURES[gguf_arch]]
        unknown = [n for n in self.tensors
                   if n not in CONFIG_TENSORS and hf_tensor_name(n, family.stacked_checkpoint, family.gemma_layout) is None]
        if unknown:
            raise UnsupportedModelError(
                f"{self.path}: unexpected tensors for a {gguf_arch} model (e.g. {unknown[0]}); "
                f"mixture-of-experts and other variants are not supported"
            )

        def key(suffix: str, default: Any = None) -> Any:
            return md.get(f"{gguf_arch}.{suffix}", default)

        try:
            hidden = int(key("embedding_length"))
            n_heads = int(key("attention.head_count"))
            n_layers = int(key("block_count"))
            ffn = int(key("feed_forward_length"))
        except TypeError:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks the {gguf_arch}.* model dimensions") from None
        n_kv = key("attention.head_count_kv", n_heads)
        vocab = key("vocab_size") or len(md.get("tokenizer.ggml.tokens", [])) or self.tensors["token_embd.weight"].shape[0]
        scaling = None
        if key("rope.scaling.type") == "linear" and key("rope.scaling.factor"):
            scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor")))
        if LONGROPE_LONG in self.tensors and LONGROPE_SHORT in self.tensors:
            context = int(key("context_length", 4096))
            scaling = RopeScaling.longrope(
                self.dequantize(LONGROPE_SHORT).flatten().tolist(), self.dequantize(LONGROPE_LONG).flatten().tolist(),
                int(key("rope.scaling.original_context_length", context)), context,
                attention_factor=key("rope.scaling.attn_factor"))
        freq_factors = None
        if ROPE_FREQS in self.tensors:
            freq_factors = tuple(float(x) for x in self.dequantize(ROPE_FREQS).flatten().tolist())
        head_dim = int(key("attention.key_length", hidden // n_heads))
        rotary_dim = int(key("rope.dimension_count", head_dim))
        eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
        window = key("attention.sliding_window") or None  # phi3 files write 0 for none
        attention: dict[str, Any] = {}  # the sliding-window layers, Gemma's attention options
        if window and not family.gemma_layout:  # phi3: every layer
            attention = dict(sliding_layers=(True,) * n_layers)
        if family.gemma_layout:
            attention = dict(
                sliding_layers=self._sliding_layers(family, n_layers) if window else (),
                local_rope_theta=key("rope.freq_base_swa", family.local_rope_theta),
                query_pre_attn_scalar=float(md.get(QUERY_PRE_ATTN_SCALAR.format(arch=gguf_arch)) or (
                    hidden // n_heads if _GEMMA_27B_LAYERS.get(gguf_arch) == n_layers else head_dim)),
                attn_logit_softcapping=key("attn_logit_softcapping"),
                final_logit_softcapping=key("final_logit_softcapping"),
            )
        return ModelConfig(
            arch=GGUF_ARCHITECTURES[gguf_arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=ffn,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors or "blk.0.attn_qkv.bias" in self.tensors,
            rope_scaling=scaling,
            rope_freq_factors=freq_factors,
            sliding_window=window,
            partial_rotary_factor=rotary_dim / head_dim,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
            name=str(md.get("general.name", self.path.stem)),
            **attention,
        )

    def _sliding_layers(self, family: Any, n_layers: int) -> tuple[bool, ...]:
        """Which layers attend through the sliding window: the file's ``sliding_window_pattern``
        (one bool per layer, or every n-th layer global), else the family's pattern (llama.cpp's)."""
        pattern = self.metadata.get(f"{self.metadata['general.architecture']}.attention.sliding_window_pattern",
                                    family.sliding_window_pattern)
        if isinstance(pattern, list):
            return tuple(bool(p) for p in pattern)
        return tuple(bool((i + 1) % int(pattern)) for i in range(n_layers))

    # ---- tensors ------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (uint8, a view of the memory map: no copy, no disk read yet)."""
        info = self.tensors[name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def read(self, name: str) -> np.ndarray:
        """The tensor's bytes copied into RAM (this is where the disk is read).

        Read from the file straight into the copy, not through the memory map: a load then
        holds each tensor's bytes once (this copy, freed when its weights are built), where
        pages faulted in through the map would stay resident in this process until unmapped
        (the file's size on top of the model's, at the load's peak)."""
        info = self.tensors[name]
        data = np.empty(info.nbytes, dtype=np.uint8)
        view, done = memoryview(data), 0
        with open(self.path, "rb", buffering=0) as fh:
            fh.seek(info.offset)
            while done < info.nbytes:
                got = fh.readinto(view[done:])
                if not got:
                    raise ModelLoadError(f"{self.path}: truncated inside tensor {name}")
                done += got
        return data

    def _unmap_pages(self) -> None:
        """``MADV_DONTNEED`` over the whole map: the pages stay in the page cache, and a later
        view (``raw``) faults them back in. The whole map, not just the header's bytes: a fault
        may map the page cache's whole folio (or the pages around it), past the header."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def dequantize(self, name: str, data: np.ndarray | None = None) -> torch.Tensor:
        """Float tensor (row-major ``info.shape``) of a tensor, from ``data`` (see :meth:`read`) or the map.

        F32/F16/BF16 keep their dtype; block-quantized types become float32. Q/K rows of
        ``llama``-architecture files are un-permuted back to the Hugging Face layout.
        """
        info = self.tensors[name]
        data = self.raw(name) if data is None else data
        if info.type_name == "F32":
            tensor = torch.from_numpy(data.view(np.float32).copy())
        elif info.type_name == "F16":
            tensor = torch.from_numpy(data.view(np.float16).copy())
        elif info.type_name == "BF16":
            tensor = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            from gguf import GGMLQuantizationType, quants

            qtype = GGMLQuantizationType[info.type_name]
            rows = data.reshape(-1, info.nbytes // (info.n_elements // info.shape[-1]))
            tensor = torch.from_numpy(quants.dequantize(rows, qtype).astype(np.float32, copy=False))
        tensor = tensor.reshape(info.shape)
        return self._unpermute_if_needed(name, tensor)

    def _unpermute_if_needed(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.metadata.get("general.architecture") not in PERMUTED_ARCHITECTURES:
            return tensor
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rows(tensor, self.config.n_heads)
        if name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rows(tensor, self.config.n_kv_heads)
        return tensor

    def hf_names(self) -> dict[str, str]:
        """GGUF tensor name -> Hugging Face parameter name, for every model parameter in the file."""
        family = self.config.family
        return {n: hf for n in self.tensors
                if (hf := hf_tensor_name(n, family.stacked_checkpoint, family.gemma_layout)) is not None}


def _ggml_type_label(type_id: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return f"{GGMLQuantizationType(type_id).name} ({type_id})"
    except (ImportError, ValueError):
        return str(type_id)


class GGUFCheckpoint(GGUFFile):
    """A GGUF file seen through the checkpoint interface shared with :class:`HFCheckpoint`."""

    file_format = "gguf"

    def parameter_names(self) -> dict[str, str]:
        return self.hf_names()

    def nbytes(self, name: str) -> int:
        return self.tensors[name].nbytes

    def tokenizer(self):
        from hybridllm.loading.tokenizer import Tokenizer

        return Tokenizer.from_gguf_metadata(self.metadata)
