"""One controller per model, shared by all of its replicas on Ray.

A named Ray actor holds the model's `Controller`. Every replica's worker sends it the records of its batches
and applies the configuration it publishes, so accuracy is judged over all of the model's traffic, not one
replica's share. If the actor is lost, a replica keeps serving with the last configuration it had, and a new
actor, started from that configuration, takes over from the records that follow.

Ray is an optional dependency (`pip install rampserve[ray]`); this module imports it.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.records import BatchRecord, Configuration

log = logging.getLogger("rampserve.serving")

# How long a replica waits for the controller before it takes it for lost; a batch record is small and the
# controller's work per record is well under a millisecond, so seconds mean the actor is gone or stuck.
CONTROLLER_TIMEOUT_S = 5.0
# The first answer waits for Ray to start the actor's worker process, which imports torch: tens of seconds on a
# busy 2-core machine, and not a sign that anything is lost.
CONTROLLER_START_TIMEOUT_S = 60.0
# Records kept for a lost controller's successor, at most (a replica keeps serving meanwhile; beyond this the
# oldest are dropped, and the successor's counts miss them)
UNDELIVERED_RECORDS = 4096


@ray.remote(num_cpus=0)  # bookkeeping only: it must not take a CPU from the replicas
class ControllerActor:
    def __init__(self, profile: dict, settings: ControllerSettings) -> None:
        self.controller = Controller(LatencyProfile.from_json(profile), settings)

    def observe(self, record: BatchRecord) -> tuple[Configuration, dict[str, float], dict]:
        """The configuration in force after this record, whoever's it was, the controller's gauges, and the counts
        a successor would start from."""
        self.controller.observe(record)
        return self.controller.configuration(), self.controller.readings(), self.controller.checkpoint()

    def catch_up(self, checkpoint: dict) -> None:
        """Count what a lost predecessor had counted (each replica that takes over brings the latest it saw)."""
        self.controller.catch_up(checkpoint)

    def configuration(self) -> Configuration:
        return self.controller.configuration()

    def status(self, latest_decisions: int | None = None) -> dict:
        return self.controller.status(latest_decisions)


def controller_name(model: str) -> str:
    return f"rampserve-controller-{model}"


class RayControl:
    """A replica's link to its model's controller actor (a `ControlLink`)."""

    idle = False  # the controller may change the configuration (it lives elsewhere: it is not asked)

    def __init__(self, model: str, profile: LatencyProfile, settings: ControllerSettings,
                 timeout_s: float = CONTROLLER_TIMEOUT_S) -> None:
        self.name = controller_name(model)
        self.profile, self.settings, self.timeout_s = profile.to_json(), settings, timeout_s
        self.takeovers = 0
        # Records the controller has not acknowledged, delivered (in order) to it or to its successor
        self._undelivered: deque[BatchRecord] = deque(maxlen=UNDELIVERED_RECORDS)
        self._checkpoint: dict | None = None  # the counts in the controller's latest answer to this replica
        self._actor = self._connect(settings)
        self._current = ray.get(self._actor.configuration.remote(), timeout=max(timeout_s, CONTROLLER_START_TIMEOUT_S))
        self._readings: dict[str, float] = {"window_accuracy": 1.0, "disagreement_upper": 0.0, "risk_scale": 1.0}
        self._status: dict = {"window_accuracy": 1.0, "cumulative_accuracy": 1.0, "decisions": []}

    def _connect(self, settings: ControllerSettings) -> ray.actor.ActorHandle:
        # get_if_exists: the first replica creates the actor, the others (and a replica after a loss, if another
        # replica already started the successor) join it.
        return ControllerActor.options(name=self.name, get_if_exists=True, lifetime="detached").remote(
            self.profile, settings)

    def _take_over(self, error: Exception) -> None:
        log.warning("controller %s lost (%s); serving on with configuration %d and starting another",
                    self.name, error, self._current.version)
        self.takeovers += 1
        start = replace(self.settings, initial=self._current.sites,
                        start_thresholds=dict(zip(self._current.sites, self._current.thresholds)))
        self._actor = self._connect(start)
        if self._checkpoint is not None:
            try:
                ray.get(self._actor.catch_up.remote(self._checkpoint), timeout=self.timeout_s)
            except (RayActorError, GetTimeoutError):
                pass  # the successor is gone too: the next record takes over again

    def configuration(self) -> Configuration:
        return self._current

    def observe(self, record: BatchRecord) -> Configuration | None:
        self._undelivered.append(record)
        return self._deliver()

    def _deliver(self) -> Configuration | None:
        """Hand every undelivered record over, oldest first; one the controller did not acknowledge stays for
        its successor (a record lost with the actor would be answers nobody counts)."""
        latest = None
        while self._undelivered:
            try:
                latest, self._readings, self._checkpoint = ray.get(
                    self._actor.observe.remote(self._undelivered[0]), timeout=self.timeout_s)
            except (RayActorError, GetTimeoutError) as exc:
                self._take_over(exc)
                return None
            self._undelivered.popleft()
        return None if latest is None else self._adopt(latest)

    def refresh(self) -> Configuration | None:
        if self._undelivered:
            return self._deliver()
        try:
            return self._adopt(ray.get(self._actor.configuration.remote(), timeout=self.timeout_s))
        except (RayActorError, GetTimeoutError) as exc:
            self._take_over(exc)
            return None

    def _adopt(self, latest: Configuration) -> Configuration | None:
        # Another replica's records may have changed it; a successor numbers its versions afresh.
        if (latest.version, latest.sites, latest.thresholds) == (
                self._current.version, self._current.sites, self._current.thresholds):
            return None
        self._current = latest
        return latest

    def readings(self) -> dict[str, float]:
        return self._readings

    def status(self, latest_decisions: int | None = None) -> dict:
        try:
            self._status = {**ray.get(self._actor.status.remote(latest_decisions), timeout=self.timeout_s),
                            "controller": self.name, "takeovers": self.takeovers}
        except (RayActorError, GetTimeoutError):
            pass  # the last known status; observe() notices the loss and takes over
        return self._status
