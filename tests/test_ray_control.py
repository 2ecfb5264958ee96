"""One controller for all replicas of a model, on a real local Ray (2 CPUs): two workers of the small prepared
ResNet feed one controller actor and apply what it publishes; killing the actor fails no request."""

from __future__ import annotations

import asyncio

import numpy as np
import ray

from rampserve.control.controller import ControllerSettings
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.executor.worker import ModelWorker
from rampserve.serving.ray.control import RayControl, controller_name
from rampserve.serving.shared.contract import Answer, ModelRequest
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.settings import ModelSettings


def replicas(served, settings: ModelSettings, model: str) -> list[ModelWorker]:
    """Two workers of one model, as two replicas would run them, each linked to the model's one controller."""
    return [ModelWorker(served, settings, ServerMetrics(),
                        RayControl(model, served.prepared.profile, settings.controller)) for _ in range(2)]


async def serve_all(workers: list[ModelWorker], feeds: np.ndarray, rounds: int) -> list[Answer]:
    answers = []
    for _ in range(rounds):
        for worker in workers:
            for row in range(len(feeds)):
                answers.append(await worker.submit(ModelRequest({"x": feeds[row:row + 1]})))
    return answers


def test_replicas_share_one_controller_and_apply_what_it_publishes(local_ray, resnet_bundle, fmnist_feeds) -> None:
    served = loaded(load_served(str(resnet_bundle)))
    site = served.prepared.site_names[0]
    # A threshold so high that early answers disagree: the controller must lower it, from both replicas' records.
    controller = ControllerSettings(initial=(site,), start_thresholds={site: 0.95}, window=32)
    settings = ModelSettings(controller=controller)
    workers = replicas(served, settings, "shared")
    for worker in workers:
        worker.start()
    try:
        answers = asyncio.run(serve_all(workers, fmnist_feeds, rounds=6))
    finally:
        for worker in workers:
            worker.stop()
    actor = ray.get_actor(controller_name("shared"))
    published = ray.get(actor.configuration.remote())
    status = ray.get(actor.status.remote())
    assert len(answers) == 2 * 6 * len(fmnist_feeds)
    assert len(status["decisions"]) > 1  # it changed the configuration
    # Each replica served a configuration the one controller published, and holds the last one once it asks (the
    # other replica's last records may have changed it after this one's last answer); the controller's window saw
    # both replicas' inputs.
    versions = {d["version"] for d in status["decisions"]}
    assert all(w.configuration.version in versions for w in workers)
    for worker in workers:
        worker.control.refresh()
    assert [w.control.configuration() for w in workers] == [published, published]
    assert status["inputs_observed"] == sum(w.books.inputs_served for w in workers) == len(answers)


def test_killing_the_controller_fails_no_request(local_ray, resnet_bundle, fmnist_feeds) -> None:
    served = loaded(load_served(str(resnet_bundle)))
    workers = replicas(served, ModelSettings(), "killed")
    for worker in workers:
        worker.start()
    try:
        before = asyncio.run(serve_all(workers, fmnist_feeds, rounds=1))
        last = [w.configuration for w in workers]
        ray.kill(ray.get_actor(controller_name("killed")), no_restart=True)
        after = asyncio.run(serve_all(workers, fmnist_feeds, rounds=2))
    finally:
        for worker in workers:
            worker.stop()
    assert len(before) + len(after) == 3 * 2 * len(fmnist_feeds)
    original = served.prepared.run({"x": fmnist_feeds}).argmax(axis=1)
    final_answers = [a for a in after if not a.early]
    assert all(a.labels[0] in range(10) for a in after) and final_answers
    assert {int(a.labels[0]) for a in final_answers} <= set(original.tolist())
    assert sum(w.control.takeovers for w in workers) >= 1
    successor = ray.get(ray.get_actor(controller_name("killed")).configuration.remote())
    assert successor.sites == last[0].sites  # it took over from the configuration the replicas had
