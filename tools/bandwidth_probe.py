"""How fast this machine reads memory now, buffer by buffer and second by second: whether a
benchmark's speeds can be compared with another run's.

    .venv/bin/python tools/bandwidth_probe.py [--buffers 6] [--mib 300] [--rounds 6] [--threads 2] [--huge-pages odd]

Allocates ``--buffers`` float32 buffers of ``--mib`` MiB each (written once, so their pages are
real), then reads each one whole five times per round (``torch.sum`` on ``--threads`` threads) and
prints each buffer's GB/s, a row per round. A row whose buffers all move together is the machine
changing speed over time (another tenant of a virtual machine's host, its power state); buffers
that differ within a row would be their memory's placement. On the 2-vCPU AMD EPYC (Zen 5) VM of
docs/benchmarks.md both states read ~40-50 and ~65-75 GB/s on 2 threads for every buffer at once,
for seconds to tens of seconds: a decode step bound by the memory moves with it (Llama-3.2-1B
Q4_K_M at 512 tokens: ~17.5 ms against ~22 ms per step). ``--huge-pages odd`` backs every other
buffer with 2 MiB pages (``hybridllm.host_pages``, as the engine's native weights), so
each row compares the two page sizes at the same moment; ``all`` backs every buffer.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridllm.host_pages import collapse_tensor

READS_PER_ROUND = 5


def read_rates(buffers: list[torch.Tensor]) -> list[float]:
    """GB/s of reading each buffer whole READS_PER_ROUND times, one after the other."""
    rates = []
    for buffer in buffers:
        start = time.perf_counter()
        for _ in range(READS_PER_ROUND):
            buffer.sum()
        rates.append(READS_PER_ROUND * buffer.numel() * buffer.element_size() / (time.perf_counter() - start) / 1e9)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffers", type=int, default=6)
    parser.add_argument("--mib", type=int, default=300, help="size of each buffer")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--huge-pages", choices=("off", "odd", "all"), default="off",
                        help="back the buffers with 2 MiB pages (MADV_COLLAPSE): none, every other one "
                             "(the two kinds side by side in each row), or all")
    args = parser.parse_args()
    if min(args.buffers, args.mib, args.rounds, args.threads) < 1:
        parser.error("--buffers, --mib, --rounds and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    try:
        buffers = [torch.ones(args.mib * (1 << 20) // 4) for _ in range(args.buffers)]  # (mib MiB / 4,) float32 each
    except RuntimeError as error:  # PyTorch's out-of-memory on the host
        parser.exit(1, f"bandwidth_probe.py: cannot allocate {args.buffers} x {args.mib} MiB: {str(error).splitlines()[0]}\n")
    collapsed = [bool(collapse_tensor(buffer)) if args.huge_pages == "all" or (args.huge_pages == "odd" and i % 2)
                 else False for i, buffer in enumerate(buffers)]
    pages = "" if not any(collapsed) else " (" + " ".join("2M" if c else "4K" for c in collapsed) + " pages)"
    print(f"GB/s reading each of {args.buffers} buffers of {args.mib} MiB, {args.threads} threads{pages}")
    for _ in range(args.rounds):
        rates = read_rates(buffers)
        print(time.strftime("%H:%M:%S"), " ".join(f"{rate:6.1f}" for rate in rates), flush=True)


if __name__ == "__main__":
    main()
