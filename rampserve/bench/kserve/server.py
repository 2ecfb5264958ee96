"""KServe's Python model server as a peer of `rampserve bench peers`: a `kserve.Model` whose `predict` runs the
model as every peer runs it (`peers_engine`: the bundle's ONNX file on ONNX Runtime, or its TorchScript trace),
served by `kserve.ModelServer` over v2 REST (JSON or the binary-data extension) at `/v2/models/{m}/infer` and v2
gRPC. KServe batches in a sidecar of its Kubernetes deployment, outside this server, so every request runs alone.

Run by the benchmark with the Python of its own venv (`.venv-kserve`), which imports `peers_engine` alone from
rampserve:

    python server.py PEER_MODEL_JSON --name M --http-port P --grpc-port G

KServe's server binds every interface (it has no setting for the address); it stops on SIGTERM. Its per-request log
lines (access, timing and latency) are off, as rampserve and the other peers write none.
"""

from __future__ import annotations

import logging
import sys

import kserve
from kserve import InferOutput, InferRequest, InferResponse
from kserve.utils.utils import generate_uuid

from rampserve.bench.peers_engine import PeerModel, label_function, server_arguments

# Loggers that write a line for every request: uvicorn's access log, and KServe's own, which logs every gRPC call
# (and, in its `trace` child, every REST request's timings)
PER_REQUEST_LOGGERS = ("uvicorn.access", "kserve")


class Labels(kserve.Model):
    def __init__(self, name: str, model: PeerModel) -> None:
        super().__init__(name)
        self.model = model

    def load(self) -> bool:
        self.labels = label_function(self.model)
        self.ready = True
        return self.ready

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> InferResponse:
        labels = self.labels({tensor.name: tensor.as_numpy() for tensor in payload.inputs})
        output = InferOutput(name="label", shape=[len(labels)], datatype="INT64")
        output.set_data_from_numpy(labels, binary_data=False)
        # a v2 response carries an id, and the benchmark's requests come without one
        return InferResponse(response_id=payload.id or generate_uuid(), model_name=self.name, infer_outputs=[output])


def main(argv: list[str]) -> int:
    args = server_arguments("python server.py", ["http-port", "grpc-port"], batching=False).parse_args(argv)
    model = Labels(args.name, args.model)
    model.load()
    server = kserve.ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, enable_latency_logging=False)
    for name in PER_REQUEST_LOGGERS:  # after ModelServer, which configures logging
        logging.getLogger(name).setLevel(logging.WARNING)
    server.start([model])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
