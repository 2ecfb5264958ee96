"""Every answer counted and consistent: a live server with its controller in the loop, on a stream whose original
answers the test knows, with a change of look at a known point and repeats served from the prediction cache."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_serving import MODEL, get_json, infer_body, post, server

from rampserve.control.controller import ControllerSettings
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.server import ServerSettings
from rampserve.serving.shared.contract import ModelRequest
from rampserve.serving.shared.settings import ModelSettings
from rampserve.workloads.fashion_mnist import to_model_input
from rampserve.workloads.streams import get_stream

REQUESTS = 600
LOOK_CHANGES_AT = 300  # from here on every image is inverted: a look the ramps were not trained on


def _stream() -> tuple[np.ndarray, list[int]]:
    """Inputs in request order and, per request, which stream item it sends: every third request repeats one
    of the previous ten, so it can hit the cache."""
    stream = get_stream("fmnist-drift")
    start = stream.evaluation.start
    pixels = stream.items(start, start + REQUESTS)
    rng = np.random.default_rng(0)
    order = []
    for i in range(REQUESTS):
        order.append(int(rng.integers(max(0, i - 10), i)) if i % 3 == 2 else i)
    images = np.asarray(pixels).copy()
    images[LOOK_CHANGES_AT:] = 255 - images[LOOK_CHANGES_AT:]
    return to_model_input(images), order


def _surest_threshold(labels: np.ndarray, errors: np.ndarray, original: np.ndarray,
                      most: int = 20) -> tuple[float, int]:
    """A threshold below which exactly the ramp's k most confident inputs before the look changes exit, every one
    agreeing with the model (k at most `most`), and k; (0, 0) where its surest answer disagrees."""
    before = np.argsort(errors[:LOOK_CHANGES_AT], kind="stable")[:most + 1]
    agreeing = int(np.argmin(np.append(labels[before[:most]] == original[before[:most]], False)))
    if agreeing == 0:
        return 0.0, 0
    return float(np.mean(errors[before[agreeing - 1:agreeing + 1]])), agreeing


def test_every_released_answer_is_counted_and_the_books_match_what_clients_saw(resnet_bundle) -> None:
    served = loaded(load_served(str(resnet_bundle)))
    feeds, order = _stream()
    seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    original = served.prepared.run({served.prepared.backend.input_names[0]: feeds}, served.prepared.site_names,
                                lambda site, labels, errors: seen.setdefault(site, (labels, errors))).argmax(axis=1)
    # The small test model's ramps agree with it only where they are surest: one ramp starts at a threshold that
    # lets out its most confident answers before the look changes, as long as they agree (at most 20), on a site
    # where no inverted input is that sure (on layer 4, inverted images saturate the ramp into wrong answers). A
    # stream this short never certifies a threshold: the ramp answers at the threshold it starts at.
    candidates = {site: _surest_threshold(*seen[site], original) for site in served.prepared.site_names}
    candidates = {site: (k, t) for site, (t, k) in candidates.items() if seen[site][1][LOOK_CHANGES_AT:].min() > t}
    site = max(candidates, key=lambda s: candidates[s][0])
    threshold = candidates[site][1]
    assert threshold > 0, "no ramp's most confident answer before the change agrees with the model"
    settings = ModelSettings(controller=ControllerSettings(initial=(site,), start_thresholds={site: threshold},
                                                           ramp_adjustment=False))
    with server(served, settings, ServerSettings(port=0, grpc=False, cache_mb=4.0)) as (url, _):
        responses = [post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, feeds[i:i + 1]))[2] for i in order]
        deadline = time.monotonic() + 60  # the last batches reach the controller after their answers
        while (model := get_json(url + "/status")["models"][MODEL])["inputs_observed"] < REQUESTS:
            assert time.monotonic() < deadline, f"the controller counted {model['inputs_observed']} answers"
            time.sleep(0.01)
    labels = np.array([r["outputs"][0]["data"][0] for r in responses])
    expected = original[order]
    cached = np.array([bool(r["parameters"].get("cached")) for r in responses])
    measured = float(np.mean(labels == expected))
    assert cached.sum() > 0 and np.array_equal(labels[cached], expected[cached])  # no cached answer disagrees
    assert measured >= 0.99, measured
    assert model["answers"]["early"] > 0  # the controller kept ramps active: some answers left early
    assert sum(model["answers"].values()) == REQUESTS and model["answers"]["cached"] == cached.sum()
    assert abs(model["cumulative_accuracy"] - measured) <= 0.005, (model["cumulative_accuracy"], measured)


def test_the_executor_releases_every_row_once_consistently_and_records_the_paths_taken(resnet_prepared,
                                                                                     fmnist_feeds) -> None:
    """Over batch compositions (inputs per request, requests that want the logits, thresholds), compiled and
    eager: every request gets one answer with one label per input, an answer with logits has the final labels,
    and the batch record's exits are the paths the answers took."""
    import asyncio
    from dataclasses import replace

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from rampserve.control.records import NO_EXIT, Configuration
    from rampserve.serving.executor.loading import served as make_served
    from rampserve.serving.executor.request_queue import Pending
    from rampserve.serving.executor.worker import ModelWorker
    from rampserve.serving.shared.contract import future_reply
    from rampserve.serving.shared.metrics import ServerMetrics

    model = replace(resnet_prepared)
    served = make_served("m", model)
    sites = tuple(model.site_names[2:5])
    name = model.backend.input_names[0]
    assert model.compile(sites, {name: fmnist_feeds[-2:]})
    worker = ModelWorker(served, ModelSettings(controller=ControllerSettings(initial=sites)), ServerMetrics())

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=5),
           st.lists(st.sampled_from([0.0, 0.5, 0.85, 0.9, 1.0]), min_size=3, max_size=3), st.booleans())
    def check(requests: list[tuple[int, bool]], thresholds: list[float], compiled: bool) -> None:
        loop = asyncio.new_event_loop()
        try:
            starts = np.cumsum([0] + [rows for rows, _ in requests])
            futures = [loop.create_future() for _ in requests]
            batch = [Pending(ModelRequest({name: fmnist_feeds[a:a + rows]}, wants), 0.0, float("inf"),
                              future_reply(loop, future)) for a, (rows, wants), future in zip(starts, requests, futures)]
            config = Configuration(1, sites, tuple(thresholds))
            worker.sets.in_force = (config, model.compiled_set(sites) if compiled else None)
            worker.runner.run(batch)
            loop.run_until_complete(asyncio.sleep(0))  # the answers were handed to the loop thread-safely
            answers = [future.result() for future in futures]
        finally:
            loop.close()
        record = worker.control_thread.controller_records([worker.control_thread.queued.get_nowait()])[0]  # as the control thread makes it
        final = model.run({name: fmnist_feeds[:starts[-1]]}).argmax(axis=1)
        taken = []
        for answer, (a, (rows, wants)) in zip(answers, zip(starts, requests)):
            assert len(answer.labels) == rows == len(answer.exits.sites)
            if wants:
                assert np.array_equal(answer.labels, answer.logits.argmax(axis=1))
                assert np.array_equal(answer.labels, final[a:a + rows]) and not any(answer.exits.sites)
            taken += [NO_EXIT if site is None else sites.index(site) for site in answer.exits.sites]
        assert np.array_equal(record.exits, taken)
        assert np.array_equal(np.concatenate([a.labels for a in answers]), record.released())

    check()


