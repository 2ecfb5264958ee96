"""Shared fixtures: a private artifact cache and small prepared models, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never touch the user's cache. The test cache persists between runs in the checkout (training is
# deterministic, so a cached tiny model is the one the test would train); CI starts from a clean clone.
TEST_HOME = Path(__file__).resolve().parent.parent / ".test-home"
os.environ["RAMPSERVE_HOME"] = str(TEST_HOME)
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(autouse=True)
def unwrapped_messages(monkeypatch):
    """Commands' messages on one line, whatever the terminal: a test that looks for a path in an error finds it
    whole (rich wraps at the terminal's width, and a test worker's temporary paths are longer). Set per test, so that
    pytest's own report keeps the terminal's width."""
    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setenv("TERMINAL_WIDTH", "1000")


@pytest.fixture(scope="session")
def small_prepare_config():
    from rampserve.ramps.train import TrainConfig
    from rampserve.runtime.prepare import PrepareConfig

    # On torch unless a test names another engine: which engine "auto" picks depends on the machine's timing
    return PrepareConfig(bootstrap_items=1200, profile_batch_sizes=(1, 2, 4, 16), profile_repeats=2,
                         profile_budget_s=0.1, engine="torch",
                         train=TrainConfig(max_epochs=8, patience=2), progress=False)


@pytest.fixture(scope="session")
def resnet_prepared(small_prepare_config):
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource

    return prepare(ModelSource("zoo", "resnet18-fmnist", small=True), small_prepare_config)


@pytest.fixture(scope="session")
def resnet_bundle(resnet_prepared, tmp_path_factory) -> Path:
    from rampserve.runtime.bundle import save_bundle

    return save_bundle(resnet_prepared, tmp_path_factory.mktemp("bundles") / "resnet18-small")


@pytest.fixture(scope="session")
def cache_prepared(small_prepare_config):
    """The small ResNet with a (small) k-means cache ramp at every site."""
    from dataclasses import replace

    from rampserve.ramps.specs import CacheSpec
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource

    config = replace(small_prepare_config, ramp_kind="cache", cache=CacheSpec(points=16, dim=8))
    return prepare(ModelSource("zoo", "resnet18-fmnist", small=True), config)


@pytest.fixture(scope="session")
def cache_bundle(cache_prepared, tmp_path_factory) -> Path:
    from rampserve.runtime.bundle import save_bundle

    return save_bundle(cache_prepared, tmp_path_factory.mktemp("bundles") / "resnet18-small-cache")


@pytest.fixture(scope="session")
def onnx_prepared(small_prepare_config, fmnist_feeds, tmp_path_factory):
    """The small ResNet exported to ONNX and prepared from that file alone (stages on ONNX Runtime)."""
    from dataclasses import replace

    import torch

    from rampserve.graph.onnx_graph import export_onnx
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource
    from rampserve.zoo.registry import load_trained

    module = load_trained("resnet18-fmnist", small=True)
    path = export_onnx(module, (torch.from_numpy(fmnist_feeds[:2]),), ["image"],
                       tmp_path_factory.mktemp("onnx") / "r18.onnx")
    return prepare(ModelSource.parse(str(path)), replace(small_prepare_config, workload="fmnist-drift",
                                                                engine="onnxruntime"))


@pytest.fixture(scope="session")
def onnx_bundle(onnx_prepared, tmp_path_factory) -> Path:
    """The small ResNet served on ONNX Runtime: what the zoo's bundles are on a machine where it is the fastest."""
    from rampserve.runtime.bundle import save_bundle

    return save_bundle(onnx_prepared, tmp_path_factory.mktemp("bundles") / "resnet18-small-onnx")


@pytest.fixture(scope="session")
def fmnist_feeds():
    """Real drifting Fashion-MNIST inputs from the evaluation part of the stream."""
    from rampserve.workloads.fashion_mnist import to_model_input
    from rampserve.workloads.streams import get_stream

    stream = get_stream("fmnist-drift")
    start = stream.evaluation.start
    return to_model_input(stream.items(start, start + 16))


def _start_redis(workdir: Path, port: int | None = None):
    """redis-server on a loopback port (a free one unless given), answering PING; returns (process, port). A free
    port may be taken before redis binds it: then redis exits and another port is tried."""
    import shutil
    import socket
    import subprocess
    import time

    import redis

    executable = shutil.which("redis-server") or "/usr/bin/redis-server"
    wanted = port
    for _attempt in range(1 if wanted else 5):
        if wanted is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        with open(workdir / f"redis-{port}.log", "ab") as log:
            proc = subprocess.Popen([executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", str(workdir)],
                                    stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, socket_timeout=1)
        deadline = time.monotonic() + 20
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if client.ping():
                        return proc, port
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.02)  # still starting: poll again until the deadline
        finally:
            client.close()
        proc.kill()
        proc.wait()
    raise RuntimeError(f"redis-server did not start; its logs are in {workdir}")


class RedisServer:
    """A redis-server of one's own that can go away and come back on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc, self.port = _start_redis(workdir)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        import subprocess

        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def start(self) -> None:
        if self.proc is None:
            self.proc, _ = _start_redis(self.workdir, self.port)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server for the session (no persistence), as a redis:// URL."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of this test's own, so tests sharing the session's Redis never see each other's keys."""
    import uuid

    return f"test-{uuid.uuid4().hex}"


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server for one test that may stop and restart it (the session's one must stay up)."""
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def local_ray():
    """A local Ray with 2 CPUs (a CI machine's), for the whole session: starting one takes seconds."""
    import uuid

    import ray

    ray.init(num_cpus=2, include_dashboard=False, namespace=f"test-{uuid.uuid4().hex}", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
