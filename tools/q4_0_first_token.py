"""The Q4_0 first-token question (issue 17): our first greedy token vs llama.cpp's vs a float64
reference with the same Q4_0 weights, on chat prompts of the default model written as Q4_0.

    .venv/bin/python tools/q4_0_first_token.py
"""
import copy, dataclasses, numpy as np, torch, llama_cpp
from hybridllm import LLM
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.gguf_writer import write_gguf
from hybridllm.loading.registry import default_model_path
src = GGUFFile(default_model_path())
meta = {k: v for k, v in src.metadata.items() if k.startswith("tokenizer.")}
write_gguf("/tmp/default-Q4_0.gguf", src.config, {hf: src.dequantize(n) for n, hf in src.hf_names().items()}, meta, "Q4_0")
path = "/tmp/default-Q4_0.gguf"
auto = LLM(path, weights="auto", threads=2); flt = LLM(path, weights="float", threads=2)
f64 = copy.deepcopy(flt.model).double()
theirs = llama_cpp.Llama(path, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
           "List three colors.", "Who wrote Hamlet?", "What is 2+2?", "Tell me a joke.", "Translate 'hello' to French.",
           "Name a planet.", "Why is the sky blue?", "Give me a recipe for tea.", "What is Python?"]
for p in prompts:
    ids = auto.encode_prompt([{"role": "user", "content": p}])
    with torch.inference_mode():
        a = auto.model(torch.tensor([ids]), auto.new_cache(), start_pos=0)[0, -1]
        f = flt.model(torch.tensor([ids]), flt.new_cache(), start_pos=0)[0, -1]
        spec = dataclasses.replace(flt.runtime.kv_spec(), dtype=torch.float64)
        d = f64(torch.tensor([ids]), DynamicCache(spec), start_pos=0)[0, -1]
    theirs.reset(); theirs.eval(ids); l = np.array(theirs.scores[theirs.n_tokens - 1])
    top2 = torch.topk(d, 2)
    err = lambda x: float((torch.as_tensor(x, dtype=torch.float64) - d).abs().max())
    print(f"{p[:28]:28} f64 top {int(d.argmax())} (top-2 margin {float(top2.values[0]-top2.values[1]):.3f}); "
          f"f32 {int(f.argmax())}, int4 kernels {int(a.argmax())}, llama.cpp {int(l.argmax())}; "
          f"max |logit - f64|: f32 {err(f):.4f}, int4 kernels {err(a):.4f}, llama.cpp {err(l):.4f}")
