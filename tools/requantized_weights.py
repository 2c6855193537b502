"""Memory, decode speed and logit error of weights kept as int8 under ``--weights auto``.

The default model's GGUF is dequantized and written again as each of ``--types``
(``write_gguf``), and requantized by llama.cpp's own quantizer as each of ``--llama-cpp-types``
(K-quant mixes: Q4_K_M, Q5_K_M, Q6_K; needs llama-cpp-python); each file is loaded with
``--weights float`` and ``--weights auto``; the logits of the first 512 tokens of README.md and
64 greedy decode tokens are compared.

    .venv/bin/python tools/requantized_weights.py --types Q8_0,Q5_1 --llama-cpp-types Q4_K_M,Q5_K_M,Q6_K
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridllm import LLM, SamplingParams
from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.gguf_writer import write_gguf
from hybridllm.loading.registry import default_model_path

LLAMA_CPP_FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}  # LLAMA_FTYPE_MOSTLY_*


def llama_cpp_requantized(source: Path, path: Path, file_type: str) -> Path:
    """``source`` requantized by llama.cpp (``llama_model_quantize``, requantizing allowed)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = LLAMA_CPP_FILE_TYPES[file_type], True, 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params)):
        raise SystemExit(f"llama.cpp could not write {file_type}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q8_0,Q5_1,Q5_0")
    parser.add_argument("--llama-cpp-types", default="", help="comma list of " + ", ".join(LLAMA_CPP_FILE_TYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="/tmp")
    args = parser.parse_args()
    source = GGUFFile(default_model_path())
    tokenizer_keys = {k: v for k, v in source.metadata.items() if k.startswith("tokenizer.")}
    tensors = {hf: source.dequantize(name) for name, hf in source.hf_names().items()}
    readme = Path(__file__).resolve().parents[1] / "README.md"
    ids = None
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    files = []
    for weight_type in filter(None, args.types.split(",")):
        path = Path(args.out) / f"default-{weight_type}.gguf"
        files.append((weight_type, write_gguf(path, source.config, tensors, tokenizer_keys, weight_type)))
    for file_type in filter(None, args.llama_cpp_types.split(",")):
        path = Path(args.out) / f"default-{file_type}.gguf"
        files.append((file_type, llama_cpp_requantized(default_model_path(), path, file_type)))
    for weight_type, path in files:
        runs = {}
        for weights in ("float", "auto"):
            llm = LLM(path, weights=weights, threads=args.threads)
            ids = ids or llm.tokenizer.encode(readme.read_text()[:3000])[:512]
            with torch.inference_mode():
                logits = llm.model(torch.tensor([ids]), llm.new_cache(), start_pos=0, all_logits=True)[0]
            llm.generate("The capital of France is", params)  # warm-up
            decode = llm.generate("The capital of France is", params).metrics["decode_tps"]
            runs[weights] = (logits, decode, sum(llm.runtime.weight_bytes.values()) / 2**20)
            print(f"{weight_type} --weights {weights}: {llm.weights_format}", flush=True)
            del llm
        (ref, ref_tps, ref_mib), (test, tps, mib) = runs["float"], runs["auto"]
        print(f"{weight_type}: weights {ref_mib:.1f} / {mib:.1f} MiB, decode {ref_tps:.1f} / {tps:.1f} tok/s "
              f"({tps / ref_tps:.2f}x), max |dlogit| {(ref - test).abs().max().item():.2f}, "
              f"argmax agreement {(ref.argmax(-1) == test.argmax(-1)).float().mean().item():.1%}")


if __name__ == "__main__":
    main()
