"""Speculative decoding side by side (``--preset spec``): its table and its Markdown section.

Per workload (``hybridllm.bench.workloads``: rewrite a file, quote a document, free-form chat) the
table puts our engine without and with speculation next to llama-cpp-python without and with its
prompt lookup (``LlamaPromptLookupDecoding``), measured in one sweep on the same file, prompt ids
and thread count: decode tokens/s, the acceptance of our proposals, each row's speed-up over the
same engine without speculation and its ratio to llama-cpp-python's prompt lookup. The section,
ready for docs/benchmarks.md (``--markdown FILE``), adds the machine, its CPU's model and the
native kernels' instruction set, the command, and the serving comparison
(``hybridllm.bench.spec_serve``: aggregate tokens/s of ``serve`` without and with ``--spec ngram``
under concurrent requests).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from hybridllm.bench import report

HEADING = "## Speculative decoding: input-grounded prompts and free-form chat (CPU, {threads} threads)"
HEADERS = ("workload", "engine", "speculation", "prompt tokens", "generated", "decode tok/s", "accepted / proposed",
           "vs no speculation", "vs llama.cpp prompt lookup", "status")
ENGINE_ORDER = {"hybridllm": 0, "llama.cpp": 1, "transformers": 2}
SERVE_HEADERS = ("server", "requests at once", "generated tok/s (median)", "vs no speculation", "accepted / proposed",
                 "bursts ok")


def _speculation(row: dict[str, Any]) -> str:
    if row.get("spec", "none") == "none":
        return "none"
    return "prompt lookup" if row["engine"] == "llama.cpp" else row["spec"]


def _acceptance(row: dict[str, Any]) -> str:
    proposed, accepted = row.get("spec_draft_tokens"), row.get("spec_accepted_tokens")
    if not proposed:
        return "-"
    return f"{accepted} / {proposed} ({100 * accepted / proposed:.0f} %)"


def records(rows: Sequence[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """Cells of the table (by workload, then engine and speculation) and the notes of failed rows."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("decode_tps")]
    plain = {(r.get("workload"), r["engine"]): r["decode_tps"] for r in ok if r.get("spec", "none") == "none"}
    lookup = {r.get("workload"): r["decode_tps"] for r in ok if r["engine"] == "llama.cpp" and r.get("spec") == "ngram"}
    out, notes = [], []
    for row in sorted(rows, key=lambda r: (str(r.get("workload")), ENGINE_ORDER.get(r["engine"], 9),
                                           r.get("spec", "none") != "none")):
        status = "ok"
        if row["status"] != "ok":
            notes.append(f"{row['engine']} {_speculation(row)} on {row.get('workload')}: {row['status']}: "
                         f"{row['error']}")
            status = f"{row['status']} [{len(notes)}]"
        decode = row.get("decode_tps") if row["status"] == "ok" else None
        out.append([
            str(row.get("workload") or f"{row['context']} tokens"), row["engine"], _speculation(row),
            str(row["context"]), str(row.get("generated_tokens") or "-"),
            report.fmt_rate(decode, row.get("decode_tps_spread")), _acceptance(row),
            _times(decode, plain.get((row.get("workload"), row["engine"]))),
            _times(decode, lookup.get(row.get("workload"))),
            status,
        ])
    return out, notes


def _times(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}x" if value and reference else "-"


