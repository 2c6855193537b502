"""A Hugging Face BPE tokenizer as GGUF ``tokenizer.*`` metadata, by llama.cpp's rules.

Two kinds, as llama.cpp's converter tells them apart: SentencePiece-style BPE (``byte_fallback``:
Llama 2, Mistral, Phi-3, Gemma) is written as ``tokenizer.ggml.model = "llama"`` with
``pre = "default"``, piece scores that reproduce the merge ranks (:func:`_spm_scores`), BYTE and
UNKNOWN token types and ``add_space_prefix`` (:func:`_adds_space_prefix`); byte-level BPE as
follows.

llama.cpp's converter (``convert_hf_to_gguf.py``) writes, for a byte-level BPE tokenizer:

* ``tokenizer.ggml.model = "gpt2"`` and the merges;
* ``tokenizer.ggml.pre``: the name of the pre-tokenizer (the regular expressions that cut text
  before the merges run). The converter recognises a tokenizer by hashing the ids it gives for a
  fixed check text, which only names tokenizers it has seen. We read the pre-tokenizer itself
  from ``tokenizer.json`` (its ``Split`` expressions, ``Digits`` and ``ByteLevel`` steps and the
  model's ``ignore_merges``) and pick the llama.cpp name whose rule is exactly that. This also
  names fine-tuned or tiny tokenizers that share a family's pre-tokenizer but not its vocabulary;
  an unrecognised one is refused (``pre`` overrides);
* one token per id up to the model's vocabulary size: vocabulary tokens NORMAL, added special
  tokens CONTROL, other added tokens USER_DEFINED, ids with no token ``[PAD<id>]`` UNUSED;
* the special ids (``bos``, ``eos``, ``unk``, ``sep``, ``pad``, ``cls``, ``mask``) from
  ``tokenizer_config.json``, else ``config.json``'s ``<role>_token_id``;
* ``add_bos_token``/``add_eos_token`` from ``tokenizer_config.json``, else from the
  ``TemplateProcessing`` post-processor in ``tokenizer.json``; when neither says, nothing is
  written and llama.cpp uses its default for the pre-tokenizer (BOS for ``llama-bpe``);
* the chat template.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridllm.errors import ConfigError
from hybridllm.loading.tokenizer import SUPPORTED_GGUF_PRE_TOKENIZERS, gguf_pre_tokenizer_rule

__all__ = ["check_pre_tokenizer", "detect_pre_tokenizer", "tokenizer_metadata_from_hf"]

# llama.cpp's token types (``tokenizer.ggml.token_type``)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPM_SPACE = "\u2581"  # "▁"
_SPECIAL_ROLES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# The names llama.cpp's converter writes, tried first when several names share one rule.
_PREFERRED_PRE = ("llama-bpe", "qwen2", "smollm", "gpt-2", "tekken", "gpt-4o", "deepseek-v3", "deepseek-coder",
                  "falcon", "dbrx")
# Hugging Face's ByteLevel(use_regex=True) and Digits(individual_digits=True), as split expressions
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_ONE_DIGIT = r"\p{N}"


def _splits(step: Mapping[str, Any] | None) -> list[str] | None:
    """The split expressions one ``tokenizer.json`` pre-tokenizer step applies; None if not expressible."""
    if step is None:
        return []
    kind = step.get("type")
    if kind == "Sequence":
        out: list[str] = []
        for inner in step.get("pretokenizers", []):
            part = _splits(inner)
            if part is None:
                return None
            out += part
        return out
    if kind == "ByteLevel":
        if step.get("add_prefix_space"):
            return None  # llama.cpp never prepends a space in byte-level BPE
        return [_GPT2_REGEX] if step.get("use_regex", True) else []
    if kind == "Split":
        pattern = step.get("pattern", {})
        if "Regex" not in pattern or step.get("behavior") != "Isolated" or step.get("invert"):
            return None
        return [pattern["Regex"]]
    if kind == "Digits":
        return [_ONE_DIGIT if step.get("individual_digits") else r"\p{N}+"]
    return None


def detect_pre_tokenizer(tokenizer_json: Mapping[str, Any]) -> str | None:
    """The llama.cpp ``tokenizer.ggml.pre`` name whose rule equals this tokenizer's; None if none does."""
    splits = _splits(tokenizer_json.get("pre_tokenizer"))
    if splits is None:
        return None
    rule = (tuple(splits), bool(tokenizer_json.get("model", {}).get("ignore_merges", False)))
    candidates = _PREFERRED_PRE + tuple(n for n in SUPPORTED_GGUF_PRE_TOKENIZERS if n not in _PREFERRED_PRE)
    return next((name for name in candidates if gguf_pre_tokenizer_rule(name) == rule), None)


