"""``bench --preset spec``'s serving comparison: ``hybridllm serve`` without and with
``--spec ngram`` under the same burst of concurrent chat requests.

    rows = compare_serving(["--model", M, "--weights", "auto"], threads=2, rounds=3, concurrency=16, max_tokens=128)

Each round starts a fresh server without speculation, then one with it (alternating, so a machine
whose speed drifts favours neither), and sends ``concurrency`` free-form chat requests at once
(``serve_load.PROMPTS``: questions whose answers copy little, the case where speculation could
only cost), greedy and stopping at the end of sequence, so both servers generate the same tokens.
A row per burst: aggregate generated tokens/s, the proposed and accepted tokens, failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from hybridllm.bench.serve_load import ServerStartError, run_load, start_server, stop_server, warm_up

SERVERS = (("none", ()), ("ngram", ("--spec", "ngram")))  # the speculation label, its serve flags


def compare_serving(serve_args: Sequence[str], threads: int | None, rounds: int, concurrency: int,
                    max_tokens: int, time_limit: float = 1800.0) -> list[dict[str, Any]]:
    """``rounds`` bursts per server, alternating: one row per burst (``speculation``, ``round``
    and ``serve_load.run_load``'s figures; a server that did not start: a row with its ``error``).

    Args:
        serve_args: the ``hybridllm serve`` flags both servers share (model, weights ...).
        threads: both servers' ``--threads``.
        concurrency: requests in the burst, all in flight at once (the servers' ``--max-batch``).
        max_tokens: each request's ``max_tokens``.
    """
    rows = []
    for round_number in range(1, rounds + 1):
        for speculation, flags in SERVERS:
            try:
                proc, url = start_server([*serve_args, *flags], threads, max_batch=concurrency)
            except ServerStartError as exc:
                rows.append({"speculation": speculation, "round": round_number, "error": str(exc)})
                continue
            try:
                model = warm_up(url)
                result = asyncio.run(run_load(url, model, concurrency, concurrency, max_tokens, time_limit,
                                              ignore_eos=False))
            finally:
                stop_server(proc)
            rows.append({"speculation": speculation, "round": round_number, **result})
    return rows
