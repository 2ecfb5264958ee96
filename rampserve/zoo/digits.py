"""A model of one's own to try rampserve with: a perceptron trained on scikit-learn's handwritten digits (bundled
with scikit-learn, so offline), exported to ONNX. No zoo stream holds these inputs, so it stands where a user's model
and data would: the README's quickstart prepares and serves it, and the tests of serving an unprepared model train
it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

INPUT = "pixels"  # the ONNX input's name: (batch, 64) float32, the 8x8 images' grey levels scaled to [0, 1]
WIDTH = 1024  # hidden units per layer: wide enough that the model's depth costs what a ramp can save
STEPS = 40  # full-batch Adam steps: about 0.97 of the digits right, in a few seconds on 2 cores


def digit_rows() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as rows of 64 pixels in [0, 1] (float32), and their classes."""
    from sklearn.datasets import load_digits

    images, classes = load_digits(return_X_y=True)
    return (images / 16.0).astype(np.float32), classes


def digits_onnx(out: Path, seed: int = 0) -> Path:
    """Train the perceptron on every digit and export it to ONNX at `out` (its one input named `INPUT`)."""
    import torch

    from rampserve.graph.onnx_graph import export_onnx

    rows, classes = digit_rows()
    x, y = torch.from_numpy(rows), torch.from_numpy(classes)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                              torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                              torch.nn.Linear(WIDTH, 10))
    optimiser = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(STEPS):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimiser.step()
    return export_onnx(net.eval(), (x[:2],), [INPUT], out)


def shuffled_rows(seed: int = 0) -> np.ndarray:
    """The digits' rows in a fixed random order: a stream that does not come sorted by class."""
    rows, _ = digit_rows()
    return rows[np.random.default_rng(seed).permutation(len(rows))]


def write_example(directory: Path) -> list[Path]:
    """The quickstart's files in `directory`: `my.onnx` (the model), `inputs.npy` (its inputs, for
    `prepare --data`), `request.json` (a v2 infer request of the first input, for curl)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = shuffled_rows()
    model = digits_onnx(directory / "my.onnx")
    np.save(directory / "inputs.npy", rows)
    request = directory / "request.json"
    request.write_text(json.dumps({"inputs": [{"name": INPUT, "shape": [1, rows.shape[1]], "datatype": "FP32",
                                               "data": rows[0].tolist()}]}) + "\n")
    return [model, directory / "inputs.npy", request]
