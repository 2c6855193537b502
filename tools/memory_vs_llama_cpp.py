"""Peak resident memory of a 512-token prompt + 64 new tokens: hybridllm against llama.cpp.

Each engine runs in a fresh process that reads its resident set (VmRSS) right after importing
the engine (``import hybridllm`` / ``import llama_cpp``), then loads the default model (or
``--model``), prefills the same prompt ids and decodes ``--new-tokens`` greedy tokens, and reads
its lifetime peak: the kernel's high-water mark (VmHWM) after the load and after the run, the
larger of the two (hybridllm resets the mark at each request to report that request's peak, so
the load's temporaries are read before the first one). The figure compared is peak - import.
Ours also reports the resident weight bytes against the GGUF file's tensor bytes.

    .venv/bin/python tools/memory_vs_llama_cpp.py [--prompt-tokens 512] [--new-tokens 64] [--threads 2]
        [--kv-dtype float16] [--json out.json] [-- extra LLM options as KEY=VALUE ...]

llama.cpp: ``llama_cpp.Llama`` with n_ctx = prompt + new tokens, n_batch = 512, its default f16
KV cache, mmap on (its default). hybridllm: ``LLM(weights="auto", kv_dtype=...)``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PRELUDE = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
"""

CHILD_OURS = PRELUDE + r"""
import hybridllm
after_import = status("VmRSS")
args = json.loads(sys.argv[1])
from hybridllm import LLM, SamplingParams
llm = LLM(args["model"], threads=args["threads"], weights="auto", kv_dtype=args["kv_dtype"], **args["options"])
after_load, load_peak = status("VmRSS"), status("VmHWM")
result = llm.generate(args["ids"], SamplingParams(max_tokens=args["new_tokens"], temperature=0, ignore_eos=True))
after_run = status("VmRSS")
print(json.dumps({"engine": "hybridllm", "import": after_import, "load": after_load, "run": after_run,
                  "load_peak": load_peak, "peak": max(load_peak, status("VmHWM")), "weight_bytes": sum(llm.weight_bytes.values()),
                  "generated": len(result.token_ids), "backend": llm.runner.report.backend}))
"""

CHILD_LLAMA = PRELUDE + r"""
import llama_cpp
after_import = status("VmRSS")
args = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=args["model"], n_ctx=len(args["ids"]) + args["new_tokens"], n_batch=512,
                      n_threads=args["threads"], n_threads_batch=args["threads"], verbose=False)
after_load, load_peak = status("VmRSS"), status("VmHWM")
n = 0
for _ in llm.generate(args["ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
    n += 1
    if n >= args["new_tokens"]:
        break
after_run = status("VmRSS")
print(json.dumps({"engine": "llama.cpp", "import": after_import, "load": after_load, "run": after_run,
                  "load_peak": load_peak, "peak": max(load_peak, status("VmHWM")), "generated": n}))
"""


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-dtype", default="float16")
    parser.add_argument("--json", default=None)
    parser.add_argument("options", nargs="*", help="extra LLM options, KEY=VALUE (ints parsed)")
    args = parser.parse_args()

    from hybridllm.bench.peers import prompt_ids
    from hybridllm.loading.registry import default_model_path, open_checkpoint

    model = Path(args.model) if args.model else default_model_path()
    ids = prompt_ids(open_checkpoint(model).tokenizer().encode, args.prompt_tokens)
    options = {k: (int(v) if v.isdigit() else v) for k, v in (o.split("=", 1) for o in args.options)}
    payload = {"model": str(model), "ids": ids, "new_tokens": args.new_tokens, "threads": args.threads,
               "kv_dtype": args.kv_dtype, "options": options}
    rows = []
    for child in (CHILD_OURS, CHILD_LLAMA):
        done = subprocess.run([sys.executable, "-c", child, json.dumps(payload)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr.strip().splitlines()[-1])
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    ours, peer = rows
    tensor_bytes = gguf_tensor_bytes(model)
    print(f"model {model.name}: {args.prompt_tokens}-token prompt + {args.new_tokens} tokens, {args.threads} threads")
    print("| engine | RSS after import | after load | load's peak | after run | peak (VmHWM) | peak - import |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['engine']} | {mib(r['import'])} MiB | {mib(r['load'])} MiB | {mib(r['load_peak'])} MiB | "
              f"{mib(r['run'])} MiB | {mib(r['peak'])} MiB | {mib(r['peak'] - r['import'])} MiB |")
    ratio = (ours["peak"] - ours["import"]) / (peer["peak"] - peer["import"])
    print(f"peak - import: hybridllm / llama.cpp = {ratio:.2f}x")
    print(f"resident weight bytes {mib(ours['weight_bytes'])} MiB vs the GGUF's tensor bytes {mib(tensor_bytes)} MiB "
          f"({ours['weight_bytes'] / tensor_bytes:.3f}x); decode backend {ours['backend']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": {k: v for k, v in payload.items() if k != "ids"},
                                               "rows": rows, "ratio": ratio, "gguf_tensor_bytes": tensor_bytes},
                                              indent=2))


if __name__ == "__main__":
    main()
