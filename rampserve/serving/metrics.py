"""Prometheus metrics of one server, in a registry of its own (several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds: from a fraction of a millisecond (an early exit on a small model) to seconds (overload).
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                   0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rampserve_requests", "Inference requests by outcome", ["model", "outcome"],
                                registry=r)
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
        self.window_accuracy = Gauge("rampserve_window_accuracy",
                                     "Agreement of released answers with the original model, recent window",
                                     ["model"], registry=r)
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
        self.config_changes = Counter("rampserve_configuration_changes", "Configurations adopted by the executor",
                                      ["model"], registry=r)
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
