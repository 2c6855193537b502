"""A timed-out bench worker says how far it got and where it was (hybridllm.bench.stacks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hybridllm.bench import stacks
from hybridllm.bench.sweep import PHASE_MARKER, _how_far

pytestmark = pytest.mark.skipif(stacks.STACK_SIGNAL is None, reason="no SIGUSR1 on this OS")

# faulthandler's format, as a worker stuck in the tiered cache would print it
DUMP = textwrap.dedent("""\
    Thread 0x00007f1c2a5fe640 (most recent call first):
      File "/usr/lib/python3.12/threading.py", line 355 in wait
      File "/opt/venv/lib/python3.12/site-packages/hybridllm/kernels/threads.py", line 40 in _spin

    Current thread 0x00007f1c3b9e7740 (most recent call first):
      File "/opt/venv/lib/python3.12/site-packages/torch/nn/functional.py", line 5000 in scaled_dot_product_attention
      File "/home/me/hybridllm/src/hybridllm/kvcache/attention.py", line 384 in fused_cuda_partial_attention
      File "/home/me/hybridllm/src/hybridllm/kvcache/tiered.py", line 312 in _attention_on_device
      File "/home/me/hybridllm/src/hybridllm/bench/worker.py", line 160 in measure
      File "/home/me/hybridllm/src/hybridllm/bench/worker.py", line 201 in main
      File "<frozen runpy>", line 88 in _run_code
    some later output of the process
    """)


def test_the_measuring_threads_innermost_frame_of_ours_is_named():
    threads = stacks.thread_stacks(DUMP)
    assert [len(frames) for frames in threads] == [2, 6]
    assert threads[1][1] == ("/home/me/hybridllm/src/hybridllm/kvcache/attention.py", 384,
                             "fused_cuda_partial_attention")
    # the spinning thread holds a frame of ours too, but its stack does not pass through the worker
    assert stacks.where(DUMP, "bench/worker.py") == "kvcache/attention.py:384 in fused_cuda_partial_attention"
    assert stacks.where(DUMP, "cli/bench.py") is None
    assert stacks.where("no dump at all", "bench/worker.py") is None


def test_a_timeout_row_names_the_last_phase_and_the_frame():
    stderr = f"{PHASE_MARKER}loading\n{PHASE_MARKER}warm-up\n{PHASE_MARKER}run 1 of 3\n{DUMP}"
    assert _how_far(stderr) == " (in run 1 of 3, at kvcache/attention.py:384 in fused_cuda_partial_attention)"
    assert _how_far(f"{PHASE_MARKER}loading\n") == " (in loading)"
    assert _how_far("") == ""


def test_a_process_that_asked_for_it_prints_its_stacks_on_the_signal(tmp_path):
    """A real process: a fake package's worker module calls a module that blocks; the signal's
    dump names that module's function, and the process is still alive to be killed after it."""
    package = tmp_path / "hybridllm"
    (package / "bench").mkdir(parents=True)
    (package / "kvcache").mkdir()
    (package / "kvcache" / "slow.py").write_text(
        "import time\n\ndef wait_here():\n    print('ready', flush=True)\n    time.sleep(120)\n")
    (package / "bench" / "worker.py").write_text(
        "import runpy\n\ndef measure(slow):\n    runpy.run_path(slow)['wait_here']()\n\n"
        f"measure({str(package / 'kvcache' / 'slow.py')!r})\n")
    child = ("from hybridllm.bench.stacks import dump_stacks_on_signal\n"
             "import runpy\n"
             "dump_stacks_on_signal()\n"
             f"runpy.run_path({str(package / 'bench' / 'worker.py')!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        stacks.ask_for_stacks(proc)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.communicate(timeout=stacks.STACK_WAIT_S)  # the dump does not end it
    finally:
        proc.kill()
    _, stderr = proc.communicate()
    assert stacks.where(stderr, "bench/worker.py") == "kvcache/slow.py:5 in wait_here", stderr

