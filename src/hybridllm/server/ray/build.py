"""The Ray Serve application: one deployment per engine replica, and the ingress in front."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from hybridllm.errors import ConfigError
from hybridllm.server.ray.ingress import Ingress
from hybridllm.server.ray.replica import EngineReplica, ServerOptions
from hybridllm.server.routing import DEFAULT_MAX_IMBALANCE

CONTROL_CALLS = 16  # room beside a replica's requests for the ingress's probes and metric scrapes
# Ray's resource of the head node: the ingress asks for a sliver of it, so it runs where the
# cluster's control lives and a worker node's loss never takes the HTTP front with it.
HEAD_NODE_RESOURCE = "node:__internal_head__"
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Ray Serve notices a dead replica and starts its replacement
HEALTH_CHECK_TIMEOUT_S = 60.0  # a busy replica on few cores can be slow to answer


def build_app(llm_options: dict[str, Any] | None = None, *, replicas: int = 2,
              server: ServerOptions | None = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
              max_imbalance: int = DEFAULT_MAX_IMBALANCE, shutdown_grace_s: float = 30.0) -> Application:
    """The ``serve.run``-able application of ``replicas`` engines behind one ingress.

    Args:
        llm_options: ``LLM`` keyword arguments each replica builds its engine with (None: the
            default model with ``LLM``'s defaults).
        replicas: engine replicas, each its own deployment named ``engine-<id>``.
        server: each replica's server options (batch, queue, KV host budget, API key ...; None:
            ``ServerOptions()``).
        num_cpus: CPUs Ray reserves for each replica (match ``threads``).
        num_gpus: GPUs Ray reserves for each replica (1 with ``device="cuda"``).
        max_imbalance: a request leaves its prefix's replica for the least loaded one when that
            replica has this many more requests in flight.
        shutdown_grace_s: how long a stopping replica may finish its requests.

    Raises:
        ConfigError: fewer than one replica, or negative resources.
    """
    server = server if server is not None else ServerOptions()
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    if num_cpus < 0 or num_gpus < 0:
        raise ConfigError(f"replica resources must be >= 0, got {num_cpus} CPUs and {num_gpus} GPUs")
    engines = [
        serve.deployment(
            EngineReplica, name=f"engine-{replica}", num_replicas=1,
            ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
            max_ongoing_requests=server.max_batch + server.max_queue + CONTROL_CALLS,
            health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
            graceful_shutdown_timeout_s=shutdown_grace_s,
        ).bind(str(replica), dict(llm_options or {}), server)
        for replica in range(replicas)
    ]
    ingress = serve.deployment(
        Ingress, name="ingress", num_replicas=1,
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        max_ongoing_requests=replicas * (server.max_batch + server.max_queue) + CONTROL_CALLS,
        graceful_shutdown_timeout_s=shutdown_grace_s,
    )
    model = (llm_options or {}).get("model")
    return ingress.bind(engines, max_imbalance=max_imbalance, route_by_pages=True,
                        model=str(model) if model is not None else None)
