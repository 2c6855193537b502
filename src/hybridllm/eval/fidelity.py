"""How faithfully an engine computes a quantized file: its next-token distributions against the
exact model's (float32 over the file's dequantized weights), over a text.

    exact = position_logits(LLM(path, weights="float"), ids)
    ours = position_logits(LLM(path), ids)
    kl, agreement = divergence(exact, ours)

``divergence`` gives the mean KL(exact || engine) over the positions and the share of positions
whose top-1 token is the exact model's. ``llama_cpp_logits`` runs llama.cpp's own kernels on the
same file and ids (llama-cpp-python), so both engines are measured against the same reference.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch


def position_logits(llm, ids: Sequence[int], chunk: int = 512) -> torch.Tensor:
    """Float32 logits (len(ids), vocab) of every position of ``ids`` through ``llm``'s runner (the
    path serving takes: native kernels where they run), prefilled in chunks of ``chunk``."""
    cache = llm.new_cache()
    out = []
    try:
        with torch.inference_mode():
            for start in range(0, len(ids), chunk):
                piece = torch.tensor([list(ids[start:start + chunk])])
                out.append(llm.runner(piece, cache, start, all_logits=True)[0].float())
    finally:
        cache.reset()
    return torch.cat(out)


def llama_cpp_logits(path: str | os.PathLike, ids: Sequence[int], threads: int = 1) -> torch.Tensor:
    """llama.cpp's float32 logits (len(ids), vocab) of every position of ``ids`` on the GGUF file."""
    import llama_cpp

    peer = llama_cpp.Llama(model_path=str(path), n_ctx=max(64, len(ids)), n_batch=512, n_threads=threads,
                           logits_all=True, verbose=False)
    try:
        peer.eval(list(ids))
        return torch.tensor(np.asarray(peer.scores[: len(ids)]), dtype=torch.float32)
    finally:
        peer.close()


def divergence(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference || logits) in nats, top-1 agreement) over the rows (positions)."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agreement = (reference.argmax(-1) == logits.argmax(-1)).double().mean()
    return float(kl.mean()), float(agreement)
