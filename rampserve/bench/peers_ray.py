"""Ray Serve as a peer of `rampserve bench peers`: the bundle's original model (no ramps, traced to TorchScript as
rampserve and MLServer run it) behind `@serve.batch`, at
`/v2/models/{m}/infer` with v2 JSON requests and responses, so the benchmark's client drives it unchanged.

`python -m rampserve.bench.peers_ray BUNDLE --name M --port P --max-batch B --wait-ms W` starts a local Ray of its own
(2 CPUs), one replica with one CPU and one intra-op thread (as rampserve's executor), prints `ready`, and shuts Ray
down on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

# Requests the replica accepts at once: Ray's default (5) would queue the rest in its proxy, out of the batcher's
# sight; rampserve's own queue takes whatever arrives, so this one must too.
MAX_ONGOING_REQUESTS = 4096


def v2_input(body: dict) -> np.ndarray:
    """The first input of a v2 JSON infer request as a float32 array of its shape."""
    tensor = body["inputs"][0]
    return np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])


def v2_labels(model_name: str, labels: np.ndarray) -> dict:
    return {"model_name": model_name,
            "outputs": [{"name": "label", "datatype": "INT64", "shape": [len(labels)], "data": labels.tolist()}]}


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=MAX_ONGOING_REQUESTS)
class V2Classifier:
    def __init__(self, bundle: str, model_name: str, max_batch: int, wait_s: float) -> None:
        import torch

        from rampserve.serving.models import load_served

        torch.set_num_threads(1)
        served = load_served(bundle)
        self.model = served.model
        # the same TorchScript as rampserve's executor and MLServer's runtime run: every system, the same kernels
        self.compiled = self.model.compile((), dict(served.example))
        self.model_name = model_name
        self.input_name = self.model.backend.input_names[0]
        self.path = f"/v2/models/{model_name}/infer"
        self.infer.set_max_batch_size(max_batch)
        self.infer.set_batch_wait_timeout_s(wait_s)

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.0)  # both set per deployment in __init__
    async def infer(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """One run of the original model (no active ramp) over every request's inputs; each gets its own labels."""
        logits = self.model.run({self.input_name: np.concatenate(inputs)}, compiled=self.compiled)
        labels = logits.argmax(axis=1).astype(np.int64)
        return np.split(labels, np.cumsum([len(x) for x in inputs])[:-1])

    async def infer_json(self, body: dict) -> dict:
        return v2_labels(self.model_name, await self.infer(v2_input(body)))

    async def __call__(self, request: Request) -> JSONResponse:
        if request.url.path == "/v2/health/ready":
            return JSONResponse({})
        if request.method != "POST" or request.url.path != self.path:
            return JSONResponse({"error": f"only POST {self.path} is served"}, status_code=404)
        try:
            body = await request.json()
            features = v2_input(body)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)
        return JSONResponse(v2_labels(self.model_name, await self.infer(features)))


def main(argv: list[str]) -> int:
    import ray

    parser = argparse.ArgumentParser(prog="python -m rampserve.bench.peers_ray")
    parser.add_argument("bundle")
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, required=True)
    parser.add_argument("--wait-ms", type=float, required=True)
    args = parser.parse_args(argv)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(V2Classifier.bind(args.bundle, args.name, args.max_batch, args.wait_ms / 1000.0), name=args.name,
                  route_prefix="/")
        print("ready", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
