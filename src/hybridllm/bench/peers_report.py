"""The foundation comparison with the peers (``--preset peers``): its table and its Markdown section.

The table puts each engine's prefill and decode figures next to llama.cpp's at the same prompt
length (``decode vs llama.cpp``); the section adds what a reader needs to judge the numbers
(date, command, machine, software, load average of the machine during the sweep) and is
written, ready for docs/benchmarks.md, by ``hybridllm bench --preset peers --markdown FILE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridllm.bench import report
from hybridllm.units import format_bytes

HEADING = "## Foundation: decode and prefill vs llama.cpp and transformers (CPU, {threads} threads)"
ENGINE_ORDER = {"hybridllm": 0, "llama.cpp": 1, "transformers": 2}
HEADERS = ("prompt tokens", "engine", "prefill tok/s", "TTFT", "decode tok/s", "decode vs llama.cpp", "TPOT p50",
           "TPOT p99", "peak host RSS", "status")


def records(rows: Sequence[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """Cells of the table (by prompt length, then engine) and the numbered notes of failed rows."""
    out, notes = [], []
    llama = {r["context"]: r.get("decode_tps") for r in rows if r["engine"] == "llama.cpp" and r["status"] == "ok"}
    for row in sorted(rows, key=lambda r: (r["context"], ENGINE_ORDER.get(r["engine"], len(ENGINE_ORDER)))):
        ok = row["status"] == "ok"
        status = "ok"
        if not ok:
            notes.append(f"{row['engine']} at {row['context']} tokens: {row['status']}: {row['error']}")
            status = f"{row['status']} [{len(notes)}]"
        reference = llama.get(row["context"])
        ratio = f"{row['decode_tps'] / reference:.2f}x" if ok and reference and row.get("decode_tps") else "-"
        out.append([
            str(row["context"]), row["engine"],
            report.fmt_rate(row.get("prefill_tps"), row.get("prefill_tps_spread")),
            report.fmt_seconds(row.get("ttft_s")),
            report.fmt_rate(row.get("decode_tps"), row.get("decode_tps_spread")),
            ratio,
            report.fmt_seconds(row.get("tpot_p50_s")),
            report.fmt_seconds(row.get("tpot_p99_s")),
            format_bytes(row.get("peak_host_bytes")),
            status,
        ])
    return out, notes


def print_peers(rows: Sequence[dict[str, Any]]) -> None:
    cells, notes = records(rows)
    report.print_table(HEADERS, cells, notes, title="peers: decode and prefill vs llama.cpp and transformers")


def table_markdown(rows: Sequence[dict[str, Any]]) -> str:
    return report.markdown_with_notes(HEADERS, *records(rows))


def section(rows: Sequence[dict[str, Any]], machine: dict[str, Any], settings: dict[str, Any]) -> str:
    """The Markdown section of docs/benchmarks.md for a peers sweep.

    Args:
        rows: the sweep's rows.
        machine: ``report.machine_info()``.
        settings: what the sweep recorded: ``command``, ``started`` (ISO time, UTC),
            ``load_average`` (1-minute, at the start and the end), ``threads``, ``new_tokens``, ``repeat``.
    """
    versions = ", ".join(f"{k} {machine.get(k)}" for k in ("torch", "transformers", "llama-cpp-python"))
    variants = sorted({f"{r['engine']}: {r['variant']}" for r in rows if r.get("variant")})
    lines = [
        HEADING.format(threads=settings.get("threads")),
        "",
        *report.measured_with(settings),
        (f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_bytes'] / 2**30:.0f} GiB RAM, "
         f"{'GPU ' + machine['gpu'] if machine['gpu'] else 'no GPU'}; {machine['os']}"),
        f"- software: Python {machine['python']}, {versions}",
        report.load_line(settings),
        (f"- model: {rows[0]['model'] if rows else '?'}; {settings.get('threads')} threads for every engine; "
         f"{settings.get('new_tokens')} new tokens, greedy, end-of-sequence ignored; median of "
         f"{settings.get('repeat')} run(s) after a warm-up (± is half the spread); each configuration in its own "
         "process"),
        ("- hybridllm and transformers dequantize the GGUF file to float32 (transformers: manual greedy loop with "
         "its DynamicCache); llama.cpp runs the Q4_1 file as it is"),
        f"- engines: {'; '.join(variants) if variants else 'hybridllm'}",
        "- prefill tok/s = prompt tokens / TTFT; decode tok/s = 1 / mean time between later tokens",
        "",
        table_markdown(rows),
    ]
    return "\n".join(lines)
