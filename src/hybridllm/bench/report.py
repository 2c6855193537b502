"""Results of a sweep: a Markdown table on the terminal (rich), JSON, CSV, the study's layout."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from hybridllm.units import format_bytes

SCHEMA = "hybridllm.bench/1"
# Columns of the CSV file, in order (``kv_bytes`` is split per tier; ``runs`` stays in the JSON).
CSV_COLUMNS = (
    "engine", "model", "kv_cache", "variant", "decode_on", "n_gpu_layers", "context", "new_tokens", "repeat",
    "prefill_tps", "prefill_tps_spread", "ttft_s", "ttft_s_spread", "decode_tps", "decode_tps_spread",
    "tpot_p50_s", "tpot_p50_s_spread", "tpot_p99_s", "tpot_p99_s_spread",
    "peak_device_bytes", "peak_host_bytes", "kv_bytes_device", "kv_bytes_host", "bus_bytes",
    "status", "error", "threads", "device", "dtype", "kv_options", "weights", "weights_format",
    "weight_bytes_device", "weight_bytes_host", "decode_weight_bytes", "load_s", "wall_s",
)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, RAM, GPU, library versions."""
    import torch

    from hybridllm.bench.peers import peer_versions
    from hybridllm.hardware import cpu_model_name, gpu_available, memory_totals

    return {
        "cpu": cpu_model_name(),
        "cores": os.cpu_count(),
        "ram_bytes": memory_totals()[0],
        "gpu": torch.cuda.get_device_name(0) if gpu_available() else None,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        **peer_versions(),
    }


# ---- files ------------------------------------------------------------------------------------
def flatten(row: dict[str, Any]) -> dict[str, Any]:
    """A row as one flat CSV record."""
    kv = row.get("kv_bytes") or {}
    out = {k: row.get(k) for k in CSV_COLUMNS}
    out["kv_bytes_device"] = kv.get("device")
    out["kv_bytes_host"] = kv.get("host")
    weights = row.get("weight_bytes") or {}
    out["weight_bytes_device"] = weights.get("device")
    out["weight_bytes_host"] = weights.get("host")
    out["kv_options"] = json.dumps(row.get("kv_options") or {}, sort_keys=True)
    return out


def write_json(rows: Sequence[dict[str, Any]], path: str | os.PathLike, settings: dict[str, Any] | None = None,
               machine: dict[str, Any] | None = None) -> None:
    document = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine if machine is not None else machine_info(),
        "settings": settings or {},
        "rows": list(rows),
    }
    _parent(path)
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def write_csv(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    _parent(path)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(flatten(row))


def _parent(path: str | os.PathLike) -> None:
    Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)


