"""`rampserve bench race` on tiny settings, for real: the small prepared ResNet served three times (once by a
second rampserve, reached over v2: a server thread here, where the benchmark starts a process, which costs a
test ten seconds more), every decider at a calibrated and a generous timeout, each model alone, real
Fashion-MNIST test queries from a client process of its own, feedback to the learning race, then a run with one
model unloaded. The report must agree with itself and with the answers it recorded; timings are the benchmark's
business, not the test's."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from rich.console import Console

from rampserve.bench.race import (
    DECIDERS,
    LEARNED_MARGIN,
    LEARNING_DECIDERS,
    RaceSettings,
    calibrated_timeout_ms,
    comparison_lines,
    correct_answers,
    diversity,
    model_table,
    race_table,
    run_race,
    seeds_summary,
    seeds_table,
)
from rampserve.runtime.bundle import load_bundle
from rampserve.workloads.fashion_mnist import load_fashion_mnist, to_model_input

QUERIES = 8
FEEDBACK_QUERIES = 6
FAILURE_QUERIES = 5
MODELS = ("near-a", "near-b", "far")


@pytest.fixture(scope="module")
def report(resnet_bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("race-models")
    refs = tuple(str(shutil.copytree(resnet_bundle, root / name)) for name in MODELS)
    settings = RaceSettings(models=refs, remote="far", timeouts_ms=(None, 5000.0), queries=QUERIES,
                            calibration_queries=4, feedback_queries=FEEDBACK_QUERIES, failing="near-b",
                            failure_queries=FAILURE_QUERIES, rate_rps=200.0, remote_process=False)
    out = root / "race.json"
    result = run_race(settings, json_out=out, progress=False)
    written = json.loads(out.read_text())
    assert written.pop("provenance")["cpus"] >= 1  # what was written is the report, with the run's provenance
    assert written == json.loads(json.dumps(result))
    return result


def test_every_query_gets_exactly_one_answer_per_configuration(report) -> None:
    timeouts = report["timeouts_ms"]
    assert timeouts[0] == calibrated_timeout_ms(report["calibration"]) == report["calibrated_timeout_ms"]
    assert timeouts[1] == 5000.0
    configurations = report["configurations"]
    races = [c for c in configurations.values() if c["kind"] == "race"]
    singles = [c for c in configurations.values() if c["kind"] == "single"]
    assert sorted((c["decider"], c["timeout_ms"]) for c in races) == sorted((d, t) for d in DECIDERS for t in timeouts)
    assert sorted(c["models"][0] for c in singles) == sorted(MODELS)
    learning = [c for c in races if c["decider"] in LEARNING_DECIDERS]
    # every query to every configuration, and its true label to each learning race after its answer
    assert report["load"]["requests"] == QUERIES * (len(configurations) + len(learning))
    assert report["load"]["feedback"]["requests"] == QUERIES * len(learning)
    assert report["load"]["feedback"]["errors"] == 0
    assert report["models"]["far"]["where"] == "remote" and report["remote"]["attempts"] >= QUERIES
    assert report["remote"]["server"] == "thread of the bench's process"
    for name, info in report["models"].items():
        measured = sum(c["model_stats"][name]["asked"] for c in configurations.values() if name in c["models"])
        # each measured query once per configuration, and a learning race's feedback asks again only a model
        # that has not answered that query at all
        assert measured >= QUERIES * (len(races) + 1)
        assert measured - QUERIES * (len(races) + 1) <= sum(c["model_stats"][name]["failed"] for c in learning)
        asked, failed = info["applications"]["asked"], info["applications"]["failed"]
        assert asked >= measured + report["calibration"]["queries"] + FEEDBACK_QUERIES * len(learning)
        if info["where"] == "local":  # the server ran what its applications asked, less what it refused
            assert asked - failed <= info["serving"]["requests"] <= asked
        assert "sites" in info["serving"]["configuration"]
    query_ids = []
    for c in configurations.values():
        answers = c["answers"]
        assert all(len(values) == QUERIES for values in answers.values())
        assert c["errors"] == 0 and set(answers["status"]) == {200}
        assert c["app_requests"] == QUERIES and c["app_defaults"] == c["defaults"] == sum(answers["default"])
        query_ids += answers["query_id"]
    # one GUID per query: no answer was duplicated or lost between the client and the applications
    assert len(set(query_ids)) == len(query_ids) == QUERIES * len(configurations)
    assert all(len(q) == 32 for q in query_ids)


def test_accuracy_and_wins_agree_with_the_recorded_answers(report, resnet_bundle) -> None:
    pixels, pixels_labels = load_fashion_mnist("test")
    labels = report["labels"]
    assert labels == pixels_labels[report["images"]].tolist() and len(labels) == QUERIES
    # the original model's own accuracy on the same images, computed here once more
    original = load_bundle(resnet_bundle).run({"x": to_model_input(pixels[report["images"]])})
    for info in report["models"].values():
        assert info["offline_accuracy"] == pytest.approx(np.mean(original.argmax(axis=1) == labels))
    for c in report["configurations"].values():
        answers = c["answers"]
        correct = correct_answers(answers, labels)
        assert c["accuracy"] == pytest.approx(correct.mean())
        answered = QUERIES - c["defaults"]
        assert c["accuracy_answered"] == (pytest.approx(correct.sum() / answered) if answered else None)
        assert c["default_share"] == pytest.approx(c["defaults"] / QUERIES)
        for output, default, winners in zip(answers["output"], answers["default"], answers["models"]):
            if default:  # no decision: the default output (None here), and no model won
                assert output is None and winners == []
            else:
                assert isinstance(output, int) and set(winners) <= set(c["models"]) and winners
        # the application's win counts are the answers' winners
        assert c["wins"] == {m: Counter(w for ws in answers["models"] for w in ws)[m] for m in c["models"]}
        for stats in c["model_stats"].values():
            # stragglers had finished when the statistics were read: every ask is accounted for once
            assert stats["asked"] == stats["answered"] + stats["late"] + stats["failed"]
            assert stats["asked"] == QUERIES or c["decider"] in LEARNING_DECIDERS
            latency = stats["latency_ms"]
            if stats["answered"] + stats["late"]:
                assert 0 <= latency["mean"]
                # a learning race served the feedback images before: only its mean is this run's own
                if c["decider"] not in LEARNING_DECIDERS:
                    assert latency["min"] <= latency["mean"] <= latency["max"]
        latency = c["latency_ms"]
        assert latency["p50"] <= latency["p99"] <= latency["max"]
        assert latency["max"] == pytest.approx(max(answers["latency_ms"]))
        if c["kind"] == "single":
            assert c["models"] == [c["models"][0]] and not any(answers["default"])
        elif c["decider"] == "first":
            assert all(len(w) == 1 for w in answers["models"] if w)
        elif c["decider"] == "consensus":  # quorum: a majority of three
            assert all(len(w) >= 2 for w, d in zip(answers["models"], answers["default"]) if not d)
        if c["kind"] == "race":
            assert c["p99_within_bound"] == (latency["p99"] <= c["timeout_ms"] + report["tolerance_ms"])
    assert report["p99_within_bound"] == all(c["p99_within_bound"] for c in report["configurations"].values()
                                             if c["kind"] == "race")


def test_consensus_is_compared_with_the_best_single_model(report) -> None:
    configurations = report["configurations"]
    singles = {c["models"][0]: c["accuracy"] for c in configurations.values() if c["kind"] == "single"}
    for row in report["comparison"]:
        consensus = next(c for c in configurations.values()
                         if c["decider"] == "consensus" and c["timeout_ms"] == row["timeout_ms"])
        assert row["best_single_accuracy"] == max(singles.values()) == singles[row["best_single_model"]]
        assert row["consensus_accuracy"] == consensus["accuracy"]
        assert row["consensus_minus_best_single"] == pytest.approx(consensus["accuracy"] - max(singles.values()))
    console = Console(record=True, width=250)
    console.print(race_table(report))
    console.print(model_table(report))
    text = console.export_text()
    assert all(f"{m} alone" in text for m in MODELS) and "consensus" in text
    lines = comparison_lines(report)
    assert "best single model" in lines[2] and sum(line.startswith("bar, learned") for line in lines) == 2


def test_the_learning_race_learned_and_the_bars_are_its_figures(report) -> None:
    feedback = report["feedback"]
    learning = [app for app, c in report["configurations"].items() if c["decider"] in LEARNING_DECIDERS]
    assert feedback["apps"] == learning and feedback["load"]["feedback"]["requests"] == FEEDBACK_QUERIES * len(learning)
    assert feedback["load"]["feedback"]["errors"] == 0
    for app in learning:  # the feedback images' answers were scored against their labels, a quarter at a time
        assert len(feedback["accuracy_by_quarter"][app]) == 4
        assert all(0.0 <= a <= 1.0 for a in feedback["accuracy_by_quarter"][app])
        for stats in report["configurations"][app]["model_stats"].values():
            assert stats["feedback"] >= QUERIES  # every measured answer was followed by its label
    bars = report["bars"]["learned"]
    assert [row["timeout_ms"] for row in bars["by_timeout"]] == report["timeouts_ms"]
    failure = report["failure"]["configurations"]
    for row in bars["by_timeout"]:
        race = next(c for c in report["configurations"].values()
                    if c["decider"] == "learned" and c["timeout_ms"] == row["timeout_ms"])
        failed = next(c for c in failure.values() if c["decider"] == "learned" and c["timeout_ms"] == row["timeout_ms"])
        assert row["accuracy"] == race["accuracy"] and row["failure_accuracy"] == failed["accuracy"]
        assert row["beats_best_single"] == (race["p99_within_bound"]
                                            and race["accuracy"] >= row["best_single_accuracy"] + LEARNED_MARGIN - 1e-9)
        assert row["failure_at_least_best_remaining"] == (failed["accuracy"] >= row["best_remaining_accuracy"])
    assert bars["met_at_ms"] == [r["timeout_ms"] for r in bars["by_timeout"]
                                 if r["beats_best_single"] and r["failure_at_least_best_remaining"]]


def test_the_failure_run_asks_the_failed_model_in_vain_and_scores_the_rest(report) -> None:
    failure = report["failure"]
    assert failure["model"] == "near-b" and len(failure["labels"]) == FAILURE_QUERIES
    assert not set(failure["images"]) & set(report["images"])  # images of its own
    configurations = failure["configurations"]
    singles = sorted(c["models"][0] for c in configurations.values() if c["kind"] == "single")
    assert singles == ["far", "near-a"]  # the remaining models alone
    for c in configurations.values():
        answers = c["answers"]
        assert c["errors"] == 0 and len(answers["status"]) == FAILURE_QUERIES
        assert c["accuracy"] == pytest.approx(correct_answers(answers, failure["labels"]).mean())
        if c["kind"] == "race":  # every ask of the failed model failed, and its answer never carried a decision
            stats = c["model_stats"]["near-b"]
            assert stats["failed"] == stats["asked"] >= FAILURE_QUERIES and c["wins"]["near-b"] == 0
            assert stats["answered"] == stats["late"] == 0
    row = failure["comparison"][0]
    assert row["best_single_model"] in ("far", "near-a")


def test_seeds_sum_up_as_medians_and_ranges_of_each_run(report) -> None:
    other = json.loads(json.dumps(report))  # a second seed's run, its accuracies shifted
    other["settings"]["seed"] = 1
    for c in [*other["configurations"].values(), *other["failure"]["configurations"].values()]:
        c["accuracy"] -= 0.5
    summary = seeds_summary([report, other])
    assert summary["seeds"] == [0, 1] and summary["failing_models"] == ["near-b", "near-b"]
    for app, c in report["configurations"].items():
        figures = summary["configurations"][app]
        assert figures["accuracy"]["values"] == [c["accuracy"], c["accuracy"] - 0.5]
        assert figures["accuracy"]["median"] == pytest.approx(c["accuracy"] - 0.25)
        assert figures["p99_ms"]["min"] == figures["p99_ms"]["max"] == c["latency_ms"]["p99"]
        assert figures["minus_best_single"]["values"][0] == figures["minus_best_single"]["values"][1]
    assert set(summary["failure"]) == set(report["failure"]["configurations"])
    assert summary["bars"]["learned"]["met_at_ms"] == [report["bars"]["learned"]["met_at_ms"]] * 2
    console = Console(record=True, width=250)
    console.print(seeds_table(summary))
    assert "near-b failing" in console.export_text()


def test_diversity_counts_what_the_models_get_right() -> None:
    labels = np.array([0, 1, 2, 3])
    figures = diversity({"a": np.array([0, 1, 9, 9]), "b": np.array([0, 9, 2, 9]), "c": np.array([0, 1, 8, 3])},
                        labels)
    assert figures["any_right"] == 1.0 and figures["all_right"] == 0.25
    # right on 0 and 1 by two votes; on 2 all differ and a, the first, is wrong; on 3 two agree on a wrong label
    assert figures["majority"] == 0.5
    assert figures["pairs"]["a|b"] == {"disagree": 0.5, "both_wrong": 0.25}


def test_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="distinct names"):
        RaceSettings(models=("vgg11-fmnist", "vgg11-fmnist"))
    with pytest.raises(ValueError, match="remote model"):
        RaceSettings(remote="nope")
    with pytest.raises(ValueError, match="timeouts"):
        RaceSettings(timeouts_ms=(0.0,))
    with pytest.raises(ValueError, match="rate_rps"):
        RaceSettings(rate_rps=0.0)
    with pytest.raises(ValueError, match="failing model"):
        RaceSettings(failing="nope")
