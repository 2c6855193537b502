"""Task accuracy of several configurations (weights x KV format) and their deltas: ``eval lm-eval``.

A configuration is a weights mode and a KV format. ``--kv-cache`` and ``--weights`` take comma
lists; every pair of the two lists is one configuration, evaluated on the same tasks. In the KV
list, ``int8`` and ``int4`` are shorthands for the ``quantized`` strategy with 8- or 4-bit codes
(``quantized`` alone takes ``--kv-bits``).

The reference (the lossless configuration) is the dynamic KV cache (full-precision keys and
values) with the least lossy weights of the list, in the order float, the file's own weights
(``auto``, or no ``--weights``), int8, int4. It is run too when the lists do not contain it,
and each row's delta is its value minus the reference's value for the same task and metric.

    configs = configurations(parse_weights_list("float,auto"), parse_kv_list("dynamic,int4", kv_bits=8))
    rows = metric_rows(results, configs[0]) + ...
    print("\\n".join(format_table(with_deltas(rows))))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hybridllm.config import KV_STRATEGIES
from hybridllm.errors import ConfigError
from hybridllm.models.quantized import WEIGHT_MODES

LOSSLESS_KV = "dynamic"
WEIGHTS_BY_LOSS = ("float", "auto", None, "int8", "int4")  # least lossy first; None: the default (auto)
KV_SHORTHANDS = {"int8": 8, "int4": 4}  # --kv-cache int8 = quantized with kv_bits 8
INSTALL_HINT = "lm-eval is not installed; install it with: pip install 'hybridllm[eval]'"


@dataclass(frozen=True)
class EvalConfiguration:
    """One evaluated configuration.

    Attributes:
        weights: ``--weights`` mode, or None for the default (the placement file's, else auto).
        kv_cache: the KV strategy.
        kv_bits: the quantized strategy's bits (None: the ``--kv-bits`` flag's).
    """

    weights: str | None
    kv_cache: str
    kv_bits: int | None = None

    @property
    def kv_label(self) -> str:
        """``int8`` / ``int4`` for the quantized strategy, else the strategy's name."""
        return f"int{self.kv_bits}" if self.kv_cache == "quantized" and self.kv_bits else self.kv_cache

    @property
    def weights_label(self) -> str:
        return self.weights or "auto"

    @property
    def lossless(self) -> bool:
        return self.kv_cache == LOSSLESS_KV


def parse_kv_list(text: str) -> list[tuple[str, int | None]]:
    """``dynamic,int8,int4`` -> [(strategy, bits)]: int8/int4 mean the quantized strategy's bits.

    Raises:
        ConfigError: an unknown name, or an empty list.
    """
    out = []
    for name in _names(text, "--kv-cache"):
        if name in KV_SHORTHANDS:
            out.append(("quantized", KV_SHORTHANDS[name]))
        elif name in KV_STRATEGIES:
            out.append((name, None))
        else:
            raise ConfigError(f"unknown KV cache {name!r}; choose from {', '.join((*KV_STRATEGIES, *KV_SHORTHANDS))}")
    return out


def parse_weights_list(text: str | None) -> list[str | None]:
    """``float,auto,int4`` -> the weights modes (None: no ``--weights``, the default).

    Raises:
        ConfigError: an unknown mode, or an empty list.
    """
    if text is None:
        return [None]
    names = _names(text, "--weights")
    bad = [name for name in names if name not in WEIGHT_MODES]
    if bad:
        raise ConfigError(f"unknown weights mode {bad[0]!r}; choose from {', '.join(WEIGHT_MODES)}")
    return list(names)


def _names(text: str, flag: str) -> list[str]:
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError(f"{flag} needs at least one value")
    return list(dict.fromkeys(names))  # repeated names run once


def configurations(weights: Sequence[str | None], kv: Sequence[tuple[str, int | None]]) -> list[EvalConfiguration]:
    """Every (weights, KV) pair, the reference first (added when the lists lack it)."""
    configs = [EvalConfiguration(w, name, bits) for w, (name, bits) in itertools.product(weights, kv)]
    reference = reference_of(configs)
    return [reference, *(c for c in configs if c != reference)]


def reference_of(configs: Sequence[EvalConfiguration]) -> EvalConfiguration:
    """The lossless configuration: dynamic KV with the least lossy weights among ``configs``."""
    weights = min((c.weights for c in configs), key=WEIGHTS_BY_LOSS.index)
    return EvalConfiguration(weights, LOSSLESS_KV)


@dataclass
class MetricRow:
    """One task metric of one configuration (``delta``: value minus the reference's, when known)."""

    task: str
    metric: str
    weights: str
    kv_cache: str
    value: float
    stderr: float | None = None
    delta: float | None = None
    reference: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def metric_rows(results: dict[str, Any], config: EvalConfiguration, reference: bool = False) -> list[MetricRow]:
    """The metrics of lm-eval's ``simple_evaluate(...)["results"]`` as rows of ``config``.

    lm-eval names a metric ``"acc,none"`` (metric, filter) and its standard error
    ``"acc_stderr,none"``; the filter is kept in the name when it is not ``none``.
    """
    rows = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            name = metric if filter_name == "none" else f"{metric},{filter_name}"
            rows.append(MetricRow(task, name, config.weights_label, config.kv_label, float(value),
                                  float(stderr) if isinstance(stderr, (int, float)) else None, reference=reference))
    return rows


def with_deltas(rows: Sequence[MetricRow]) -> list[MetricRow]:
    """The rows with ``delta`` against the reference row of the same task and metric."""
    reference = {(r.task, r.metric): r.value for r in rows if r.reference}
    return [replace(r, delta=r.value - reference[(r.task, r.metric)]) if (r.task, r.metric) in reference else r
            for r in rows]


def format_table(rows: Sequence[MetricRow]) -> list[str]:
    """The rows as aligned text lines: task, metric, weights, KV, value +- stderr, delta."""
    header = ("task", "metric", "weights", "kv", "value", "stderr", "delta")
    cells = [header]
    for r in rows:
        stderr = "" if r.stderr is None or math.isnan(r.stderr) else f"{r.stderr:.4f}"
        delta = "reference" if r.reference else ("" if r.delta is None else f"{r.delta:+.4f}")
        cells.append((r.task, r.metric, r.weights, r.kv_cache, f"{r.value:.4f}", stderr, delta))
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]


def evaluate_tasks(model: Any, tasks: Sequence[str], include_path: Path | None = None, limit: float | None = None,
                   num_fewshot: int | None = None) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on an lm-eval model; its whole result dict.

    Raises:
        ConfigError: lm-eval is not installed, or a task is unknown.
    """
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f" (looked in lm-eval's tasks and {include_path})" if include_path is not None else ""
        raise ConfigError(f"unknown lm-eval task {unknown[0]!r}{where}")
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=False)
