"""Tiny random Llama-family models for tests, saved as Hugging Face folders and as GGUF files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hybrid inference splits layers between the CPU and the GPU, and keeps the KV cache in tiers.",
    "Paris is the capital of France; Berlin is the capital of Germany. 12345 67890!",
    "def add(a, b):\n    return a + b\n",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Pre-tokenizer split expressions of Hugging Face tokenizer.json files, by llama.cpp's pre name
PRE_TOKENIZER_REGEX = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def build_spm_tokenizer(folder: Path, vocab_size: int = 320, space_prefix: bool = True) -> int:
    """A SentencePiece-style BPE ``tokenizer.json`` as transformers converts Llama 2 / Mistral /
    Phi-3 (``space_prefix``: "▁" prepended to the text) or Gemma (no prefix) tokenizers: "▁" for
    spaces, ``<0xNN>`` byte fallback, and every pair of pieces that joins into a piece as a merge,
    ranked by the joined piece's score (SentencePiece's rule). Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>", *SPECIALS]
    trainer_model = Tokenizer(models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always" if space_prefix else "never")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials, show_progress=False)
    trainer_model.train_from_iterator(TRAIN_TEXT, trainer)
    learned = sorted(trainer_model.get_vocab().items(), key=lambda item: item[1])  # creation order
    pieces = [p for p, _ in learned if p not in specials]
    vocab = {p: i for i, p in enumerate(specials[:3])}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = sorted(((left, right, vocab[left + right]) for piece in vocab for left, right in
                     ((piece[:cut], piece[cut:]) for cut in range(1, len(piece)))
                     if left in vocab and right in vocab and left + right in vocab and not piece.startswith("<")),
                    key=lambda m: m[2])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    escape = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if space_prefix else escape
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    tok.add_special_tokens(specials[1:3])
    tok.add_special_tokens(SPECIALS)  # chat markers after the pieces, as fine-tunes add them
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok.get_vocab_size()


def build_tokenizer(folder: Path, vocab_size: int = 320, style: str = "gpt-2") -> int:
    """Train a byte-level BPE on a few sentences; save tokenizer files; return its vocab size.

    ``style``: "gpt-2" (GPT-2's pre-tokenizer, no BOS), "llama-bpe" (Llama 3: its split expression,
    ``ignore_merges``, a ``<|begin_of_text|>`` BOS added by the post-processor), "qwen2", or the
    SentencePiece styles "spm" (Llama 2, Mistral, Phi-3) and "gemma" (:func:`build_spm_tokenizer`).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if style in ("spm", "gemma"):
        return build_spm_tokenizer(folder, vocab_size + 256, space_prefix=style == "spm")

    tok = Tokenizer(models.BPE(ignore_merges=style == "llama-bpe"))
    if style == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[style]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    specials = SPECIALS + (["<|begin_of_text|>"] if style == "llama-bpe" else [])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok_config = {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
                  "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    if style == "llama-bpe":  # as Llama 3: the BOS comes from the post-processor, not add_bos_token
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
        del tok_config["add_bos_token"]
        tok_config["bos_token"] = bos
    if style == "qwen2":
        tok_config["pad_token"] = "<|endoftext|>"
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return tok.get_vocab_size()


def hf_config(arch: str, vocab_size: int, eos_id: int, **overrides):
    """A transformers config of a tiny model of ``arch`` (llama, llama3, qwen2, mistral, qwen3, phi3,
    phi3_partial: Phi-3 with half of each head rotated, as Phi-4-mini's 3/4; gemma2, gemma3: a
    sliding window of 8 tokens, a score scale other than head_dim's, small soft-caps (Gemma 2) and
    a local rotary base and linear global scaling (Gemma 3), so that each of them changes the logits)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        eos_token_id=eos_id, bos_token_id=None, tie_word_embeddings=False, rope_theta=10000.0,
    )
    if arch not in ("gemma2", "gemma3"):
        common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3":
        return LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": common["rope_theta"]})
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**{"sliding_window": None, **common})
    if arch == "qwen3":  # head_dim 32 != hidden / heads (16), tied embeddings, as the small Qwen3s
        return Qwen3Config(**{**common, "tie_word_embeddings": True}, head_dim=32, use_sliding_window=False)
    if arch in ("phi3", "phi3_partial"):
        factor = 0.5 if arch == "phi3_partial" else 1.0
        return Phi3Config(**{"sliding_window": None, "original_max_position_embeddings": common["max_position_embeddings"],
                             **common}, pad_token_id=None, partial_rotary_factor=factor)
    if arch in ("gemma2", "gemma3"):
        gemma = dict(common, head_dim=16, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW,
                     tie_word_embeddings=True, pad_token_id=None, rms_norm_eps=1e-6,
                     hidden_activation="gelu_pytorch_tanh")
        if arch == "gemma2":  # 4 layers: local, global, local, global
            gemma.update(num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
            return Gemma2Config(**{**gemma, **overrides})
        # 6 layers: 5 local, 1 global
        gemma.update(num_hidden_layers=6, rope_local_base_freq=100.0,
                     rope_scaling={"rope_type": "linear", "factor": 2.0})
        return Gemma3TextConfig(**{**gemma, **overrides})
    raise ValueError(arch)


GEMMA_WINDOW = 8  # the tiny Gemmas' sliding window: test prompts are longer


def build_hf_model(folder: Path, arch: str = "llama", seed: int = 0, tokenizer_style: str = "gpt-2", **overrides):
    """Save a tiny random model of ``arch`` with its tokenizer in ``folder``; return the HF model."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder, style=tokenizer_style)
    eos_id = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"].get("<|im_end|>")
    if eos_id is None:
        eos_id = next(t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
                      if t["content"] == "<|im_end|>")
    config = hf_config(arch, vocab, eos_id, **overrides)
    torch.manual_seed(seed)
    # transformers' eager attention: its SDPA path drops Gemma 2's soft-capping
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # larger weights than HF's init so greedy choices are far from ties
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_greedy_ids(hf_model, prompt: list[int], n_new: int) -> list[int]:
    """The ``n_new`` token ids transformers' greedy ``generate`` adds to ``prompt`` (EOS ignored,
    as ``SamplingParams(ignore_eos=True)``)."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def save_as_gguf(hf_folder: Path, out_path: Path, weight_type: str = "F32") -> Path:
    """Write the HF folder's model as a GGUF file, as llama.cpp's converter would."""
    from hybridllm.loading.gguf_vocab import tokenizer_metadata_from_hf
    from hybridllm.loading.gguf_writer import write_gguf
    from hybridllm.loading.safetensors import HFCheckpoint

    checkpoint = HFCheckpoint(hf_folder)  # the tensors as the model holds them (Gemma norms: 1 + w)
    tensors = {name: checkpoint.dequantize(name, checkpoint.read(name)) for name in checkpoint.parameter_names()}
    return write_gguf(out_path, checkpoint.config, tensors, tokenizer_metadata_from_hf(hf_folder), weight_type)
