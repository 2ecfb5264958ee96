"""The "stop" exit mode on the compiled serving path: an input released at a fused ramp leaves its batch there and
is never computed further, except for a uniform feedback sample (and requests that want the logits), which run
to the end. Real small models on real Fashion-MNIST inputs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rampserve.control.controller import ControllerSettings
from rampserve.control.exit_rule import STOP_MARGIN, first_exits
from rampserve.control.records import NO_EXIT, NO_LABEL, Configuration
from rampserve.runtime.torchscript_sets import set_key
from rampserve.serving.executor.loading import served as make_served
from rampserve.serving.executor.request_queue import Pending
from rampserve.serving.executor.worker import ModelWorker
from rampserve.serving.shared.contract import ModelRequest, future_reply
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.settings import ModelSettings


class _Counted(Pending):
    """A request that counts its answers (a second one would be lost silently on its future)."""

    answers = 0

    def settle(self, result) -> None:
        self.answers += 1
        super().settle(result)


@pytest.fixture(scope="module")
def stream_feeds():
    """256 real inputs of the drifting stream's evaluation part."""
    from rampserve.workloads.fashion_mnist import to_model_input
    from rampserve.workloads.streams import get_stream

    stream = get_stream("fmnist-drift")
    start = stream.evaluation.start
    return to_model_input(stream.items(start, start + 256))


def _worker(model, sites: tuple[str, ...], mode: str, share: float = 0.1, **overrides) -> ModelWorker:
    controller = ControllerSettings(initial=sites, exit_mode=mode, feedback_share=share, threshold_tuning=False,
                                    ramp_adjustment=False)
    return ModelWorker(make_served("m", model), ModelSettings(controller=controller, **overrides), ServerMetrics())


def _serve(worker: ModelWorker, config: Configuration, mode: str, name: str, feeds: np.ndarray,
           requests: list[tuple[int, bool]]):
    """One batch of `requests` (inputs, wants the logits) through the worker's executor, on the compiled set of
    `mode`; returns the requests, their answers and the batch's books (record, state)."""
    model = worker.served.prepared
    worker.sets.in_force = (config, model.compiled_set(config.sites, mode))
    loop = asyncio.new_event_loop()
    try:
        starts = np.cumsum([0] + [rows for rows, _ in requests])
        futures = [loop.create_future() for _ in requests]
        batch = [_Counted(ModelRequest({name: feeds[a:a + rows]}, wants), 0.0, float("inf"), future_reply(loop, future))
                 for a, (rows, wants), future in zip(starts, requests, futures)]
        worker.runner.run(batch)
        loop.run_until_complete(asyncio.sleep(0))  # the answers were handed to the loop thread-safely
        answers = [future.result() for future in futures]
    finally:
        loop.close()
    done = worker.control_thread.queued.get_nowait()
    return batch, answers, worker.control_thread.controller_records([done])[0], done.state


def _gaps(errors: np.ndarray) -> list[float]:
    """Thresholds halfway between consecutive error scores (away from every input's), and 0 and 1."""
    ordered = np.sort(errors)
    return [0.0, *((ordered[1:] + ordered[:-1]) / 2)[[3, 7, 11]], 1.0]