def serve_records(serve_rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Cells of the serving table (``spec_serve.compare_serving``'s rows): per server, the median
    aggregate tokens/s of its bursts that all succeeded, and its ratio to the server without."""
    medians: dict[str, float | None] = {}
    cells = []
    for speculation in dict.fromkeys(r["speculation"] for r in serve_rows):
        bursts = [r for r in serve_rows if r["speculation"] == speculation]
        ok = [r for r in bursts if not r.get("error") and not r["failed"]]
        medians[speculation] = statistics.median(r["generated_tokens_per_s"] for r in ok) if ok else None
        proposed, accepted = sum(r["draft_tokens"] for r in ok), sum(r["accepted_tokens"] for r in ok)
        cells.append([
            "serve" if speculation == "none" else f"serve --spec {speculation}",
            str(bursts[0].get("concurrency", "-")), report.fmt_rate(medians[speculation]),
            _times(medians[speculation], medians.get("none")),
            f"{accepted} / {proposed} ({100 * accepted / proposed:.0f} %)" if proposed else "-",
            f"{len(ok)} / {len(bursts)}",
        ])
    return cells


def print_spec(rows: Sequence[dict[str, Any]]) -> None:
    cells, notes = records(rows)
    report.print_table(HEADERS, cells, notes, title="speculative decoding: ours and llama-cpp-python's prompt lookup")


def print_serve(serve_rows: Sequence[dict[str, Any]]) -> None:
    errors = sorted({r["error"] for r in serve_rows if r.get("error")} |
                    {e for r in serve_rows for e in r.get("errors", ())})
    report.print_table(SERVE_HEADERS, serve_records(serve_rows), errors,
                       title="serving concurrent requests without and with speculation")


def table_markdown(rows: Sequence[dict[str, Any]]) -> str:
    return report.markdown_with_notes(HEADERS, *records(rows))


def section(rows: Sequence[dict[str, Any]], machine: dict[str, Any], settings: dict[str, Any],
            serve_rows: Sequence[dict[str, Any]] = ()) -> str:
    """The Markdown section of docs/benchmarks.md for a ``--preset spec`` sweep.

    Args:
        rows: the sweep's rows.
        machine: ``report.machine_info()`` (plus ``kernel_isa``: the native kernels' instruction set).
        settings: what the sweep recorded (``command``, ``started``, ``load_average``, ``threads``, ``repeat``,
            ``warmup``).
        serve_rows: the serving comparison's bursts (``spec_serve.compare_serving``), if it ran.
    """
    variants = sorted({f"{r['engine']}: {r['variant']}" for r in rows if r.get("variant")})
    caps = ", ".join(f"{workload} {n}" for workload, n in sorted({(str(r.get("workload")), r.get("new_tokens"))
                                                                 for r in rows}))
    lines = [
        HEADING.format(threads=settings.get("threads")),
        "",
        *report.measured_with(settings),
        (f"- machine: {machine['cpu']} (native kernels: {machine.get('kernel_isa') or 'not built'}), "
         f"{machine['cores']} cores, {machine['ram_bytes'] / 2**30:.0f} GiB RAM; {machine['os']}"),
        f"- software: Python {machine['python']}, torch {machine['torch']}, llama-cpp-python "
        f"{machine.get('llama-cpp-python')}",
        report.load_line(settings),
        (f"- model: {rows[0]['model'] if rows else '?'}, its own quantization in both engines; "
         f"{settings.get('threads')} threads for every engine; greedy, new tokens at most {caps}, "
         f"stopping at the end of sequence; median of {settings.get('repeat')} run(s)"
         f"{' after a warm-up' if settings.get('warmup', True) else ''}; each "
         "configuration in its own process"),
        "- workloads: rewrite (a ~600-token Python file given back with a class renamed), quote (a ~550-token "
        "document, the paragraph that answers a question repeated), chat (a free-form story: nothing to copy)",
        f"- engines: {'; '.join(variants) if variants else 'hybridllm'}",
        "- decode tok/s = tokens after the first / their time; a step's accepted tokens share its time",
        "",
        table_markdown(rows),
    ]
    if serve_rows:
        first = serve_rows[0]
        lines += [
            "",
            f"### Serving {first.get('concurrency')} concurrent requests",
            "",
            (f"`hybridllm serve` without and with `--spec ngram`, {settings.get('threads')} threads, "
             f"`--max-batch` = the requests in flight; each burst {first.get('concurrency')} free-form chat requests "
             f"at once (`hybridllm.bench.serve_load.PROMPTS`), greedy, at most {first.get('max_tokens')} new tokens, "
             f"stopping at the end of sequence (both servers generate the same tokens); a fresh server per burst, "
             f"alternating, {settings.get('repeat')} burst(s) each; aggregate tok/s = generated tokens / the "
             "burst's wall time (prefill included)"),
            "",
            report.markdown(SERVE_HEADERS, serve_records(serve_rows)),
        ]
    return "\n".join(lines)
