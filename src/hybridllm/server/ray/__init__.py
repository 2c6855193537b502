"""``hybridllm serve --ray``: engine replicas on a Ray Serve cluster behind one OpenAI-compatible API.

Needs the ``ray`` extra (``pip install 'hybridllm[ray]'``). Each replica is its own Ray Serve
deployment (one engine: ``LLM``, request loop, the app of ``hybridllm serve``; Ray places it and
replaces it when its process dies); the ingress deployment routes each request to the replica most
likely to hold its prompt's KV prefix and serves every replica's ``/metrics`` with a ``replica``
label. The application is ``serve.run``-able::

    from ray import serve
    from hybridllm.server.ray import ServerOptions, build_app

    app = build_app({"threads": 1, "weights": "float"}, replicas=2, server=ServerOptions(max_batch=8))
    serve.run(app, name="hybridllm", route_prefix="/")   # http://127.0.0.1:8000/v1/...

Modules: :mod:`.replica` (:class:`EngineReplica`, :class:`ServerOptions`), :mod:`.ingress`
(:class:`Ingress`), :mod:`.build` (:func:`build_app`), :mod:`.driver` (:func:`ray_serve`: the
CLI's cluster start and shutdown).
"""

from hybridllm.server.ray.build import build_app
from hybridllm.server.ray.driver import RayServeError, ray_serve
from hybridllm.server.ray.replica import EngineReplica, ServerOptions

__all__ = ["EngineReplica", "RayServeError", "ServerOptions", "build_app", "ray_serve"]