def test_stop_mode_releases_every_input_once_as_release_mode_and_never_recomputes_one_that_left(
        resnet_prepared, cache_prepared, fmnist_feeds) -> None:
    """Over batch compositions (inputs per request, requests that want the logits), thresholds and feedback
    samples: every request gets exactly one answer with a label per input; an input that exits gets its ramp's
    label there, as in release mode, and one that does not the original model's final label; single-input
    requests get release mode's very answers. An input leaves the batch exactly where it certainly exits unless
    it is sampled or its request wants the logits; the final stage runs on the others only (the runner's
    returned rows); its record has no final label and NO_LABEL / NaN at the ramps after it, every other input's
    record is complete. A cache ramp (evaluated in Python) after a fused one sees only the inputs still there,
    scores them as the eager ramp does, and learns from those that ran to the end."""
    model = replace(resnet_prepared)  # compiled sets of its own
    names = model.site_names
    sites = (names[0], names[2], names[4])
    # the middle ramp is a cache ramp: it runs in Python, stashed on the compiled path, and never stops an input
    model.ramps = {**model.ramps, names[2]: cache_prepared.ramps[names[2]]}
    name = model.backend.input_names[0]
    example = {name: fmnist_feeds[-2:]}
    for mode in ("release", "stop"):
        assert model.compile(sites, example, mode)
    stop_set = model.compiled_set(sites, "stop")
    assert stop_set.stops and not model.compiled_set(sites).stops and stop_set.fused == (True, False, True)
    eager: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    original = model.run({name: fmnist_feeds}, sites, lambda site, *seen: eager.setdefault(site, seen))
    final = original.argmax(axis=1)
    choices = [_gaps(eager[site][1]) for site in sites]
    # Release mode's run does not teach the cache ramp, so that both runs of a batch see the same cache
    release, stop = _worker(model, sites, "release", cache_updates=False), _worker(model, sites, "stop", share=0.25)
    stop.runner.stop_strategy.feedback = np.random.default_rng(3)
    cache = model.ramps[names[2]]
    learnt = []
    learn = cache.learn
    cache.learn = lambda labels: learnt.append(np.array(labels)) or learn(labels)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=5),  # 16 inputs at most
           st.tuples(*(st.integers(0, 4) for _ in sites)))
    def check(requests: list[tuple[int, bool]], picks: tuple[int, ...]) -> None:
        thresholds = tuple(choices[j][k] for j, k in enumerate(picks))
        config = Configuration(1, sites, thresholds)
        n = sum(rows for rows, _ in requests)
        learnt.clear()
        _, before, record_before, _ = _serve(release, config, "release", name, fmnist_feeds, requests)
        batch, answers, record, state = _serve(stop, config, "stop", name, fmnist_feeds, requests)
        assert all(p.answers == 1 for p in batch) and all(len(a.labels) == p.rows for a, p in zip(answers, batch))
        # Where each input exits (release mode's record holds every ramp's score for every input)
        exits = first_exits(record_before.errors, np.array(thresholds))
        wants = np.repeat([w for _, w in requests], [r for r, _ in requests])
        kept = state.sample | wants
        left = state.left
        # an input leaves where it first exits at a fused ramp (certainly: away from the margin), unless kept; one
        # released by the cache ramp runs on, and may leave at the next fused ramp where that one is sure too
        errors = np.where(exits >= 0, record_before.errors[np.arange(n), exits], np.inf)
        certain = np.isin(exits, [0, 2]) & (errors < np.array(thresholds + (0.0,))[exits] - STOP_MARGIN - 1e-5)
        assert np.array_equal(left[certain & ~kept], exits[certain & ~kept])
        gone = left != NO_EXIT
        assert not np.any(gone & kept) and np.all(np.isin(left[gone], [0, 2]))
        assert np.all((exits[gone] != NO_EXIT) & (exits[gone] <= left[gone]))
        assert np.all(record_before.errors[gone, left[gone]] < np.array(thresholds)[left[gone]])
        # the released labels
        released = np.concatenate([a.labels for a in answers])
        sites_at = np.concatenate([[sites.index(s) if s is not None else NO_EXIT for s in a.exits.sites]
                                   for a in answers])
        ramp_labels = record_before.labels[np.arange(n), np.maximum(sites_at, 0)]
        assert np.array_equal(released, np.where(sites_at == NO_EXIT, final[:n], ramp_labels))
        assert np.all((sites_at == exits) | (sites_at == NO_EXIT))  # an input answered early exits there
        assert np.all(sites_at[gone] != NO_EXIT)  # one that left has no final answer: it got its ramp's
        for (rows, _), a, b in zip(requests, before, answers):
            if rows == 1 or all(s is not None for s in a.exits.sites):  # release mode answered it as it stands
                assert np.array_equal(a.labels, b.labels) and a.exits.sites == b.exits.sites
        # the record: one that left has no final label and nothing after its ramp; the others are complete
        assert np.array_equal(record.final == NO_LABEL, gone) and np.array_equal(record.final[~gone], final[:n][~gone])
        assert np.array_equal(record.exits, sites_at) and record.feedback_share == 0.25
        after = np.arange(len(sites))[None, :] > left[:, None]
        assert np.all(record.labels[gone[:, None] & after] == NO_LABEL)
        assert np.all(np.isnan(record.errors[gone[:, None] & after]))
        reached = ~(gone[:, None] & after)
        assert np.array_equal(record.labels[reached], record_before.labels[reached])
        np.testing.assert_allclose(record.errors[reached], record_before.errors[reached], rtol=0, atol=1e-5)
        # the cache ramp saw the inputs still there and learnt from those that ran to the end
        there = np.flatnonzero(reached[:, 1])
        if len(there):
            (labels,) = learnt
            assert len(labels) == len(there)
            assert np.array_equal(labels, np.where(gone[there], NO_LABEL, final[there]))
        # the runner: the final stage ran on the inputs that did not leave, and gave the original model's output
        outputs = model.ramp_outputs(stop_set, n)
        with torch.inference_mode():
            output, ran = model.run_stopping(stop_set, {name: fmnist_feeds[:n]}, outputs, thresholds, -1, kept)
        assert np.array_equal(ran, np.flatnonzero(outputs.buffers.left == -1))
        assert np.array_equal(outputs.buffers.left, left)
        if len(ran):  # else the runner stopped before the last stage
            assert np.array_equal(output.argmax(axis=1), final[ran])
            np.testing.assert_allclose(output, original[ran], rtol=1e-5, atol=1e-5)

    check()
    assert set_key("d", sites, "max_prob", "stop") != set_key("d", sites, "max_prob")  # kept apart on disk


