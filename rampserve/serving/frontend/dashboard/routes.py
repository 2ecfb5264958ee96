"""The dashboard's HTTP routes: the page, its scripts and the vendored chart library (read from the package once,
served from memory), and the sampler's data as JSON.

Read-only and open like /status and /metrics, whatever the server is bound to: they show what /status shows
(models' counts, latencies, configurations, the controller's decisions, applications' statistics), never a
request's inputs or outputs, and change nothing. The page's Content-Security-Policy lets it load and fetch from
this server alone, so a browser showing it sends no request anywhere else."""

from __future__ import annotations

import mimetypes
from importlib import resources
from importlib.resources.abc import Traversable

import orjson
from fastapi import Request, Response

from rampserve.serving.frontend.dashboard.sampler import DashboardSampler
from rampserve.serving.shared.protocol import ProtocolError

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
SERVED_SUFFIXES = (".html", ".js", ".css")  # the static folder's licence and notes stay in the package


def static_files() -> dict[str, tuple[bytes, str]]:
    """Every page, script and stylesheet under static/, by its path there, with its content type."""
    files: dict[str, tuple[bytes, str]] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(SERVED_SUFFIXES):
                kind = mimetypes.guess_type(entry.name)[0] or "application/octet-stream"
                files[prefix + entry.name] = (entry.read_bytes(), f"{kind}; charset=utf-8")

    walk(resources.files(__package__) / "static", "")
    return files


def since_parameter(request: Request) -> int:
    raw = request.query_params.get("since", "0")
    if not raw.isdigit():
        raise ProtocolError(f"query parameter 'since' must be a sample number (a non-negative integer), got {raw!r}")
    return int(raw)


class DashboardEndpoints:
    """The routes over the sampler; with none (`rampserve serve --no-dashboard`) each answers 404 saying so."""

    def __init__(self, sampler: DashboardSampler | None) -> None:
        self.sampler = sampler
        self.files = static_files()

    def _check_on(self) -> None:
        if self.sampler is None:
            raise ProtocolError("the dashboard is off: this server was started with --no-dashboard", 404)

    def _static(self, path: str) -> Response:
        self._check_on()
        found = self.files.get(path)
        if found is None:
            raise ProtocolError(f"no dashboard file {path!r}", 404)
        content, kind = found
        return Response(content, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"}, media_type=kind)

    async def page(self) -> Response:
        return self._static("index.html")

    async def asset(self, path: str) -> Response:
        return self._static(path)

    async def data(self, request: Request) -> Response:
        self._check_on()
        body = orjson.dumps(self.sampler.data(since_parameter(request)), option=orjson.OPT_SERIALIZE_NUMPY)
        return Response(body, headers={**SECURITY_HEADERS, "Cache-Control": "no-store"},
                        media_type="application/json")
