"""What a server is doing, read-only and open like the dashboard: Prometheus metrics (the executors' merged into
the server's own) and the JSON status of the server and of each model."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rampserve.serving.frontend.apps.update_stream import UpdateListener
from rampserve.serving.frontend.endpoints.messages import json_response
from rampserve.serving.frontend.plane import DataPlane
from rampserve.serving.shared.metrics import MergedRegistry


class ObservabilityEndpoints:
    """Bound to the data plane (its catalogue and metrics); `is_ready` says whether the server has started its
    models, `listener` is the model-update stream's follower, if any."""

    def __init__(self, plane: DataPlane, is_ready: Callable[[], bool], listener: UpdateListener | None) -> None:
        self.plane, self.is_ready, self.listener = plane, is_ready, listener
        self.catalogue, self.metrics = plane.catalogue, plane.metrics

    async def prometheus(self) -> Response:
        # Executor processes keep their models' metrics; they are merged into this server's, family by family
        workers = list(self.catalogue.workers.values())
        elsewhere = await asyncio.gather(*(w.exported_metrics() for w in workers))
        merged = MergedRegistry(self.metrics.registry, [f for families in elsewhere for f in families])
        return Response(generate_latest(merged), media_type=CONTENT_TYPE_LATEST)

    async def status(self) -> Response:
        models = dict(self.catalogue.models)
        statuses = dict(zip(models, await asyncio.gather(*(p.status() for p in models.values()))))
        return json_response({
            "ready": self.is_ready(),
            "process": os.getpid(),  # which replica answered, where several serve one address
            # Bundles, whose executors report counts, latencies and decisions; then every other kind
            "models": {n: s for n, s in statuses.items() if models[n].worker is not None},
            "other_models": {n: s for n, s in statuses.items() if models[n].worker is None},
            # Models served before they were prepared: the phase of each (recording, training, ..., managed)
            "learning": {name: learner.status() for name, learner in self.catalogue.learners.items()},
            "applications": sorted(self.catalogue.apps),
            "store": self.catalogue.store.description,
            "updates": None if self.listener is None else self.listener.status(),
            "event_loop": self.metrics.loop_lag.to_json(),
        })

    async def model_status(self, model: str) -> Response:
        status = await self.plane.model(model).status()
        learner = self.catalogue.learners.get(model)
        return json_response(status if learner is None else {**status, "learning": learner.status()})
