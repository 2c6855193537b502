#!/usr/bin/env python
"""The GPU session's one command (issues #15 and #30): issue #15's table, in one run that fits a lent device.

    bash tools/gpu_run.sh --kit shared/gpu --stages ...  # on the lent GPU: two commands (docs/benchmarks.md, "GPU")
    python tools/gpu_run.py --stages long_context      # a second command: some stages only
    python tools/gpu_run.py --dry-run --out /tmp/dry   # the same stage list on the CPU, tiny shapes
    python tools/gpu_run.py --list                     # the plan: stages, commands, time caps

The stages, in order (each one process after another; ``--list`` prints their commands):
setup (the GPU kit's ``setup.sh``, then an import probe), cuda_tests (``pytest -m cuda``),
bench_cuda_graph and bench_eager (decode and prefill at 4K and 32K, transformers as the peer),
bench_tiered (32K, 90% of the KV on the host), profile (``torch.profiler`` over a few decode
steps per backend at 4K), profile_tiered (the tiered cache's bus bytes per decode token), server_streams (16
concurrent streams of ``hybridllm serve`` vs one at a time), long_context (512K tokens in an
8 GiB device budget) and table (the issue's lines from the files above: ``tools/gpu_table.py``).

Everything lands under ``--out`` (``$OUT`` on the lent machine): each stage's own result files,
its log (``logs/<stage>.log``) and its record (``stages/<stage>.json``: status, exit code, wall
time, time limit, commands, the files it wrote); ``stages.json`` and ``stages.md`` summarize the
run and are rewritten after every stage, so a run cut short still says how far it got and how
long each stage took (plan the next run from them). Each stage runs under a time limit: the
smaller of its own cap and what is left of ``--budget`` (less the caps of the stages kept for
the end); a stage that fails or runs out of time is recorded, its processes are ended, and the
next one runs. The exit status is the number of stages that did not succeed.

This script uses only the standard library: it runs before the set-up has installed anything.
Scratch files that must not come back with ``$OUT`` (the served model's 2.5 GB of weights) go
under ``--work``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DEVICE_CONFIG = Path("configs/llama-3.2-1b.json")  # relative to ROOT, where every stage runs
MIN_STAGE_S = 15.0  # a stage left less time than this (or than its cap, if smaller) is skipped
KILL_GRACE_S = 10.0  # after SIGTERM, seconds before SIGKILL
# Asks a command for its Python stacks before it is ended (hybridllm.bench.stacks' signal; this
# file imports no hybridllm module: it runs before the set-up)
STACK_SIGNAL, STACK_WAIT_S = signal.SIGUSR1, 2.0
BENCH_MARGIN_S = 15.0  # the bench's per-configuration timeout ends this much before the stage's: it writes its JSON
DEVICE_BUDGET_S = 480.0  # the device run: ~8 minutes; the device tool's call gets timeout_s 540
DRY_BUDGET_S = 1500.0

# Result files under --out (tools/gpu_table.py reads them): NAME.json, NAME.md, or as named.
SETUP_JSON = "setup.json"
CUDA_TESTS_XML = "cuda_tests.xml"
BENCH_CUDA_GRAPH = "bench_cuda_graph"
BENCH_EAGER = "bench_eager"
BENCH_TIERED = "bench_tiered"
PROFILE_DIR = "profile"
SERVER_STREAMS_JSON = "server_streams.json"
SERVER_PROFILE = "server_profile"  # py-spy's samples of the server per burst, where py-spy is installed
CARRIED_WHEELS = ".whl"  # wheels a device call carries (git-ignored; docs/benchmarks.md, "How to run it")
LONG_CONTEXT = "long_context"
TABLE = "table"

# The dry run's model: the device run's architecture (Llama 3, llama3 rope scaling) at a tiny size.
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class Plan:
    """What the stages measure and at which sizes: the device run's, or the dry run's tiny ones."""

    name: str  # "device" or "dry run"
    device: str
    dtype: str
    config: Path  # the model's shape (a Hugging Face config.json, random weights)
    long_config: Path  # the same shape, its window widened to hold ``longest`` tokens
    contexts: tuple[int, int]  # the table's prompt lengths (4K and 32K)
    longest: int  # the long-context run's prompt (512K)
    vram_budget: str  # the long-context run's device budget
    new_tokens: int
    peer_new_tokens: int  # the run with transformers as the peer (its eager decode: ~15 tok/s on the H100)
    long_new_tokens: int
    prefill_chunk: int
    decode_steps: int  # profile: timed decode steps per backend
    profile_steps: int  # profile: decode steps recorded by torch.profiler
    streams: int  # concurrent server streams
    stream_tokens: int  # new tokens per stream
    work: Path  # scratch outside --out: configs, the served model's folder
    kit: Path | None  # the GPU kit whose setup.sh runs first (None: the environment as it is)

    @property
    def served_model(self) -> Path:
        return self.work / "served-model"

    def summary(self) -> dict[str, Any]:
        return {"plan": self.name, "device": self.device, "dtype": self.dtype, "config": str(self.config),
                "contexts": list(self.contexts), "longest": self.longest, "vram_budget": self.vram_budget,
                "new_tokens": self.new_tokens, "streams": self.streams, "kit": str(self.kit) if self.kit else None}


def widened_config(config: Path, dest: Path, window: int, overrides: dict[str, Any] | None = None) -> Path:
    """``config`` with ``overrides`` and a window of ``window`` tokens, written to ``dest``."""
    shape = {**json.loads((ROOT / config).read_text()), **(overrides or {}), "max_position_embeddings": window}
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(shape, indent=2) + "\n")
    return dest


def device_plan(work: Path, kit: Path | None) -> Plan:
    """Issue #15's sizes: the Llama-3.2-1B shape in bfloat16 on CUDA, 4K and 32K, 512K in 8 GiB."""
    longest, long_new_tokens = 524288, 32
    long_config = widened_config(DEVICE_CONFIG, work / f"{DEVICE_CONFIG.stem}-512k.json",
                                 longest + long_new_tokens)
    return Plan("device", "cuda", "bfloat16", DEVICE_CONFIG, long_config, contexts=(4096, 32768), longest=longest,
                vram_budget="8GiB", new_tokens=128, peer_new_tokens=32, long_new_tokens=long_new_tokens,
                prefill_chunk=8192, decode_steps=64, profile_steps=5, streams=16, stream_tokens=128, work=work, kit=kit)


