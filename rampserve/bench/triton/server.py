"""Triton Inference Server as a peer of `rampserve bench peers`, through PyTriton: the bundle's original model traced
to TorchScript (as rampserve, MLServer and Ray Serve run it) behind Triton's dynamic batcher at the benchmark's max
batch and wait, answering each input's label at `/v2/models/{m}/infer` (binary tensors or JSON).

Run by the benchmark with the Python of its own venv (`.venv-triton`, Debian's python3.11: Triton's Python-backend
stub links that interpreter's libpython), so it imports nothing from rampserve:

    python server.py MODEL.pt --name M --inputs JSON --http-port P --grpc-port G --metrics-port X --max-batch B
        --wait-ms W

`--inputs` is a JSON list of [name, numpy dtype, per-input shape] (-1 for a dimension that varies). Every port binds
to 127.0.0.1. The server stops cleanly (tritonserver, its Python backend and their shared memory too) on SIGINT; a
SIGTERM is turned into one, since PyTriton left alone with a SIGTERM leaves tritonserver running.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

LOOPBACK = "127.0.0.1"


def labels_function(model_path: str, input_names: list[str]) -> Callable[..., dict[str, np.ndarray]]:
    """The inference callable: the TorchScript model on the batch Triton formed, with one intra-op thread (as
    rampserve's executor and the other peers), its argmax as an (n, 1) int64 label column."""
    torch.set_num_threads(1)
    module = torch.jit.load(model_path).eval()

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            logits = module(*(torch.from_numpy(inputs[name]) for name in input_names))
        return {"label": logits.argmax(dim=1, keepdim=True).numpy().astype(np.int64)}

    return infer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python server.py")
    parser.add_argument("model_path")
    parser.add_argument("--name", required=True)
    parser.add_argument("--inputs", required=True, help="JSON list of [name, numpy dtype, shape]")
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, required=True)
    parser.add_argument("--wait-ms", type=float, required=True)
    args = parser.parse_args(argv)

    inputs = [(name, np.dtype(dtype), tuple(shape)) for name, dtype, shape in json.loads(args.inputs)]
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    config = TritonConfig(http_address=LOOPBACK, http_port=args.http_port, grpc_address=LOOPBACK,
                          grpc_port=args.grpc_port, metrics_address=LOOPBACK, metrics_port=args.metrics_port,
                          allow_gpu_metrics=False, exit_on_error=True)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=args.name,
            infer_func=labels_function(args.model_path, [name for name, _, _ in inputs]),
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