def test_the_feedback_sample_is_uniform_and_independent_of_exits(resnet_prepared, stream_feeds) -> None:
    """Over 300 batches, the inputs kept running to the end are a share of the batch within binomial noise of the
    feedback share, among inputs that exit as among those that do not (a chi-square test of independence); the
    exited inputs that ran to the end (what the controller learns agreement from) are that share of the exits,
    and every other exit left its batch."""
    model = replace(resnet_prepared)
    name = model.backend.input_names[0]
    sites = (model.site_names[1],)
    assert model.compile(sites, {name: stream_feeds[-2:]}, "stop")
    share = 0.3
    worker = _worker(model, sites, "stop", share)
    worker.runner.stop_strategy.feedback = np.random.default_rng(11)
    errors: list[np.ndarray] = []
    model.run({name: stream_feeds}, sites, lambda _, labels, seen: errors.append(seen))
    # About half the inputs exit: a threshold in the widest gap between error scores near the median, far from
    # every input's (then no input is released inside the stop margin, where it would run on)
    ordered = np.sort(errors[0])
    middle = np.arange(len(ordered) * 3 // 8, len(ordered) * 5 // 8)
    widest = middle[np.argmax(ordered[middle + 1] - ordered[middle])]
    threshold = float(ordered[widest] + ordered[widest + 1]) / 2
    config = Configuration(1, sites, (threshold,))
    rng = np.random.default_rng(5)
    sampled, exited, observed = [], [], []
    for _ in range(300):
        order = rng.permutation(len(stream_feeds))[:16]
        _, _, record, state = _serve(worker, config, "stop", name, stream_feeds[order], [(1, False)] * 16)
        sampled.append(state.sample)
        exited.append(record.exits != NO_EXIT)
        observed.append(record.final != NO_LABEL)
    sampled, exited, observed = np.concatenate(sampled), np.concatenate(exited), np.concatenate(observed)
    n = len(sampled)
    assert 0.3 < exited.mean() < 0.7
    assert abs(sampled.mean() - share) < 4 * np.sqrt(share * (1 - share) / n)
    # 2x2 contingency of (sampled, exited): chi-square with one degree of freedom, 10.83 at p = 0.001
    table = np.array([[np.sum(sampled & exited), np.sum(sampled & ~exited)],
                      [np.sum(~sampled & exited), np.sum(~sampled & ~exited)]], dtype=float)
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / n
    assert ((table - expected) ** 2 / expected).sum() < 10.83
    # what the controller sees: exits that ran to the end are the sample's (and the margin's, none here)
    exits = int(exited.sum())
    assert np.array_equal(observed & exited, sampled & exited)
    assert abs((observed & exited).sum() / exits - share) < 4 * np.sqrt(share * (1 - share) / exits)
    assert worker.books.stopped_rows == int((exited & ~sampled).sum()) > 0


def test_an_onnx_set_stops_its_run_once_every_input_of_the_batch_has_left(onnx_prepared, fmnist_feeds) -> None:
    """An ONNX set whose ramps signal from one session, in stop mode (`OnnxStoppingRunner`; one cut into stages does
    not stop, and serves stop mode as release mode): over batch compositions, thresholds and feedback samples, every
    request gets exactly one answer, release mode's labels; an input leaves where it certainly exits unless it is
    sampled or its request wants the logits; the run ends once every input of the batch has left (the runner
    returns no row) and otherwise runs to the end, giving the original model's output for the inputs that did not
    leave. The record has no final label exactly for those that left."""
    model = replace(onnx_prepared)  # compiled sets of its own
    name = model.backend.input_names[0]
    sites = (model.site_names[1], model.site_names[3])
    two = {name: fmnist_feeds[-2:]}
    for mode in ("release", "stop"):
        assert model.compile(sites, two, mode)
    stop_set = model.compiled_set(sites, "stop")
    assert stop_set.stops and type(stop_set.runner).__name__ == "OnnxStoppingRunner"
    staged = model.build_compiled(sites, two, "stop", signals=False)  # cut into stages: it cannot stop a run
    assert type(staged.runner).__name__ == "OnnxSetRunner" and not staged.stops
    eager: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    original = model.run({name: fmnist_feeds}, sites, lambda site, *seen: eager.setdefault(site, seen))
    final = original.argmax(axis=1)
    choices = [_gaps(eager[site][1]) for site in sites]
    release, stop = _worker(model, sites, "release"), _worker(model, sites, "stop", share=0.25)
    assert stop.sets.mode == "stop"
    stop.runner.stop_strategy.feedback = np.random.default_rng(5)

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=4),
           st.tuples(*(st.integers(0, 4) for _ in sites)))
    @example([(1, False)], (4, 4))  # threshold 1 everywhere: one input, sampled or not
    def check(requests: list[tuple[int, bool]], picks: tuple[int, ...]) -> None:
        thresholds = tuple(choices[j][k] for j, k in enumerate(picks))
        config = Configuration(1, sites, thresholds)
        n = sum(rows for rows, _ in requests)
        _, before, record_before, _ = _serve(release, config, "release", name, fmnist_feeds, requests)
        batch, answers, record, state = _serve(stop, config, "stop", name, fmnist_feeds, requests)
        assert all(p.answers == 1 for p in batch) and all(len(a.labels) == p.rows for a, p in zip(answers, batch))
        for (rows, _), a, b in zip(requests, before, answers):
            if rows == 1 or all(s is not None for s in a.exits.sites):  # release mode answered it as it stands
                assert np.array_equal(a.labels, b.labels) and a.exits.sites == b.exits.sites
        # an input with several in its request that left keeps its ramp's answer: it has no final one
        released = np.concatenate([a.labels for a in answers])
        sites_at = np.concatenate([[sites.index(s) if s is not None else NO_EXIT for s in a.exits.sites]
                                   for a in answers])
        ramp_labels = record_before.labels[np.arange(n), np.maximum(sites_at, 0)]
        assert np.array_equal(released, np.where(sites_at == NO_EXIT, final[:n], ramp_labels))
        exits = first_exits(record_before.errors, np.array(thresholds))
        wants = np.repeat([w for _, w in requests], [r for r, _ in requests])
        kept = state.sample | wants
        left = state.left
        errors = np.where(exits >= 0, record_before.errors[np.arange(n), np.maximum(exits, 0)], np.inf)
        certain = (exits >= 0) & (errors < np.array(thresholds)[np.maximum(exits, 0)] - STOP_MARGIN - 1e-5)
        assert np.array_equal(left[certain & ~kept], exits[certain & ~kept])
        gone = left != NO_EXIT
        assert not np.any(gone & kept) and np.all(left[gone] == exits[gone]) and np.all(sites_at[gone] == left[gone])
        assert np.array_equal(record.final == NO_LABEL, gone) and np.array_equal(record.final[~gone], final[:n][~gone])
        outputs = model.ramp_outputs(stop_set, n)
        with torch.inference_mode():
            output, ran = model.run_stopping(stop_set, {name: fmnist_feeds[:n]}, outputs, thresholds, -1, kept)
        assert np.array_equal(outputs.buffers.left, left) and np.array_equal(ran, np.flatnonzero(left == NO_EXIT))
        logits = outputs.buffers.logits
        if len(ran):  # it ran to the end: every ramp's logits are the run's
            assert not np.isnan(logits).any()
            np.testing.assert_allclose(output, original[ran], rtol=1e-5, atol=1e-5)
        else:  # it ended at the ramp the last input left at: the ramps after it never ran
            assert np.isnan(logits[:, left.max() + 1:]).all() and not np.isnan(logits[:, left.max()]).any()

    check()


