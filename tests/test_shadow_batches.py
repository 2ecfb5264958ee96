"""Shadow batches on the live serving path: one batch in `shadow_every` of a configuration evaluates the ramp at
every site for the controller, releasing the answers the configuration releases. A real worker (executor, releasing
and control threads) on the small ResNet and real Fashion-MNIST inputs; the control link is a stub that keeps one
configuration and collects the records, since the controller is not what is under test."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from rampserve.control.controller import ControllerSettings
from rampserve.control.records import NO_EXIT, BatchRecord, Configuration
from rampserve.runtime.compiled import CompiledSet
from rampserve.runtime.prepared import PreparedModel
from rampserve.serving.executor.loading import served as make_served
from rampserve.serving.executor.request_queue import Pending
from rampserve.serving.executor.worker import ModelWorker
from rampserve.serving.shared.contract import Answer, ModelRequest
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.settings import ModelSettings

WAIT_S = 60.0
SHARE = 0.1  # stop mode's feedback share: most exits leave their plain batch


class FixedControl:
    """A control link that keeps one configuration and collects the records the worker sends."""

    idle = False  # the worker sends it every record, which the test reads

    def __init__(self, config: Configuration) -> None:
        self.config = config
        self.records: list[BatchRecord] = []
        self._cond = threading.Condition()

    def configuration(self) -> Configuration:
        return self.config

    def observe(self, record: BatchRecord) -> Configuration | None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()
        return None

    def readings(self) -> dict[str, float]:
        return {"window_accuracy": 1.0, "disagreement_upper": 0.0, "risk_scale": 1.0}

    def refresh(self) -> Configuration | None:
        return None

    def status(self, latest_decisions: int | None = None) -> dict:
        return {}

    def wait_for(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.records) >= count, WAIT_S), \
                f"the controller heard of {len(self.records)} batches, not {count}"


class HeldCompiler:
    """A compile service whose sets become ready only when the test says so (then compiled in this process, as
    the worker process would, in the worker's exit mode), recording what was asked for and how urgently."""

    def __init__(self, model: PreparedModel, example: dict[str, np.ndarray], mode: str) -> None:
        self.model, self.example, self.mode = model, example, mode
        self.requests: list[tuple[tuple[str, ...], bool]] = []
        self.released: set[tuple[str, ...]] = set()
        self.loads = 0

    def request(self, sites: tuple[str, ...], urgent: bool = False) -> None:
        self.requests.append((tuple(sites), urgent))

    def ready(self, sites: tuple[str, ...]) -> bool:
        return tuple(sites) in self.released

    def wait(self, sites: tuple[str, ...], timeout_s: float, urgent: bool = True) -> bool:
        self.request(sites, urgent)
        return self.ready(sites)

    def load(self, sites: tuple[str, ...]) -> CompiledSet | None:
        self.loads += 1
        return self.model.build_compiled(sites, self.example, self.mode)


def _between(errors: np.ndarray) -> float:
    """A threshold in the widest gap between these error scores around their median: about half the inputs exit,
    none close to it (two compiled sets score a fused ramp to float rounding)."""
    ordered = np.sort(errors)
    middle = np.arange(len(ordered) // 4, len(ordered) * 3 // 4)
    widest = middle[np.argmax(ordered[middle + 1] - ordered[middle])]
    return float(ordered[widest] + ordered[widest + 1]) / 2


def _serve_each(model: PreparedModel, config: Configuration, mode: str, feeds: np.ndarray
                ) -> tuple[list[Answer], list[BatchRecord], dict, ServerMetrics]:
    """Every input as a request of its own through a started worker whose controller keeps `config`, each sent
    once the controller has heard of the one before (so each is a batch of its own); returns the answers, the
    records, the status and the metrics."""
    control = FixedControl(config)
    metrics = ServerMetrics()
    settings = ModelSettings(controller=ControllerSettings(exit_mode=mode, feedback_share=SHARE))
    worker = ModelWorker(make_served("m", model), settings, metrics, control)
    name = worker.served.inputs[0].name
    answers: dict[int, Answer] = {}
    worker.start()
    try:
        for i in range(len(feeds)):
            worker.queue.admit(ModelRequest({name: feeds[i:i + 1]}), lambda answer, i=i: answers.setdefault(i, answer))
            control.wait_for(i + 1)
        status = worker.status()
    finally:
        worker.stop()
    return [answers[i] for i in range(len(feeds))], control.records, status, metrics


@pytest.mark.parametrize("mode", ["release", "stop"])
def test_shadow_batches_report_every_sites_ramp_and_release_the_configurations_answers(
        resnet_prepared, fmnist_feeds, mode: str) -> None:
    """With one batch in two a shadow batch, the records alternate between every site and the active ones, all of
    the configuration's version; a shadow record holds each site's ramp as the eager ramp scores those inputs, and
    the original model's label for every input (in stop mode too: no input stops, each weighs 1), while the
    answers, labels and exit sites, are those of the same inputs served without shadow batches."""
    model = replace(resnet_prepared)  # compiled sets of its own
    names = tuple(model.site_names)
    active = (names[1], names[-2])  # inactive sites before, between and after them
    name = model.backend.input_names[0]
    eager: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    final = model.run({name: fmnist_feeds}, names, lambda site, *seen: eager.setdefault(site, seen)).argmax(axis=1)
    config = Configuration(1, active, tuple(_between(eager[site][1]) for site in active), names, 2)

    answers, records, status, metrics = _serve_each(model, config, mode, fmnist_feeds)
    plain_answers, plain_records, plain_status, _ = _serve_each(model, replace(config, shadow_every=0), mode,
                                                                fmnist_feeds)

    n = len(fmnist_feeds)
    assert [r.sites for r in records] == [names if i % 2 == 0 else active for i in range(n)]
    assert all(r.version == 1 for r in records) and all(r.sites == active for r in plain_records)
    assert (status["shadow_batches"], status["shadow_batches_skipped"]) == (n // 2, 0)
    assert (plain_status["shadow_batches"], plain_status["shadow_batches_skipped"]) == (0, 0)
    served = metrics.registry.get_sample_value("rampserve_shadow_batches_total", {"model": "m", "outcome": "served"})
    assert served == n // 2
    for answer, plain in zip(answers, plain_answers, strict=True):
        assert np.array_equal(answer.labels, plain.labels) and answer.exits.sites == plain.exits.sites
    assert any(a.early for a in answers) and not all(a.early for a in answers)  # the thresholds mix exits
    for i, record in enumerate(records):
        # where each answer came from, in the record's own sites
        exits = [None if j == NO_EXIT else record.sites[j] for j in record.exits]
        assert exits == list(answers[i].exits.sites) and np.array_equal(record.released(), answers[i].labels)
        if i % 2:
            assert record.feedback_share == (SHARE if mode == "stop" else 1.0)
            continue
        for j, site in enumerate(names):
            assert np.array_equal(record.labels[:, j], eager[site][0][i:i + 1])
            np.testing.assert_allclose(record.errors[:, j], eager[site][1][i:i + 1], rtol=0, atol=1e-5)
        assert np.array_equal(record.final, final[i:i + 1])
        assert record.observed().all() and np.all(record.weights() == 1.0) and record.feedback_share == 1.0


def test_a_shadow_batch_runs_only_once_its_set_is_loaded_and_each_version_counts_its_own(resnet_prepared,
                                                                                         fmnist_feeds) -> None:
    """The set of every shadow site is asked for ahead, first of the sets preloaded (none where the configuration
    has no shadow batches: its set never changes) and (not urgently) by a configuration with shadow batches, and
    never compiled on the serving path: until it is loaded, a shadow batch is served plainly and counted as skipped. A new configuration version counts its batches from its own first, a shadow
    batch, on the set already loaded."""
    model = replace(resnet_prepared)
    names = tuple(model.site_names)
    active = (names[1],)
    name = model.backend.input_names[0]
    example = {name: fmnist_feeds[-2:]}
    config = Configuration(1, active, (0.5,), names, 2)
    worker = ModelWorker(make_served("m", model), ModelSettings(preload_s=0.0), ServerMetrics(), FixedControl(config))
    assert model.compile(active, example, worker.sets.mode)
    compiler = worker.sets.compiler = HeldCompiler(model, example, worker.sets.mode)

    def run(i: int) -> BatchRecord:
        worker.runner.run([Pending(ModelRequest({name: fmnist_feeds[i:i + 1]}), time.monotonic(), math.inf, lambda _: None)])
        return worker.control_thread.controller_records([worker.control_thread.queued.get_nowait()])[0]

    try:
        worker.sets.preload(replace(config, shadow_sites=(), shadow_every=0))  # a controller that searches nothing
        assert compiler.requests == []
        worker.sets.preload(config)
        assert compiler.requests[0] == (names, False)
        worker.sets.adopt(config)  # as `start` and the control thread do
        assert run(0).sites == active and not model.has_compiled(names)
        assert (worker.status()["shadow_batches"], worker.status()["shadow_batches_skipped"]) == (0, 1)
        compiler.released.add(names)
        worker.sets.advance(None)  # the control thread, woken by the compile's outcome
        assert [run(i).sites for i in (1, 2)] == [active, names]
        worker.sets.adopt(replace(config, version=2, thresholds=(0.25,)))
        record = run(3)
        assert (record.version, record.sites) == (2, names)
        assert (worker.status()["shadow_batches"], worker.status()["shadow_batches_skipped"]) == (2, 1)
        assert compiler.loads == 1 and all(not urgent for sites, urgent in compiler.requests if sites == names)
    finally:
        if worker.runner.signals is not None:
            worker.runner.signals.close()
