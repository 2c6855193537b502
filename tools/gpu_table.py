#!/usr/bin/env python
"""Issue #15's lines from a GPU run's result files: the measured figure, the target, met or not.

    python tools/gpu_table.py --out $OUT        # after tools/gpu_run.py; writes table.md and table.json

Reads what the stages of ``tools/gpu_run.py`` wrote under ``--out`` (the bench JSONs, the
profile's records, the load test's, the cuda tests' JUnit XML) and writes one line per figure
of the issue. A figure whose stage did not write it is "no figure", with the reason; nothing is
estimated. The verdicts are the device run's only: a dry run (CPU, tiny shapes) exercises the
arithmetic, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpu_run

from hybridllm.bench.report import speed_records
from hybridllm.units import format_bytes, parse_bytes

MiB = 2**20


@dataclass
class Line:
    """One line of the issue's "done when"."""

    line: str
    target: str
    measured: str
    verdict: str  # "met", "not met" or "no figure"
    value: float | None = None
    source: str | None = None


class Missing(Exception):
    """A figure the run did not produce; the message says why."""


def judge(line: str, target: str, source: str, measure: Callable[[], tuple[float, str]],
          met: Callable[[float], bool]) -> Line:
    """The line, with ``measure()``'s (value, text) or, when it raises ``Missing``, no figure."""
    try:
        value, text = measure()
    except Missing as exc:
        return Line(line, target, str(exc), "no figure", source=source)
    return Line(line, target, text, "met" if met(value) else "not met", value, source)