def test_a_server_in_stop_mode_answers_every_request_exactly_once(resnet_bundle, fmnist_feeds) -> None:
    """A live server (uvicorn on loopback, concurrent clients) in stop mode: every request gets exactly one answer;
    an early one is the ramp's below its threshold, a final one the original model's, and a request for the logits
    gets the original model's (its inputs run to the end); inputs left their batches, and /status and /metrics
    say so."""
    import json
    import urllib.request

    from test_serving import MODEL, _concurrent, books_after, get_json, infer_body, mixing_threshold, server

    from rampserve.serving.executor.loading import load_served, loaded

    served = loaded(load_served(str(resnet_bundle)))
    site = served.prepared.site_names[1]
    x = fmnist_feeds
    threshold = mixing_threshold(served, 1, x)
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    original = served.prepared.run({served.inputs[0].name: x}, [site], lambda _, *scored: seen.append(scored))
    (ramp_labels, ramp_errors), = seen
    controller = ControllerSettings(initial=(site,), start_thresholds={site: threshold}, threshold_tuning=False,
                                    ramp_adjustment=False, exit_mode="stop", feedback_share=0.2)
    settings = ModelSettings(controller=controller, max_batch=8, max_delay_ms=2.0, deadline_ms=60_000.0,
                             adaptive_batching=False, preload_s=0.0)
    wants_logits = [i % 10 == 0 for i in range(240)]
    bodies = []
    for i, wants in enumerate(wants_logits):
        body = json.loads(infer_body(served, x[i % 16: i % 16 + 1]))
        if wants:
            body["outputs"] = [{"name": "label"}, {"name": "logits"}]
        bodies.append(json.dumps(body).encode())
    with server(served, settings) as (url, _):
        results = asyncio.run(_concurrent(url, bodies, clients=24))
        status = books_after(url, len(bodies))
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert get_json(url + "/status")["models"][MODEL]["stopping"] is True
    assert sorted(index for index, _, _ in results) == list(range(len(bodies)))
    assert all(code == 200 for _, code, _ in results)
    assert status["requests"] == len(bodies) and sum(status["answers"].values()) == len(bodies)
    assert status["exit_mode"] == "stop" and status["compiled"] is True
    assert status["stopped_inputs"] > 0
    assert f'rampserve_stopped_rows_total{{model="{MODEL}"}} {float(status["stopped_inputs"])}' in metrics
    early = 0
    for index, _, answer in results:
        i = index % 16
        label = next(o for o in answer["outputs"] if o["name"] == "label")["data"][0]
        if wants_logits[index]:
            logits = np.array(next(o for o in answer["outputs"] if o["name"] == "logits")["data"])
            np.testing.assert_allclose(logits, original[i], rtol=1e-5, atol=1e-5)
            assert label == original[i].argmax() and answer["parameters"]["early"] is False
        elif answer["parameters"]["early"]:
            early += 1
            assert answer["parameters"]["exit_site"] == site and label == ramp_labels[i]
            assert answer["parameters"]["error_score"] < threshold and ramp_errors[i] < threshold + 1e-5
        else:
            assert label == original[i].argmax() and ramp_errors[i] >= threshold - 1e-5
    assert early > 0


