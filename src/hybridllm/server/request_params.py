"""A chat or completion request's sampling fields -> the engine's :class:`SamplingParams`.

Checks what the request loop's limits decide (the context window, the batch, the vocabulary) and
answers each violation with a 400 naming the field.
"""

from __future__ import annotations

import math
import re

from hybridllm.config import SamplingParams, StructuredOutput
from hybridllm.engine.scheduler import Scheduler
from hybridllm.errors import HybridLLMError
from hybridllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_TOKEN_ID = re.compile(r"[0-9]+")  # a logit_bias key: decimal digits, nothing around them


def check_prompt_size(scheduler: Scheduler, max_token_bytes: int, n_bytes: int, param: str) -> None:
    """400 for a prompt of ``n_bytes`` UTF-8 bytes that cannot fit in the context window, found
    without tokenizing it: no token covers more than ``max_token_bytes`` bytes, so the prompt has
    at least ``n_bytes / max_token_bytes`` tokens (a cheap check before the expensive one)."""
    at_least = -(-n_bytes // max(1, max_token_bytes))
    if at_least >= scheduler.context_length:
        raise APIError(400, f"the prompt has at least {at_least} tokens ({n_bytes} bytes) but "
                       f"{scheduler.runtime.context_description}; shorten it", param=param,
                       code="context_length_exceeded")


def logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias) checked against the vocabulary."""
    out = {}
    for key, bias in (raw or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise APIError(400, f"logit_bias keys must be token ids (decimal digits only), got {key!r}",
                           param="logit_bias")
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise APIError(400, f"logit_bias token id {token_id} is outside the vocabulary "
                           f"(0..{vocab_size - 1})", param="logit_bias")
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}",
                           param="logit_bias")
        out[token_id] = float(bias)
    return out


def repetition_penalty(req: ChatCompletionRequest | CompletionRequest) -> float:
    """``repetition_penalty``, or llama.cpp's ``repeat_penalty`` (the same when both are given)."""
    value, alias = req.repetition_penalty, req.repeat_penalty
    if alias is not None and value is not None and alias != value:
        raise APIError(400, f"repeat_penalty ({alias}) is llama.cpp's name of repetition_penalty ({value}); "
                       f"give one of them", param="repeat_penalty")
    value = alias if value is None else value
    return 1.0 if value is None else float(value)


def sampling_params(scheduler: Scheduler, req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                    default_max: int | None, prompt_len: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    """The request's sampling parameters within ``scheduler``'s limits.

    Args:
        scheduler: the request loop (its context window, batch and vocabulary).
        req: the request.
        max_tokens: the tokens asked for (None: ``default_max``, else the rest of the context).
        default_max: the route's default token budget (None: the rest of the context).
        prompt_len: the prompt's tokens.
        logprobs: top log-probabilities per generated token (None: none).
        prompt_logprobs: the same for the prompt's positions.
        structured: the grammar the output follows.
    """
    if (req.n or 1) > scheduler.max_batch:
        raise APIError(400, f"n={req.n} choices do not fit in this server's batch of {scheduler.max_batch} "
                       f"sequences; lower n", param="n")
    ctx, limit = scheduler.context_length, scheduler.runtime.context_description
    if prompt_len >= ctx:
        raise APIError(400, f"the prompt has {prompt_len} tokens but {limit}; "
                       f"shorten it", param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else ctx - prompt_len
    if prompt_len + max_tokens > ctx:
        raise APIError(400, f"{prompt_len + max_tokens} tokens were requested ({prompt_len} in the prompt, "
                       f"{max_tokens} for the completion) but {limit}; lower max_tokens to at most "
                       f"{ctx - prompt_len}", param="max_tokens", code="context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            repetition_penalty=repetition_penalty(req),
            seed=req.seed,
            stop=stop,
            ignore_eos=bool(req.ignore_eos),
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            logit_bias=logit_bias(req.logit_bias, scheduler.vocab_size),
            n=req.n or 1,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            speculative=req.speculative is not False,
        )
    except HybridLLMError as exc:
        raise APIError(400, str(exc)) from None