def check_pre_tokenizer(pre: str) -> str:
    """``pre`` if llama.cpp (and our reader) know it; else ConfigError naming the supported ones."""
    if gguf_pre_tokenizer_rule(pre) is None:
        raise ConfigError(f"unknown pre-tokenizer {pre!r}; choose one of {', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}")
    return pre


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_adds(post_processor: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """(first, last) special token ids a ``TemplateProcessing`` post-processor puts around one text."""
    if not post_processor:
        return None, None
    if post_processor.get("type") == "Sequence":
        found = [_template_adds(p) for p in post_processor.get("processors", [])]
        return next((f for f, _ in found if f), None), next((last for _, last in found if last), None)
    if post_processor.get("type") != "TemplateProcessing":
        return None, None
    single = post_processor.get("single", [])
    ends = [item["SpecialToken"]["id"] if "SpecialToken" in item else None for item in single[:1] + single[-1:]]
    return (ends[0], ends[-1]) if ends else (None, None)


def tokenizer_metadata_from_hf(
    folder: str | os.PathLike, vocab_size: int | None = None, pre: str | None = None
) -> dict[str, object]:
    """GGUF ``tokenizer.*`` metadata for a Hugging Face folder's byte-level BPE ``tokenizer.json``.

    Args:
        folder: the folder with ``tokenizer.json`` (and optionally ``tokenizer_config.json``,
            ``config.json``, ``chat_template.jinja``).
        vocab_size: number of tokens to write (the model's embedding rows); default
            ``config.json``'s ``vocab_size``, else the tokenizer's size.
        pre: ``tokenizer.ggml.pre`` to write instead of the detected one.

    Raises:
        ConfigError: not a byte-level BPE tokenizer, an unknown ``pre``, or a pre-tokenizer that
            matches no llama.cpp rule (and no ``pre`` given).
    """
    folder = Path(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    model = data["model"]
    if model.get("type") != "BPE":
        raise ConfigError(f"{folder}: a {model.get('type')} tokenizer cannot be written to GGUF here; supported: "
                          "byte-level BPE and SentencePiece-style BPE (byte_fallback)")
    spm = bool(model.get("byte_fallback"))
    if spm:
        if pre is not None and pre != "default":
            raise ConfigError(f"--pre {pre}: a SentencePiece-style tokenizer has no pre-tokenizer (llama.cpp: default)")
        pre = "default"
    else:
        pre = check_pre_tokenizer(pre) if pre is not None else detect_pre_tokenizer(data)
        if pre is None:
            raise ConfigError(f"{folder}: its pre-tokenizer matches none llama.cpp knows "
                              f"({', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}); name one with --pre")

    def read_json(name: str) -> dict[str, Any]:
        path = folder / name
        return json.loads(path.read_text()) if path.is_file() else {}

    tok_config, hf_config = read_json("tokenizer_config.json"), read_json("config.json")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {entry["id"]: entry for entry in data.get("added_tokens", [])}
    for entry in added.values():
        vocab[entry["content"]] = entry["id"]
    by_id = {index: token for token, index in vocab.items()}
    size = max(vocab_size or int(hf_config.get("vocab_size") or 0), max(by_id) + 1)
    unk = model.get("unk_token")
    tokens, types = [], []
    for index in range(size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(_UNUSED)
        elif index in added and token != unk:
            tokens.append(token)
            types.append(_CONTROL if added[index].get("special") else _USER_DEFINED)
        else:
            tokens.append(token)
            types.append(_token_type(token, unk) if spm else _NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta: dict[str, object] = {
        "tokenizer.ggml.model": "llama" if spm else "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
    }
    if spm:
        meta["tokenizer.ggml.scores"] = _spm_scores(tokens, types, merges)
        meta["tokenizer.ggml.add_space_prefix"] = _adds_space_prefix(data)
    else:
        meta["tokenizer.ggml.merges"] = merges
    for role in _SPECIAL_ROLES:
        token = _token_text(tok_config.get(f"{role}_token"))
        token_id = vocab.get(token) if token is not None else hf_config.get(f"{role}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < size:
            meta[f"tokenizer.ggml.{role}_token_id"] = token_id
    first, last = _template_adds(data.get("post_processor"))
    template_adds = {"bos": first, "eos": last}
    for role in ("bos", "eos"):
        flag = tok_config.get(f"add_{role}_token")
        if flag is None and template_adds[role] is not None:
            flag = template_adds[role] == _token_text(tok_config.get(f"{role}_token"))
        if isinstance(flag, bool):
            meta[f"tokenizer.ggml.add_{role}_token"] = flag
    template = tok_config.get("chat_template")
    if not template and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, str) and template:
        meta["tokenizer.chat_template"] = template
    return meta


# ---- SentencePiece-style BPE ----------------------------------------------------------------
def _token_type(token: str, unk: str | None) -> int:
    """llama.cpp's type of a vocabulary piece of a SentencePiece-style tokenizer."""
    if token == unk:
        return _UNKNOWN
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return _BYTE
    return _NORMAL


def _spm_scores(tokens: list[str], types: list[int], merges: list[str]) -> list[float]:
    """SentencePiece scores that make llama.cpp's "join the adjacent pair whose joined piece scores
    best" rule pick the merges ``tokenizer.json`` ranks first: a piece's score is minus the rank
    of the first merge that makes it. Pieces no merge makes (single characters, bytes, specials)
    score 0, and no pair joins into them; ordinary pieces of several characters that no merge
    makes rank after every merge (transformers never builds them from parts either)."""
    first_rank: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, _, right = merge.partition(" ")
        first_rank.setdefault(left + right, rank)
    scores = []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if token in first_rank:
            scores.append(-float(first_rank[token] + 1))
        elif kind == _NORMAL and len(token) > 1:
            scores.append(-float(len(merges) + 1 + index))
        else:
            scores.append(0.0)
    return scores


def _adds_space_prefix(data: Mapping[str, Any]) -> bool:
    """Whether the tokenizer puts "▁" before the text (Llama 2, Mistral, Phi-3; not Gemma): a
    ``Prepend("▁")`` normalizer or a ``Metaspace`` pre-tokenizer that prepends."""
    def steps(step: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
        if not step:
            return []
        nested = step.get("normalizers") or step.get("pretokenizers")
        return [s for inner in nested for s in steps(inner)] if nested else [step]

    for step in steps(data.get("normalizer")):
        if step.get("type") == "Prepend" and step.get("prepend") == _SPM_SPACE:
            return True
    for step in steps(data.get("pre_tokenizer")):
        if step.get("type") == "Metaspace":
            return step.get("prepend_scheme", "always") != "never" and step.get("add_prefix_space", True)
    return False
