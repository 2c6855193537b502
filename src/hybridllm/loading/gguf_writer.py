"""Write GGUF files the way llama.cpp's converter does (metadata, tokenizer, permuted Q/K rows).

Used by ``hybridllm quantize`` and by the tests, which save tiny Hugging Face models as GGUF.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from hybridllm.config import ModelConfig
from hybridllm.errors import ConfigError
from hybridllm.formats.gguf_qk_permutation import PERMUTED_ARCHITECTURES, permute_rows
from hybridllm.loading.gguf import LONGROPE_LONG, LONGROPE_SHORT, QUERY_PRE_ATTN_SCALAR, ROPE_FREQS
from hybridllm.loading.gguf_array import GGUFArray
from hybridllm.models.layers import rope_inverse_frequencies

# Hugging Face parameter suffix -> GGUF tensor suffix (inverse of gguf.py's tables)
_HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # stacked checkpoints (Phi-3)
    "self_attn.qkv_proj.bias": "attn_qkv.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: gate then up, as llama.cpp's converter writes it
    "mlp.down_proj.weight": "ffn_down.weight",
}
# The Gemma block (inverse of gguf.py's Gemma table).
_HF_TO_GGUF_GEMMA_BLOCK = {
    **_HF_TO_GGUF_BLOCK,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
GGUF_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32}


def gguf_tensor_name(hf_name: str, gemma_layout: bool = False) -> str:
    """llama.cpp's name of a Hugging Face parameter (``gemma_layout``: the Gemma block's norms)."""
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    block_names = _HF_TO_GGUF_GEMMA_BLOCK if gemma_layout else _HF_TO_GGUF_BLOCK
    parts = hf_name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
        suffix = ".".join(parts[3:])
        if suffix in block_names:
            return f"blk.{parts[2]}.{block_names[suffix]}"
    raise ConfigError(f"no GGUF name for tensor {hf_name}")


def default_tensor_type(hf_name: str, tensor: torch.Tensor, weight_type: str) -> str:
    """llama.cpp's choice: norms and biases stay F32; matrices get ``weight_type`` if rows allow."""
    if tensor.ndim < 2:
        return "F32"
    if weight_type.startswith("Q") and tensor.shape[-1] % 32:
        return "F16"
    return weight_type


def write_gguf(
    path: str | os.PathLike,
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    tokenizer_metadata: Mapping[str, object] | None = None,
    weight_type: str = "F32",
    type_for: Callable[[str, torch.Tensor], str] | None = None,
) -> Path:
    """Write a GGUF file of a Llama-family model.

    Args:
        path: output file.
        config: the model's numbers.
        tensors: Hugging Face-named float tensors as the model holds them (Gemma norms: 1 + w,
            what ``checkpoint.dequantize`` returns and llama.cpp's converter writes).
        tokenizer_metadata: ``tokenizer.*`` keys (see
            :func:`hybridllm.loading.gguf_vocab.tokenizer_metadata_from_hf`).
        weight_type: GGML type of the weight matrices (one of ``QUANT_TYPES``).
        type_for: optional per-tensor override ``(hf_name, tensor) -> type``.
    """
    import gguf

    if weight_type not in QUANT_TYPES:
        raise ConfigError(f"unsupported output type {weight_type!r}; choose one of {', '.join(QUANT_TYPES)}")
    arch = config.family.gguf_arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(config.name or "hybridllm model")
    writer.add_file_type(GGUF_FILE_TYPES[weight_type])
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.rotary_dim)
    writer.add_vocab_size(config.vocab_size)
    longrope = config.longrope
    if arch == "phi3":  # llama.cpp's phi3 reader requires these (a sliding window of 0: none)
        writer.add_rope_scaling_orig_ctx_len(longrope.original_max_position_embeddings if longrope
                                             else config.max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
    if longrope is not None:  # as llama.cpp's converter writes Phi-3 128K: the divisors as tensors
        writer.add_rope_scaling_attn_factors(longrope.attention_factor)
        writer.add_tensor(LONGROPE_LONG, np.asarray(longrope.long_factor, dtype=np.float32))
        writer.add_tensor(LONGROPE_SHORT, np.asarray(longrope.short_factor, dtype=np.float32))
    if config.family.gemma_layout:
        _add_gemma_metadata(writer, config)
    if config.head_dim != config.hidden_size // config.n_heads:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.rope_scaling is not None and config.rope_scaling.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
    if config.rope_scaling is not None and config.rope_scaling.kind == "llama3":
        # llama.cpp stores llama3 scaling as per-dimension divisors of the base frequencies
        scaled = rope_inverse_frequencies(config)
        base = rope_inverse_frequencies(dataclasses.replace(config, rope_scaling=None))
        writer.add_tensor(ROPE_FREQS, (base / scaled).numpy().astype(np.float32))
    for key, value in (tokenizer_metadata or {}).items():
        _add_metadata(writer, key, value)
    for hf_name, tensor in tensors.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = gguf_tensor_name(hf_name, config.family.gemma_layout)
        data = tensor.detach().float().cpu()
        permuted = arch in PERMUTED_ARCHITECTURES
        if permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = permute_rows(data, config.n_heads)
        elif permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = permute_rows(data, config.n_kv_heads)
        qtype = (type_for or (lambda n, t: default_tensor_type(n, t, weight_type)))(hf_name, data)
        array = data.numpy()
        if qtype == "F32":
            writer.add_tensor(name, array.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            gtype = gguf.GGMLQuantizationType[qtype]
            # raw bytes: gguf-py derives the element shape from the byte shape and the type
            writer.add_tensor(name, gguf.quants.quantize(array, gtype), raw_dtype=gtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _add_gemma_metadata(writer, config: ModelConfig) -> None:
    """The Gemma keys llama.cpp reads (sliding window, soft-capping, the local rotary base), and the
    layer pattern and score scale where they differ from what llama.cpp assumes."""
    family = config.family
    if config.sliding_layers:
        writer.add_sliding_window(config.sliding_window)
        default = tuple(bool((i + 1) % family.sliding_window_pattern) for i in range(config.n_layers))
        if config.sliding_layers != default:
            writer.add_sliding_window_pattern(list(config.sliding_layers))
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.local_rope_theta is not None:
        writer.add_rope_freq_base_swa(config.local_rope_theta)
    if config.query_pre_attn_scalar is not None and config.query_pre_attn_scalar != config.head_dim:
        writer.add_float32(QUERY_PRE_ATTN_SCALAR.format(arch=family.gguf_arch), config.query_pre_attn_scalar)


def _add_metadata(writer, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple, GGUFArray)):
        writer.add_array(key, list(value))
    else:
        raise ConfigError(f"cannot write metadata {key} of type {type(value).__name__}")
