"""``hybridllm quantize``: write a quantized GGUF file from a float checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def quantize(
    src: Annotated[Path, typer.Argument(help="A Hugging Face folder or a float (F32/F16/BF16) GGUF file.")],
    dst: Annotated[Path, typer.Argument(help="The GGUF file to write.")],
    qtype: Annotated[str, typer.Option("--type", help="Weight type: q4_0, q4_1 or q8_0.")] = "q4_1",
    pre: Annotated[str | None, typer.Option(
        "--pre", help="tokenizer.ggml.pre to write (llama-bpe, qwen2, smollm, gpt-2, ...); default: "
                      "detected from tokenizer.json.")] = None,
) -> None:
    """Write a quantized GGUF file (llama.cpp's format) from a float checkpoint."""
    from collections import Counter

    from hybridllm.loading.gguf import GGUFFile
    from hybridllm.loading.quantize import quantize_checkpoint
    from hybridllm.report import format_bytes

    out = quantize_checkpoint(src, dst, qtype, pre)
    written = GGUFFile(out)
    try:
        types = Counter(info.type_name for info in written.tensors.values())
        tensor_bytes = sum(info.nbytes for info in written.tensors.values())
    finally:
        written.close()
    summary = ", ".join(f"{n} {t}" for t, n in types.most_common())
    typer.echo(f"wrote {out} ({format_bytes(out.stat().st_size)}; tensors: {summary}; "
               f"{format_bytes(tensor_bytes)} of tensor data)")
