"""The model every peer of `bench peers` serves, run as rampserve's vanilla runs it: the bundle's own ONNX file on
ONNX Runtime at the thread settings of the bundle's engine, or (a bundle served on torch) the original model traced
to TorchScript with one intra-op thread; the v2 JSON that the peers without a v2 front end of their own read and
answer; and the command line every peer's server is started with.

Each peer imports this module in its own venv (the benchmark puts the repository on its PYTHONPATH), so it imports
nothing but numpy and the engine it runs: nothing else of rampserve, whose pins those venvs do not share.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

ONNX_SUFFIX = ".onnx"
# The datatypes the benchmark's requests carry: images as FP32 (the CNNs) or UINT8 (lite0-fmnist's grey images), token
# ids and masks as INT64
V2_NUMPY = {"FP32": np.float32, "UINT8": np.uint8, "INT64": np.int64}

Labels = Callable[[Mapping[str, np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class PeerModel:
    path: str  # a .onnx file (ONNX Runtime) or a TorchScript trace (torch)
    input_names: tuple[str, ...]  # the model's inputs, in the order a TorchScript trace takes them
    intra_op_threads: int  # ONNX Runtime: the bundle's engine's (0: its default, one per core); TorchScript: 1
    spin_us: int  # how long ONNX Runtime's idle pool threads spin after a run, as rampserve bounds them

    @property
    def engine(self) -> str:
        return "onnxruntime" if self.path.endswith(ONNX_SUFFIX) else "torchscript"

    def to_json(self) -> str:
        """What a peer's command line or settings file carries to its server."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerModel:
        fields = json.loads(text)
        return cls(str(fields["path"]), tuple(fields["input_names"]), int(fields["intra_op_threads"]),
                   int(fields["spin_us"]))


def _onnxruntime(model: PeerModel) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = model.intra_op_threads
    options.add_session_config_entry("session.intra_op.spin_duration_us", str(model.spin_us))
    session = ort.InferenceSession(model.path, options, providers=["CPUExecutionProvider"])
    first_output = session.get_outputs()[0].name
    return lambda feeds: session.run([first_output], {name: feeds[name] for name in model.input_names})[0]


def _torchscript(model: PeerModel) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    import torch

    torch.set_num_threads(1)
    module = torch.jit.load(model.path).eval()

    def run(feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        with torch.inference_mode():
            return module(*(torch.from_numpy(feeds[name]) for name in model.input_names)).numpy()

    return run


def label_function(model: PeerModel) -> Labels:
    """Each input's label (the argmax of the model's logits, int64) from a batch of inputs by name."""
    logits = _onnxruntime(model) if model.engine == "onnxruntime" else _torchscript(model)
    return lambda feeds: logits(feeds).argmax(axis=1).astype(np.int64)


def labels_per_request(labels: Labels, requests: Sequence[Mapping[str, np.ndarray]]) -> list[np.ndarray]:
    """One run over every request's inputs (joined along the batch axis); each request gets its own labels."""
    names = requests[0].keys()
    joined = {name: np.concatenate([request[name] for request in requests]) for name in names}
    sizes = [len(next(iter(request.values()))) for request in requests]
    return np.split(labels(joined), np.cumsum(sizes)[:-1])


def v2_json_feeds(body: Mapping) -> dict[str, np.ndarray]:
    """Every input of a v2 JSON infer request, by name, as an array of its shape and datatype."""
    return {tensor["name"]: np.asarray(tensor["data"], dtype=V2_NUMPY[tensor["datatype"]]).reshape(tensor["shape"])
            for tensor in body["inputs"]}


def v2_json_labels(model_name: str, labels: np.ndarray) -> dict:
    """A v2 JSON infer response with one output, `label`."""
    return {"model_name": model_name,
            "outputs": [{"name": "label", "datatype": "INT64", "shape": [len(labels)], "data": labels.tolist()}]}


def server_arguments(prog: str, ports: Sequence[str], batching: bool = True) -> argparse.ArgumentParser:
    """A peer server's command line: the `PeerModel`'s JSON (parsed), `--name` (the model's, in its URLs), a
    `--PORT` for each of `ports` and, where the peer batches, `--max-batch` and `--wait-ms`."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("model", type=PeerModel.from_json, help="the PeerModel's JSON")
    parser.add_argument("--name", required=True)
    for port in ports:
        parser.add_argument(f"--{port}", type=int, required=True)
    if batching:
        parser.add_argument("--max-batch", type=int, required=True)
        parser.add_argument("--wait-ms", type=float, required=True)
    return parser
