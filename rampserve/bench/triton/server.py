"""Triton Inference Server as a peer of `rampserve bench peers`, through PyTriton: the model as every peer runs it
(`peers_engine`: the bundle's ONNX file on ONNX Runtime, or its TorchScript trace) behind Triton's dynamic batcher at
the benchmark's max batch and wait, answering each input's label at `/v2/models/{m}/infer` (binary tensors or JSON).

Run by the benchmark with the Python of its own venv (`.venv-triton`, Debian's python3.11: Triton's Python-backend
stub links that interpreter's libpython), which imports `peers_engine` alone from rampserve:

    python server.py PEER_MODEL_JSON --name M --inputs JSON --http-port P --grpc-port G --metrics-port X
        --max-batch B --wait-ms W

`PEER_MODEL_JSON` is a `PeerModel`'s JSON; `--inputs` is a JSON list of [name, numpy dtype, per-input shape] (-1 for a dimension that varies). Every port binds
to 127.0.0.1. The server stops cleanly (tritonserver, its Python backend and their shared memory too) on SIGINT; a
SIGTERM is turned into one, since PyTriton left alone with a SIGTERM leaves tritonserver running.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

from rampserve.bench.peers_engine import PeerModel, label_function, server_arguments

LOOPBACK = "127.0.0.1"


def labels_function(model: PeerModel) -> Callable[..., dict[str, np.ndarray]]:
    """The inference callable: the model on the batch Triton formed, its labels as an (n, 1) int64 column."""
    labels = label_function(model)

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return {"label": labels(inputs)[:, None]}

    return infer


def main(argv: list[str]) -> int:
    parser = server_arguments("python server.py", ["http-port", "grpc-port", "metrics-port"])
    parser.add_argument("--inputs", required=True, help="JSON list of [name, numpy dtype, shape]")
    args = parser.parse_args(argv)

    inputs = [(name, np.dtype(dtype), tuple(shape)) for name, dtype, shape in json.loads(args.inputs)]
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    config = TritonConfig(http_address=LOOPBACK, http_port=args.http_port, grpc_address=LOOPBACK,
                          grpc_port=args.grpc_port, metrics_address=LOOPBACK, metrics_port=args.metrics_port,
                          allow_gpu_metrics=False, exit_on_error=True)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=args.name,
            infer_func=labels_function(args.model),
            inputs=[Tensor(name=name, dtype=dtype, shape=shape) for name, dtype, shape in inputs],
            outputs=[Tensor(name="label", dtype=np.int64, shape=(1,))],
            config=ModelConfig(max_batch_size=args.max_batch, batcher=DynamicBatcher(
                max_queue_delay_microseconds=round(args.wait_ms * 1000.0))),
            strict=True,
        )
        triton.serve()  # until SIGINT (a KeyboardInterrupt it handles by stopping everything it started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