class RunFiles:
    """The result files of one run directory, read on demand."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def json(self, name: str) -> dict[str, Any]:
        path = self.out / name
        if not path.is_file():
            raise Missing(f"{name} was not written (see stages.md)")
        return json.loads(path.read_text())

    def bench(self, name: str) -> dict[str, Any]:
        return self.json(f"{name}.json")

    def row(self, name: str, context: int, engine: str = "hybridllm") -> dict[str, Any]:
        """The ``engine`` row at ``context`` of the bench ``name``; Missing unless it ran to the end."""
        rows = [r for r in self.bench(name)["rows"] if r["engine"] == engine and r["context"] == context]
        if not rows:
            raise Missing(f"{name}.json has no {engine} row at {context} tokens")
        row = rows[0]
        if row["status"] != "ok":
            raise Missing(f"{engine} at {context} tokens: {row['status']} ({row.get('error') or 'no message'})")
        return row


def decode_lines(run: RunFiles, short: int, long: int) -> list[Line]:
    def limit_fraction() -> tuple[float, str]:
        document = run.bench(gpu_run.BENCH_CUDA_GRAPH)
        bandwidth = document["settings"].get("device_bandwidth_gbs")
        if not bandwidth:
            raise Missing("no device bandwidth measured (the bench ran without a GPU)")
        row = run.row(gpu_run.BENCH_CUDA_GRAPH, short)
        record = next(r for r in speed_records([row], bandwidth) if r["context"] == short)
        return record["limit_fraction"], (f"{row['decode_tps']:.0f} tok/s = {100 * record['limit_fraction']:.0f} % of "
                                          f"{record['limit_tps']:.0f} tok/s ({format_bytes(record['bytes_per_token'])}"
                                          f"/token at {bandwidth:.0f} GB/s)")

    def long_vs_short() -> tuple[float, str]:
        at_short, at_long = run.row(gpu_run.BENCH_CUDA_GRAPH, short), run.row(gpu_run.BENCH_CUDA_GRAPH, long)
        ratio = at_long["decode_tps"] / at_short["decode_tps"]
        return ratio, f"{at_long['decode_tps']:.0f} / {at_short['decode_tps']:.0f} tok/s = {ratio:.2f}x"

    source = f"{gpu_run.BENCH_CUDA_GRAPH}.json"
    return [judge(f"decode at {short} (cuda-graph): share of the bandwidth limit", ">= 60 %", source,
                  limit_fraction, lambda v: v >= 0.6),
            judge(f"decode at {long} vs at {short} (cuda-graph)", ">= 0.7x", source, long_vs_short,
                  lambda v: v >= 0.7)]


def prefill_lines(run: RunFiles, contexts: tuple[int, ...]) -> list[Line]:
    def versus_transformers(context: int) -> Callable[[], tuple[float, str]]:
        def measure() -> tuple[float, str]:
            ours = run.row(gpu_run.BENCH_CUDA_GRAPH, context)["prefill_tps"]
            peer = run.row(gpu_run.BENCH_EAGER, context, engine="transformers")["prefill_tps"]
            return ours / peer, f"{ours:.0f} vs {peer:.0f} tok/s = {ours / peer:.2f}x"
        return measure

    return [judge(f"prefill at {context} vs transformers (SDPA)", ">= 1.0x",
                  f"{gpu_run.BENCH_CUDA_GRAPH}.json, {gpu_run.BENCH_EAGER}.json", versus_transformers(context),
                  lambda v: v >= 1.0) for context in contexts]


def tiered_lines(run: RunFiles, short: int, long: int) -> list[Line]:
    def decode_ratio() -> tuple[float, str]:
        tiered, dense = run.row(gpu_run.BENCH_TIERED, long), run.row(gpu_run.BENCH_EAGER, long)
        ratio = tiered["decode_tps"] / dense["decode_tps"]
        return ratio, f"{tiered['decode_tps']:.1f} vs {dense['decode_tps']:.1f} tok/s (eager, dynamic) = {ratio:.2f}x"

    def ttft_ratio() -> tuple[float, str]:
        tiered, dense = run.row(gpu_run.BENCH_TIERED, long), run.row(gpu_run.BENCH_EAGER, long)
        ratio = tiered["ttft_s"] / dense["ttft_s"]
        return ratio, f"{tiered['ttft_s']:.2f} vs {dense['ttft_s']:.2f} s = {ratio:.2f}x"

    def bus_per_token() -> tuple[float, str]:
        rows = run.json(f"{gpu_run.PROFILE_DIR}/decode_{short}_tiered.json")["rows"]
        if not rows:
            raise Missing("the tiered profile recorded no backend")
        value = rows[0]["bus_bytes_per_token"]
        return value, (f"{format_bytes(value)} per decode token (profile at {short} tokens: q out, partial "
                       f"outputs back, evicted pages; none of it grows with the context)")

    sources = f"{gpu_run.BENCH_TIERED}.json, {gpu_run.BENCH_EAGER}.json"
    return [judge(f"tiered at {long}, 90% of KV on the host: decode vs all on the device", ">= 0.8x", sources,
                  decode_ratio, lambda v: v >= 0.8),
            judge(f"tiered at {long}: TTFT vs dynamic's", "<= 1.5x", sources, ttft_ratio, lambda v: v <= 1.5),
            judge("tiered: bus bytes per decode token", "<= 1 MiB", f"{gpu_run.PROFILE_DIR}/decode_{short}_tiered.json",
                  bus_per_token, lambda v: v <= MiB)]


def long_context_lines(run: RunFiles, longest: int, budget: str) -> list[Line]:
    source = f"{gpu_run.LONG_CONTEXT}.json"

    def completes() -> tuple[float, str]:
        row = run.row(gpu_run.LONG_CONTEXT, longest)
        return 1.0, f"completed: TTFT {row['ttft_s']:.1f} s, {row['generated_tokens']} tokens generated"

    def decode() -> tuple[float, str]:
        row = run.row(gpu_run.LONG_CONTEXT, longest)
        return row["decode_tps"], f"{row['decode_tps']:.1f} tok/s"

    def peak() -> tuple[float, str]:
        row = run.row(gpu_run.LONG_CONTEXT, longest)
        return row["peak_device_bytes"], f"{format_bytes(row['peak_device_bytes'])} (budget {budget})"

    limit = parse_bytes(budget)
    return [judge(f"{longest} tokens within a device budget of {budget}", "completes", source, completes,
                  lambda v: True),
            judge(f"{longest} tokens: decode", ">= 10 tok/s", source, decode, lambda v: v >= 10),
            judge(f"{longest} tokens: device peak", f"<= {budget}", source, peak, lambda v: v <= limit)]


def streams_line(run: RunFiles, streams: int) -> Line:
    def ratio() -> tuple[float, str]:
        result = run.json(gpu_run.SERVER_STREAMS_JSON)
        if result["failed"]:
            raise Missing(f"{result['failed']} request(s) failed")
        medians = result["median_tokens_per_s"]
        return result["ratio"], (f"{medians['batched']:.0f} vs {medians['one_at_a_time']:.0f} generated tok/s "
                                 f"= {result['ratio']:.2f}x")

    return judge(f"{streams} concurrent server streams vs one", ">= 8x", gpu_run.SERVER_STREAMS_JSON, ratio,
                 lambda v: v >= 8)


def cuda_tests_line(run: RunFiles) -> Line:
    def passed() -> tuple[float, str]:
        path = run.out / gpu_run.CUDA_TESTS_XML
        if not path.is_file():
            raise Missing(f"{gpu_run.CUDA_TESTS_XML} was not written (see stages.md)")
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        ran = counts["tests"] - counts["skipped"]
        bad = counts["failures"] + counts["errors"]
        return (1.0 if ran and not bad else 0.0), (f"{ran - bad} passed, {counts['failures']} failed, "
                                                    f"{counts['errors']} errors, {counts['skipped']} skipped")

    return judge("pytest -m cuda", "passes", gpu_run.CUDA_TESTS_XML, passed,
                 lambda v: v == 1.0)


def build_table(out: Path) -> dict[str, Any]:
    """Every line of the issue from the run under ``out``."""
    run = RunFiles(out)
    plan = json.loads((out / "stages.json").read_text())["plan"] if (out / "stages.json").is_file() else {}
    if not plan:
        raise SystemExit(f"error: {out} holds no stages.json: run tools/gpu_run.py first")
    short, long = plan["contexts"]
    lines = [*decode_lines(run, short, long), *prefill_lines(run, (short, long)), *tiered_lines(run, short, long),
             *long_context_lines(run, plan["longest"], plan["vram_budget"]), streams_line(run, plan["streams"]),
             cuda_tests_line(run)]
    setup = (out / gpu_run.SETUP_JSON)
    machine = json.loads(setup.read_text()) if setup.is_file() else {}
    return {"plan": plan, "machine": machine, "lines": [line.__dict__ for line in lines]}


def markdown(table: dict[str, Any]) -> str:
    plan, machine = table["plan"], table["machine"]
    device = machine.get("gpu") or plan["device"]
    lines = [f"# Issue #15's lines: {plan['plan']} on {device}", "",
             f"torch {machine.get('torch', '?')} (CUDA {machine.get('torch_cuda') or '-'}), triton "
             f"{machine.get('triton') or '-'}, Python {machine.get('python', '?')}; {plan['dtype']}, shape "
             f"{plan['config']}.", "",
             "| line | target | measured | verdict |", "| --- | --- | --- | --- |"]
    lines += [f"| {row['line']} | {row['target']} | {row['measured']} | {row['verdict']} |" for row in table["lines"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the run's directory (tools/gpu_run.py --out)")
    args = parser.parse_args()
    table = build_table(args.out)
    (args.out / f"{gpu_run.TABLE}.json").write_text(json.dumps(table, indent=2) + "\n")
    text = markdown(table)
    (args.out / f"{gpu_run.TABLE}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
