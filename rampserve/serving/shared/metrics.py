"""Prometheus metrics of one server, in a registry of its own (several servers can live in one process), and the
watch on its event loop's lag."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

# Seconds: from a fraction of a millisecond (an early exit on a small model) to seconds (overload).
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                   0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Seconds: from below the timer's own resolution to a loop stalled for a second.
LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Node's monitorEventLoopDelay samples every 10 ms by default too: a stall that long or longer always covers a
# wake-up and is seen whole, a shorter one is seen in proportion to its length. The watch's own work is ~2 us a
# wake-up; waking an idle loop 100 times a second cost 0.7-0.9% of a core on a 2-core VM (mostly the wake-up
# itself), which a serving loop, awake for its requests anyway, mostly does not pay.
LAG_INTERVAL_S = 0.01
# Lag that a request would notice (a small model's whole batch takes a few ms); counted apart so that a client
# can take the difference of two status reports for the time between them.
SLOW_LAG_S = 0.005


@dataclass
class LagTracker:
    """How late the event loop ran the lag watch's timers: the latest lag, the largest since the watch started, and
    how many were measured and how many were over SLOW_LAG_S."""

    last_s: float = 0.0
    max_s: float = 0.0
    samples: int = 0
    slow: int = 0

    def observe(self, lag_s: float) -> float:
        """Records one wake-up's lag and returns it as recorded."""
        # uvloop's timers are due in whole milliseconds of a clock read once per loop iteration, so one can fire
        # up to 1 ms before the interval has passed: that is no lag at all.
        lag_s = max(lag_s, 0.0)
        self.last_s = lag_s
        self.max_s = max(self.max_s, lag_s)
        self.samples += 1
        if lag_s > SLOW_LAG_S:
            self.slow += 1
        return lag_s

    def to_json(self) -> dict:
        return {"lag_ms": self.last_s * 1000.0, "max_lag_ms": self.max_s * 1000.0, "samples": self.samples,
                "lag_samples_over_5ms": self.slow}