def test_inputs_that_left_are_released_even_when_no_column_reaches_the_releasing_thread(resnet_prepared,
                                                                                      fmnist_feeds) -> None:
    """With nobody listening to the ramps' pipe, the executor scores after the run every ramp that took inputs out
    of the batch and releases them there: threshold 1 at the first ramp, every input not kept leaves there and is
    answered with that ramp's label, the kept ones run to the end (and are answered there too: they exited)."""
    model = replace(resnet_prepared)
    name = model.backend.input_names[0]
    sites = (model.site_names[0],)
    assert model.compile(sites, {name: fmnist_feeds[-2:]}, "stop")
    worker = _worker(model, sites, "stop", share=0.5)
    worker.runner.stop_strategy.feedback = np.random.default_rng(1)
    worker.runner.signals = None
    eager: list[tuple[np.ndarray, np.ndarray]] = []
    model.run({name: fmnist_feeds}, sites, lambda _, *seen: eager.append(seen))
    batch, answers, record, state = _serve(worker, Configuration(1, sites, (1.0,)), "stop", name, fmnist_feeds,
                                           [(2, False)] * 8)
    assert all(p.answers == 1 for p in batch) and all(a.early for a in answers)
    assert np.array_equal(np.concatenate([a.labels for a in answers]), eager[0][0])
    assert np.array_equal(state.left == NO_EXIT, state.sample) and 0 < state.sample.sum() < 16
    assert np.array_equal(record.final == NO_LABEL, ~state.sample)


