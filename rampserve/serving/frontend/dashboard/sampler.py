"""The dashboard's sampler: one task on the front end's event loop that, once a second, reads every model's
counters (the front end's own request counts and latency histogram, and each executor's status, asked over the
status path an executor process already answers) and every application's statistics, turns two readings into a
point of the time series (`series.model_point`) and keeps the last ten minutes in a ring. Browsers read the ring;
however many watch, the executors are asked once a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from rampserve.serving.frontend.dashboard.series import ModelReading, SampleRing, counter_delta, model_point
from rampserve.serving.frontend.repository.catalogue import Catalogue
from rampserve.serving.shared.metrics import LATENCY_BUCKETS, ServerMetrics

log = logging.getLogger("rampserve.serving")

LATENCY_BOUNDS = (*LATENCY_BUCKETS, math.inf)
ERROR_OUTCOMES = frozenset({"invalid", "shed", "failed"})  # rampserve_requests' outcomes that are no answer
DECISIONS_SHOWN = 12  # the controller's latest decisions, per model
EVENTS_KEPT = 2000  # configuration changes marked on the time axis, all models together


@dataclass(frozen=True)
class SamplerSettings:
    interval_s: float = 1.0
    history_s: float = 600.0  # what the ring keeps: 10 minutes at 1 s

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or self.history_s < self.interval_s:
            raise ValueError(f"the sampler needs a positive interval within its history, got {self}")

    @property
    def capacity(self) -> int:
        return round(self.history_s / self.interval_s)


def front_end_readings(metrics: ServerMetrics) -> tuple[dict[str, tuple[float, float]], dict[str, list[float]]]:
    """Per model, from the front end's own registry: (answered, refused or failed) requests over every transport
    (rampserve_requests' samples per transport add up), and the request latency histogram's cumulative bucket
    counts in LATENCY_BOUNDS' order."""
    requests: dict[str, list[float]] = {}
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                counts = requests.setdefault(sample.labels["model"], [0.0, 0.0])
                counts[sample.labels["outcome"] in ERROR_OUTCOMES] += sample.value
    position = {bound: i for i, bound in enumerate(LATENCY_BOUNDS)}
    latency: dict[str, list[float]] = {}
    for family in metrics.latency.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                buckets = latency.setdefault(sample.labels["model"], [0.0] * len(LATENCY_BOUNDS))
                buckets[position[float(sample.labels["le"])]] = sample.value
    return {model: (answered, refused) for model, (answered, refused) in requests.items()}, latency


def executor_reading(status: dict, last: ModelReading | None) -> dict:
    """The fields of a `ModelReading` an executor's status gives; where it did not answer, the last reading's
    counters, marked stale (so that its next answer's counts are not taken for one interval's)."""
    if "unavailable" in status:
        if last is None:
            return {}
        return {"executor": last.executor, "stale": True, "batches": last.batches, "inputs": last.inputs,
                "exits": last.exits}
    configuration = status["configuration"]
    bound = status.get("bound")
    return {"executor": status["executor"]["pid"], "queued": status["queued_inputs"], "batches": status["batches_booked"], "inputs": status["inputs"],
            "exits": status["exits"], "thresholds": dict(zip(configuration["sites"], configuration["thresholds"])),
            "config_version": configuration["version"], "window_accuracy": status.get("window_accuracy"),
            "accuracy_bound": None if bound is None else 1.0 - bound["disagreement_upper"]}


def model_summary(status: dict | None, decisions: list[dict]) -> dict:
    """What the dashboard shows of a model beside its time series: its executor and controller, the latest
    decisions (with when the sampler first saw each) and its totals."""
    if status is None:
        return {"executor": None}
    if "unavailable" in status:
        return {"executor": status["executor"], "unavailable": status["unavailable"], "decisions": decisions}
    bound = status.get("bound")
    return {"executor": status["executor"], "vanilla": status["vanilla"], "exit_mode": status["exit_mode"],
            "configuration": status["configuration"], "compiled": status["compiled"],
            "accuracy_floor": None if bound is None else 1.0 - bound["constraint"],
            "confidence": None if bound is None else bound["confidence"],
            "cumulative_accuracy": status.get("cumulative_accuracy"), "risk_scale": status.get("risk_scale"),
            "answers": status["answers"], "exits": status["exits"], "requests": status["requests"],
            "slo_ms": status["slo_ms"], "batch_limit": status["batch_limit"], "decisions": decisions}


def application_summary(status: dict) -> dict:
    """An application's totals as the dashboard's panel shows them: queries, defaults, and per model its answers in
    time, wins, late answers and failures."""
    return {"requests": status["requests"], "defaults": status["defaults"], "policy": status["spec"].get("policy"),
            "models": {name: {key: stats[key] for key in ("asked", "answered", "wins", "late", "failed")}
                       for name, stats in status["models"].items()}}


class DashboardSampler:
    def __init__(self, catalogue: Catalogue, metrics: ServerMetrics,
                 settings: SamplerSettings = SamplerSettings()) -> None:
        self.catalogue, self.metrics, self.settings = catalogue, metrics, settings
        self.ring = SampleRing(settings.capacity)
        self.started = time.time()
        self._last: dict[str, ModelReading] = {}
        self._last_apps: dict[str, dict] = {}
        self._last_at: float | None = None
        self._decision_seen: dict[str, dict[int, float]] = {}  # per model: configuration version -> first seen
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)  # configuration changes, with the sample that saw them
        self.summary: dict = {"models": {}, "apps": {}}
        self.ticks = 0
        self.cpu_s = 0.0  # the sampler's own work on the event loop, all ticks together
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dashboard sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = self.settings.interval_s
        next_at = time.monotonic()
        while True:
            try:
                await self.sample()
            except Exception:  # a dashboard must never take the server down; the next tick tries again
                log.exception("the dashboard's sampler failed")
            # A fixed cadence; a tick that overran (an executor slow to answer) is not made up for
            next_at = max(next_at + interval, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    async def sample(self) -> None:
        """Read everything once and add a point to the series."""
        started_cpu = time.thread_time()
        # A sample is stamped when it was asked for: whatever it shows was counted by then
        now, wall = time.monotonic(), time.time()
        workers = dict(self.catalogue.workers)
        asked = asyncio.gather(*(w.current_status(DECISIONS_SHOWN) for w in workers.values()),
                               return_exceptions=True)
        self.cpu_s += time.thread_time() - started_cpu
        statuses = dict(zip(workers, await asked))
        started_cpu = time.thread_time()
        requests, latency = front_end_readings(self.metrics)
        readings: dict[str, ModelReading] = {}
        summaries: dict[str, dict] = {}
        for name in self.catalogue.models:
            status = statuses.get(name)
            if isinstance(status, BaseException):
                status = {"executor": None, "unavailable": f"{type(status).__name__}: {status}"}
            answered, refused = requests.get(name, (0.0, 0.0))
            readings[name] = ModelReading(answered, refused, tuple(latency.get(name, ())),
                                          **({} if status is None else executor_reading(status, self._last.get(name))))
            summaries[name] = model_summary(status, self._decisions(name, status, wall))
            if (learner := self.catalogue.learners.get(name)) is not None:
                summaries[name]["learning"] = learner.status()
        seconds = self.settings.interval_s if self._last_at is None else now - self._last_at
        points = {name: model_point(self._last.get(name, ModelReading()), reading, seconds, LATENCY_BOUNDS)
                  for name, reading in readings.items()}
        apps = {name: application_summary(app.status()) for name, app in self.catalogue.apps.items()}
        app_points = {name: self._app_point(self._last_apps.get(name), app, seconds) for name, app in apps.items()}
        seq = self.ring.append({"t": wall, "models": points, "apps": app_points})
        for name, reading in readings.items():
            before = self._last.get(name)
            if reading.config_version is not None and (before is None or before.config_version != reading.config_version):
                self.events.append({"seq": seq, "t": wall, "model": name, "version": reading.config_version,
                                    "thresholds": reading.thresholds})
        self._last, self._last_apps, self._last_at = readings, apps, now
        self.summary = {"models": summaries, "apps": apps}
        self.ticks += 1
        self.cpu_s += time.thread_time() - started_cpu

    @staticmethod
    def _app_point(before: dict | None, after: dict, seconds: float) -> dict:
        before = before or {"requests": 0, "defaults": 0}
        return {"qps": counter_delta(before["requests"], after["requests"]) / seconds,
                "defaults_ps": counter_delta(before["defaults"], after["defaults"]) / seconds}

    def _decisions(self, model: str, status: dict | None, now: float) -> list[dict]:
        """The controller's latest decisions, each with the time the sampler first saw it (decisions made before
        the sampler's first tick show that tick's time)."""
        decisions = (status or {}).get("decisions") or []
        seen = self._decision_seen.setdefault(model, {})
        latest = decisions[-DECISIONS_SHOWN:]
        for decision in latest:
            seen.setdefault(decision["version"], now)
        kept = {d["version"] for d in latest}
        for version in [v for v in seen if v not in kept]:
            del seen[version]
        return [{**decision, "seen": seen[decision["version"]]} for decision in latest]

    def data(self, since: int) -> dict:
        """What a browser that has seen samples up to `since` needs: the samples after it, the configuration changes
        they saw, and the latest summaries."""
        return {"started": self.started, "interval_s": self.settings.interval_s, "capacity": self.ring.capacity,
                "seq": self.ring.last_seq, "samples": self.ring.since(since),
                "events": [event for event in self.events if event["seq"] > since],
                "sampler": {"ticks": self.ticks, "cpu_ms_per_tick": 1000.0 * self.cpu_s / self.ticks if self.ticks
                            else None},
                **self.summary}