def dry_plan(work: Path, kit: Path | None) -> Plan:
    """The same stages on the CPU at tiny sizes: contexts past a KV page (128 tokens), so the
    tiered cache moves pages, and a device budget that holds the weights and the hot window only."""
    longest, long_new_tokens = 1024, 4
    config = widened_config(DEVICE_CONFIG, work / "llama-tiny.json", 1024, TINY_SHAPE)
    long_config = widened_config(DEVICE_CONFIG, work / "llama-tiny-long.json", longest + 64, TINY_SHAPE)
    return Plan("dry run", "cpu", "bfloat16", config, long_config, contexts=(192, 384), longest=longest,
                vram_budget="384KiB", new_tokens=4, peer_new_tokens=4, long_new_tokens=long_new_tokens,
                prefill_chunk=64, decode_steps=4, profile_steps=2, streams=16, stream_tokens=8, work=work, kit=kit)


@dataclass(frozen=True)
class Stage:
    """One step of the run: commands run one after another under one time limit.

    ``commands`` is given the seconds the stage may take (tools that take a timeout of their own
    get a little less, so they end first and still write their results).
    """

    name: str
    what: str
    commands: Callable[[float], Sequence[Sequence[str]]]
    cap_s: float  # the most this stage may take
    expect_s: float  # the planning estimate on an H100 (the first run's stages.json replaces it)
    outputs: tuple[str, ...] = ()  # files under --out it must write
    reserved: bool = False  # its cap is kept out of the earlier stages' time (it runs at the end)