def test_a_final_answer_is_kept_before_the_response_that_carries_it(resnet_prepared, fmnist_feeds) -> None:
    """Over batch compositions, thresholds and both exit modes: a request answered with its batch's final answer
    has that answer handed to `on_final` (what the prediction cache keeps) before its reply goes out, so a repeat
    sent once the reply is back finds it kept; one released early at a ramp gets its reply first and its final
    answer after (the cache keeps final answers only), and in stop mode one whose input left the batch has none.
    Each request gets one reply and at most one final answer, and release mode gives every request its final."""
    model = replace(resnet_prepared)  # compiled sets of its own
    names = model.site_names
    sites = (names[0], names[2])
    name = model.backend.input_names[0]
    for mode in ("release", "stop"):
        assert model.compile(sites, {name: fmnist_feeds[-2:]}, mode)
    eager: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    model.run({name: fmnist_feeds}, sites, lambda site, *seen: eager.setdefault(site, seen))
    choices = [_gaps(eager[site][1]) for site in sites]
    workers = {mode: _worker(model, sites, mode, share=0.25, cache_updates=False) for mode in ("release", "stop")}
    workers["stop"].runner.stop_strategy.feedback = np.random.default_rng(7)
    seen = {"final first": 0, "reply first": 0}

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=5),
           st.tuples(*(st.integers(0, 4) for _ in sites)), st.sampled_from(["release", "stop"]))
    # both paths in every run, whatever is drawn: threshold 0 exits nothing, threshold 1 lets every input exit
    @example([(1, False), (2, True)], (0,) * len(sites), "release")
    @example([(1, False), (2, True)], (4,) * len(sites), "release")
    def check(requests: list[tuple[int, bool]], picks: tuple[int, ...], mode: str) -> None:
        worker = workers[mode]
        config = Configuration(1, sites, tuple(choices[j][k] for j, k in enumerate(picks)))
        worker.sets.in_force = (config, model.compiled_set(sites, mode))
        events: list[tuple[str, int, object]] = []
        starts = np.cumsum([0] + [rows for rows, _ in requests])
        batch = [Pending(ModelRequest({name: fmnist_feeds[a:a + rows]}, wants,
                                      on_final=lambda answer, i=i: events.append(("final", i, answer))),
                         0.0, float("inf"), lambda answer, i=i: events.append(("reply", i, answer)))
                 for i, (a, (rows, wants)) in enumerate(zip(starts, requests))]
        worker.runner.run(batch)
        state = worker.control_thread.queued.get_nowait().state
        for i, (rows, wants) in enumerate(requests):
            (at_reply, reply), = [(k, e[2]) for k, e in enumerate(events) if e[:2] == ("reply", i)]
            finals = [(k, e[2]) for k, e in enumerate(events) if e[:2] == ("final", i)]
            left = state.left is not None and bool(np.any(state.left[starts[i]:starts[i] + rows] != NO_EXIT))
            assert len(finals) == (0 if left else 1)
            if not finals:
                continue
            (at_final, final), = finals
            if any(site is None for site in reply.exits.sites):  # answered with the final layer's labels
                assert at_final < at_reply, "the final answer was kept after the reply that carried it"
                assert np.array_equal(final.labels, reply.labels)
                seen["final first"] += 1
            else:  # released at a ramp before the batch ended; its final answer is known only at the end
                assert not wants and at_reply < at_final
                seen["reply first"] += 1

    check()
    assert seen["final first"] > 0 and seen["reply first"] > 0  # both paths were taken
