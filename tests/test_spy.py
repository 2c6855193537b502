"""``hybridllm.bench.spy``: py-spy's samples of a running process, summarized per thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from hybridllm.bench.spy import Sampler, find_py_spy, summarize

RAW = """\
thread (0x1): MainThread;run (asyncio/runners.py:118);send (uvicorn/protocols/http/httptools_impl.py:544) 30
thread (0x1): MainThread;run (asyncio/runners.py:118);sse (hybridllm/server/streams.py:84) 10
thread (0x2): hybridllm-scheduler;step (hybridllm/engine/scheduler.py:239);process (hybridllm/engine/output_processor.py:128);_sample (hybridllm/engine/output_processor.py:188) 50
thread (0x2): hybridllm-scheduler;step (hybridllm/engine/scheduler.py:239);forward (torch/nn/modules/linear.py:134) 10
thread (0x3): worker 5
not a sample line
"""


def test_the_summary_gives_each_thread_its_share_and_innermost_frames(tmp_path):
    raw = tmp_path / "burst.raw"
    raw.write_text(RAW)
    text = summarize(raw)
    assert text.startswith("105 samples with the GIL held")
    sections = text.split("\n## ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["hybridllm-scheduler: 60 samples (57 %)",
                                                     "MainThread: 40 samples (38 %)", "worker: 5 samples (5 %)"]
    assert sections[2].splitlines()[1].split() == ["5", "(no", "Python", "frame)"]
    scheduler = sections[0].splitlines()[1:]
    assert scheduler[0].split() == ["50", "_sample", "output_processor.py:188", "<", "process",
                                    "output_processor.py:128", "<", "step", "scheduler.py:239"]
    assert scheduler[1].split()[:3] == ["10", "forward", "linear.py:134"]
    assert sections[1].splitlines()[1].split()[:3] == ["30", "send", "httptools_impl.py:544"]


def test_no_samples_says_so(tmp_path):
    raw = tmp_path / "empty.raw"
    raw.write_text("")
    assert summarize(raw) == "no samples\n"


def test_a_sampler_without_py_spy_measures_nothing_and_says_why(tmp_path):
    sampler = Sampler(1, tmp_path / "x.raw", py_spy=None)
    sampler.py_spy, sampler.available, sampler.error = None, False, "py-spy not found"
    with sampler:
        pass
    assert sampler.error == "py-spy not found" and not (tmp_path / "x.raw").exists()


@pytest.mark.slow
def test_py_spy_finds_where_a_busy_process_spends_its_time(tmp_path):
    if find_py_spy() is None:
        pytest.skip("py-spy is not installed")
    busy = textwrap.dedent("""
        import time
        def spin_in_python():
            end = time.time() + 30
            while time.time() < end:
                sum(i * i for i in range(1000))
        spin_in_python()
    """)
    proc = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.5)
        with Sampler(proc.pid, tmp_path / "busy.raw") as sampler:
            time.sleep(1.5)
    finally:
        proc.kill()
        proc.wait()
    if sampler.error is not None:
        pytest.skip(f"py-spy cannot sample a process here: {sampler.error}")
    text = summarize(sampler.path)
    assert "samples (100 %)" in text and "spin_in_python" in text, text  # its one thread, in its function
