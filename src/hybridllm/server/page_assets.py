"""The page at ``/``: plain HTML, CSS and JavaScript shipped in the package (``server/page/``).

No build step and no request that leaves the server: the page loads its script and style from
the same origin, talks only to ``/v1/chat/completions``, ``/v1/models`` and ``/stats``, and every
answer carries a Content-Security-Policy that forbids anything else (the browser enforces it).
The single server (:mod:`hybridllm.server.routes.page`) and the ``serve --ray`` ingress
(:mod:`hybridllm.server.ray.ingress`) serve the same files through :func:`page_response`.
"""

from __future__ import annotations

from importlib import resources

from starlette.responses import Response

# URL path -> (file in server/page/, media type)
PAGE_FILES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/page/style.css": ("style.css", "text/css; charset=utf-8"),
}
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def page_response(path: str) -> Response:
    """The page file served at ``path`` (a key of :data:`PAGE_FILES`)."""
    name, media_type = PAGE_FILES[path]
    body = resources.files("hybridllm.server").joinpath("page", name).read_bytes()
    return Response(body, media_type=media_type,
                    headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache",
                             "X-Content-Type-Options": "nosniff"})