def _bench(plan: Plan, out: Path, name: str, limit_s: float, *flags: str, config: Path | None = None) -> list[str]:
    """A ``hybridllm bench`` command of this plan, its JSON and Markdown as ``name``.json/.md under ``out``."""
    return [PYTHON, "-m", "hybridllm.cli", "bench", "--random-weights", str(config or plan.config),
            "--device", plan.device, "--dtype", plan.dtype, "--prefill-chunk", str(plan.prefill_chunk), *flags,
            "--timeout", f"{max(limit_s - BENCH_MARGIN_S, 5):.0f}",
            "--json", str(out / f"{name}.json"), "--markdown", str(out / f"{name}.md")]


def _profile(plan: Plan, out: Path, backends: str, *flags: str) -> list[str]:
    return [PYTHON, "tools/gpu_profile.py", "--random-weights", str(plan.config), "--device", plan.device,
            "--dtype", plan.dtype, "--context", str(plan.contexts[0]), "--prefill-chunk", str(plan.prefill_chunk),
            "--steps", str(plan.decode_steps), "--profile-steps", str(plan.profile_steps), "--backends", backends,
            *flags, "--out", str(out / PROFILE_DIR)]


def stages(plan: Plan, out: Path) -> list[Stage]:
    """The run's stages, most needed first (the long-context run, last, gets what time is left)."""
    short, long = plan.contexts
    both = f"{short},{long}"
    new = ("--new-tokens", str(plan.new_tokens))

    def bench(name: str, what: str, cap_s: float, expect_s: float, *flags: str, config: Path | None = None) -> Stage:
        """A stage of one ``hybridllm bench`` command, its results as ``name``.json/.md."""
        return Stage(name, what, lambda limit_s: [_bench(plan, out, name, limit_s, *flags, config=config)],
                     cap_s=cap_s, expect_s=expect_s, outputs=(f"{name}.json", f"{name}.md"))

    def setup(limit_s: float) -> list[list[str]]:
        kit = [["bash", str(plan.kit / "setup.sh")]] if plan.kit else []
        # a carried py-spy wheel (the image has none): the server stage samples the server with it
        kit += [[PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)]
                for wheel in sorted((ROOT / CARRIED_WHEELS).glob("py_spy-*.whl")) if plan.kit]
        smi = [["nvidia-smi"]] if plan.device.startswith("cuda") else []
        return [*kit, [PYTHON, "tools/gpu_probe.py", str(out / SETUP_JSON)],
                [PYTHON, "-m", "hybridllm.cli", "--help"], *smi]

    def server(limit_s: float) -> list[list[str]]:
        serve = ["--model", str(plan.served_model), "--device", plan.device, "--dtype", plan.dtype,
                 "--decode-backend", "cuda-graph"]
        return [[PYTHON, "tools/random_model_folder.py", str(plan.config), str(plan.served_model),
                 "--dtype", plan.dtype],
                [PYTHON, "tools/load_test.py", "--compare", "1", "--concurrency", str(plan.streams),
                 "--requests", str(plan.streams), "--max-tokens", str(plan.stream_tokens), "--warmup-burst",
                 "--profile", str(out / SERVER_PROFILE),
                 "--time-limit", f"{max(limit_s / 2, 10):.0f}", *(f"--serve-arg={arg}" for arg in serve),
                 "--json", str(out / SERVER_STREAMS_JSON)]]

    return [
        Stage("setup", "the GPU kit (shared/gpu/setup.sh), then the imports and versions the run depends on",
              setup, cap_s=90, expect_s=55, outputs=(SETUP_JSON,)),
        Stage("cuda_tests", "pytest -m cuda: graph replay == eager token for token, greedy parity with "
                            "transformers, SDPA backends in every phase (they skip without a GPU)",
              lambda limit_s: [[PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests",
                                f"--junitxml={out / CUDA_TESTS_XML}"]],
              cap_s=150, expect_s=30, outputs=(CUDA_TESTS_XML,)),
        bench(BENCH_CUDA_GRAPH, f"decode and prefill at {both} tokens, cuda-graph backend, dynamic KV (median of 3: "
                                "a run that captures a new key span is not the median)", 150, 110,
              "--prompt-tokens", both, *new, "--kv-cache", "dynamic", "--decode-backend", "cuda-graph",
              "--baseline", "none", "--repeat", "3"),
        bench(BENCH_EAGER, f"decode and prefill at {both} tokens, eager backend, dynamic KV, transformers (SDPA) "
                           "on the same weights as the peer", 240, 240,
              "--prompt-tokens", both, "--new-tokens", str(plan.peer_new_tokens), "--kv-cache", "dynamic",
              "--decode-backend", "eager",
              "--baseline", "transformers", "--repeat", "1"),
        bench(BENCH_TIERED, f"the tiered row: {long} tokens, 90% of the KV on the host, eager backend (cuda-graph "
                            "serves dense KV only)", 120, 90,
              "--prompt-tokens", str(long), *new, "--kv-cache", "tiered", "--kv-offload-percent", "90",
              "--decode-backend", "eager", "--baseline", "none", "--repeat", "1"),
        Stage("profile", f"torch.profiler over {plan.profile_steps} decode steps per backend at {short} tokens "
                         "(eager, cuda-graph)",
              lambda limit_s: [_profile(plan, out, "eager,cuda-graph")],
              cap_s=150, expect_s=110, outputs=(f"{PROFILE_DIR}/decode_{short}_dynamic.json",)),
        # its own stage: in the second run the dynamic profiles took the whole shared cap
        Stage("profile_tiered", f"torch.profiler over {plan.profile_steps} tiered decode steps at {short} tokens, "
                                "90% of the KV on the host, eager backend: bus bytes per decode token",
              lambda limit_s: [_profile(plan, out, "eager", "--kv-cache", "tiered", "--kv-offload-percent", "90")],
              cap_s=120, expect_s=60, outputs=(f"{PROFILE_DIR}/decode_{short}_tiered.json",)),
        Stage("server_streams", f"{plan.streams} concurrent streams of hybridllm serve (cuda-graph) vs one at a "
                                f"time, {plan.stream_tokens} new tokens each",
              server, cap_s=150, expect_s=120, outputs=(SERVER_STREAMS_JSON,)),
        # In the first run it gets what the budget leaves (expected: little); its cap serves a second run.
        bench(LONG_CONTEXT, f"{plan.longest} tokens in {plan.vram_budget} of device memory: tiered KV, 4-bit cold "
                            "pages on the host, eager backend", 300, 200,
              "--prompt-tokens", str(plan.longest), "--new-tokens", str(plan.long_new_tokens), "--kv-cache", "tiered",
              "--kv-cold-bits", "4", "--vram-budget", plan.vram_budget, "--decode-backend", "eager",
              "--baseline", "none", "--repeat", "1", "--no-warmup", config=plan.long_config),
        Stage(TABLE, "the issue's lines (measured figure, target, met or not) from the files above",
              lambda limit_s: [[PYTHON, "tools/gpu_table.py", "--out", str(out)]],
              cap_s=30, expect_s=5, outputs=(f"{TABLE}.json", f"{TABLE}.md"), reserved=True),
    ]


