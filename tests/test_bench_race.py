"""`rampserve bench race` on tiny settings, for real: the small prepared ResNet served three times (once by a
second rampserve, reached over v2: a server thread here, where the benchmark starts a process, which costs a
test ten seconds more), every decider at a calibrated and a generous timeout, each model alone, real
Fashion-MNIST test queries from a client process of its own. The report must agree with itself and with the
answers it recorded; timings are the benchmark's business, not the test's."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from rich.console import Console

from rampserve.bench.race import (
    DECIDERS,
    RaceSettings,
    calibrated_timeout_ms,
    comparison_lines,
    correct_answers,
    model_table,
    race_table,
    run_race,
)
from rampserve.serving.models import load_served
from rampserve.workloads.fashion_mnist import load_fashion_mnist, to_model_input

QUERIES = 8
MODELS = ("near-a", "near-b", "far")


@pytest.fixture(scope="module")
def report(resnet_bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("race-models")
    refs = tuple(str(shutil.copytree(resnet_bundle, root / name)) for name in MODELS)
    settings = RaceSettings(models=refs, remote="far", timeouts_ms=(None, 5000.0), queries=QUERIES,
                            calibration_queries=4, rate_rps=200.0, remote_process=False)
    out = root / "race.json"
    result = run_race(settings, json_out=out, progress=False)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))  # what was written is the report
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
    assert report["load"]["requests"] == QUERIES * len(configurations)
    assert report["models"]["far"]["where"] == "remote" and report["remote"]["attempts"] >= QUERIES
    assert report["remote"]["server"] == "thread of the bench's process"
    for name, info in report["models"].items():
        asks = [report["calibration"]["models"][name]] + [c["model_stats"][name] for c in configurations.values()
                                                          if name in c["models"]]
        asked, failed = sum(a["asked"] for a in asks), sum(a["failed"] for a in asks)
        assert asked == report["calibration"]["queries"] + QUERIES * (len(races) + 1)
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
    original = load_served(str(resnet_bundle)).model.run({"x": to_model_input(pixels[report["images"]])})
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
            assert stats["asked"] == QUERIES == stats["answered"] + stats["late"] + stats["failed"]
            latency = stats["latency_ms"]
            if stats["answered"] + stats["late"]:
                assert 0 <= latency["min"] <= latency["mean"] <= latency["max"]
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
    assert len(lines) == len(report["timeouts_ms"]) + 3 and "best single model" in lines[2]


def test_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="distinct names"):
        RaceSettings(models=("vgg11-fmnist", "vgg11-fmnist"))
    with pytest.raises(ValueError, match="remote model"):
        RaceSettings(remote="nope")
    with pytest.raises(ValueError, match="timeouts"):
        RaceSettings(timeouts_ms=(0.0,))
    with pytest.raises(ValueError, match="rate_rps"):
        RaceSettings(rate_rps=0.0)
