"""Human-readable reports of the metrics (rich tables on standard error)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from hybridllm.timing import ColdStart
from hybridllm.units import format_bytes


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} tok/s"


def print_metrics(metrics: dict[str, Any], cold_start: ColdStart | None = None, console: Console | None = None) -> None:
    """Print a request's metrics as one table."""
    console = console or Console(stderr=True)
    table = Table(title="hybridllm request metrics", show_header=True, header_style="bold")
    table.add_column("phase")
    table.add_column("figure", justify="right")
    if cold_start is not None:
        table.add_row("cold start", f"{_seconds(cold_start.total_s)} (read {_seconds(cold_start.read_s)}, "
                      f"dequantize {_seconds(cold_start.dequantize_s)}, to device {_seconds(cold_start.to_device_s)}, "
                      f"tokenizer {_seconds(cold_start.tokenizer_s)}"
                      + (f", host copy {_seconds(cold_start.host_copy_s)}" if cold_start.host_copy_s else "")
                      + (f", decode backend {_seconds(cold_start.compile_s)}" if cold_start.compile_s else "")
                      + (f", draft model {_seconds(cold_start.draft_s)}" if cold_start.draft_s else "")
                      + ")")
    table.add_row("prompt tokens", str(metrics["prompt_tokens"]))
    table.add_row("generated tokens", str(metrics["generated_tokens"]))
    table.add_row("TTFT", _seconds(metrics["ttft_s"]))
    table.add_row("prefill", _rate(metrics["prefill_tps"]))
    table.add_row("decode", _rate(metrics["decode_tps"]))
    table.add_row("TPOT mean / p50 / p99", " / ".join(_seconds(metrics[k]) for k in ("tpot_mean_s", "tpot_p50_s", "tpot_p99_s")))
    if metrics.get("spec_method", "none") != "none":
        rate = metrics["spec_acceptance_rate"]
        table.add_row(f"speculative ({metrics['spec_method']}): accepted / proposed",
                      f"{metrics['spec_accepted_tokens']} / {metrics['spec_draft_tokens']} tokens"
                      + ("" if rate is None else f" ({100 * rate:.0f} %)") + f" in {metrics['spec_drafts']} drafts")
    table.add_row("peak host RSS", format_bytes(metrics["peak_host_bytes"]))
    table.add_row("peak device memory", format_bytes(metrics["peak_device_bytes"]))
    if "kv_bytes" in metrics:
        peak = metrics["kv_peak_bytes"]
        table.add_row(f"KV ({metrics.get('kv_cache', '?')}) peak device / host",
                      f"{format_bytes(peak['device'])} / {format_bytes(peak['host'])}")
        table.add_row("bus bytes (host<->device)", format_bytes(metrics.get("bus_bytes", 0)))
    console.print(table)
