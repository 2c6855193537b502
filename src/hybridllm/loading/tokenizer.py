"""Text <-> token ids, for GGUF files and Hugging Face folders.

The heavy lifting (BPE merges, byte fallback, special-token matching) is done by the Hugging Face
``tokenizers`` library; this module only assembles its pipeline from what the model ships:

* A GGUF file has no ``tokenizer.json``. Its metadata carries the vocabulary under llama.cpp's
  keys, and we rebuild the tokenizer llama.cpp would use:

  - ``tokenizer.ggml.model = "gpt2"``: byte-level BPE (SmolLM, Llama 3, Qwen2, ...). Text is cut by
    the regular expressions llama.cpp picks from ``tokenizer.ggml.pre`` and every byte is spelled
    as one of 256 printable characters before the merges run.
  - ``tokenizer.ggml.model = "llama"``: SentencePiece-style BPE (Llama 2, Mistral). Spaces become
    ``▁``, one is prepended to each piece of text (``add_space_prefix``), merges are ranked by the
    tokens' scores, and characters outside the vocabulary fall back to ``<0xNN>`` byte tokens.

  Tokens typed CONTROL (and UNKNOWN) become special tokens, USER_DEFINED ones plain added tokens;
  both are always matched whole in the input text, as llama.cpp does.
* A Hugging Face folder has ``tokenizer.json``, which ``tokenizers`` loads as is, plus
  ``tokenizer_config.json`` (special tokens, BOS policy, chat template), an optional
  ``chat_template.jinja`` and an optional ``generation_config.json`` (extra end-of-turn ids).

Example:
    >>> tok = Tokenizer.from_gguf_metadata(metadata)
    >>> ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    >>> stream = tok.stream_decoder()
    >>> text = "".join(stream.push(i) for i in ids) + stream.flush()
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from hybridllm.errors import ConfigError, HybridLLMError, ModelLoadError, UnsupportedModelError
from hybridllm.loading.chat_template import ChatTemplate

__all__ = [
    "SUPPORTED_GGUF_PRE_TOKENIZERS",
    "SUPPORTED_GGUF_TOKENIZER_MODELS",
    "StreamDecoder",
    "Tokenizer",
    "gguf_pre_tokenizer_rule",
]

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_TOKENIZER_MODELS = ("gpt2", "llama")
"""Values of ``tokenizer.ggml.model`` that :meth:`Tokenizer.from_gguf_metadata` understands."""

# llama.cpp's token types (``tokenizer.ggml.token_type``).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Token texts llama.cpp treats as end-of-generation whatever the file declares.
_EOG_TOKEN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regular expressions for byte-level BPE, as llama.cpp selects them by
# ``tokenizer.ggml.pre``. Each entry is applied in turn; matches and the text between them both
# become pieces ("isolated"), so a later expression only ever sees one earlier piece.
# ---------------------------------------------------------------------------------------------
_CONTRACTIONS = r"'s|'t|'re|'ve|'m|'ll|'d"
_GPT2_SPLIT = _CONTRACTIONS + r"| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_FALCON_SPLITS = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _PreTokenizerSpec:
    """How llama.cpp pre-tokenizes one ``tokenizer.ggml.pre`` family."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is not re-merged (Llama 3)
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


_DEFAULT_PRE = _PreTokenizerSpec((_GPT2_SPLIT,))