# ---- running ------------------------------------------------------------------------------------
@dataclass
class StageRecord:
    """What one stage did: written to stages/<name>.json and summarized in stages.json/.md."""

    name: str
    what: str
    status: str  # "ok", "failed", "timeout", "skipped" (no time left) or "pending" (not reached yet)
    cap_s: float
    expect_s: float
    limit_s: float | None = None
    wall_s: float | None = None
    exit_code: int | None = None
    commands: list[str] = field(default_factory=list)
    log: str | None = None
    outputs: dict[str, bool] = field(default_factory=dict)  # each expected result file: written or not
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (through /proc), children first; [] where /proc is not Linux's."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found.extend(children)
        frontier = children
    return found


def end_process_tree(proc: subprocess.Popen) -> None:
    """The stack signal to ``proc`` (its stacks go to the stage's log), then SIGTERM and SIGKILL
    to it and everything it started (bench workers and servers run in sessions of their own, so
    the process group alone would miss them)."""
    tree = [proc.pid, *descendants(proc.pid)]
    if proc.poll() is None:  # first its Python stacks into the log (tools that call dump_stacks_on_signal)
        os.kill(proc.pid, STACK_SIGNAL)
        try:
            proc.wait(STACK_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        tree = [pid for pid in tree if Path(f"/proc/{pid}").exists()]
        if not tree:
            return


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_stage(stage: Stage, limit_s: float, out: Path, env: dict[str, str]) -> StageRecord:
    """Run ``stage``'s commands in order, the stage's output in logs/<name>.log, within ``limit_s``."""
    log = out / "logs" / f"{stage.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    commands = [list(argv) for argv in stage.commands(limit_s)]
    record = StageRecord(stage.name, stage.what, "ok", stage.cap_s, stage.expect_s, limit_s=round(limit_s, 1),
                         commands=[shlex.join(argv) for argv in commands], log=str(log.relative_to(out)))
    start = time.monotonic()
    with log.open("w") as handle:
        for argv in commands:
            handle.write(f"$ {shlex.join(argv)}\n")
            handle.flush()
            left = limit_s - (time.monotonic() - start)
            try:
                proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                        start_new_session=True)
            except OSError as exc:  # the command itself is missing (nvidia-smi on a machine without it)
                record.status, record.error = "failed", f"{argv[0]}: {exc.strerror}"
                break
            try:
                record.exit_code = proc.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                end_process_tree(proc)
                record.status, record.exit_code = "timeout", proc.returncode
                record.error = f"{shlex.join(argv[:4])} ... ran past the stage's {limit_s:.0f} s"
                break
            if record.exit_code != 0:
                record.status, record.error = "failed", f"{shlex.join(argv[:4])} ... exited {record.exit_code}"
                break
    record.wall_s = round(time.monotonic() - start, 2)
    record.outputs = {name: (out / name).is_file() for name in stage.outputs}
    missing = [name for name, written in record.outputs.items() if not written]
    if record.status == "ok" and missing:
        record.status, record.error = "failed", f"exited 0 without writing {', '.join(missing)}"
    if record.status != "ok":
        record.error = f"{record.error}\n{log_tail(log)}"
    return record


