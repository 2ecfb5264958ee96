"""Every answer counted and consistent: a live server with its controller in the loop, on a stream whose original
answers the test knows, with a change of look at a known point and repeats served from the prediction cache."""

from __future__ import annotations

import time

import numpy as np

from rampserve.control.controller import ControllerSettings
from rampserve.serving.models import load_served
from rampserve.serving.server import ServerSettings
from rampserve.serving.worker import ModelSettings
from rampserve.workloads.fashion_mnist import to_model_input
from rampserve.workloads.streams import get_stream
from test_serving import MODEL, get_json, infer_body, post, server

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


def test_every_released_answer_is_counted_and_the_books_match_what_clients_saw(resnet_bundle) -> None:
    served = load_served(str(resnet_bundle))
    feeds, order = _stream()
    original = served.model.run({served.model.backend.input_names[0]: feeds}).argmax(axis=1)
    # The small test model's ramps agree with it only where they are very sure: one ramp at a low threshold
    # answers a few inputs early, until the look changes and the same threshold lets wrong answers out, which the
    # controller must catch from the final answers and stop
    site = served.model.site_names[3]
    settings = ModelSettings(controller=ControllerSettings(initial=(site,), start_thresholds={site: 0.02},
                                                           ramp_adjustment=False))
    with server(served, settings, ServerSettings(port=0, cache_mb=4.0)) as (url, _):
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