# ---- formatting -------------------------------------------------------------------------------
def fmt_rate(value: float | None, spread: float | None = None) -> str:
    if value is None:
        return "-"
    text = f"{value:.1f}"
    return f"{text} ±{spread / 2:.1f}" if spread else text


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def fmt_context(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _status(row: dict[str, Any], index: int | None = None) -> str:
    if row["status"] == "ok":
        return "ok"
    return row["status"] if index is None else f"{row['status']} [{index}]"


# ---- the terminal table ---------------------------------------------------------------------------
SUMMARY_HEADERS = ("engine", "KV cache", "decode on", "GPU layers", "context", "prefill tok/s", "TTFT",
                   "decode tok/s", "TPOT p50", "TPOT p99", "peak device", "peak host", "KV device / host",
                   "bus", "status")


def summary_records(rows: Sequence[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """Cells of the summary table and the numbered notes of rows that are not "ok"."""
    records, notes = [], []
    for row in rows:
        index = None
        if row["status"] != "ok":
            notes.append(f"{row['engine']} {row['kv_cache']} ctx {row['context']}: {row['status']}: {row['error']}")
            index = len(notes)
        kv = row.get("kv_bytes") or {}
        records.append([
            row["engine"] + (f" ({row['weights']} weights)" if row.get("weights") else ""),
            row["kv_cache"] + (f" ({row['variant'].split(',')[0]})" if row["engine"] == "transformers"
                               and row.get("variant") else ""),
            row.get("decode_on") or "-",
            "-" if row.get("n_gpu_layers") is None else str(row["n_gpu_layers"]),
            str(row["context"]),
            fmt_rate(row.get("prefill_tps"), row.get("prefill_tps_spread")),
            fmt_seconds(row.get("ttft_s")),
            fmt_rate(row.get("decode_tps"), row.get("decode_tps_spread")),
            fmt_seconds(row.get("tpot_p50_s")),
            fmt_seconds(row.get("tpot_p99_s")),
            format_bytes(row.get("peak_device_bytes")),
            format_bytes(row.get("peak_host_bytes")),
            f"{format_bytes(kv.get('device'))} / {format_bytes(kv.get('host'))}",
            format_bytes(row.get("bus_bytes")),
            _status(row, index),
        ])
    return records, notes


def markdown(headers: Sequence[str], records: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in record) + " |" for record in records]
    return "\n".join(lines)


def markdown_with_notes(headers: Sequence[str], records: Sequence[Sequence[str]], notes: Sequence[str]) -> str:
    """A Markdown table followed by its numbered notes (the rows that are not "ok")."""
    text = markdown(headers, records)
    return text + ("\n\n" + "\n".join(f"[{i}] {n}" for i, n in enumerate(notes, 1)) if notes else "")


def measured_with(settings: dict[str, Any]) -> list[str]:
    """The opening lines of a docs/benchmarks.md section: when (``started``, UTC) and the ``command``."""
    started = str(settings.get("started", "?")).replace("T", " ")[:16]
    return [f"Measured {started} UTC with:", "", "```", str(settings.get("command", "")), "```", ""]


def load_line(settings: dict[str, Any]) -> str:
    """The machine's 1-minute load average at the start and the end of a sweep (``load_average``)."""
    start, end = settings.get("load_average") or (float("nan"), float("nan"))
    return f"- 1-minute load average of the machine (other work included): {start:.2f} at the start, {end:.2f} at the end"


def print_table(headers: Sequence[str], records: Sequence[Sequence[str]], notes: Sequence[str] = (),
                title: str | None = None, console: Console | None = None) -> None:
    """Print a Markdown table: with rich on a terminal, as plain Markdown text otherwise."""
    console = console or Console()
    if not console.is_terminal:  # a pipe or a file: no wrapping, no styling
        text = (f"{title}\n\n" if title else "") + markdown(headers, records)
        text += "".join(f"\n[{i}] {note}" for i, note in enumerate(notes, 1))
        console.file.write(text + "\n\n")
        console.file.flush()
        return
    table = Table(box=box.MARKDOWN, title=title, show_edge=True, header_style="bold")
    for header in headers:
        table.add_column(header, overflow="fold")
    for record in records:
        table.add_row(*record)
    console.print(table)
    for i, note in enumerate(notes, 1):
        console.print(f"[{i}] {note}", markup=False, highlight=False)


def print_summary(rows: Sequence[dict[str, Any]], console: Console | None = None) -> None:
    models = sorted({r["model"] for r in rows})
    records, notes = summary_records(rows)
    print_table(SUMMARY_HEADERS, records, notes, title=f"hybridllm bench: {', '.join(models)}", console=console)


def summary_markdown(rows: Sequence[dict[str, Any]]) -> str:
    records, notes = summary_records(rows)
    return markdown_with_notes(SUMMARY_HEADERS, records, notes)


# ---- the study's layout ---------------------------------------------------------------------------
PAPER_HEADERS = ("context", "CPU decode", "strategy", "GPU mem", "CPU mem", "tokens/s")


def paper_records(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One line per row: context, decode on the CPU?, strategy, peak device/host memory, decode tok/s."""
    records = []
    for row in sorted(rows, key=lambda r: (r["context"], r["decode_on"] == "host", r["engine"], r["kv_cache"])):
        strategy = row["kv_cache"] if row["engine"] == "hybridllm" else f"{row['engine']} {row['kv_cache']}"
        ok = row["status"] == "ok"
        records.append([
            fmt_context(row["context"]),
            "yes" if row.get("decode_on") == "host" else "no",
            strategy,
            format_bytes(row.get("peak_device_bytes")) if ok else "-",
            format_bytes(row.get("peak_host_bytes")) if ok else "-",
            f"{row['decode_tps']:.1f}" if ok and row.get("decode_tps") is not None else row["status"].upper(),
        ])
    return records


def paper_markdown(rows: Sequence[dict[str, Any]]) -> str:
    return markdown(PAPER_HEADERS, paper_records(rows))


# ---- the speed layout (--preset speed) -------------------------------------------------------------
SPEED_HEADERS = ("context", "engine", "prefill tok/s", "decode tok/s", "decode vs llama.cpp", "prefill vs llama.cpp",
                 "bytes/token", "bandwidth limit tok/s", "of the limit")


def bytes_per_token(row: dict[str, Any]) -> int | None:
    """Bytes a decode step reads: every weight it uses once plus the whole KV cache.

    The weight term is the engine's ``decode_weight_bytes`` where reported, else every weight
    held. The KV term is the
    cache's ledger at the end of the run (context + new tokens, an upper bound of what a step
    reads); None when the row does not report its weight bytes.
    """
    weights = row.get("weight_bytes") or {}
    if weights.get("device") is None and weights.get("host") is None:
        return None
    kv = row.get("kv_bytes") or {}
    read = row.get("decode_weight_bytes")
    weight_term = read if read is not None else sum(v or 0 for v in weights.values())
    return weight_term + sum(v or 0 for v in kv.values())


def speed_records(rows: Sequence[dict[str, Any]], bandwidth_gbs: float | None) -> list[dict[str, Any]]:
    """Per ok row: its decode/prefill ratio to llama.cpp's row at the same context, and the
    fraction of the bandwidth limit (``bandwidth / bytes_per_token`` tokens/s) its decode reached.

    Args:
        rows: sweep rows (any engines; llama.cpp rows are the reference).
        bandwidth_gbs: measured host read bandwidth in GB/s (10^9 bytes/s); None: no fraction.
    """
    reference = {r["context"]: r for r in rows if r["engine"] == "llama.cpp" and r["status"] == "ok"}
    out = []
    for row in sorted(rows, key=lambda r: (r["context"], r["engine"] != "hybridllm", r["engine"])):
        if row["status"] != "ok":
            continue
        ref = reference.get(row["context"])
        per_token = bytes_per_token(row)
        limit = bandwidth_gbs * 1e9 / per_token if bandwidth_gbs and per_token else None
        out.append({
            "context": row["context"],
            "engine": row["engine"],
            "weights": row.get("weights_format") or row.get("weights"),
            "kv_dtype": (row.get("kv_options") or {}).get("kv_dtype"),
            "prefill_tps": row.get("prefill_tps"),
            "decode_tps": row.get("decode_tps"),
            "decode_ratio": _ratio(row.get("decode_tps"), ref and ref.get("decode_tps")),
            "prefill_ratio": _ratio(row.get("prefill_tps"), ref and ref.get("prefill_tps")),
            "bytes_per_token": per_token,
            "limit_tps": limit,
            "limit_fraction": _ratio(row.get("decode_tps"), limit),
        })
    return out


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def speed_table(records: Sequence[dict[str, Any]]) -> list[list[str]]:
    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    def engine(r: dict[str, Any]) -> str:
        details = [r["weights"]] if r.get("weights") else []
        if r["engine"] == "hybridllm" and r.get("kv_dtype") not in (None, "auto"):
            details.append(f"KV {r['kv_dtype']}")
        return r["engine"] + (f" ({', '.join(details)})" if details else "")

    return [[
        str(r["context"]),
        engine(r),
        fmt_rate(r["prefill_tps"]),
        fmt_rate(r["decode_tps"]),
        times(r["decode_ratio"]),
        times(r["prefill_ratio"]),
        format_bytes(r["bytes_per_token"]),
        fmt_rate(r["limit_tps"]),
        "-" if r["limit_fraction"] is None else f"{100 * r['limit_fraction']:.0f} %",
    ] for r in records]


def print_speed(rows: Sequence[dict[str, Any]], bandwidth_gbs: float | None, console: Console | None = None,
                bandwidth_label: str = "host read bandwidth") -> None:
    title = "speed: ratio to llama.cpp and fraction of the bandwidth limit"
    if bandwidth_gbs:
        title += f" ({bandwidth_label} {bandwidth_gbs:.1f} GB/s)"
    print_table(SPEED_HEADERS, speed_table(speed_records(rows, bandwidth_gbs)), title=title, console=console)


def speed_markdown(rows: Sequence[dict[str, Any]], bandwidth_gbs: float | None) -> str:
    return markdown(SPEED_HEADERS, speed_table(speed_records(rows, bandwidth_gbs)))
