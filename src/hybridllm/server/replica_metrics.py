"""Several replicas' ``/metrics`` as one Prometheus exposition, each series labelled with its replica.

Each replica's server renders its own registry (:mod:`hybridllm.server.metrics`); the ingress in
front of them (:mod:`hybridllm.server.ray`) serves their union. The text format allows each
metric family once, so the replicas' families are parsed (prometheus_client's parser), their
samples gathered per family with a ``replica="<id>"`` label added, and the result rendered again.

    merge_replica_metrics({"0": text_of_replica_0, "1": text_of_replica_1})  # -> bytes
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"


def relabel(text: str, replica: str) -> list[Metric]:
    """The families of one exposition, with ``replica`` added to every sample's labels (first)."""
    families = []
    for family in text_string_to_metric_families(text):
        out = Metric(family.name, family.documentation, family.type, family.unit)
        out.samples.extend(sample._replace(labels={REPLICA_LABEL: replica, **sample.labels})
                           for sample in family.samples)
        families.append(out)
    return families


def merge_families(texts: Mapping[str, str]) -> list[Metric]:
    """Each family once (in first-seen order, its first replica's help), holding every replica's samples."""
    merged: dict[tuple[str, str], Metric] = {}
    for replica, text in texts.items():
        for family in relabel(text, replica):
            key = (family.name, family.type)
            if key not in merged:
                merged[key] = Metric(family.name, family.documentation, family.type, family.unit)
            merged[key].samples.extend(family.samples)
    return list(merged.values())


class _Families(Collector):
    """A fixed list of families as a collector (what ``generate_latest`` renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_replica_metrics(texts: Mapping[str, str]) -> bytes:
    """The expositions of ``texts`` (replica id -> its ``/metrics`` text) as one exposition.

    Args:
        texts: each replica's exposition, by replica id.

    Returns:
        Prometheus text: every family once, every sample with a ``replica`` label.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merge_families(texts)))
    return generate_latest(registry)
