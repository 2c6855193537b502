"""Our engine as an lm-evaluation-harness model (``lm_eval``, the optional ``eval`` extra).

    from hybridllm.eval.lm_eval_model import HybridLLMEvalModel
    lm = HybridLLMEvalModel(LLM(weights="auto").runtime)
    results = lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"])

The class is registered with lm-eval as ``"hybridllm"`` when this module is imported, so
``simple_evaluate(model="hybridllm", model_args={"runtime": llm.runtime})`` works too.

Every request runs through the engine's one request loop (:meth:`LLMEngine.generate_batch`): a
whole task's requests are submitted together and the loop batches them.

* ``loglikelihood``: the prompt is context + continuation (token ids, nothing prepended), run with
  ``prompt_logprobs=1``; the continuation's log-likelihood is the sum of its tokens' entries, the
  engine's own float32 log-softmax, and it is greedy when each token is its position's top-1.
  Too long an input is cut on the left, as lm-eval's other backends do.
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows (``prefix_token_id`` first), each
  scored like a loglikelihood request.
* ``generate_until``: greedy (or sampled, with ``do_sample``) until a stop string, an
  end-of-sequence token or ``max_gen_toks``.

Text is tokenized with the model's own tokenizer without special tokens, as lm-eval's ``hf``
backend does for causal models; an empty context is lm-eval's ``prefix_token_id`` (BOS when the
model has one, else EOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval import utils as lm_eval_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from hybridllm.config import SamplingParams
from hybridllm.engine.llm_engine import GenerationResult, LLMEngine
from hybridllm.errors import ConfigError

MODEL_NAME = "hybridllm"
"""The name the model is registered under in lm-eval."""

# context tokens, continuation tokens: one scored request
TokenPair = tuple[list[int], list[int]]


@register_model(MODEL_NAME)
class HybridLLMEvalModel(TemplateLM):
    """lm-eval's model interface on a built runtime of our engine.

    Args:
        runtime: the built model (``LLM(...).runtime``, :func:`hybridllm.runtime.build.build_runtime`).
        batch_size: most requests running at once in the request loop (lm-eval's ``batch_size``;
            "auto" means 16).
        max_gen_toks: token budget of ``generate_until`` when a task gives none.
        show_progress: a progress bar per request kind.
        **lm_eval_options: what ``simple_evaluate`` adds (``device``, ``max_batch_size``): ignored,
            the runtime was built for its device.
    """

    def __init__(self, runtime: Any, batch_size: int | str = 16, max_gen_toks: int = 256,
                 show_progress: bool = True, **lm_eval_options: Any) -> None:
        super().__init__()
        batch = 16 if isinstance(batch_size, str) and batch_size.startswith("auto") else int(batch_size)
        if batch < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if int(max_gen_toks) < 1:
            raise ConfigError(f"max_gen_toks must be >= 1, got {max_gen_toks}")
        self.runtime = runtime
        self.engine = LLMEngine(runtime, max_batch=batch)
        self.tokenizer = runtime.tokenizer  # lm-eval reads its chat_template
        self.max_gen_toks = int(max_gen_toks)
        self.show_progress = show_progress

    # ---- what lm-eval asks of a TemplateLM -----------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What stands for an empty context: BOS when the model has one, else EOS (as ``hf``)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """Most prompt tokens a request may have (the context window less the one token the loop samples)."""
        return self.runtime.context_length - 1

    @property
    def tokenizer_name(self) -> str:
        return str(self.runtime.checkpoint.path)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; special tokens (BOS) only when asked."""
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's own chat template (lm-eval's ``apply_chat_template=True``)."""
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    # ---- loglikelihood ---------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        pairs = [(list(context), list(continuation)) for _, context, continuation in requests]
        scored = self.score_pairs(pairs, desc="loglikelihood", disable_tqdm=disable_tqdm)
        for (cache_key, _, _), answer in zip(requests, scored):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return scored

    def score_pairs(self, pairs: Sequence[TokenPair], desc: str = "loglikelihood",
                    disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each continuation after its context, all in one batch.

        Raises:
            ConfigError: a continuation is empty, or a context is empty (lm-eval always gives one token).
        """
        prompts, starts = [], []
        for context, continuation in pairs:
            if not continuation or not context:
                raise ConfigError("a loglikelihood request needs a context and a continuation of at least one token")
            whole = (context + continuation)[-self.max_length:]  # cut on the left, as lm-eval's backends do
            prompts.append(whole)
            starts.append(len(whole) - len(continuation))
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        results = self._run(prompts, [params] * len(prompts), desc, disable_tqdm)
        return [continuation_score(result, start) for result, start in zip(results, starts)]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents over lm-eval's disjoint rolling windows."""
        windows: list[TokenPair] = []
        owners: list[int] = []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(lm_eval_utils.make_disjoint_window, lm_eval_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((list(context), list(continuation)))
                owners.append(index)
        scored = self.score_pairs(windows, desc="loglikelihood_rolling", disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scored):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---- generation -----------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampled with ``do_sample``), cut at the first stop string."""
        prompts, params = [], []
        eos = self.tok_decode([self.eot_token_id])
        for context, gen_kwargs in (request.args[:2] for request in requests):
            options = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_new = int(options.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ConfigError(f"max_gen_toks {max_new} leaves no room for a prompt: "
                                  f"{self.runtime.context_description}")
            ids = self.tok_encode(context)[-(self.max_length - max_new):]  # room for the new tokens
            prompts.append(ids or [self.prefix_token_id])
            params.append(sampling_params(options, until, max_new))
        results = self._run(prompts, params, "generate_until", disable_tqdm)
        outputs = [result.text for result in results]
        for request, text in zip(requests, outputs):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return outputs

    # ---- the request loop --------------------------------------------------------------------------
    def _run(self, prompts: list[list[int]], params: list[SamplingParams], desc: str,
             disable_tqdm: bool) -> list[GenerationResult]:
        """Every request through the engine's loop, with a progress bar."""
        with tqdm(total=len(prompts), desc=desc, disable=disable_tqdm or not self.show_progress) as bar:

            def advance(_index: int, _result: GenerationResult) -> None:
                bar.update(1)

            return self.engine.generate_batch(prompts, params, on_result=advance)


def continuation_score(result: GenerationResult, start: int) -> tuple[float, bool]:
    """(sum of log-probabilities, all top-1) of the prompt tokens from ``start`` on."""
    entries = result.prompt_logprobs[start:]
    logprob = sum(entry.logprob for entry in entries)
    greedy = all(entry.top and entry.top[0][0] == entry.token_id for entry in entries)
    return logprob, greedy


def sampling_params(options: dict[str, Any], until: list[str], max_new: int) -> SamplingParams:
    """Our sampling parameters of lm-eval's normalized generation kwargs (greedy unless ``do_sample``)."""
    if not options.get("do_sample"):
        return SamplingParams(max_tokens=max_new, temperature=0.0, stop=until)
    return SamplingParams(max_tokens=max_new, temperature=float(options.get("temperature", 1.0)),
                          top_p=float(options.get("top_p", 1.0)), top_k=int(options.get("top_k", 0)),
                          seed=options.get("seed"), stop=until)
