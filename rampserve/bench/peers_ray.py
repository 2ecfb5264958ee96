"""Ray Serve as a peer of `rampserve bench peers`: the model as every peer runs it (`peers_engine`: the bundle's ONNX
file on ONNX Runtime, or its TorchScript trace) behind `@serve.batch`, at `/v2/models/{m}/infer` with v2 JSON requests
and responses, so the benchmark's client drives it unchanged.

`python -m rampserve.bench.peers_ray PEER_MODEL_JSON --name M --port P --max-batch B --wait-ms W` starts a local Ray of
its own (2 CPUs), one replica with one CPU, prints `ready`, and shuts Ray down on SIGTERM/SIGINT.
"""

from __future__ import annotations

import signal
import sys
import threading

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from rampserve.bench.peers_engine import (
    PeerModel,
    label_function,
    labels_per_request,
    server_arguments,
    v2_json_feeds,
    v2_json_labels,
)

# Requests the replica accepts at once: Ray's default (5) would queue the rest in its proxy, out of the batcher's
# sight; rampserve's own queue takes whatever arrives, so this one must too.
MAX_ONGOING_REQUESTS = 4096


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=MAX_ONGOING_REQUESTS)
class V2Classifier:
    def __init__(self, model: PeerModel, model_name: str, max_batch: int, wait_s: float) -> None:
        self.labels = label_function(model)
        self.model_name = model_name
        self.path = f"/v2/models/{model_name}/infer"
        self.infer.set_max_batch_size(max_batch)
        self.infer.set_batch_wait_timeout_s(wait_s)

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.0)  # both set per deployment in __init__
    async def infer(self, requests: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
        return labels_per_request(self.labels, requests)

    async def __call__(self, request: Request) -> JSONResponse:
        if request.url.path == "/v2/health/ready":
            return JSONResponse({})
        if request.method != "POST" or request.url.path != self.path:
            return JSONResponse({"error": f"only POST {self.path} is served"}, status_code=404)
        try:
            feeds = v2_json_feeds(await request.json())
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)
        return JSONResponse(v2_json_labels(self.model_name, await self.infer(feeds)))


def main(argv: list[str]) -> int:
    import ray

    args = server_arguments("python -m rampserve.bench.peers_ray", ["port"]).parse_args(argv)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(V2Classifier.bind(args.model, args.name, args.max_batch, args.wait_ms / 1000.0), name=args.name,
                  route_prefix="/")
        print("ready", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