@pytest.mark.parametrize("ramp_budget", [0.0, ControllerSettings.ramp_budget])
def test_a_controller_that_can_change_nothing_hears_of_no_batch_while_the_books_count_every_answer(
        resnet_prepared, fmnist_feeds, ramp_budget: float) -> None:
    """With no ramp within the budget at any batch size (budget 0), the controller searches nothing and the worker
    sends it no record, yet every answer is counted; at the default budget (the small test model's ramps fit it)
    the same worker feeds its controller every input. Stopping the worker drains its records first, so the
    controller's count is final when read."""
    from dataclasses import replace

    from rampserve.serving.executor.loading import served as make_served
    from rampserve.serving.executor.worker import ModelWorker
    from rampserve.serving.shared.metrics import ServerMetrics

    model = replace(resnet_prepared)
    settings = ModelSettings(controller=ControllerSettings(ramp_budget=ramp_budget))
    worker = ModelWorker(make_served("m", model), settings, ServerMetrics())
    name = worker.served.inputs[0].name
    requests = 12
    answered = threading.Semaphore(0)
    worker.start()
    try:
        for i in range(requests):
            worker.queue.admit(ModelRequest({name: fmnist_feeds[i:i + 1]}), lambda _: answered.release())
        for _ in range(requests):
            assert answered.acquire(timeout=60), "a request was never answered"
    finally:
        worker.stop()
    status = worker.status()
    idle = ramp_budget == 0.0
    assert status["controller_idle"] is idle and status["vanilla"] is False
    assert sum(status["answers"].values()) == requests
    assert status["inputs_observed"] == (0 if idle else requests)
    assert ("no ramp fits the ramp budget" in status["decisions"][0]["reason"]) is idle
    assert (status["configuration"]["shadow_sites"] == []) is idle