def _pre_table() -> Mapping[str, _PreTokenizerSpec]:
    groups = [
        (
            "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
            _PreTokenizerSpec((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
        ),
        ("dbrx smaug-bpe chatglm-bpe glm4", _PreTokenizerSpec((_LLAMA3_SPLIT,))),
        (
            "smollm starcoder refact command-r codeshell exaone minerva-7b",
            _PreTokenizerSpec((r"\p{N}", _GPT2_SPLIT)),  # every digit alone, then GPT-2
        ),
        (
            "default gpt-2 gpt2 phi-2 mpt olmo jais jina-es jina-de jina-v1-en jina-v2-es jina-v2-de "
            "jina-v2-code roberta-bpe gigachat a.x-4.0 mellum exaone4 trillion granite-docling",
            _DEFAULT_PRE,
        ),
        ("qwen2 deepseek-r1-qwen kormo stablelm2 megrez hunyuan", _PreTokenizerSpec((_QWEN2_SPLIT,))),
        ("tekken", _PreTokenizerSpec((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True)),
        ("gpt-4o llama4 minimax-m2", _PreTokenizerSpec((_GPT4O_SPLIT,))),
        ("deepseek-coder", _PreTokenizerSpec(_DEEPSEEK_CODER_SPLITS)),
        ("deepseek-v3 hunyuan-dense", _PreTokenizerSpec(_DEEPSEEK_V3_SPLITS)),
        ("falcon", _PreTokenizerSpec(_FALCON_SPLITS)),
    ]
    return MappingProxyType({name: spec for names, spec in groups for name in names.split()})


_PRE_TOKENIZERS = _pre_table()

SUPPORTED_GGUF_PRE_TOKENIZERS = tuple(_PRE_TOKENIZERS)
"""Values of ``tokenizer.ggml.pre`` whose pre-tokenizer we rebuild (``gpt2`` tokenizer model)."""


def gguf_pre_tokenizer_rule(pre: str) -> tuple[tuple[str, ...], bool] | None:
    """The split expressions and ``ignore_merges`` flag llama.cpp uses for ``pre``; None if unknown."""
    spec = _PRE_TOKENIZERS.get(pre)
    return None if spec is None else (spec.splits, spec.ignore_merges)


# ---------------------------------------------------------------------------------------------
# Reading GGUF metadata
# ---------------------------------------------------------------------------------------------
def _gguf_array(metadata: Mapping[str, Any], key: str) -> list[Any] | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ModelLoadError(f"GGUF metadata {key} must be an array, got {type(value).__name__}")
    return list(value)


def _gguf_tokens(metadata: Mapping[str, Any]) -> list[str]:
    tokens = _gguf_array(metadata, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens; the file carries no vocabulary")
    if "" in tokens:  # llama.cpp renames empty tokens the same way
        tokens = [token or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]
    return tokens


def _gguf_token_types(metadata: Mapping[str, Any], n_tokens: int) -> list[int]:
    types = _gguf_array(metadata, "tokenizer.ggml.token_type")
    if types is None:
        return [_NORMAL] * n_tokens
    if len(types) != n_tokens:
        raise ModelLoadError(
            f"GGUF metadata has {len(types)} token types for {n_tokens} tokens (tokenizer.ggml.token_type)"
        )
    return [int(t) for t in types]


def _gguf_token_id(metadata: Mapping[str, Any], name: str, n_tokens: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return None
    token_id = int(value)
    if not 0 <= token_id < n_tokens:
        logger.warning(
            "ignoring tokenizer.ggml.%s_token_id=%d: outside the %d-token vocabulary", name, token_id, n_tokens
        )
        return None
    return token_id


def _gguf_bool(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key)
    return default if value is None else bool(value)


def _parse_merges(raw: Sequence[str]) -> list[tuple[str, str]]:
    merges = []
    for merge in raw:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"GGUF merge {merge!r} is not two tokens separated by a space")
        merges.append((left, right))
    return merges


# ---------------------------------------------------------------------------------------------
# Building the backend for each GGUF tokenizer model
# ---------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of the 256 byte values as printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Token -> id, with any ordinary token written outside the byte alphabet re-spelled into it.

    Well-formed files never need the re-spelling; control and user-defined tokens keep their raw
    text because they are matched and printed verbatim.
    """
    spelling = _bytes_to_unicode()
    alphabet = frozenset(spelling.values())
    ordinary = "".join(token for token, kind in zip(tokens, types, strict=True) if kind in (_NORMAL, _UNUSED))
    if alphabet.issuperset(ordinary):
        return {token: index for index, token in enumerate(tokens)}

    def respell(token: str, kind: int) -> str:
        if kind not in (_NORMAL, _UNUSED) or alphabet.issuperset(token):
            return token
        return "".join(spelling[byte] for byte in token.encode("utf-8"))

    return {respell(token, kind): index for index, (token, kind) in enumerate(zip(tokens, types, strict=True))}


def _split_pre_tokenizer(splits: Sequence[str]) -> pre_tokenizers.PreTokenizer:
    steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _pre_tokenizer_spec(pre: str | None) -> _PreTokenizerSpec:
    if pre is None:
        return _DEFAULT_PRE
    spec = _PRE_TOKENIZERS.get(pre)
    if spec is None:
        logger.warning("unknown tokenizer.ggml.pre %r; using the GPT-2 pre-tokenizer", pre)
        return _DEFAULT_PRE
    return spec


def _build_gpt2(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> tuple[_Backend, bool]:
    """Byte-level BPE. Returns the backend and llama.cpp's default for adding BOS."""
    raw_merges = _gguf_array(metadata, "tokenizer.ggml.merges")
    if not raw_merges:
        raise ModelLoadError("GGUF tokenizer 'gpt2' needs tokenizer.ggml.merges, which the file lacks")
    spec = _pre_tokenizer_spec(metadata.get("tokenizer.ggml.pre"))
    model = models.BPE(
        vocab=_byte_level_vocab(tokens, types),
        merges=_parse_merges(raw_merges),
        fuse_unk=False,
        ignore_merges=spec.ignore_merges,
    )
    backend = _Backend(model)
    backend.pre_tokenizer = _split_pre_tokenizer(spec.splits)
    backend.decoder = decoders.ByteLevel()
    return backend, spec.add_bos


_HASH_BASE = 0x100000001B3  # odd (FNV's prime), so its powers never vanish mod 2**64


def _derive_spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's "join the best-scoring adjacent pair" rule.

    Every ordinary token that is the concatenation of two tokens yields a merge of those two,
    ranked by the token's score (higher first, ties in vocabulary order); splits of one token keep
    their left-to-right order.

    A 262K vocabulary has ~1.2M candidate splits: they are tested at once on 64-bit polynomial
    hashes of every prefix and suffix (wrapping arithmetic), and only the hits are checked on
    the strings themselves, so a hash collision can never add a merge.
    """
    if not tokens:
        return []
    vocab = set(tokens)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    codes = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)  # (total chars,)
    starts = np.cumsum(lengths) - lengths
    longest = int(lengths.max())
    base = np.uint64(_HASH_BASE)
    # prefix_hash[starts[i] + c]: the hash of tokens[i][:c + 1], built one character column at a time
    prefix_hash = codes.copy()
    longest_first = starts[np.argsort(-lengths, kind="stable")]
    longer_than = len(tokens) - np.searchsorted(np.sort(lengths), np.arange(longest), side="right")  # (longest,)
    for column in range(1, longest):
        at = longest_first[:longer_than[column]] + column  # the tokens longer than ``column``, at it
        prefix_hash[at] = prefix_hash[at - 1] * base + codes[at]
    powers = np.array([pow(_HASH_BASE, k, 1 << 64) for k in range(longest + 1)], np.uint64)  # base**k
    whole = np.where(lengths > 0, prefix_hash[np.maximum(starts + lengths - 1, 0)], np.uint64(0))
    known = np.sort(whole)

    def in_vocab(hashes: np.ndarray) -> np.ndarray:
        order = np.argsort(hashes)  # sorted queries search in cache order (3x faster than as they come)
        ordered = hashes[order]
        slot = np.minimum(np.searchsorted(known, ordered), len(known) - 1)
        found = np.empty(len(hashes), bool)
        found[order] = known[slot] == ordered
        return found

    mergeable = np.isin(np.asarray(types), (_NORMAL, _USER_DEFINED, _UNUSED)) & (lengths >= 2)
    token = np.repeat(np.flatnonzero(mergeable), lengths[mergeable] - 1)  # one entry per (token, cut)
    first = np.cumsum(lengths[mergeable] - 1) - (lengths[mergeable] - 1)
    cut = np.arange(len(token)) - np.repeat(first, lengths[mergeable] - 1) + 1  # 1 .. length - 1
    left = prefix_hash[starts[token] + cut - 1]
    right = whole[token] - left * powers[lengths[token] - cut]
    left_known = in_vocab(left)
    token, cut, right = token[left_known], cut[left_known], right[left_known]
    right_known = in_vocab(right)
    token, cut = token[right_known], cut[right_known]
    rank = np.empty(len(tokens), np.int64)
    rank[np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")] = np.arange(len(tokens))
    order = np.argsort(rank[token] * (longest + 1) + cut, kind="stable")
    return [(left, right) for index, at in zip(token[order].tolist(), cut[order].tolist())
            if (left := tokens[index][:at]) in vocab and (right := tokens[index][at:]) in vocab]


def _build_llama(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> _Backend:
    """SentencePiece-style BPE with ``▁`` for spaces and ``<0xNN>`` byte fallback."""
    raw_merges = _gguf_array(metadata, "tokenizer.ggml.merges")
    if raw_merges:
        merges = _parse_merges(raw_merges)
    else:
        scores = _gguf_array(metadata, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError("GGUF tokenizer 'llama' needs tokenizer.ggml.scores (one per token) or merges")
        merges = _derive_spm_merges(tokens, [float(s) for s in scores], types)
    unk_id = _gguf_token_id(metadata, "unknown", len(tokens))
    model = models.BPE(
        vocab=dict(zip(tokens, range(len(tokens)))),
        merges=merges,
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = _Backend(model)
    add_space_prefix = _gguf_bool(metadata, "tokenizer.ggml.add_space_prefix", True)
    escape_spaces = normalizers.Replace(" ", _SPM_SPACE)
    # Prepend acts on each stretch of text between special tokens, as llama.cpp's space prefix does.
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), escape_spaces]) if add_space_prefix else escape_spaces
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_gguf_special_tokens(backend: _Backend, tokens: list[str], types: list[int]) -> None:
    """Register CONTROL/UNKNOWN tokens as special and USER_DEFINED ones as added (not special)."""
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind in (_CONTROL, _UNKNOWN)
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind == _USER_DEFINED
    ]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _gguf_eos_ids(metadata: Mapping[str, Any], tokens: list[str]) -> tuple[int | None, frozenset[int]]:
    """The declared EOS id, and every id that ends generation (EOS, EOT, EOM, llama.cpp's EOG texts)."""
    n_tokens = len(tokens)
    eos_id = _gguf_token_id(metadata, "eos", n_tokens)
    declared = (eos_id, _gguf_token_id(metadata, "eot", n_tokens), _gguf_token_id(metadata, "eom", n_tokens))
    ids = {token_id for token_id in declared if token_id is not None}
    ids.update(index for index, token in enumerate(tokens) if token in _EOG_TOKEN_TEXTS)
    return eos_id, frozenset(ids)


# ---------------------------------------------------------------------------------------------
# Reading Hugging Face folders
# ---------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        template = named.get("default") or (next(iter(named.values())) if len(named) == 1 else None)
    return template if isinstance(template, str) and template.strip() else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _post_processor_adds(backend: _Backend, bos_id: int | None, eos_id: int | None) -> tuple[bool, bool]:
    """Whether tokenizer.json's post-processor adds BOS / EOS around a text."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    if len(full) <= len(plain):
        return False, False
    return (bos_id is not None and full[0] == bos_id), (eos_id is not None and full[-1] == eos_id)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
class Tokenizer:
    """A model's tokenizer: encoding, decoding, incremental decoding and chat templates.

    Build one with :meth:`from_gguf_metadata` or :meth:`from_hf_folder`.

    Args:
        backend: The ``tokenizers.Tokenizer`` that does the work.
        vocab_size: Number of token ids; defaults to the backend's count, added tokens included.
        bos_token_id: Id of the beginning-of-sequence token, if the model has one.
        eos_token_id: Id of the model's main end-of-sequence token.
        eos_token_ids: Every id that ends generation; ``eos_token_id`` is always included.
        add_bos: Whether ``encode(..., add_special_tokens=True)`` prepends BOS.
        add_eos: Whether ``encode(..., add_special_tokens=True)`` appends EOS.
        chat_template: Jinja2 source of the chat template, if the model has one.
        template_tokens: Token strings offered to the template (``bos_token``, ``eos_token``,
            ...); by default the texts of the BOS and EOS tokens.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        vocab_size: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        template_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        self._backend = backend
        self._vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        ids = set(eos_token_ids)
        if eos_token_id is not None:
            ids.add(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self._add_bos = add_bos and bos_token_id is not None
        self._add_eos = add_eos and eos_token_id is not None
        if template_tokens is None:
            template_tokens = {"bos_token": self.id_to_token(bos_token_id), "eos_token": self.id_to_token(eos_token_id)}
        self._chat_template = ChatTemplate(chat_template, template_tokens) if chat_template else None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes.

        Args:
            metadata: The file's key/value metadata, e.g.
                ``{name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}``.

        Returns:
            The tokenizer, matching llama.cpp's tokenization of the file.

        Raises:
            UnsupportedModelError: If ``tokenizer.ggml.model`` is not one of
                :data:`SUPPORTED_GGUF_TOKENIZER_MODELS`.
            ModelLoadError: If the tokenizer metadata is missing or inconsistent.
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind is None:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.model; the file carries no tokenizer")
        if kind not in SUPPORTED_GGUF_TOKENIZER_MODELS:
            supported = ", ".join(repr(name) for name in SUPPORTED_GGUF_TOKENIZER_MODELS)
            raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported (supported: {supported})")
        tokens = _gguf_tokens(metadata)
        types = _gguf_token_types(metadata, len(tokens))
        try:
            if kind == "gpt2":
                backend, add_bos_default = _build_gpt2(metadata, tokens, types)
            else:
                backend, add_bos_default = _build_llama(metadata, tokens, types), True
            _add_gguf_special_tokens(backend, tokens, types)
        except Exception as exc:  # the tokenizers library raises plain Exceptions on bad vocabularies
            if isinstance(exc, HybridLLMError):
                raise
            raise ModelLoadError(f"cannot build the GGUF {kind!r} tokenizer: {exc}") from exc

        n_tokens = len(tokens)
        bos_id = _gguf_token_id(metadata, "bos", n_tokens)
        eos_id, eos_ids = _gguf_eos_ids(metadata, tokens)
        template_tokens = {
            f"{name}_token": tokens[token_id] if token_id is not None else None
            for name, token_id in (
                ("bos", bos_id),
                ("eos", eos_id),
                ("unk", _gguf_token_id(metadata, "unknown", n_tokens)),
                ("pad", _gguf_token_id(metadata, "padding", n_tokens)),
            )
        }
        return cls(
            backend,
            vocab_size=n_tokens,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            eos_token_ids=eos_ids,
            add_bos=_gguf_bool(metadata, "tokenizer.ggml.add_bos_token", add_bos_default),
            add_eos=_gguf_bool(metadata, "tokenizer.ggml.add_eos_token", False),
            chat_template=metadata.get("tokenizer.chat_template") or None,
            template_tokens=template_tokens,
        )

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer folder.

        Reads ``tokenizer.json`` (required), and if present ``tokenizer_config.json`` (special
        tokens, ``add_bos_token``/``add_eos_token``, ``chat_template``),
        ``special_tokens_map.json``, ``chat_template.jinja`` (which wins over the config's
        template) and ``generation_config.json`` (its ``eos_token_id`` values end generation too).

        Args:
            path: The folder.

        Returns:
            The tokenizer.

        Raises:
            ModelLoadError: If the folder has no usable ``tokenizer.json`` or a config file is invalid.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ModelLoadError(f"{tokenizer_file}: cannot load ({exc})") from exc
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")

        def special(name: str) -> str | None:
            return _token_text(config.get(name, special_map.get(name)))

        template_tokens = {name: special(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_id = backend.token_to_id(template_tokens["bos_token"]) if template_tokens["bos_token"] else None
        eos_id = backend.token_to_id(template_tokens["eos_token"]) if template_tokens["eos_token"] else None
        generation = _read_json(folder / "generation_config.json")
        eos_ids = set(_as_id_list(generation.get("eos_token_id")))
        if eos_id is None and eos_ids:
            eos_id = _as_id_list(generation.get("eos_token_id"))[0]
        adds_bos, adds_eos = _post_processor_adds(backend, bos_id, eos_id)
        add_bos = config.get("add_bos_token")
        add_eos = config.get("add_eos_token")
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            eos_token_ids=eos_ids,
            add_bos=add_bos if isinstance(add_bos, bool) else adds_bos,
            add_eos=add_eos if isinstance(add_eos, bool) else adds_eos,
            chat_template=_hf_chat_template(folder, config),
            template_tokens=template_tokens,
        )

    # -- vocabulary ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows."""
        return self._vocab_size

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` prepends the BOS token."""
        return self._add_bos

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest spelling of a token in UTF-8 bytes: no token stands for more bytes of text
        (a byte-level token spells each byte with one character, a SentencePiece token spells a
        space with the 3-byte "▁", a byte-fallback token one byte with "<0xAB>"), so a text of B
        bytes has at least B / max_token_bytes tokens, known without encoding it."""
        return max((len(token.encode("utf-8")) for token in self._backend.get_vocab(with_added_tokens=True)),
                   default=1)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token, written as the vocabulary spells it (``"Ġthe"``, ``"▁the"``), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int | None) -> str | None:
        """The vocabulary's spelling of a token id, or None for an unknown id."""
        if token_id is None or token_id < 0:
            return None
        return self._backend.id_to_token(token_id)

    def to_json(self) -> str:
        """The whole tokenization pipeline (vocabulary, merges, special tokens, decoder) as
        ``tokenizer.json`` text; GGUF tokenizers included, as rebuilt here. Libraries that take a
        Hugging Face ``tokenizers`` description (the grammar engine) load it."""
        return self._backend.to_str()

    # -- encoding and decoding ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Turn text into token ids.

        Special tokens written in the text (``"<|im_start|>"``) always become their single id.

        Args:
            text: The text.
            add_special_tokens: Add BOS (and EOS) around the text when the model asks for it.

        Returns:
            The token ids.

        Raises:
            ConfigError: If ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise ConfigError(f"text to encode must be a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self.bos_token_id)
            if self._add_eos:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Turn token ids back into text.

        Ids outside the vocabulary are ignored.

        Args:
            ids: The token ids.
            skip_special_tokens: Leave out control tokens such as ``<|im_end|>``.

        Returns:
            The text; invalid UTF-8 in the byte stream shows as U+FFFD.

        Raises:
            ConfigError: If an id is negative or not an integer.
        """
        try:
            id_list = [int(token_id) for token_id in ids]
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"token ids must be integers: {exc}") from exc
        if id_list and min(id_list) < 0:
            raise ConfigError(f"token ids must be non-negative, got {min(id_list)}")
        return self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence.

        Args:
            skip_special_tokens: Leave out control tokens, as in :meth:`decode`.

        Returns:
            The decoder.
        """
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """The Jinja2 source of the model's chat template, if any."""
        return self._chat_template.source if self._chat_template is not None else None

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        *,
        extra_context: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation with the model's chat template.

        The result equals transformers' ``apply_chat_template(messages, tokenize=False)``. Encode it
        with ``add_special_tokens=False``: templates write their own BOS.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``, oldest first.
            add_generation_prompt: End with the header that opens the assistant's turn.
            extra_context: More template variables (e.g. ``{"tools": [...]}``).

        Returns:
            The prompt text.

        Raises:
            HybridLLMError: If the model has no chat template, the conversation is empty or
                malformed, or the template rejects it.
        """
        if self._chat_template is None:
            raise HybridLLMError("this model has no chat template; pass a plain prompt instead of messages")
        return self._chat_template.render(messages, add_generation_prompt, extra_context)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self._vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, chat_template={self.has_chat_template})"
        )


class StreamDecoder:
    """Turns generated token ids into text one token at a time.

    Text is released only once it is final: while the bytes seen so far end in an incomplete
    UTF-8 character (the tail decodes to U+FFFD) they are held back. The concatenation of every
    :meth:`push` result and :meth:`flush` equals ``tokenizer.decode(ids, skip_special_tokens)``.

    Each step decodes only a short window: the tokens already released by the previous step
    (so context-dependent rules such as SentencePiece's leading-space strip apply the same way)
    plus the tokens not yet released.

    Args:
        tokenizer: The tokenizer the ids come from.
        skip_special_tokens: Leave out control tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: first token of the previously released step
        self._read = 0  # tokens before this index have been released

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token id.

        Args:
            token_id: The next generated id.

        Returns:
            The text that became final with this token; often ``""``.
        """
        self._ids.append(token_id)
        released = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(released) or text.endswith("\ufffd"):
            return ""
        # Drop the ids no later window needs, so memory stays bounded on long generations.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(released) :]

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character shows as U+FFFD) and reset.

        Returns:
            The remaining text.
        """
        released = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._ids.clear()
        self._prefix = self._read = 0
        return text[len(released) :]
