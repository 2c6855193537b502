"""Time and profile decode steps on a GPU, one decode backend after another.

    python tools/gpu_profile.py --random-weights configs/llama-3.2-1b.json --context 4096 \
        --backends eager,cuda-graph --out $OUT/profile
    python tools/gpu_profile.py --random-weights configs/llama-3.2-1b.json --context 4096 \
        --backends eager --kv-cache tiered --kv-offload-percent 90 --out $OUT/profile

For each backend: builds ``LLM(RandomCheckpoint(config), device=cuda, dtype=bfloat16)`` with the
KV cache ``--kv-cache``, prefills a random prompt of ``--context`` tokens on a cache of the
runtime (the backend's own: static rows for ``cuda-graph``), times ``--steps`` greedy decode
steps (CUDA-synchronized), then records ``--profile-steps`` more under ``torch.profiler`` (CPU +
CUDA). Writes, per backend, a Chrome trace (``trace_<backend>_<kv cache>.json``), the top
operators by CUDA time (``ops_<backend>_<kv cache>.txt``) and all backends' records in
``decode_<context>_<kv cache>.json``, and prints one line per backend: ms/token, tok/s, kernel
launches per token, the bytes the timed steps moved between host and device per token (tiered
KV: q and partial outputs, evicted pages) and, with the cache's ledger and the model's bytes,
bytes read per token and the fraction of the device's measured bandwidth
(``hybridllm.hardware.measure_gpu``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hybridllm import LLM
from hybridllm.bench.stacks import dump_stacks_on_signal
from hybridllm.hardware import measure_gpu
from hybridllm.loading.random_checkpoint import RandomCheckpoint
from hybridllm.runtime.backends.cuda_graph import CudaGraphBackend
from hybridllm.timing import synchronize


def decode_steps(llm: LLM, cache, token: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy decode steps, each token read on the host before the next step, as the
    engine reads it (so the cuda-graph backend's step launched ahead overlaps that host work as it
    does in serving); returns the last token (1, 1)."""
    for _ in range(steps):
        token = torch.tensor([[int(llm.runner(token, cache, cache.seq_length)[0, -1].argmax())]])
    return token


def bus_bytes(cache) -> int:
    """Bytes ``cache`` has moved between host and device so far (both directions)."""
    return sum(cache.bus_bytes.values())


def progress(began: float, what: str) -> None:
    """A line in the log per phase (a stage that runs out of time shows how far it got)."""
    print(f"[{time.perf_counter() - began:7.1f} s] {what}", flush=True)


def run_backend(args: argparse.Namespace, backend: str, bandwidth_gbs: float | None, out: Path) -> dict:
    kv_options = {"kv_cache": args.kv_cache}
    if args.kv_offload_percent is not None:
        kv_options["kv_offload_percent"] = args.kv_offload_percent
    began = time.perf_counter()
    llm = LLM(RandomCheckpoint(args.random_weights, args.dtype, seed=0), device=args.device, dtype=args.dtype,
              decode_backend=backend, **kv_options)
    progress(began, f"{backend}/{args.kv_cache}: loaded")
    device = llm.engine_config.torch_device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    cache = llm.new_cache()
    cache.reserve(args.context + args.steps + args.profile_steps + 8)
    ids = torch.randint(0, min(llm.config.vocab_size, 20000), (1, args.context),
                        generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        t0 = time.perf_counter()
        for start in range(0, args.context, args.prefill_chunk):
            logits = llm.runner(ids[:, start:start + args.prefill_chunk], cache, cache.seq_length)
        synchronize(device)
        prefill_s = time.perf_counter() - t0
        progress(began, f"{backend}/{args.kv_cache}: prefilled {args.context} tokens")
        token = decode_steps(llm, cache, logits[:, -1].argmax(-1, keepdim=True), 3)  # warm-up (and capture)
        synchronize(device)
        bus_before, t0 = bus_bytes(cache), time.perf_counter()
        token = decode_steps(llm, cache, token, args.steps)
        synchronize(device)
        step_s = (time.perf_counter() - t0) / args.steps
        progress(began, f"{backend}/{args.kv_cache}: {args.steps} decode steps")
        bus_per_token = (bus_bytes(cache) - bus_before) / args.steps
        with profile(activities=activities) as prof:
            decode_steps(llm, cache, token, args.profile_steps)
            synchronize(device)
    prof.export_chrome_trace(str(out / f"trace_{backend}_{args.kv_cache}.json"))
    table = prof.key_averages().table(sort_by=f"{device.type}_time_total", row_limit=40)
    (out / f"ops_{backend}_{args.kv_cache}.txt").write_text(table + "\n")
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                      "cudaGraphLaunch", "cudaLaunchKernelExC"))
    bytes_per_token = llm.decode_weight_bytes + cache.ledger.current("device")
    limit = bandwidth_gbs * 1e9 / bytes_per_token if bandwidth_gbs else None
    record = {
        "backend": backend, "kv_cache": args.kv_cache, "kv_offload_percent": args.kv_offload_percent,
        "context": args.context, "dtype": args.dtype,
        "prefill_tps": args.context / prefill_s, "decode_ms": 1000 * step_s, "decode_tps": 1 / step_s,
        "launches_per_token": launches / args.profile_steps, "bus_bytes_per_token": bus_per_token,
        "bytes_per_token": bytes_per_token,
        "bandwidth_gbs": bandwidth_gbs, "limit_tps": limit,
        "limit_fraction": (1 / step_s) / limit if limit else None,
        "notes": llm.runner.report.notes,
    }
    backend = llm.runner.backend
    if isinstance(backend, CudaGraphBackend):  # ms per replay of each attention form tried
        record["attention_choice"] = {f"bucket {b}, span {s}": t for (b, s), t in backend.attention_choice.items()}
        policy = backend.lookahead_policy  # steps launched ahead that the next call took, or dropped
        record["lookahead"] = {"on": backend.lookahead, "hits": policy.hits, "misses": policy.misses}
    print(json.dumps(record))
    del llm, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-weights", required=True, help="a Hugging Face config.json")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a smoke run")
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--backends", default="eager,cuda-graph")
    parser.add_argument("--kv-cache", default="dynamic", help="the KV cache of every backend (cuda-graph: dynamic)")
    parser.add_argument("--kv-offload-percent", type=float, help="tiered: percent of the KV kept on the host")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dump_stacks_on_signal()  # gpu_run asks for the stacks of a stage that runs out of time
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = measure_gpu(0) if args.device.startswith("cuda") else None
    bandwidth = gpu.bandwidth_gbs if gpu is not None else None
    records = [run_backend(args, backend, bandwidth, args.out) for backend in args.backends.split(",")]
    (args.out / f"decode_{args.context}_{args.kv_cache}.json").write_text(
        json.dumps({"gpu": gpu and gpu.name, "rows": records}, indent=2) + "\n")


if __name__ == "__main__":
    main()
