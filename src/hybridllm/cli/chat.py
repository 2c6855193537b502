"""``hybridllm chat``: an interactive chat that streams its replies.

Ctrl-C while a reply streams stops that reply before the request loop's next step (its KV is
freed at once); what was said so far stays in the conversation, so the next answer still knows
the earlier turns. At the prompt, Ctrl-C drops the line being typed; a second Ctrl-C in a row (at
the prompt, or right after stopping a reply), Ctrl-D or ``/exit`` leaves. ``/reset`` clears the
history (a ``--system`` message stays) and says so.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Annotated, Any, Optional

import typer

from hybridllm.cli.options import (
    KVOptions,
    ModelOptions,
    PlacementOptions,
    PrefixCacheOptions,
    SpeculativeOptions,
    SpeedOptions,
    load_llm,
    with_option_groups,
)
from hybridllm.errors import ConfigError, HybridLLMError

HELP_LINE = "Ctrl-C stops a reply; /reset clears the history; /exit, Ctrl-D or Ctrl-C twice quits."
QUIT_HINT = "(Ctrl-C again, Ctrl-D or /exit quits)"


@with_option_groups
def chat(
    model: ModelOptions = ModelOptions(),
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 512,
    temperature: Annotated[float, typer.Option("--temperature", "--temp")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    placement: PlacementOptions = PlacementOptions(),
    kv: KVOptions = KVOptions(),
    speed: SpeedOptions = SpeedOptions(),
    spec: SpeculativeOptions = SpeculativeOptions(),
    prefix: PrefixCacheOptions = PrefixCacheOptions(prefix_cache_ram="auto"),
) -> None:
    """Interactive chat that streams tokens. Ctrl-C stops a reply and keeps the conversation; /reset
    clears the history; /exit, Ctrl-D or a second Ctrl-C at the prompt quits."""
    from hybridllm.config import SamplingParams
    from hybridllm.loading.local_models import model_name

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    llm = load_llm(model, placement, kv, speed, prefix, spec)
    if not llm.tokenizer.has_chat_template:
        raise ConfigError("this model has no chat template; use `hybridllm generate --no-chat` instead")
    conversation = Conversation(system)
    take_ctrl_c()
    enable_line_editing()
    typer.echo(f"{model_name(llm.checkpoint.path)} ready. {HELP_LINE}", err=True)
    quit_armed = False  # the last thing the user did was Ctrl-C: one more at the prompt leaves
    while True:
        try:
            line = input("> ")
        except EOFError:  # Ctrl-D
            typer.echo("", err=True)
            return
        except KeyboardInterrupt:
            typer.echo("", err=True)
            if quit_armed:
                return
            typer.echo(QUIT_HINT, err=True)
            quit_armed = True
            continue
        quit_armed = False
        command = line.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            conversation.reset()
            typer.echo("history cleared" + (" (the system message is kept)" if system else ""), err=True)
            continue
        if command == "/help":
            typer.echo(HELP_LINE, err=True)
            continue
        if command:
            quit_armed = answer(llm, conversation, line, params)


class Conversation:
    """The messages of a chat: an optional system message, then user and assistant turns."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Back to the system message alone (or nothing)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def drop_last(self) -> None:
        """Forget the last message (a user turn that got no reply)."""
        self.messages.pop()


def answer(llm: Any, conversation: Conversation, line: str, params: Any) -> bool:
    """Stream the reply to ``line`` and add both to ``conversation``; True when Ctrl-C stopped it.

    A stopped reply keeps the text streamed so far as the assistant's turn (without any, the user's
    line is dropped too). An error of the request (the conversation outgrew the context, a KV
    budget) prints one line and drops the line; the session goes on.
    """
    conversation.add("user", line)
    stop = threading.Event()
    pieces: list[str] = []
    tokens = 0
    result = None
    try:
        prompt = llm.encode_prompt(conversation.messages)
        with interrupt_sets(stop):
            for event in llm.stream_events(prompt, params, cancel=stop):
                if event.result is not None:
                    result = event.result
                    continue
                if event.token_id is not None:
                    tokens += 1
                pieces.append(event.text)
                typer.echo(event.text, nl=False)
    except HybridLLMError as exc:
        conversation.drop_last()
        typer.echo("")
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        typer.echo(f"error: {message} (the message was not added; /reset starts over)", err=True)
        return False
    typer.echo("")
    if result is None:  # Ctrl-C
        text = "".join(pieces)
        if text:
            conversation.add("assistant", text)
            kept = "the reply so far stays in the conversation"
        else:
            conversation.drop_last()
            kept = "nothing was said, so the message was dropped"
        typer.echo(f"[stopped after {tokens} tokens ({len(prompt)} prompt tokens); {kept}] {QUIT_HINT}", err=True)
        return True
    conversation.add("assistant", result.text)
    m = result.metrics
    typer.echo(
        f"[{m['prompt_tokens']} prompt tokens ({m.get('cached_tokens') or 0} cached), "
        f"{m['generated_tokens']} tokens, TTFT {m['ttft_s']:.3f} s, {(m['decode_tps'] or 0):.1f} tok/s]", err=True,
    )
    return False


@contextlib.contextmanager
def interrupt_sets(event: threading.Event) -> Iterator[None]:
    """Inside: Ctrl-C (SIGINT) sets ``event`` instead of raising KeyboardInterrupt, so a step of the
    request loop is never cut in half; the previous handler is back on exit (main thread only)."""
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def take_ctrl_c() -> None:
    """Ctrl-C at the prompt raises KeyboardInterrupt even when the chat was started with SIGINT
    ignored (a shell's background job, a script's child: Python then installs no handler of its
    own, and Ctrl-C at the prompt would do nothing). Main thread only."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def enable_line_editing() -> None:
    """Arrow keys and history in ``input()`` on a terminal (GNU readline, where Python has it)."""
    if sys.stdin is not None and sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (importing it is what turns it on)
