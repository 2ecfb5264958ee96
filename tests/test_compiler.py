"""Compiling active-ramp sets off the serving process: a real worker process, the on-disk cache next to the bundle,
corrupt and refused entries, and a worker that adopts a configuration only once its set is compiled."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from rampserve.control.records import Configuration
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.compiled import CompiledSet, CorruptEntry, has_compiled, opened_entry, write_entry
from rampserve.runtime.torchscript_sets import save_compiled, set_key
from rampserve.serving.executor.compiler import CompileService
from rampserve.serving.executor.compiling import CompileOutcome, likely_next_sets

WAIT_S = 180.0


@pytest.fixture()
def bundle_copy(resnet_bundle, tmp_path):
    """A private copy of the small ResNet bundle: each test starts with an empty compile cache."""
    import shutil

    return shutil.copytree(resnet_bundle, tmp_path / "bundle", ignore=shutil.ignore_patterns("compiled"))


def _example(model, fmnist_feeds) -> dict[str, np.ndarray]:
    return {model.backend.input_names[0]: fmnist_feeds[-2:]}


class Outcomes:
    """What a service reported through `on_outcome`. The worker stores a set on disk before it reports it, so a
    set can be ready (and `wait` return) a moment before its outcome arrives on the listener thread."""

    def __init__(self) -> None:
        self.seen: list[CompileOutcome] = []
        self._arrived = threading.Event()

    def __call__(self, outcome: CompileOutcome) -> None:
        self.seen.append(outcome)
        self._arrived.set()

    def last(self) -> CompileOutcome:
        assert self._arrived.wait(WAIT_S), "the service reported no outcome"
        return self.seen[-1]


def test_a_set_compiled_in_the_worker_process_runs_like_the_eager_path_and_is_reused_from_disk(
        bundle_copy, fmnist_feeds) -> None:
    model = load_bundle(bundle_copy)
    sites = model.site_names[1:3]
    outcomes = Outcomes()
    service = CompileService(model, _example(model, fmnist_feeds), outcomes)
    try:
        assert not service.ready(sites)
        assert service.wait(sites, WAIT_S)
        compiled = service.load(sites)
        assert isinstance(compiled, CompiledSet) and outcomes.last().outcome == "compiled"
    finally:
        service.close()
    assert service.directory == bundle_copy / "compiled"
    feeds = {model.backend.input_names[0]: fmnist_feeds[:5]}
    seen: dict[bool, list] = {True: [], False: []}
    outputs = {c: model.run(feeds, sites, lambda *r, c=c: seen[c].append(r), compiled=compiled if c else False)
               for c in (True, False)}
    assert np.array_equal(outputs[True], outputs[False])
    for (site, labels, errors), (eager_site, eager_labels, eager_errors) in zip(seen[True], seen[False], strict=True):
        assert site == eager_site and np.array_equal(labels, eager_labels)
        np.testing.assert_allclose(errors, eager_errors, rtol=0, atol=1e-5)

    # A second server of the same bundle (a restart, a replica) finds it on disk and starts no worker process
    again = CompileService(load_bundle(bundle_copy), _example(model, fmnist_feeds))
    try:
        assert again.ready(sites) and again.load(sites) is not None
        assert again._process is None
    finally:
        again.close()


def test_a_corrupt_entry_is_never_loaded_and_is_compiled_again(bundle_copy, fmnist_feeds) -> None:
    model = load_bundle(bundle_copy)
    sites = model.site_names[:1]
    service = CompileService(model, _example(model, fmnist_feeds))
    try:
        assert service.wait(sites, WAIT_S)
        key = set_key(service.digest, model.backend.ordered_cuts(sites), model.error_score)
        archive = service.directory / f"{key}.pt"
        data = bytearray(archive.read_bytes())
        data[len(data) // 2] ^= 0xFF
        archive.write_bytes(bytes(data))
        with pytest.raises(KeyError, match="corrupt"):
            service.load(sites)
        assert service.wait(sites, WAIT_S)  # compiled again in the worker
        assert isinstance(service.load(sites), CompiledSet)
    finally:
        service.close()


def test_an_opened_entry_names_the_file_it_checked_while_it_is_written_again(tmp_path) -> None:
    """A loader that reads a set's file itself gets a path to the very file whose digest was checked: the set written
    again under its name meanwhile (a new file renamed over it) is not what it reads. A file that does not match its
    index is never handed out, and a refused set has no file."""
    first, second = b"graph one" * 1000, b"graph two" * 999
    write_entry(tmp_path, "k", ".onnx", first, {"logits": ["a"]})
    with opened_entry(tmp_path, "k", ".onnx") as (index, path):
        write_entry(tmp_path, "k", ".onnx", second, {"logits": ["b"]})
        assert index["logits"] == ["a"]
        assert Path(path).read_bytes() == first
    with opened_entry(tmp_path, "k", ".onnx") as (index, path):
        assert index["logits"] == ["b"] and Path(path).read_bytes() == second
    (tmp_path / "k.onnx").write_bytes(first)  # not the data k.json hashed
    with pytest.raises(CorruptEntry, match="sha256"), opened_entry(tmp_path, "k", ".onnx"):
        pass
    save_compiled(tmp_path, "r", None, "not faithful")
    with opened_entry(tmp_path, "r", ".onnx") as (index, path):
        assert index["refused"] == "not faithful" and path is None


def test_a_refused_set_is_remembered_and_served_eagerly(bundle_copy, fmnist_feeds) -> None:
    """A set whose trace is not faithful is stored as refused: loading it gives None (the eager path), and a
    later server does not compile it again, even with an example the model runs."""
    model = load_bundle(bundle_copy)
    sites = model.site_names[:2]
    # An example the model cannot run: tracing its first stage raises, and a trace that raises is refused
    # (`trace_stages`), never failed (a failure would be remembered in memory alone, not on disk)
    service = CompileService(model, {model.backend.input_names[0]: np.zeros((2, 3), np.float32)})
    outcomes = Outcomes()
    service.on_outcome = outcomes
    try:
        assert service.wait(sites, WAIT_S)
        assert service.load(sites) is None
        assert outcomes.last().outcome == "refused" and outcomes.last().sites == model.backend.ordered_cuts(sites)
    finally:
        service.close()
    key = set_key(service.digest, model.backend.ordered_cuts(sites), model.error_score)
    assert has_compiled(service.directory, key)  # the refusal is on disk
    # Kept on disk: a later server, with an example the model runs, neither compiles the set nor waits for it
    later = CompileService(load_bundle(bundle_copy), _example(model, fmnist_feeds))
    try:
        assert later.ready(sites) and later.wait(sites, WAIT_S)
        assert later.load(sites) is None and later._process is None
    finally:
        later.close()


def test_a_worker_adopts_a_configuration_only_once_its_set_is_compiled(bundle_copy, fmnist_feeds) -> None:
    from rampserve.serving.executor.loading import served
    from rampserve.serving.executor.worker import ModelWorker
    from rampserve.serving.shared.metrics import ServerMetrics
    from rampserve.serving.shared.settings import ModelSettings

    model = load_bundle(bundle_copy)
    worker = ModelWorker(served("m", model), ModelSettings(), ServerMetrics())
    worker.start()
    try:
        first = worker.configuration
        assert worker.compiled  # the first set was compiled before the worker started serving
        target = tuple(s for s in model.site_names if s not in first.sites)[:1] + first.sites
        new = Configuration(first.version + 1, model.backend.ordered_cuts(target), (0.0,) * len(target))
        adopted = threading.Event()
        compiled_before: list[bool] = []

        original = worker.sets.adopt

        def watch(config: Configuration) -> None:
            if config is new:
                compiled_before.append(model.has_compiled(config.sites, worker.sets.mode)
                                       and worker.sets.compiler.ready(config.sites))
                adopted.set()
            original(config)

        worker.sets.adopt = watch
        worker.sets.pending = new
        worker.control_thread.record(CompileOutcome((), "compiled", 0.0))  # wake the control thread
        assert adopted.wait(WAIT_S)
        assert compiled_before == [True] and worker.configuration is new and worker.compiled
    finally:
        worker.stop()


def test_likely_next_sets_hold_every_single_step_from_the_active_set() -> None:
    sites = ["a", "b", "c", "d"]
    sets = likely_next_sets(("b",), sites)
    assert sets[0] == ()
    assert set(sets) == {(), ("a", "b"), ("b", "c"), ("b", "d"), ("a",), ("c",), ("d",)}
    assert ("b",) not in sets and all(list(s) == sorted(s, key=sites.index) for s in sets)
