"""``hybridllm bench --preset multi-turn``: what the prefix cache saves a chat, turn by turn.

A conversation with a long system prompt (``--prompt-tokens`` tokens) and ``--turns`` user turns is
played twice on the same model, in this process: with the prefix cache off (every turn prefills
the whole conversation) and on (a turn prefills only what the previous turns did not hold). A
third run measures a restart: an engine writes the first turn's pages to a disk tier and is
dropped; a fresh engine on the same directory answers the same first turn from disk.
Each turn's TTFT and cached tokens are printed and written as JSON.
"""

from __future__ import annotations

import json
import platform
import tempfile
from pathlib import Path
from typing import Any

from hybridllm.config import SamplingParams

FILLER = ("The archive holds records of ships, harbours and the goods they carried between the northern "
          "ports, with the dates of each voyage, the names of the crews and the weather they met. ")
QUESTIONS = ("Which port appears most often?", "Name one crew member.", "What goods were carried?",
             "Summarise the weather.", "Which voyage was longest?", "List two harbours.",
             "What does the archive hold?", "Give one date.")


def system_prompt(llm: Any, tokens: int) -> str:
    """A system message of about ``tokens`` tokens of this model's tokenizer."""
    unit = len(llm.tokenizer.encode(FILLER, add_special_tokens=False))
    return FILLER * max(1, tokens // max(1, unit))


def play(llm: Any, system: str, turns: int, new_tokens: int) -> list[dict[str, Any]]:
    """Run the conversation greedily; each turn's prompt tokens, cached tokens and TTFT."""
    messages = [{"role": "system", "content": system}]
    rows = []
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        result = llm.generate(messages, params)
        messages.append({"role": "assistant", "content": result.text})
        rows.append({"turn": turn + 1, "prompt_tokens": result.metrics["prompt_tokens"],
                     "cached_tokens": result.metrics["cached_tokens"], "ttft_s": result.metrics["ttft_s"]})
    return rows


def measure(llm_options: dict[str, Any], context: int, turns: int, new_tokens: int) -> dict[str, Any]:
    """The three runs (no prefix cache, prefix cache, restart from disk) as one document."""
    from hybridllm.llm import LLM

    cold_llm = LLM(**llm_options, prefix_cache_ram=0)
    system = system_prompt(cold_llm, context)
    cold = play(cold_llm, system, turns, new_tokens)
    del cold_llm
    warm = play(LLM(**llm_options, prefix_cache_ram="auto"), system, turns, new_tokens)
    with tempfile.TemporaryDirectory(prefix="hybridllm-prefix-") as disk:
        play(LLM(**llm_options, prefix_cache_ram=0, prefix_cache_disk=disk), system, 1, new_tokens)
        restarted = play(LLM(**llm_options, prefix_cache_ram="auto", prefix_cache_disk=disk), system, 1, new_tokens)
    return {"context": context, "turns": turns, "new_tokens": new_tokens, "cold": cold, "prefix_cache": warm,
            "restart": {"cold_ttft_s": cold[0]["ttft_s"], **restarted[0]},
            "machine": {"cpu": _cpu_model(), "python": platform.python_version()}}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_document(document: dict[str, Any]) -> None:
    print(f"multi-turn: system prompt ~{document['context']} tokens, {document['turns']} turns, "
          f"{document['new_tokens']} new tokens per turn")
    print(f"{'turn':>4} {'prompt':>7} {'TTFT off (s)':>13} {'cached':>7} {'TTFT on (s)':>12} {'on/off':>7}")
    for off, on in zip(document["cold"], document["prefix_cache"]):
        print(f"{off['turn']:>4} {on['prompt_tokens']:>7} {off['ttft_s']:>13.3f} {on['cached_tokens']:>7} "
              f"{on['ttft_s']:>12.3f} {on['ttft_s'] / off['ttft_s']:>7.3f}")
    first = document["prefix_cache"][0]["ttft_s"]
    later = [row["ttft_s"] / first for row in document["prefix_cache"][1:]]
    if later:
        print(f"prefix cache on: TTFT of turns 2-{document['turns']} / turn 1: max {max(later):.3f}")
    restart = document["restart"]
    print(f"restart from disk: TTFT {restart['ttft_s']:.3f} s with {restart['cached_tokens']} cached tokens vs "
          f"{restart['cold_ttft_s']:.3f} s cold ({restart['ttft_s'] / restart['cold_ttft_s']:.3f}x)")


def run_preset(llm_options: dict[str, Any], settings: dict[str, Any], turns: int, json_out: Path | None,
               command: str) -> int:
    """Measure (the first of ``settings["contexts"]`` is the system prompt's length), print, write."""
    document = measure(llm_options, settings["contexts"][0], turns, settings["new_tokens"])
    print_document(document)
    if json_out is not None:
        json_out.expanduser().parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"command": command, **document}, indent=2) + "\n")
    return 0
