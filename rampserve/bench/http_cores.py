"""The HTTP cores a front end could run on, timed bare: each serves an echo "model" that reads a v2 infer request's
body and answers a fixed v2 response, so what a client measures is the HTTP core (and the ASGI framework above
it) alone. `bench executor` times them one request at a time with its lean client beside the real server, so the
choice of core is shown against the server's own overhead.

- `uvicorn`: rampserve's front end as it runs, FastAPI on uvicorn with httptools and uvloop, the infer route a
  plain Starlette handler;
- `uvicorn-raw`: a bare ASGI callable on the same uvicorn (what routing and Starlette's request objects cost);
- `granian-asgi`: the same FastAPI app on granian (a Rust HTTP core, ASGI);
- `granian-rsgi`: a bare callable on granian's own interface, RSGI (no ASGI message passing; FastAPI cannot run
  on it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import orjson
from fastapi import FastAPI, Request, Response

ECHO_MODEL = "echo"
INFER_PATH = f"/v2/models/{ECHO_MODEL}/infer"
# What every core answers: a v2 response whose label the load generator reads
ANSWER = orjson.dumps({"model_name": ECHO_MODEL, "outputs": [{"name": "label", "datatype": "INT64", "shape": [1],
                                                              "data": [0]}]})
JSON_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def _echo(request: Request) -> Response:
    await request.body()
    return Response(ANSWER, media_type="application/json")


async def _ready() -> Response:
    return Response(b'{"ready": true}', media_type="application/json")


def fastapi_app() -> FastAPI:
    app = FastAPI()
    app.add_api_route("/v2/health/ready", _ready, methods=["GET"])
    app.add_route(INFER_PATH, _echo, methods=["POST"])
    return app


starlette_app = fastapi_app()


async def raw_asgi(scope: dict, receive: Callable, send: Callable) -> None:
    if scope["type"] != "http":  # lifespan: nothing to start
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


async def rsgi_app(scope: object, protocol: object) -> None:
    await protocol()  # the whole body
    protocol.response_bytes(200, [("content-type", "application/json")], ANSWER)


# How each core is started on a port, in this interpreter
CORES: dict[str, Callable[[int], list[str]]] = {
    "uvicorn": lambda port: [sys.executable, "-m", "uvicorn", f"{__name__}:starlette_app", "--host", "127.0.0.1",
                             "--port", str(port), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
                             "--log-level", "warning"],
    "uvicorn-raw": lambda port: [sys.executable, "-m", "uvicorn", f"{__name__}:raw_asgi", "--host", "127.0.0.1",
                                 "--port", str(port), "--loop", "uvloop", "--http", "httptools",
                                 "--no-access-log", "--log-level", "warning"],
    "granian-asgi": lambda port: [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1",
                                  "--port", str(port), "--workers", "1", "--runtime-threads", "1", "--loop",
                                  "uvloop", "--no-log", f"{__name__}:starlette_app"],
    "granian-rsgi": lambda port: [sys.executable, "-m", "granian", "--interface", "rsgi", "--host", "127.0.0.1",
                                  "--port", str(port), "--workers", "1", "--runtime-threads", "1", "--loop",
                                  "uvloop", "--no-log", f"{__name__}:rsgi_app"],
}
