"""The models preset: real model shapes as the Q4_K_M files people download, ours vs llama.cpp vs
transformers on each.

    files = model_files(["qwen2.5-0.5b", ...], configs="configs", folder="~/.cache/hybridllm/models")
    rows = run_sweep(models_grid(files, threads=2))
    print_models(rows, files)

Each file is a published config's shape with random weights (``bench.model_files``: written as F16
GGUF, quantized by llama.cpp's own quantizer), so its tensor types are the mix a real Q4_K_M file
has and its speed what a real one's would be. Per file: decode at 512 tokens and at 8K (or the
model's window when smaller), prefill at 2K; the table puts ours next to llama.cpp's, with the
weights we keep resident against the file's tensor bytes and the peak RSS against llama.cpp's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridllm.bench import report
from hybridllm.bench.model_files import real_shaped_file
from hybridllm.bench.sweep import BenchConfig, build_grid
from hybridllm.errors import ConfigError
from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.local_models import model_name
from hybridllm.units import format_bytes

# The published shapes of the preset: configs/<name>.json (Phi-3 and Mistral scaled to <= 1.5B).
MODELS = ("llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "gemma-3-270m", "gemma-3-1b", "phi-3-mini-scaled-1.4b",
          "mistral-7b-scaled-1.4b")
DECODE_SHORT, PREFILL, DECODE_LONG = 512, 2048, 8192
HEADERS = ("model (Q4_K_M)", "types", "decode @512 vs llama.cpp", "decode @long vs llama.cpp", "prefill @2K vs llama.cpp",
           "decode @512 vs transformers", "weights / file", "peak RSS vs llama.cpp")


def model_files(names: Sequence[str], configs: str | os.PathLike, folder: str | os.PathLike,
                file_type: str = "Q4_K_M") -> dict[str, Path]:
    """name -> the ``file_type`` file of configs/<name>.json's shape (written once into ``folder``)."""
    out = {}
    for name in names:
        config = Path(configs) / f"{name}.json"
        if not config.exists():
            raise ConfigError(f"no config {config} (the models preset reads the repository's configs/ folder)")
        out[name] = real_shaped_file(config, Path(folder).expanduser(), file_type)
    return out


def long_context(path: Path, new_tokens: int) -> int:
    """The long decode context of a file: 8K, or its window less the new tokens when smaller."""
    window = GGUFFile(path).config.max_position_embeddings
    return min(DECODE_LONG, window - new_tokens)


def models_grid(files: dict[str, Path], baselines: Sequence[str] = ("llama.cpp", "transformers"),
                new_tokens: int = 64, **common: Any) -> list[BenchConfig]:
    """Every file's configurations: ours and llama.cpp at 512, 2K and the long context;
    transformers at 512 only (the table's one transformers column: its float32 prefill of a long
    prompt on a few cores takes minutes and tells nothing more)."""
    grid = []
    for path in files.values():
        contexts = sorted({DECODE_SHORT, PREFILL, long_context(path, new_tokens)})
        grid += build_grid(contexts, baselines=[b for b in baselines if b != "transformers"], model=str(path),
                           new_tokens=new_tokens, **common)
        if "transformers" in baselines:
            grid += build_grid([DECODE_SHORT], baselines=["transformers"], include_ours=False, model=str(path),
                               new_tokens=new_tokens, **common)
    return grid


def figure_of(row: dict[str, Any]) -> str:
    """The speed figure the table reads from a row: prefill's at the prefill context, decode's else."""
    return "prefill_tps" if row["context"] == PREFILL else "decode_tps"


def best_of_rounds(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, engine, context) from rows of several rounds (``tools/models_bench.py
    --rounds``: the whole grid again, every configuration in a fresh process): the row of the best
    speed figure the table reads (``figure_of``), with the largest peak RSS of the rounds. A VM's
    memory can change speed over time (docs/benchmarks.md: ~45 against ~70 GB/s for seconds to
    minutes), so each engine's best of the same number of processes is what both can do; memory
    takes the worst.
    Rows that did not run ok are kept only where no round of theirs did."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["engine"], row["context"]), []).append(row)
    best = []
    for group in groups.values():
        ok = [r for r in group if r["status"] == "ok"]
        if not ok:
            best.append(group[0])
            continue
        chosen = max(ok, key=lambda r: r.get(figure_of(r)) or 0.0)
        peaks = [r["peak_host_bytes"] for r in ok if r.get("peak_host_bytes")]
        best.append({**chosen, "peak_host_bytes": max(peaks)} if peaks else chosen)
    return best


def memory_note(rows: Sequence[dict[str, Any]]) -> str:
    """How fast the machine's memory read around the rows, for a table's header: each row's
    ``memory_read_gbs`` is (before, after) it in GB/s (``tools/models_bench.py`` reads 256 MiB
    between the rows). Empty when no row has them."""
    rates = [rate for row in rows for rate in row.get("memory_read_gbs") or () if rate]
    if not rates:
        return ""
    return f"the memory read {min(rates):.0f}-{max(rates):.0f} GB/s between the rows"


def _ratio(ours: dict | None, peer: dict | None, key: str) -> str:
    if not ours or not peer or not ours.get(key) or not peer.get(key):
        return "-"
    return f"{ours[key] / peer[key]:.2f}x ({ours[key]:.1f} vs {peer[key]:.1f})"


def records(rows: Sequence[dict[str, Any]], files: dict[str, Path]) -> list[list[str]]:
    """One table row per file (the cells of ``HEADERS``); rows of several rounds give their best."""
    by = {(r["model"], r["engine"], r["context"]): r for r in best_of_rounds(rows) if r["status"] == "ok"}
    cells = []
    for name, path in files.items():
        model = model_name(path)  # how the sweep's rows name it
        contexts = {r["context"] for r in rows if r["model"] == model}
        others = contexts - {DECODE_SHORT, PREFILL}  # the long context: 8K, or the window's (maybe shorter)
        long = max(others or contexts or {0})
        get = lambda engine, context: by.get((model, engine, context))  # noqa: E731
        gguf = GGUFFile(path)
        tensor_bytes = sum(t.nbytes for t in gguf.tensors.values())
        types = sorted({t.type_name for t in gguf.tensors.values()} - {"F32"})
        ours = get("hybridllm", DECODE_SHORT)
        resident = sum((ours or {}).get("weight_bytes", {}).values() or [0]) if ours else 0
        rss = [get(engine, DECODE_SHORT) for engine in ("hybridllm", "llama.cpp")]
        cells.append([
            f"{name} ({format_bytes(tensor_bytes)})", "+".join(types),
            _ratio(get("hybridllm", DECODE_SHORT), get("llama.cpp", DECODE_SHORT), "decode_tps"),
            f"@{long}: " + _ratio(get("hybridllm", long), get("llama.cpp", long), "decode_tps"),
            _ratio(get("hybridllm", PREFILL), get("llama.cpp", PREFILL), "prefill_tps"),
            _ratio(get("hybridllm", DECODE_SHORT), get("transformers", DECODE_SHORT), "decode_tps"),
            f"{resident / tensor_bytes:.3f}" if resident else "-",
            f"{rss[0]['peak_host_bytes'] / rss[1]['peak_host_bytes']:.2f}x" if all(rss) else "-",
        ])
    return cells


def print_models(rows: Sequence[dict[str, Any]], files: dict[str, Path]) -> None:
    report.print_table(HEADERS, records(rows, files), [], title="models: real shapes as Q4_K_M files, vs the peers")


def table_markdown(rows: Sequence[dict[str, Any]], files: dict[str, Path]) -> str:
    return report.markdown(HEADERS, records(rows, files))
