"""``hybridllm chat`` under a pseudo-terminal (pexpect): Ctrl-C stops a reply and keeps the
conversation, /reset says so, and a second Ctrl-C, Ctrl-D or /exit leaves.

A tiny random model whose end-of-sequence token greedy decoding never picks (its head row is
zero, every other logit row random) and whose window is 32K tokens: a reply runs until Ctrl-C
stops it, so a Ctrl-C that did not work fails the test by its timeout, never by luck.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

pexpect = pytest.importorskip("pexpect")

pytestmark = pytest.mark.slow  # each test starts the CLI in a pseudo-terminal

ENDLESS_WINDOW = 32768
STOPPED = re.compile(r"\[stopped after (\d+) tokens \((\d+) prompt tokens\)")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
FINISHED = re.compile(r"\[(\d+) prompt tokens \((\d+) cached\), (\d+) tokens")


@pytest.fixture(scope="module")
def endless_gguf(tmp_path_factory) -> Path:
    """A tiny llama GGUF that never ends a reply by itself (greedy), named ``endless-chat.gguf``."""
    from tiny_models import build_hf_model, save_as_gguf

    root = tmp_path_factory.mktemp("chat")
    folder = root / "hf"
    model = build_hf_model(folder, "llama", max_position_embeddings=ENDLESS_WINDOW)
    eos = model.config.eos_token_id
    with torch.no_grad():
        model.lm_head.weight[eos].zero_()  # EOS logit 0, below the best of the other random logits
    model.save_pretrained(folder, safe_serialization=True)
    return save_as_gguf(folder, root / "endless-chat.gguf")


def spawn_chat(*args: str, timeout: float = 60, preexec_fn=None) -> "pexpect.spawn":
    child = pexpect.spawn(sys.executable, ["-m", "hybridllm.cli", "chat", *args], env=dict(os.environ),
                          encoding="utf-8", codec_errors="replace", timeout=timeout, dimensions=(50, 200),
                          preexec_fn=preexec_fn)
    return child


def banner_name(child: "pexpect.spawn") -> str:
    """The model name the chat greets with (the text before " ready." on its line, terminal
    control sequences of a progress bar removed)."""
    child.expect_exact(" ready.")
    return ANSI_ESCAPE.sub("", child.before).splitlines()[-1].strip()


def wait_for_reply_text(child: "pexpect.spawn", line: str) -> None:
    """Send ``line`` and wait until the reply has streamed a few characters."""
    child.sendline(line)
    child.expect_exact(line)  # the terminal's echo of the line
    child.expect(r"\n")
    child.expect(r"\S{3}")  # the reply is streaming


def stop_reply(child: "pexpect.spawn") -> tuple[int, int]:
    """Ctrl-C mid-reply; (tokens streamed, prompt tokens) from the line saying it stopped."""
    child.sendintr()
    child.expect(STOPPED)
    tokens, prompt = int(child.match.group(1)), int(child.match.group(2))
    child.expect_exact("> ")
    return tokens, prompt


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(endless_gguf):
    child = spawn_chat("--model", str(endless_gguf), "--temperature", "0", "--max-tokens", "30000",
                       "--threads", "1")
    try:
        assert banner_name(child) == "endless-chat"  # the file's name, as `models` and the server say
        child.expect_exact("> ")

        wait_for_reply_text(child, "hello")
        tokens, first_prompt = stop_reply(child)
        assert tokens >= 1

        wait_for_reply_text(child, "hello")  # the same line again: the earlier turn is in its prompt
        _, second_prompt = stop_reply(child)
        assert second_prompt > first_prompt + tokens // 2

        child.sendline("/reset")
        child.expect_exact("history cleared")
        child.expect_exact("> ")
        wait_for_reply_text(child, "hello")
        _, after_reset = stop_reply(child)
        assert after_reset == first_prompt  # a fresh conversation again

        child.sendintr()  # a second Ctrl-C, at the empty prompt: leave
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_ctrl_c_at_the_prompt_warns_then_leaves_and_ctrl_d_leaves(endless_gguf):
    child = spawn_chat("--model", str(endless_gguf), "--threads", "1")
    try:
        child.expect_exact("> ")
        child.send("half a line")
        child.expect_exact("half a line")  # the terminal's echo: Ctrl-C comes after the keys, as a person's
        child.sendintr()  # drops the line, says how to quit, stays
        child.expect_exact("Ctrl-C again")
        child.expect_exact("> ")
        child.sendline("/help")
        child.expect_exact("/reset clears the history")
        child.expect_exact("> ")
        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_ctrl_c_works_when_the_chat_was_started_with_sigint_ignored(endless_gguf):
    """A shell's background job (and CI's test run) starts with SIGINT ignored, which every
    child inherits and for which Python installs no KeyboardInterrupt: chat takes Ctrl-C anyway."""
    import signal

    child = spawn_chat("--model", str(endless_gguf), "--threads", "1",
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        child.expect_exact("> ")
        child.sendintr()
        child.expect_exact("Ctrl-C again")
        child.expect_exact("> ")
        child.sendintr()  # the second one leaves
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_exit_command_and_an_overlong_turn_keeps_the_session(endless_gguf):
    child = spawn_chat("--model", str(endless_gguf), "--temperature", "0", "--max-tokens", "4", "-c", "64",
                       "--threads", "1")
    try:
        child.expect_exact("> ")
        child.sendline("fox " * 80)  # longer than the 64-token context: one error line, the session goes on
        child.expect(r"error: the prompt has \d+ tokens but the context size is 64 tokens \(--ctx-size")
        child.expect_exact("> ")
        child.sendline("hi")
        child.expect(FINISHED)
        assert int(child.match.group(3)) == 4
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_the_default_model_still_knows_the_earlier_turn_after_ctrl_c():
    """Semantics on the real model: a name given in a turn whose reply was stopped is recalled."""
    child = spawn_chat("--temperature", "0", "--max-tokens", "200", "--threads", "2", timeout=180)
    try:
        assert banner_name(child) == "SmolLM2-135M-Instruct.Q4_1"  # not the file's general.name
        child.expect_exact("> ")
        wait_for_reply_text(child, "My name is Zorblax and my favourite colour is teal. "
                                   "Tell me a long story about a dragon.")
        stop_reply(child)
        child.sendline("What is my name?")
        child.expect_exact("What is my name?")
        child.expect(FINISHED)
        assert "Zorblax" in child.before, child.before
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
