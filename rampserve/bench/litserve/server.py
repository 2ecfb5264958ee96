"""LitServe as a peer of `rampserve bench peers`: a `LitAPI` whose `predict` runs the model as every peer runs it
(`peers_engine`: the bundle's ONNX file on ONNX Runtime, or its TorchScript trace) behind LitServe's batching at the
benchmark's max batch and wait. LitServe has no v2 protocol: a LitAPI reads whatever JSON its `decode_request` is
written for, and this one reads the v2 JSON body the other JSON peers get (posted to LitServe's own route,
`/predict`) and answers each request's labels in a v2 JSON response, so the benchmark's client drives it unchanged.

Run by the benchmark with the Python of its own venv (`.venv-litserve`), which imports `peers_engine` alone from
rampserve:

    python server.py PEER_MODEL_JSON --name M --port P --max-batch B --wait-ms W

It listens on 127.0.0.1 with one inference worker on the CPU and one API server process, and stops on SIGINT.
"""

from __future__ import annotations

import sys

import litserve as ls
import numpy as np

from rampserve.bench.peers_engine import (
    PeerModel, label_function, labels_per_request, server_arguments, v2_json_feeds, v2_json_labels,
)


class Labels(ls.LitAPI):
    def __init__(self, model: PeerModel, model_name: str, max_batch: int, wait_s: float) -> None:
        super().__init__(max_batch_size=max_batch, batch_timeout=wait_s)
        self.model, self.model_name = model, model_name

    def setup(self, device: str) -> None:
        self.labels = label_function(self.model)

    def decode_request(self, request: dict) -> dict[str, np.ndarray]:
        return v2_json_feeds(request)

    def predict(self, x: dict[str, np.ndarray] | list[dict[str, np.ndarray]]) -> np.ndarray | list[np.ndarray]:
        # With batching on, LitServe hands over the decoded requests as a list and splits the answer by request
        return labels_per_request(self.labels, x) if isinstance(x, list) else self.labels(x)

    def encode_response(self, output: np.ndarray) -> dict:
        return v2_json_labels(self.model_name, output)


def main(argv: list[str]) -> int:
    args = server_arguments("python server.py", ["port"]).parse_args(argv)
    api = Labels(args.model, args.name, args.max_batch, args.wait_ms / 1000.0)
    # fast_queue: ZeroMQ between the API server and the worker, LitServe's setting for over 100 requests a second
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, fast_queue=True)
    # log_level warning: no access line per request, as rampserve and the other peers write none
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, log_level="warning", generate_client_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
