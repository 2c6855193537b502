"""``hybridllm generate``: one completion, with what each phase cost (``chat`` is :mod:`hybridllm.cli.chat`)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

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
from hybridllm.errors import ConfigError


@with_option_groups
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt (read from stdin when omitted).")] = None,
    prompt_option: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt, llama.cpp's way (instead of the argument).")] = None,
    model: ModelOptions = ModelOptions(),
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Maximum new tokens.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", "--temp", help="0 means greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 disables.")] = 0,
    min_p: Annotated[float, typer.Option("--min-p", help="0 disables.")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", "--repeat-penalty", help="1 disables.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Format with the model's chat template (default: when it has one).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text, ids and metrics.")] = False,
    placement: PlacementOptions = PlacementOptions(),
    kv: KVOptions = KVOptions(),
    speed: SpeedOptions = SpeedOptions(),
    spec: SpeculativeOptions = SpeculativeOptions(),
    prefix: PrefixCacheOptions = PrefixCacheOptions(),
) -> None:
    """Generate a completion and report what each phase cost."""
    from hybridllm.config import SamplingParams

    if prompt is not None and prompt_option is not None:
        raise ConfigError("give the prompt as an argument or with --prompt, not both")
    prompt = prompt if prompt is not None else prompt_option
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise ConfigError("give a prompt as an argument or on standard input")
        prompt = read_stdin_text()
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed, stop=list(stop or []), ignore_eos=ignore_eos,
    )
    llm = load_llm(model, placement, kv, speed, prefix, spec)
    use_chat = llm.tokenizer.has_chat_template if chat is None else chat
    request = [{"role": "user", "content": prompt}] if use_chat else prompt
    result = None
    for event in llm.stream_events(request, params):
        if event.result is not None:
            result = event.result
        elif not as_json:
            typer.echo(event.text, nl=False)
    if as_json:
        typer.echo(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "prompt_token_ids": result.prompt_token_ids,
            "finish_reason": result.finish_reason,
            "metrics": result.metrics,
        }))
    else:
        typer.echo("")
        sys.stdout.flush()
        from hybridllm.report import print_metrics

        print_metrics(result.metrics, llm.cold_start)


def read_stdin_text() -> str:
    """Standard input as UTF-8 text; other bytes are the user's error (ConfigError, one line).

    The bytes are decoded here, strictly: the stream's own decoding may be lenient (a C locale
    gives surrogate escapes, which the tokenizer then refuses with a traceback).
    """
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # an in-memory text stream (tests): already text
        return sys.stdin.read()
    raw = buffer.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"standard input is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
                          f"convert it first, e.g. with iconv -t UTF-8") from None