def write_summary(out: Path, header: dict[str, Any], records: Sequence[StageRecord]) -> None:
    """stages.json (everything) and stages.md (one line per stage), rewritten as the run goes."""
    (out / "stages.json").write_text(json.dumps({**header, "stages": [r.to_dict() for r in records]}, indent=2) + "\n")

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    lines = [f"# GPU run: {header['plan']['plan']} on {header['plan']['device']}, started {header['started']}", "",
             f"Budget {header['budget_s']:.0f} s; walls in seconds (expected: the plan's estimate on an H100).", "",
             "| stage | status | wall s | limit s | expected s | result files | what |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        files = ", ".join(f"{name}{'' if written else ' (missing)'}" for name, written in r.outputs.items()) or "-"
        lines.append(f"| {r.name} | {r.status} | {seconds(r.wall_s)} | {seconds(r.limit_s)} | {seconds(r.expect_s)} "
                     f"| {files} | {r.what} |")
    total = sum(r.wall_s or 0 for r in records)
    lines += ["", f"Total {total:.0f} s; {sum(r.status not in ('ok', 'pending') for r in records)} stage(s) "
                  f"not ok."]
    (out / "stages.md").write_text("\n".join(lines) + "\n")


def run_stages(stage_list: Sequence[Stage], out: Path, budget_s: float, plan_summary: dict[str, Any],
               env: dict[str, str] | None = None) -> list[StageRecord]:
    """Run every stage within ``budget_s`` seconds; a failed, timed-out or skipped stage is recorded
    and the next one runs. Returns the records (also written under ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "stages").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHON": PYTHON, "PYTHONUNBUFFERED": "1"} if env is None else env
    header = {"plan": plan_summary, "budget_s": budget_s,
              "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    records = [StageRecord(s.name, s.what, "pending", s.cap_s, s.expect_s) for s in stage_list]
    write_summary(out, header, records)
    deadline = time.monotonic() + budget_s
    for index, stage in enumerate(stage_list):
        reserve = sum(later.cap_s for later in stage_list[index + 1:] if later.reserved)
        limit_s = min(stage.cap_s, deadline - time.monotonic() - reserve)
        if limit_s < min(stage.cap_s, MIN_STAGE_S):
            record = StageRecord(stage.name, stage.what, "skipped", stage.cap_s, stage.expect_s,
                                 limit_s=round(max(limit_s, 0), 1), error="no time left in the budget",
                                 outputs={name: False for name in stage.outputs})
        else:
            print(f"== {stage.name} (at most {limit_s:.0f} s): {stage.what}", flush=True)
            record = run_stage(stage, limit_s, out, env)
        print(f"== {stage.name}: {record.status} in {record.wall_s or 0:.1f} s", flush=True)
        records[index] = record
        (out / "stages" / f"{stage.name}.json").write_text(json.dumps(record.to_dict(), indent=2) + "\n")
        write_summary(out, header, records)
    return records


def find_kit() -> Path | None:
    """The GPU kit (shared/gpu) inside or beside the project, as the device tool lays it."""
    for candidate in (ROOT / "shared" / "gpu", ROOT.parent / "shared" / "gpu"):
        if (candidate / "setup.sh").is_file():
            return candidate
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out/gpu"),
                        help="where everything is written (default: $OUT, else out/gpu)")
    parser.add_argument("--dry-run", action="store_true", help="the same stages on the CPU at tiny sizes")
    parser.add_argument("--stages", help="comma-separated stage names to run (default: all, in order)")
    parser.add_argument("--budget", type=float, help=f"seconds for the whole run (default {DEVICE_BUDGET_S:.0f}; "
                                                     f"dry run {DRY_BUDGET_S:.0f})")
    parser.add_argument("--kit", type=Path, help="the GPU kit whose setup.sh the setup stage runs (default: "
                                                 "shared/gpu or ../shared/gpu; none in a dry run)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hybridllm-gpu-run"),
                        help="scratch outside --out (configs, the served model's weights)")
    parser.add_argument("--list", action="store_true", help="print the stages and their commands, run nothing")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    kit = args.kit.resolve() if args.kit else (None if args.dry_run else find_kit())
    plan = (dry_plan if args.dry_run else device_plan)(args.work.resolve(), kit)
    stage_list = stages(plan, out)
    if args.stages:
        names = [name.strip() for name in args.stages.split(",") if name.strip()]
        known = {s.name for s in stage_list}
        unknown = [name for name in names if name not in known]
        if unknown:
            parser.error(f"unknown stage(s) {', '.join(unknown)}; the stages: {', '.join(s.name for s in stage_list)}")
        stage_list = [s for s in stage_list if s.name in names]
    budget = args.budget if args.budget is not None else (DRY_BUDGET_S if args.dry_run else DEVICE_BUDGET_S)
    if budget <= 0:
        parser.error("--budget must be > 0")
    if args.list:
        for s in stage_list:
            print(f"{s.name} (cap {s.cap_s:.0f} s, expected {s.expect_s:.0f} s): {s.what}")
            for command in s.commands(s.cap_s):
                print(f"    {shlex.join(command)}")
        return 0
    records = run_stages(stage_list, out, budget, plan.summary())
    failed = [r.name for r in records if r.status != "ok"]
    print(f"results under {out} (stages.md); {len(failed)} stage(s) not ok{': ' + ', '.join(failed) if failed else ''}")
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