@dataclass(frozen=True)
class ModelSeries:
    """One model's series of the metrics its executor updates on every batch, bound to its label once: each `labels`
    call takes a lock and hashes its labels, several times a batch on the requests' path otherwise (the queue binds
    its own gauge of queued inputs)."""

    queue: Histogram
    compute: Histogram
    answer: Histogram
    batch_size: Histogram
    batch_limit: Gauge


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rampserve_requests", "Inference requests by outcome and transport (http, grpc)",
                                ["model", "outcome", "transport"], registry=r)
        self.queue = Histogram("rampserve_queue_seconds", "Time a request waited for its batch to start",
                               ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("rampserve_compute_seconds", "Time a batch ran, first stage to final layer",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.answer = Histogram("rampserve_answer_seconds", "Arrival at the model's queue to the answer's release",
                                ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("rampserve_request_seconds", "Request body read to response ready",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("rampserve_batch_size", "Inputs per batch", ["model"], buckets=BATCH_BUCKETS,
                                    registry=r)
        self.exits = Counter("rampserve_exits", "Inputs answered per exit site ('final': the last layer)",
                             ["model", "site"], registry=r)
        self.stopped_rows = Counter("rampserve_stopped_rows", "Inputs that left their batch at the ramp they exited "
                                    "at and never ran to its end (exit mode 'stop')", ["model"], registry=r)
        self.shadow_batches = Counter(
            "rampserve_shadow_batches", "Shadow batches of the configuration in force (every site's ramp evaluated "
            "for the controller, answers unchanged) by outcome: served, or skipped (served plainly) while the set "
            "of every site was not loaded yet", ["model", "outcome"], registry=r)
        self.window_accuracy = Gauge("rampserve_window_accuracy",
                                     "Agreement of released answers with the original model, recent window",
                                     ["model"], registry=r)
        self.disagreement_upper = Gauge(
            "rampserve_disagreement_upper_bound", "Upper confidence bound (at the configured confidence) on the share "
            "of released answers that differ from the original model's, over the controller's history",
            ["model"], registry=r)
        self.risk_scale = Gauge("rampserve_risk_scale", "Share of the certified thresholds rolling risk control "
                                "serves (1: all of them)", ["model"], registry=r)
        self.threshold = Gauge("rampserve_ramp_threshold", "Threshold of each active ramp", ["model", "site"],
                               registry=r)
        self.config_version = Gauge("rampserve_configuration_version", "Version of the configuration in use",
                                    ["model"], registry=r)
        self.cache = Counter("rampserve_cache_lookups", "Prediction cache lookups by result", ["model", "result"],
                             registry=r)
        self.shed = Counter("rampserve_shed", "Requests refused or dropped to protect deadlines, by reason",
                            ["model", "reason"], registry=r)
        self.queued = Gauge("rampserve_queued_inputs", "Inputs waiting for a batch", ["model"], registry=r)
        self.batch_limit = Gauge("rampserve_batch_limit", "Current adaptive batch size limit", ["model"],
                                 registry=r)
        self.compiles = Counter("rampserve_compiles", "Compilations of an active-ramp set by outcome (compiled, "
                                "loaded from the on-disk cache, refused, failed)", ["model", "outcome"], registry=r)
        self.compile_time = Histogram("rampserve_compile_seconds", "Time from asking for an active-ramp set's "
                                      "compiled stages to having them ready", ["model"],
                                      buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.answers = Counter("rampserve_answers", "Answers given, one per input, by path (early: at a ramp; final: "
                               "at the last layer; cached: from the prediction cache; unverified: released before "
                               "its batch failed)", ["model", "path"], registry=r)
        self.executor_restarts = Counter("rampserve_executor_restarts", "Executor processes started again after "
                                         "theirs died", ["model"], registry=r)
        self.executor_frames_found = Counter(
            "rampserve_executor_frames_found", "Times an executor process found the front end's frames, by how: ready "
            "(waiting when it looked), polled (within --idle-poll-ms of the last frame), rested (within it, while "
            "the poll left the core to the server's SCHED_IDLE work) or slept", ["model", "how"],
            registry=r)
        self.config_changes = Counter("rampserve_configuration_changes", "Configurations adopted by the executor",
                                      ["model"], registry=r)
        self.learning_phase = Gauge(
            "rampserve_learning_phase", "Where a model served before it was prepared stands: 1 for its phase "
            "(recording, training, profiling, certifying, managed, failed; vanilla: not recording), 0 for the others",
            ["model", "phase"], registry=r)
        self.recorded_requests = Gauge("rampserve_recorded_requests", "Distinct requests a model served before it "
                                       "was prepared has recorded to train its ramps on", ["model"], registry=r)
        self.record_target = Gauge("rampserve_record_target", "Requests it records before its ramps are trained",
                                   ["model"], registry=r)
        self.loop_lag = LagTracker()
        self.loop_lag_latest = Gauge("rampserve_event_loop_lag_seconds",
                                     "How late the event loop ran a timer, latest sample", registry=r)
        self.loop_lag_max = Gauge("rampserve_event_loop_lag_max_seconds",
                                  "Largest event-loop lag since the server became ready", registry=r)
        self.loop_lag_distribution = Histogram("rampserve_event_loop_lag_distribution_seconds",
                                               f"Event-loop lag, sampled every {LAG_INTERVAL_S * 1000:g} ms",
                                               buckets=LAG_BUCKETS, registry=r)
        self.app_requests = Counter("rampserve_app_requests", "Application queries by outcome (answered, default)",
                                    ["app", "outcome"], registry=r)
        self.app_latency = Histogram("rampserve_app_answer_seconds", "Application query arrival to its answer",
                                     ["app"], buckets=LATENCY_BUCKETS, registry=r)
        self.app_model_answers = Counter(
            "rampserve_app_model_answers",
            "Answers of an application's models by outcome (answered, late, failed, won)",
            ["app", "model", "outcome"], registry=r)
        self.app_model_latency = Histogram("rampserve_app_model_seconds", "Time a model of an application took "
                                           "to answer", ["app", "model"], buckets=LATENCY_BUCKETS, registry=r)

    def model_series(self, model: str) -> ModelSeries:
        """The series of `model` that its executor updates on every batch, bound once."""
        return ModelSeries(*(getattr(self, name).labels(model=model) for name in ModelSeries.__dataclass_fields__))

    def set_readings(self, labels: dict[str, str], readings: dict[str, float]) -> None:
        """The controller's gauges (`Controller.readings`) for one model."""
        self.window_accuracy.labels(**labels).set(readings["window_accuracy"])
        self.disagreement_upper.labels(**labels).set(readings["disagreement_upper"])
        self.risk_scale.labels(**labels).set(readings["risk_scale"])

    def observe_loop_lag(self, lag_s: float) -> None:
        lag_s = self.loop_lag.observe(lag_s)
        self.loop_lag_latest.set(lag_s)
        self.loop_lag_max.set(self.loop_lag.max_s)
        self.loop_lag_distribution.observe(lag_s)


class MergedRegistry:
    """A registry's metrics with samples collected elsewhere (`executor.metric_families`: an executor process's
    registry, as data) merged in by family name, so that each family is exposed once."""

    def __init__(self, registry: CollectorRegistry, families: list[dict]) -> None:
        self.registry, self.families = registry, families

    def collect(self) -> Iterator[Metric]:
        extra: dict[str, list[dict]] = {}
        for family in self.families:
            extra.setdefault(family["name"], []).append(family)
        for metric in self.registry.collect():
            for family in extra.pop(metric.name, ()):
                _add_samples(metric, family)
            yield metric
        for name, families in extra.items():
            metric = Metric(name, families[0]["help"], families[0]["type"])
            for family in families:
                _add_samples(metric, family)
            yield metric


def _add_samples(metric: Metric, family: dict) -> None:
    for name, labels, value in family["samples"]:
        metric.add_sample(name, labels, math.nan if value is None else value)  # JSON carries NaN as null


async def watch_loop_lag(metrics: ServerMetrics, interval_s: float = LAG_INTERVAL_S) -> None:
    """Sleeps `interval_s` at a time and records how late each wake-up came, until cancelled. The time is
    `time.perf_counter`'s: uvloop's `loop.time()` counts whole milliseconds."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(interval_s)
        metrics.observe_loop_lag(time.perf_counter() - asked - interval_s)
