"""The GPU session's one command (tools/gpu_run.py), checked without a GPU.

The stage runner: a stage that fails, runs past its time or exits without writing its result is
recorded and the next stage runs; what a timed-out stage started (in sessions of its own, as the
bench's workers are) is ended; stages the budget cannot fit are skipped. The table reports a
figure a stage did not produce as "no figure", with the reason. The dry run (slow): every stage
of the device run's list, on the CPU at tiny sizes, end to end, so the device run finds no typo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"


@pytest.fixture
def gpu_run(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import gpu_run

    return gpu_run


@pytest.fixture
def gpu_table(gpu_run):
    import gpu_table

    return gpu_table


def python_stage(gpu_run, name: str, code: str, cap_s: float = 60, outputs: tuple[str, ...] = (),
                 reserved: bool = False):
    """A stage of one ``python -c code`` command."""
    return gpu_run.Stage(name, f"the {name} stage", lambda limit_s: [[sys.executable, "-c", code]], cap_s=cap_s,
                         expect_s=1, outputs=outputs, reserved=reserved)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_failing_stage_is_recorded_and_the_next_still_runs(gpu_run, tmp_path):
    out = tmp_path / "out"
    grandchild_file = tmp_path / "grandchild.pid"
    # A stage that starts a process in a session of its own (as the bench starts its workers), then hangs.
    hang = (f"import subprocess, sys, time\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
            f"                         start_new_session=True)\n"
            f"open({str(grandchild_file)!r}, 'w').write(str(child.pid))\n"
            f"time.sleep(120)\n")
    stage_list = [
        python_stage(gpu_run, "first", f"open({str(out / 'first.txt')!r}, 'w').write('1'); print('first ran')",
                     outputs=("first.txt",)),
        python_stage(gpu_run, "broken", "import sys; print('about to fail'); sys.exit(3)"),
        python_stage(gpu_run, "hangs", hang, cap_s=3),
        python_stage(gpu_run, "forgetful", "print('no result file')", outputs=("never.json",)),
        python_stage(gpu_run, "last", f"open({str(out / 'last.txt')!r}, 'w').write('1')", outputs=("last.txt",)),
    ]
    records = gpu_run.run_stages(stage_list, out, budget_s=600, plan_summary={"plan": "test", "device": "cpu"})

    assert [r.status for r in records] == ["ok", "failed", "timeout", "failed", "ok"]
    assert [r.exit_code for r in records][:2] == [0, 3]
    assert "exited 3" in records[1].error and "about to fail" in records[1].error  # the log's tail
    assert "ran past" in records[2].error
    assert "without writing never.json" in records[3].error and records[3].outputs == {"never.json": False}
    assert records[4].outputs == {"last.txt": True} and (out / "last.txt").is_file()
    grandchild = int(grandchild_file.read_text())
    deadline = time.monotonic() + 30
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(grandchild)  # the timed-out stage's whole tree was ended

    summary = json.loads((out / "stages.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ["first", "broken", "hangs", "forgetful", "last"]
    assert [s["status"] for s in summary["stages"]] == ["ok", "failed", "timeout", "failed", "ok"]
    assert all(isinstance(s["wall_s"], float) for s in summary["stages"])
    for record in records:
        saved = json.loads((out / "stages" / f"{record.name}.json").read_text())
        assert saved["status"] == record.status and saved["limit_s"] > 0
    assert "first ran" in (out / "logs" / "first.log").read_text()
    markdown = (out / "stages.md").read_text()
    assert "| broken | failed |" in markdown and "| hangs | timeout |" in markdown and "| last | ok |" in markdown


def test_the_budget_skips_what_it_cannot_fit_and_keeps_the_reserved_stage(gpu_run, tmp_path):
    out = tmp_path / "out"
    stage_list = [python_stage(gpu_run, "big", "print('never')", cap_s=300),
                  python_stage(gpu_run, "table", f"open({str(out / 't.txt')!r}, 'w').write('1')", cap_s=20,
                               outputs=("t.txt",), reserved=True)]
    records = gpu_run.run_stages(stage_list, out, budget_s=30, plan_summary={"plan": "test", "device": "cpu"})
    assert [r.status for r in records] == ["skipped", "ok"]  # 30 s less the table's 20: under the minimum
    assert records[0].error == "no time left in the budget" and not (out / "logs" / "big.log").exists()
    assert (out / "t.txt").is_file()


def flags(command) -> list[str]:
    return [arg.split("=")[0] for arg in command if arg.startswith("--")]


def test_the_device_run_has_the_dry_runs_stages_and_flags(gpu_run, tmp_path):
    out = tmp_path / "out"
    kit = tmp_path / "kit"
    device = gpu_run.stages(gpu_run.device_plan(tmp_path / "work", kit), out)
    dry = gpu_run.stages(gpu_run.dry_plan(tmp_path / "work", None), out)
    assert [s.name for s in device] == [s.name for s in dry]
    for device_stage, dry_stage in zip(device, dry):
        device_commands = device_stage.commands(device_stage.cap_s)
        dry_commands = dry_stage.commands(dry_stage.cap_s)
        if device_stage.name == "setup":  # the kit's setup.sh first, carried py-spy wheels (if any) and
            # nvidia-smi last: on the device only
            assert device_commands[0] == ["bash", str(kit / "setup.sh")] and device_commands[-1] == ["nvidia-smi"]
            carried = [c for c in device_commands if c[-1].endswith(".whl")]
            assert all("py_spy-" in c[-1] and "--no-index" in c for c in carried)
            device_commands = [c for c in device_commands[1:-1] if c not in carried]
        assert [flags(c) for c in device_commands] == [flags(c) for c in dry_commands], device_stage.name
        assert len(device_stage.outputs) == len(dry_stage.outputs)
    bench = next(s for s in device if s.name == "long_context").commands(300)[0]
    assert bench[bench.index("--prompt-tokens") + 1] == "524288" and bench[bench.index("--vram-budget") + 1] == "8GiB"
    window = json.loads(Path(bench[bench.index("--random-weights") + 1]).read_text())["max_position_embeddings"]
    assert window >= 524288 + 32  # the 1B shape, its window widened to hold the prompt
    assert bench[bench.index("--timeout") + 1] == str(300 - int(gpu_run.BENCH_MARGIN_S))


def write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))


def test_the_table_says_which_figure_is_missing_and_why(gpu_run, gpu_table, tmp_path):
    """A long-context run that timed out, a bench never written: "no figure" with the reason."""
    plan = gpu_run.device_plan(tmp_path / "work", None)
    write_json(tmp_path / "stages.json", {"plan": plan.summary(), "stages": []})
    row = {"engine": "hybridllm", "context": 524288, "status": "timeout", "error": "ran past 135 s"}
    write_json(tmp_path / f"{gpu_run.LONG_CONTEXT}.json", {"settings": {}, "rows": [row]})
    lines = {line["line"]: line for line in gpu_table.build_table(tmp_path)["lines"]}
    long_line = lines["524288 tokens within a device budget of 8GiB"]
    assert long_line["verdict"] == "no figure" and "timeout (ran past 135 s)" in long_line["measured"]
    decode = lines["decode at 4096 (cuda-graph): share of the bandwidth limit"]
    assert decode["verdict"] == "no figure" and "bench_cuda_graph.json was not written" in decode["measured"]
    assert all(line["verdict"] == "no figure" for line in lines.values())


@pytest.mark.slow  # 2.5-4.5 minutes on 2 cores: ten stages, each starting PyTorch (the bench more than once)
def test_the_dry_run_runs_every_stage_end_to_end(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(TOOLS / "gpu_run.py"), "--dry-run", "--out", str(out),
                           "--work", str(work)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OUT": ""})
    summary = json.loads((out / "stages.json").read_text())
    statuses = {s["name"]: s["status"] for s in summary["stages"]}
    assert proc.returncode == 0, f"{statuses}\n{proc.stdout[-3000:]}"
    assert list(statuses) == ["setup", "cuda_tests", "bench_cuda_graph", "bench_eager", "bench_tiered", "profile",
                              "profile_tiered", "server_streams", "long_context", "table"]
    assert set(statuses.values()) == {"ok"}
    for stage in summary["stages"]:
        assert stage["wall_s"] is not None and all(stage["outputs"].values()), stage
        assert (out / stage["log"]).is_file() and (out / "stages" / f"{stage['name']}.json").is_file()

    assert json.loads((out / "setup.json").read_text())["torch"]
    for name in ("bench_cuda_graph", "bench_eager", "bench_tiered"):
        rows = json.loads((out / f"{name}.json").read_text())["rows"]
        assert rows and all(r["status"] == "ok" for r in rows), name
    engines = {r["engine"] for r in json.loads((out / "bench_eager.json").read_text())["rows"]}
    assert engines == {"hybridllm", "transformers"}
    long_row = json.loads((out / "long_context.json").read_text())["rows"][0]
    assert long_row["context"] == 1024 and long_row["kv_bytes"]["host"] > 0  # cold pages on the host
    assert long_row["peak_device_bytes"] <= 384 * 1024  # within the dry run's device budget
    streams = json.loads((out / "server_streams.json").read_text())
    assert streams["failed"] == 0 and streams["rounds"]["batched"][0]["concurrency"] == 16
    assert (out / "profile" / "trace_cuda-graph_dynamic.json").is_file()
    assert (out / "profile" / "decode_192_tiered.json").is_file()

    table = json.loads((out / "table.json").read_text())
    verdicts = {line["line"]: line["verdict"] for line in table["lines"]}
    assert len(verdicts) == 12
    # every figure exists but the bandwidth share (no device bandwidth without a GPU); the cuda
    # tests skipped, which the table does not count as passing
    no_figure = [line for line, verdict in verdicts.items() if verdict == "no figure"]
    assert no_figure == ["decode at 192 (cuda-graph): share of the bandwidth limit"]
    assert verdicts["pytest -m cuda"] == "not met"
