"""The parts of serving a model before it is prepared that need no server: the request log its traffic becomes
(read back by the server's own v2 parser, resumed after a crash), and how the training job's output is read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.serving.learning import (
    CERTIFYING_DETAIL,
    PROFILING,
    TRAINING,
    RequestRecorder,
    certified,
    certifying_detail,
    failure_reason,
    job_stage,
    request_line,
    unprepared_model,
)
from rampserve.serving.shared.protocol import TensorSpec, parse_infer_request

SPECS = (TensorSpec("pixels", "FP32", (-1, 3)), TensorSpec("mask", "INT64", (-1, -1)))


def inputs(values: list[float], width: int = 2) -> dict[str, np.ndarray]:
    return {"pixels": np.asarray(values, dtype=np.float32).reshape(1, 3),
            "mask": np.arange(width, dtype=np.int64).reshape(1, width)}


def test_a_recorded_line_is_a_v2_request_the_server_reads_back_as_it_was() -> None:
    batch = {"pixels": np.array([[0.1, -2.5e-8, 3.0], [1e30, 0.0, -7.25]], dtype=np.float32),
             "mask": np.array([[1, 1, 0], [1, 0, 0]], dtype=np.int64)}
    parsed = parse_infer_request(request_line(batch, {s.name: s.datatype for s in SPECS}), None, SPECS)
    assert parsed.inputs.keys() == batch.keys()
    for name, array in batch.items():
        assert parsed.inputs[name].dtype == array.dtype and np.array_equal(parsed.inputs[name], array)


rows = st.lists(st.floats(-1e6, 1e6, width=32), min_size=3, max_size=3)


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(rows, min_size=1, max_size=30), target=st.integers(1, 12))
def test_the_recorder_keeps_the_first_distinct_requests_up_to_its_target(requests, target, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("log") / "recording.jsonl"
    recorder = RequestRecorder(path, target, SPECS)
    filled = []
    recorder.on_full = lambda: filled.append(recorder.count)
    for values in requests:
        recorder.record(inputs(values))
    first_seen: dict[bytes, tuple] = {}  # distinct as sent, bit for bit (0.0 and -0.0 are two requests)
    for values in requests:
        first_seen.setdefault(np.float32(values).tobytes(), tuple(np.float32(values)))
    distinct = list(first_seen.values())
    expected = distinct[:target]
    lines = path.read_bytes().splitlines()
    assert recorder.count == len(lines) == len(expected)
    assert [tuple(parse_infer_request(line, None, SPECS).inputs["pixels"][0]) for line in lines] == expected
    assert filled == ([target] if len(distinct) >= target else [])


def test_a_recording_left_by_a_killed_server_is_resumed_without_its_unfinished_line(tmp_path: Path) -> None:
    path = tmp_path / "recording.jsonl"
    first = RequestRecorder(path, 5, SPECS)
    for i in range(3):
        first.record(inputs([i, i, i]))
    first.close()
    with path.open("ab") as log:  # a server killed while writing a line leaves part of it
        log.write(request_line(inputs([9, 9, 9]), {"pixels": "FP32", "mask": "INT64"})[:20])
    resumed = RequestRecorder(path, 5, SPECS)
    assert resumed.count == 3 and not resumed.full
    resumed.record(inputs([1, 1, 1]))  # already recorded: not counted again
    resumed.record(inputs([4, 4, 4]))
    lines = path.read_bytes().splitlines()
    assert resumed.count == len(lines) == 4
    assert [parse_infer_request(line, None, SPECS).inputs["pixels"][0, 0] for line in lines] == [0, 1, 2, 4]
    resumed.close()
    assert RequestRecorder(path, 4, SPECS).full


def test_the_training_jobs_stages_and_its_refusal_are_read_from_its_output() -> None:
    assert job_stage("running the model for ramp features:  40%|####      | 2/5 [00:01<00:01]") == TRAINING
    assert job_stage("training ramps: 100%|##########| 8/8 [00:02<00:00]") == TRAINING
    assert job_stage("profiling latency:   0%|          | 0/7") == PROFILING
    assert job_stage("prepared model.onnx on onnxruntime") is None
    box = ["Usage: rampserve prepare [OPTIONS] {model}", "╭─ Error ───────────────────╮",
           "│ Invalid value: the request log holds 5 inputs, │", "│ at least 200 are needed       │",
           "╰───────────────────────────╯"]
    assert failure_reason(box) == "Invalid value: the request log holds 5 inputs, at least 200 are needed"
    trace = ["Traceback (most recent call last):", '  File "x.py", line 1', "RuntimeError: out of memory", ""]
    assert failure_reason(trace) == "RuntimeError: out of memory"
    assert failure_reason([]) is None


def test_a_model_is_managed_once_its_configuration_has_an_exit() -> None:
    assert not certified({"configuration": {"sites": [], "thresholds": []}})
    assert not certified({"configuration": {"sites": ["a", "b"], "thresholds": [0.0, 0.0]}})
    assert certified({"configuration": {"sites": ["a", "b"], "thresholds": [0.0, 0.12]}})
    assert not certified({"unavailable": "the executor process is restarting"})


def test_a_certifying_model_says_when_no_ramp_fits_the_batch_size_it_serves() -> None:
    assert certifying_detail({"ramps_fit": True, "ramp_budget": 0.2, "budget_batch": 1}) == CERTIFYING_DETAIL
    assert certifying_detail({"unavailable": "the executor process is restarting"}) == CERTIFYING_DETAIL
    detail = certifying_detail({"ramps_fit": False, "ramp_budget": 0.2, "budget_batch": 8})
    assert detail.startswith("no ramp fits the ramp budget (20% of the model) at batch 8")


def test_which_models_are_served_unprepared_and_where_they_keep_their_state(tmp_path: Path) -> None:
    folder = tmp_path / "clf"
    folder.mkdir()
    assert unprepared_model(str(folder)) is None  # holds no model
    (folder / "model.onnx").write_bytes(b"")
    own = unprepared_model(str(folder))
    assert own.name == "clf" and own.folder.path == folder and own.source == str(folder / "model.onnx")
    (folder / "manifest.json").write_text("{}")
    assert unprepared_model(str(folder)) is None  # a bundle
    elsewhere = unprepared_model(str(folder / "model.onnx"))
    other = tmp_path / "other" / "model.onnx"
    other.parent.mkdir()
    other.write_bytes(b"")
    assert elsewhere.name == "model" and elsewhere.folder != unprepared_model(str(other)).folder
    assert unprepared_model("resnet18-fmnist") is None


def test_a_request_is_set_in_the_phase_the_server_was_in_when_it_arrived() -> None:
    """Phases a relearning goes through again are told from the first ones."""
    from rampserve.bench.cold import phase_labels, phase_of

    history = [{"phase": "recording", "at": 100.0}, {"phase": "training", "at": 130.5},
               {"phase": "certifying", "at": 190.0}, {"phase": "managed", "at": 250.0},
               {"phase": "recording", "at": 500.0}, {"phase": "training", "at": 520.0},
               {"phase": "managed", "at": 600.0}]
    arrived = np.array([99.0, 100.0, 130.4, 130.5, 189.99, 190.0, 400.0, 510.0, 700.0])
    assert np.array(phase_labels(history))[phase_of(arrived, history)].tolist() == [
        "recording", "recording", "recording", "training", "training", "certifying", "managed",
        "recording, relearning", "managed, relearning"]


def test_requests_with_the_training_job_stopped_are_told_from_those_with_it_running() -> None:
    from rampserve.bench.cold import paused_figures
    from rampserve.bench.loadgen import LoadResult

    # Arrivals each second from 0 to 59; the job stopped at 10, went on at 20, stopped at 30, went on at 40
    arrived = np.arange(60.0)
    latency = np.where(((arrived >= 10) & (arrived < 20)) | ((arrived >= 30) & (arrived < 40)), 1.0, 3.0)
    latency[5] = 9.0  # the first running turn's slowest
    none = np.zeros(60)
    result = LoadResult(arrived * 1000, none, arrived * 1000 + latency, np.full(60, 200), none.astype(int),
                        none.astype(bool), none.astype(int), (), {}, None, None)
    figures = paused_figures(result, arrived, np.arange(60), [(10.0, False), (20.0, True), (30.0, False),
                                                               (40.0, True)])
    assert figures["running"]["requests"] == 40 and figures["stopped"]["requests"] == 20
    assert figures["stopped"]["p99_ms"] == 1.0 and figures["running"]["p50_ms"] == 3.0
    ratios = figures["turn_p99_ratio"]
    assert ratios["min_max"][0] == 3.0 and ratios["min_max"][1] > 3.0  # two pairs: (0-9, 10-19), (20-29, 30-39)


def test_exits_before_a_change_are_set_against_those_after_the_relearning_on_the_same_requests_as_vanilla() -> None:
    """`bench live --from-cold --change-at`: the last seconds of the first managed spell before the change against
    the last of the relearned generation's, each side's p50 saving taken on vanilla's replay of its own requests."""
    from rampserve.bench.cold import ColdSettings, change_figures, change_sides, phase_of
    from rampserve.bench.loadgen import LoadResult

    settings = ColdSettings(model="hf:checkpoint", data=Path("texts.jsonl"), change_at=60, compare_s=10.0)
    arrived = np.arange(100.0)  # one request a second, row i at second i
    history = [{"phase": "recording", "at": 0.0}, {"phase": "managed", "at": 20.0},
               {"phase": "recording", "at": 65.0}, {"phase": "managed", "at": 80.0}]
    occurrences = phase_of(arrived, history)
    sides = change_sides(settings, arrived * 1000, occurrences, history)
    assert sides["before"].tolist() == list(range(49, 60)) and sides["after"].tolist() == list(range(89, 100))
    early = (arrived % 2 == 0) & (((arrived >= 20) & (arrived < 60)) | (arrived >= 80))
    early[89:100] &= arrived[89:100] % 4 == 0  # after: 2 of its 11 where 5 of 11 exited before
    latency = np.where(early, 1.0, 5.0)
    ones = np.ones(100)

    def result(latency_ms: np.ndarray, early_rows: np.ndarray) -> LoadResult:
        n = len(latency_ms)
        scheduled = np.arange(n) * 1000.0
        return LoadResult(scheduled, scheduled, scheduled + latency_ms, np.full(n, 200), np.zeros(n, int),
                          early_rows, np.zeros(n, int), (), {}, None, None)

    spans = [(49, 60), (89, 100)]
    replays = [result(np.full(11, 6.0), np.zeros(11, bool)), result(np.full(11, 6.0), np.zeros(11, bool))]
    learning = {"drifts": [{"at": 70.0}], "phases": history}
    figures = change_figures(settings, result(latency, early), ones.astype(bool), sides, replays, spans, learning, 0.0)
    assert figures["before"]["early_share"] == 5 / 11 and figures["after"]["early_share"] == 2 / 11
    assert figures["before"]["vanilla_p50_ms"] == 6.0 and figures["before"]["p50_saving_ms"] == 1.0
    assert figures["early_share_recovered"] == 2 / 5 and figures["p50_saving_recovered"] == 1.0
    assert figures["drift_detected_s"] == 70.0 and figures["relearned_managed_s"] == 80.0
