"""A server whose bundles run in executor processes never loads torch or ONNX Runtime in its own process: it serves
each bundle from its manifest and signature, and only the executor loads the model."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
from test_executor import get_json, infer_body, post

from rampserve.bench.startup import mapped_libraries
from rampserve.serving.executor.loading import load_served

MODEL = "resnet18-small"


def test_building_a_server_for_a_bundle_imports_no_torch(resnet_bundle) -> None:
    """In a fresh interpreter: the server's state for a bundle served by an executor process, then the model itself
    (which does import torch, so the check is not blind to it)."""
    script = f"""
import json, sys
from rampserve.serving.shared.settings import ModelSettings
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.server import ServerSettings, build_state

served = load_served({str(resnet_bundle)!r})
state = build_state([served], ModelSettings(), ServerSettings(port=0, grpc=False))
front_end = [name for name in ("torch", "onnxruntime") if name in sys.modules]
loaded(served).prepared.site_names
print(json.dumps({{"front_end": front_end, "after_loading": "torch" in sys.modules,
                   "workers": sorted(type(w).__name__ for w in state.catalogue.workers.values())}}))
"""
    found = json.loads(subprocess.run([sys.executable, "-c", script], check=True, stdout=subprocess.PIPE,
                                      text=True).stdout.splitlines()[-1])
    assert found == {"front_end": [], "after_loading": True, "workers": ["ProcessWorker"]}


def test_the_real_server_serves_without_torch_while_its_executor_runs_the_model(resnet_bundle, fmnist_feeds) -> None:
    """`rampserve serve BUNDLE`: once it answers, the libraries mapped into its process include neither torch's nor
    ONNX Runtime's; its executor process's include torch's."""
    served = load_served(str(resnet_bundle))
    process = subprocess.Popen([sys.executable, "-m", "rampserve.cli", "serve", str(resnet_bundle), "--port", "0",
                                "--grpc-port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://[\d.]+:\d+", process.stdout.readline()).group(0)
        code, body = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[:2]))
        assert code == 200, body
        assert np.asarray(body["outputs"][0]["data"]).shape == (2,)
        executor = get_json(url + "/status")["models"][MODEL]["executor"]
        assert executor["kind"] == "process"
        assert mapped_libraries(process.pid) == []
        assert "torch" in mapped_libraries(executor["pid"])
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()


def test_an_onnx_bundles_executor_serves_its_ramps_without_torch(onnx_bundle, fmnist_feeds) -> None:
    """`rampserve serve` of an ONNX model with linear ramps: its executor loads the bundle (the ramps as arrays), runs
    every ramp on the controller's shadow batches, answers every request with the model's own label unless it left
    early, and has ONNX Runtime's native code mapped into it and never torch's."""
    from rampserve.runtime.bundle import load_bundle

    name, served = onnx_bundle.name, load_served(str(onnx_bundle))
    model = load_bundle(onnx_bundle)
    original = model.run({model.backend.input_names[0]: fmnist_feeds}).argmax(axis=1)
    # A budget the small ResNet's ramps fit in (at the default 2% none does: its controller would have nothing to run)
    process = subprocess.Popen([sys.executable, "-m", "rampserve.cli", "serve", str(onnx_bundle), "--port", "0",
                                "--grpc-port", "0", "--ramp-budget", "0.5"], stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://[\d.]+:\d+", process.stdout.readline()).group(0)
        deadline = time.monotonic() + 120
        while not get_json(url + "/status")["models"][name]["shadow_batches"]:  # its ramps' set loads in the executor
            assert time.monotonic() < deadline, "no batch ran the ramps"
            post(f"{url}/v2/models/{name}/infer", infer_body(served, fmnist_feeds[:1]))
        for i in range(len(fmnist_feeds)):
            code, body = post(f"{url}/v2/models/{name}/infer", infer_body(served, fmnist_feeds[i:i + 1]))
            assert code == 200, body
            label = next(o for o in body["outputs"] if o["name"] == "label")["data"][0]
            assert body["parameters"]["early"] or label == original[i]
        libraries = mapped_libraries(get_json(url + "/status")["models"][name]["executor"]["pid"])
        assert "onnxruntime" in libraries and "torch" not in libraries
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()
