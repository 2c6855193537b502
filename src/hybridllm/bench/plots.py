"""PNG plots of a sweep (matplotlib, Agg backend: no display needed).

One figure, four panels, all against the context length (log scale):
decode tokens/s per strategy; peak memory per tier; P99 TPOT; and the ratio of decode
tokens/s with decode on the host to decode on the device, per strategy.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def series_label(row: dict[str, Any]) -> str:
    parts = [row["engine"] if row["engine"] != "hybridllm" else "", row["kv_cache"]]
    if row.get("decode_on"):
        parts.append(f"decode on {row['decode_on']}")
    if row.get("n_gpu_layers") is not None:
        parts.append(f"ngl {row['n_gpu_layers']}")
    return " ".join(p for p in parts if p)


def _series(rows: Sequence[dict[str, Any]], key: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        if row["status"] == "ok" and row.get(key) is not None:
            out[series_label(row)].append((row["context"], row[key]))
    return {label: sorted(points) for label, points in out.items()}


def host_device_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """decode tok/s on the host / on the device, per (engine, strategy, layers) and context."""
    by_key: dict[tuple, dict[str, float]] = defaultdict(dict)
    for row in rows:
        if row["status"] == "ok" and row.get("decode_tps"):
            key = (row["engine"], row["kv_cache"], row.get("n_gpu_layers"), row["context"])
            by_key[key][row.get("decode_on") or "device"] = row["decode_tps"]  # the device is the default
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (engine, kv, layers, context), rates in by_key.items():
        if "host" in rates and "device" in rates:
            label = " ".join(p for p in (engine if engine != "hybridllm" else "", kv,
                                         "" if layers is None else f"ngl {layers}") if p)
            out[label].append((context, rates["host"] / rates["device"]))
    return {label: sorted(points) for label, points in out.items()}


def _draw(ax, series: dict[str, list[tuple[int, float]]], title: str, ylabel: str, empty: str,
          colors: dict[str, str], linestyle: str = "-", suffix: str = "") -> None:
    from matplotlib.ticker import FuncFormatter

    from hybridllm.bench.report import fmt_context

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    if not series:
        if empty:
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="gray")
        return
    for label, points in series.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=label + suffix, linestyle=linestyle, color=colors.get(label))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: fmt_context(int(x)) if x >= 1 else f"{x:g}"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def write_plots(rows: Sequence[dict[str, Any]], path: str | os.PathLike, title: str | None = None) -> Path:
    """Write the four panels as one PNG at ``path``; return the path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    labels = sorted({series_label(r) for r in rows})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {label: palette[i % len(palette)] for i, label in enumerate(labels)}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    _draw(axes[0][0], _series(rows, "decode_tps"), "decode tokens/s vs context", "tokens/s", "no successful rows",
          colors)
    gib = lambda series: {k: [(x, y / 2**30) for x, y in v] for k, v in series.items()}
    title_mem = "peak memory per tier vs context (solid: device, dashed: host)"
    _draw(axes[0][1], gib(_series(rows, "peak_device_bytes")), title_mem, "GiB", "no successful rows", colors,
          suffix=" (device)")
    _draw(axes[0][1], gib(_series(rows, "peak_host_bytes")), title_mem, "GiB", "", colors, "--", " (host)")
    _draw(axes[1][0], {k: [(x, y * 1000) for x, y in v] for k, v in _series(rows, "tpot_p99_s").items()},
          "P99 time per output token vs context", "ms", "no successful rows", colors)
    _draw(axes[1][1], host_device_ratios(rows), "decode tokens/s: host / device", "ratio",
          "needs rows decoded on both the device and the host", {})
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out
