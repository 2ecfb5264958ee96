"""`bench peers` without the peers' own venvs: every peer runs what rampserve's vanilla runs (an ONNX bundle's own
file at its engine's threads, or a torch bundle's TorchScript trace) and gives the original model's labels, the Ray
Serve peer answers them through v2 JSON, the client's JSON bodies are what the JSON peers read, each peer's server is
started from its venv with the model's description and the repository on its path; where a peer's venv has been made
(by a `bench peers` run), its server starts for real and answers the benchmark's client over each transport it is
spoken to in. And the rounds' arithmetic: rotated orders, medians and min–max over rounds, saturation from a sweep
under the SLO rule, goals on medians, the report's shape with a system that failed."""

from __future__ import annotations

import io
import json
import signal
import socket
import sys
import tomllib
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray import serve
from rich.console import Console

from rampserve.bench.harness import ServerProcess
from rampserve.bench.live import LiveSettings
from rampserve.bench.loadgen import Job, LoadResult, encode_request, read_answer
from rampserve.bench.peers import (
    BASELINE, EXITS, GRPC, JSON, MAX_UNANSWERED_SHARE, PEERS, SYSTEMS, TRANSPORTS, PeerLaunch,
    PeerSettings, ensure_venv, goals, infer_url, input_specs, mlserver_repository, over_rounds, peer_model,
    peer_server, peers_notes, peers_table, round_orders, saturation_from_sweep, sweep_point, system_summary,
    transport_of, with_ratios, within_slo,
)
from rampserve.bench.peers_engine import (
    PeerModel, label_function, labels_per_request, v2_json_feeds, v2_json_labels,
)
from rampserve.bench.peers_plots import write_peer_plots
from rampserve.bench.peers_ray import V2Classifier
from rampserve.graph.onnx_graph import ONNX_SPIN_US
from rampserve.runtime.bundle import load_bundle
from rampserve.workloads.fashion_mnist import to_model_input
from rampserve.workloads.streams import get_stream


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def inputs() -> np.ndarray:
    stream = get_stream("fmnist-drift")
    start = stream.evaluation.start
    return to_model_input(stream.items(start, start + 12))


def original_labels(bundle, inputs: np.ndarray) -> np.ndarray:
    model = load_bundle(bundle)
    return model.run({model.backend.input_names[0]: inputs}).argmax(axis=1)


def served_model(bundle: Path, inputs: np.ndarray, workdir: Path) -> PeerModel:
    model = load_bundle(bundle)
    return peer_model(model, {model.backend.input_names[0]: inputs[:1]}, workdir)


def json_job(url: str, input_name: str) -> Job:
    return Job(url, ((input_name, "FP32"),), "label", None, json_bodies=True)


def post(job: Job, request: dict[str, np.ndarray]) -> bytes:
    body, headers = encode_request(job, request)
    with urllib.request.urlopen(urllib.request.Request(job.url, data=body, headers=headers), timeout=60) as response:
        return response.read()


def test_json_request_is_plain_v2_and_what_the_json_peers_read(inputs):
    job = json_job("http://unused", "x")
    body, headers = encode_request(job, {"x": inputs[:2]})
    decoded = orjson.loads(body)
    assert headers == {"Content-Type": "application/json"}
    tensor = decoded["inputs"][0]
    assert (tensor["name"], tensor["datatype"], tensor["shape"]) == ("x", "FP32", list(inputs[:2].shape))
    feeds = v2_json_feeds(decoded)
    assert list(feeds) == ["x"] and feeds["x"].dtype == np.float32
    np.testing.assert_array_equal(feeds["x"], inputs[:2])
    tokens = np.array([[101, 7, 102]], dtype=np.int64)  # a text model's inputs keep their integer type
    text = v2_json_feeds(orjson.loads(encode_request(Job("http://unused", (("input_ids", "INT64"),), "label", None,
                                                         json_bodies=True), {"input_ids": tokens})[0]))
    assert text["input_ids"].dtype == np.int64
    np.testing.assert_array_equal(text["input_ids"], tokens)
    answer = orjson.dumps(v2_json_labels("m", np.array([3, 1], dtype=np.int64)))
    assert read_answer(answer, "label") == (3, False, None, None)  # the client reads the JSON peers' answers (no trace)


def test_every_peer_runs_an_onnx_bundles_own_file_at_its_engines_threads(onnx_bundle, inputs, tmp_path):
    model = load_bundle(onnx_bundle)
    served = served_model(onnx_bundle, inputs, tmp_path)
    assert Path(served.path) == onnx_bundle / "model.onnx"  # the file rampserve serves, not an export of its own
    assert served.engine == "onnxruntime"
    assert served.input_names == tuple(model.backend.input_names)
    assert (served.intra_op_threads, served.spin_us) == (model.backend.intra_op_threads, ONNX_SPIN_US)
    assert not list(tmp_path.iterdir())
    assert PeerModel.from_json(served.to_json()) == served  # what a peer's command line carries
    labels = label_function(served)
    for batch in (1, 5, 12):  # the batch axis is dynamic
        found = labels({served.input_names[0]: inputs[:batch]})
        assert found.dtype == np.int64
        np.testing.assert_array_equal(found, original_labels(onnx_bundle, inputs[:batch]))


def test_a_torch_bundle_is_served_to_peers_as_a_torchscript_trace_on_one_thread(resnet_bundle, inputs, tmp_path):
    served = served_model(resnet_bundle, inputs, tmp_path)
    assert served.engine == "torchscript" and served.intra_op_threads == 1
    assert Path(served.path).parent == tmp_path
    labels = label_function(served)
    for batch in (1, 5, 12):
        np.testing.assert_array_equal(labels({served.input_names[0]: inputs[:batch]}),
                                      original_labels(resnet_bundle, inputs[:batch]))


def test_requests_batched_together_get_their_own_labels_back(onnx_bundle, inputs, tmp_path):
    served = served_model(onnx_bundle, inputs, tmp_path)
    name = served.input_names[0]
    requests = [{name: inputs[0:1]}, {name: inputs[1:4]}, {name: inputs[4:5]}]
    answers = labels_per_request(label_function(served), requests)
    expected = original_labels(onnx_bundle, inputs[:5])
    assert [a.tolist() for a in answers] == [expected[0:1].tolist(), expected[1:4].tolist(), expected[4:5].tolist()]


def test_ray_serve_peer_answers_the_original_labels(local_ray, onnx_bundle, inputs, tmp_path):
    expected = original_labels(onnx_bundle, inputs)
    served = served_model(onnx_bundle, inputs, tmp_path)
    name = served.input_names[0]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(V2Classifier.bind(served, "small", 4, 0.001), name="peer", route_prefix="/")
        job = json_job(f"http://127.0.0.1:{port}/v2/models/small/infer", name)
        labels = [read_answer(post(job, {name: inputs[i:i + 1]}), "label")[0] for i in range(len(inputs))]
        assert labels == expected.tolist()
        whole = orjson.loads(post(job, {name: inputs}))  # several inputs in one request keep their order
        assert whole["model_name"] == "small"
        assert whole["outputs"][0]["data"] == expected.tolist()
        with pytest.raises(urllib.error.HTTPError) as wrong_path:
            post(json_job(f"http://127.0.0.1:{port}/v2/models/other/infer", name), {name: inputs[:1]})
        assert wrong_path.value.code == 404
    finally:
        serve.shutdown()


def test_mlserver_repository_sets_adaptive_batching_and_carries_the_model(tmp_path):
    served = PeerModel(str(tmp_path / "model.onnx"), ("x",), 0, ONNX_SPIN_US)
    root = mlserver_repository(tmp_path / "repo", "m", served, 8, 0.0, (1, 2, 3))
    server = json.loads((root / "settings.json").read_text())
    assert (server["host"], server["http_port"], server["grpc_port"], server["metrics_port"]) == ("127.0.0.1", 1, 2, 3)
    model = json.loads((root / "m" / "model-settings.json").read_text())
    assert model["max_batch_size"] == 8
    assert 0 < model["max_batch_time"] <= 1e-3  # 0 would turn MLServer's batching off
    assert model["implementation"] == "runtime.Labels"
    assert PeerModel.from_json(model["parameters"]["extra"]["peer_model"]) == served
    assert (root / "m" / "runtime.py").is_file()


def launch(served: PeerModel, workdir: Path, venv_bin: Path | None, max_batch: int = 4) -> PeerLaunch:
    return PeerLaunch(served, "m", max_batch, 0.0, [("x", "float32", [1, 28, 28])], workdir, 120.0, venv_bin)


VENV_PEERS = ("mlserver", "triton", "kserve", "litserve")


@pytest.mark.parametrize("name", VENV_PEERS)
def test_a_peer_in_a_venv_of_its_own_runs_its_python_with_the_model_and_the_repository_on_its_path(name, tmp_path):
    served = PeerModel(str(tmp_path / "model.onnx"), ("x",), 0, ONNX_SPIN_US)
    command = peer_server(name, launch(served, tmp_path, tmp_path / "venv" / "bin")).command
    repository = Path(__file__).resolve().parents[1]
    program = tmp_path / "venv" / "bin" / ("mlserver" if name == "mlserver" else "python")
    assert command[:3] == ["env", f"PYTHONPATH={repository}", str(program)]
    arguments = command[3:]
    if name == "mlserver":  # the model is in the repository's settings
        settings = json.loads((tmp_path / "mlserver" / "m" / "model-settings.json").read_text())
        assert PeerModel.from_json(settings["parameters"]["extra"]["peer_model"]) == served
    else:
        assert arguments[0] == str(repository / "rampserve" / "bench" / name / "server.py")
        assert PeerModel.from_json(arguments[1]) == served
        assert arguments[arguments.index("--name") + 1] == "m"
    with pytest.raises(ValueError, match="venv"):
        peer_server(name, launch(served, tmp_path, None))


def test_the_client_finds_each_peer_where_it_serves_in_the_transport_it_reads(tmp_path):
    served = PeerModel(str(tmp_path / "model.onnx"), ("x",), 0, ONNX_SPIN_US)
    srv = peer_server("kserve", launch(served, tmp_path, tmp_path))
    assert infer_url(srv, "kserve", "m", "http") == f"http://127.0.0.1:{srv.port}/v2/models/m/infer"
    assert infer_url(srv, "kserve", "m", GRPC) == f"grpc://127.0.0.1:{srv.grpc_port}/m"
    assert infer_url(srv, "litserve", "m", GRPC) == f"http://127.0.0.1:{srv.port}/predict"  # LitServe: HTTP only
    assert infer_url(srv, "ray_serve", "m", GRPC) == f"http://127.0.0.1:{srv.port}/v2/models/m/infer"
    assert (transport_of("kserve", "http"), transport_of("litserve", "http")) == ("binary", JSON)
    assert (transport_of("kserve", GRPC), transport_of("litserve", GRPC)) == (GRPC, JSON)
    with pytest.raises(ValueError, match="not a peer"):
        peer_server("torchserve", launch(served, tmp_path, tmp_path))


def test_every_peer_runs_the_onnx_runtime_that_rampserve_pins():
    repository = Path(__file__).resolve().parents[1]
    pins = tomllib.loads((repository / "pyproject.toml").read_text())["project"]["dependencies"]
    onnxruntime = next(pin for pin in pins if pin.startswith("onnxruntime=="))
    for name in VENV_PEERS:
        requirements = (repository / "rampserve" / "bench" / name / "requirements.txt").read_text().splitlines()
        assert onnxruntime in [line.split("#")[0].strip() for line in requirements], name


# --- rounds -------------------------------------------------------------------------------------------------------

def test_each_round_starts_one_system_further_along():
    orders = round_orders(SYSTEMS, 3)
    assert orders[0] == SYSTEMS
    assert orders[1] == SYSTEMS[1:] + SYSTEMS[:1]
    assert orders[2] == SYSTEMS[2:] + SYSTEMS[:2]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(1, 12))
def test_every_round_runs_every_system_once_and_each_system_takes_every_position(n, rounds):
    systems = [f"s{i}" for i in range(n)]
    orders = round_orders(systems, rounds)
    assert len(orders) == rounds
    assert all(sorted(order) == sorted(systems) for order in orders)
    positions = {name: [order.index(name) for order in orders] for name in systems}
    for taken in positions.values():
        # no position twice before every position was taken once
        assert set(taken) == set(range(n)) if rounds >= n else len(set(taken)) == rounds


def test_medians_and_min_max_over_rounds_skip_what_a_round_lacks():
    rounds = [{"p50_ms": 3.0, "throughput_rps": 100, "errors": {"x": 1}, "compiled": True, "p99_ms": None},
              {"p50_ms": 1.0, "throughput_rps": 300, "p99_ms": None},
              {"p50_ms": None, "throughput_rps": 200, "p99_ms": None}]
    medians, spans = over_rounds(rounds)
    assert medians == {"p50_ms": 2.0, "throughput_rps": 200.0, "p99_ms": None}  # flags and dicts are no figures
    assert spans == {"p50_ms": [1.0, 3.0], "throughput_rps": [100.0, 300.0], "p99_ms": None}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=9))
def test_the_median_over_rounds_lies_within_their_min_and_max(values):
    medians, spans = over_rounds([{"p99_ms": v} for v in values])
    low, high = spans["p99_ms"]
    assert (low, high) == (min(values), max(values))
    assert low <= medians["p99_ms"] <= high


# --- the sweep and saturation ---------------------------------------------------------------------------------------

def load_result(scheduled_ms: list[float], latency_ms: list[float], status: list[int]) -> LoadResult:
    n = len(scheduled_ms)
    scheduled = np.asarray(scheduled_ms, dtype=np.float64)
    ok = np.asarray(status) == 200
    return LoadResult(scheduled_ms=scheduled, sent_ms=scheduled.copy(), done_ms=scheduled + np.asarray(latency_ms),
                      status=np.asarray(status), label=np.where(ok, 0, -1), early=np.zeros(n, dtype=bool),
                      exit_site=np.full(n, -1), sites=(), errors={}, status_before=None, status_after=None)


def test_a_sweep_level_counts_answers_in_its_window_and_latency_once_the_clients_run():
    result = load_result(scheduled_ms=[0, 0, 200, 300, 400, 1000], latency_ms=[50, 150, 10, 1, 30, 200],
                         status=[200, 200, 200, 429, 200, 200])
    point = sweep_point(result, clients=2, settle_ms=100.0, end_ms=1100.0)
    # answers done within [100, 1100) ms: at 150, 210 and 430 (the last one, at 1200, is after the window)
    assert point["throughput_rps"] == pytest.approx(3.0)
    # issued after settling: at 200, 300 (shed), 400 and 1000
    assert (point["clients"], point["requests"], point["answered"], point["shed"], point["failed"]) == (2, 4, 3, 1, 0)
    assert point["p50_ms"] == pytest.approx(30.0)
    assert point["p99_ms"] == pytest.approx(np.percentile([10, 30, 200], 99))


def level(rps: float, p99_ms: float | None, requests: int = 1000, shed: int = 0, failed: int = 0,
          clients: int = 1) -> dict:
    return {"clients": clients, "throughput_rps": rps, "p99_ms": p99_ms, "requests": requests, "shed": shed,
            "failed": failed}


def test_saturation_is_the_most_throughput_whose_p99_is_within_the_slo():
    sweep = [level(100, 2.0), level(180, 3.9), level(250, 4.1), level(240, 8.0)]
    assert saturation_from_sweep(sweep, slo_ms=4.0) == 180
    assert saturation_from_sweep(sweep, slo_ms=10.0) == 250
    assert saturation_from_sweep(sweep, slo_ms=1.0) == 0.0  # no level within it: nothing sustained within it


def test_a_level_that_left_more_than_one_percent_unanswered_is_not_within_the_slo():
    assert MAX_UNANSWERED_SHARE == 0.01
    assert within_slo(level(500, 1.0, shed=10), 4.0)  # exactly 1% of 1,000
    assert not within_slo(level(500, 1.0, shed=6, failed=5), 4.0)
    assert not within_slo(level(0, None, requests=10, failed=10), 4.0)
    assert saturation_from_sweep([level(100, 2.0), level(500, 1.0, shed=20)], 4.0) == 100


sweeps = st.lists(st.builds(level, st.floats(0.0, 1e4, allow_nan=False),
                            st.one_of(st.none(), st.floats(0.0, 100.0, allow_nan=False)),
                            st.just(1000), st.integers(0, 30)), min_size=1, max_size=6)


@settings(max_examples=80, deadline=None)
@given(sweeps, st.floats(0.1, 100.0), st.floats(0.0, 100.0))
def test_saturation_never_exceeds_the_sweeps_throughput_and_never_falls_as_the_slo_loosens(sweep, slo_ms, looser):
    saturation = saturation_from_sweep(sweep, slo_ms)
    assert saturation <= max(p["throughput_rps"] for p in sweep)
    assert saturation == 0.0 or saturation in [p["throughput_rps"] for p in sweep if within_slo(p, slo_ms)]
    assert saturation_from_sweep(sweep, slo_ms + looser) >= saturation


# --- per-system summaries, goals and the report ---------------------------------------------------------------------

def measured_round(number: int, p50_ms: float | None, p99_ms: float | None, saturation_rps: float, rps: float = 100.0) -> dict:
    sweep = [level(rps / 2, p50_ms, clients=1) | {"p50_ms": p50_ms},
             level(rps, p99_ms, clients=2) | {"p50_ms": p50_ms}]
    figures = {"p50_ms": p50_ms, "p99_ms": p99_ms, "throughput_rps": rps, "saturation_rps": saturation_rps,
               "sweep_max_rps": rps, "accuracy": 1.0, "exit_share": 0.0, "errors": {}}
    return {"round": number, "position": number, "figures": figures, "sweep": sweep}


def failed_round(number: int) -> dict:
    return {"round": number, "position": number, "error": "RuntimeError: the server was not ready within 300 s"}


def test_a_system_holds_the_medians_of_its_measured_rounds_every_round_and_its_median_sweep():
    rounds = [measured_round(1, 2.0, 5.0, 300.0, rps=90.0), failed_round(2), measured_round(3, 4.0, 9.0, 280.0),
              measured_round(4, 3.0, 6.0, 310.0, rps=120.0)]
    summary = system_summary(BASELINE, rounds)
    assert (summary["p50_ms"], summary["p99_ms"], summary["saturation_rps"]) == (3.0, 6.0, 300.0)
    assert summary["min_max"]["p50_ms"] == [2.0, 4.0]
    assert summary["min_max"]["saturation_rps"] == [280.0, 310.0]
    assert (summary["rounds_measured"], summary["rounds"], summary["transport"]) == (3, rounds, "binary")
    assert [p["clients"] for p in summary["sweep"]] == [1, 2]
    assert summary["sweep"][1]["throughput_rps"] == 100.0  # the median of 90, 100 and 120
    assert summary["sweep"][1]["min_max"]["throughput_rps"] == [90.0, 120.0]
    assert "error" not in summary


def test_a_system_that_never_ran_keeps_its_key_with_the_error():
    summary = system_summary("triton", [failed_round(1), failed_round(2)])
    assert "not ready within 300 s" in summary["error"]
    assert (summary["transport"], summary["rounds_measured"], len(summary["rounds"])) == ("binary", 0, 2)
    assert "p50_ms" not in summary


def peers_report(systems: dict[str, dict]) -> dict:
    systems = with_ratios(systems)
    return json.loads(json.dumps({
        "model": "resnet18-fmnist", "workload": "fmnist-drift", "trace": "maf", "load": 0.2, "rate_rps": 400.0, "slo_ms": 4.0,
        "max_batch": 8, "max_delay_ms": 0.0, "rounds": 3, "sweep_clients": [1, 2],
        "systems": systems, "goals": goals(systems)}))  # what the JSON file holds


def three_rounds(p50s: list[float], p99s: list[float], saturations: list[float]) -> list[dict]:
    return [measured_round(i + 1, *figures) for i, figures in enumerate(zip(p50s, p99s, saturations))]


def every_system() -> dict[str, dict]:
    return {BASELINE: system_summary(BASELINE, three_rounds([2.0, 2.2, 1.8], [4.0, 4.6, 4.4], [300, 310, 290])),
            EXITS: system_summary(EXITS, three_rounds([1.0, 1.1, 0.9], [5.0, 5.0, 5.0], [300, 300, 300])),
            "mlserver": system_summary("mlserver", three_rounds([3.0, 3.5, 2.5], [4.2, 4.0, 9.0], [200, 210, 190])),
            "ray_serve": system_summary("ray_serve", three_rounds([4.0, 4.5, 4.2], [8.0, 8.0, 8.0], [250, 250, 240])),
            "triton": system_summary("triton", [failed_round(1), failed_round(2), failed_round(3)]),
            "kserve": system_summary("kserve", three_rounds([3.2, 3.4, 3.3], [6.0, 6.0, 6.0], [220, 220, 220])),
            "litserve": system_summary("litserve", three_rounds([5.0, 5.0, 5.0], [9.0, 9.0, 9.0], [150, 150, 150]))}


def test_the_report_keeps_every_system_a_failed_one_with_its_error_and_judges_goals_on_the_others():
    report = peers_report(every_system())
    assert list(report["systems"]) == list(SYSTEMS)
    for name, summary in report["systems"].items():
        assert summary["transport"] == TRANSPORTS[name]
        if name == "triton":
            assert "error" in summary and "ratios" not in summary
            continue
        for key in ("p50_ms", "p99_ms", "throughput_rps", "saturation_rps", "rounds", "sweep", "min_max", "ratios"):
            assert key in summary, (name, key)
    assert report["systems"]["mlserver"]["ratios"]["p50_ms"] == pytest.approx(3.0 / 2.0)
    assert report["goals"] == {
        "peers_compared": ["mlserver", "ray_serve", "kserve", "litserve"],  # triton failed: not compared
        "vanilla_p50_at_most_every_peer": True,  # 2.0 against 3.0, 4.2, 3.3 and 5.0
        "vanilla_p99_at_most_1.1x_best_peer": True,  # 4.4 against 1.1 × 4.2
        "vanilla_saturation_at_least_every_peer": True,  # 300 against 200, 250, 220 and 150
        "exits_p50_at_most_0.6x_best_peer": True,  # 1.0 against 0.6 × 3.0
    }


def test_goals_count_on_medians_not_on_a_lucky_round():
    systems = every_system()
    # vanilla's best round beats every peer's, its median does not
    systems[BASELINE] = system_summary(BASELINE, three_rounds([1.0, 3.2, 3.1], [4.0, 4.0, 4.0], [300, 300, 300]))
    systems[EXITS] = system_summary(EXITS, three_rounds([0.5, 1.9, 1.9], [5.0, 5.0, 5.0], [300, 300, 300]))
    systems["ray_serve"] = system_summary("ray_serve", three_rounds([4.0, 4.0, 4.0], [3.6, 3.6, 3.6],
                                                                    [400, 200, 310]))
    verdicts = goals(systems)
    assert verdicts["vanilla_p50_at_most_every_peer"] is False  # 3.1 against mlserver's 3.0
    assert verdicts["vanilla_p99_at_most_1.1x_best_peer"] is False  # 4.0 against 1.1 × 3.6
    assert verdicts["vanilla_saturation_at_least_every_peer"] is False  # 300 against ray_serve's 310
    assert verdicts["exits_p50_at_most_0.6x_best_peer"] is False  # 1.9 against 0.6 × 3.0


def test_goals_need_the_systems_they_compare():
    systems = every_system()
    only_vanilla = {BASELINE: systems[BASELINE], "triton": systems["triton"]}
    assert goals(only_vanilla) == {"peers_compared": [], "vanilla_p50_at_most_every_peer": None,
                                   "vanilla_p99_at_most_1.1x_best_peer": None,
                                   "vanilla_saturation_at_least_every_peer": None,
                                   "exits_p50_at_most_0.6x_best_peer": None}


def test_saturations_are_not_compared_when_no_system_had_a_level_within_the_slo():
    systems = {name: system_summary(name, three_rounds([2.0] * 3, [9.0] * 3, [0.0] * 3))
               for name in (BASELINE, "mlserver")}
    assert goals(systems)["vanilla_saturation_at_least_every_peer"] is None  # 0 against 0 says nothing
    systems["mlserver"] = system_summary("mlserver", three_rounds([2.0] * 3, [3.0] * 3, [0.0, 50.0, 50.0]))
    assert goals(systems)["vanilla_saturation_at_least_every_peer"] is False
    report = peers_report(systems | {"triton": system_summary("triton", [failed_round(1)])})
    assert peers_notes(report) == [
        "triton was not measured: no round was measured; the last said: RuntimeError: the server was not ready "
        "within 300 s",
        "no sweep level of rampserve_vanilla kept p99 within the SLO (4.00 ms) in at least half the rounds: median "
        "saturation 0 (a looser --slo-ms compares what they sustain)"]


def test_a_peer_that_answered_nothing_counts_as_slowest():
    systems = every_system()
    systems["mlserver"] = system_summary("mlserver", three_rounds([None] * 3, [None] * 3, [0.0] * 3))
    verdicts = goals(with_ratios(systems))
    assert systems["mlserver"]["ratios"]["p50_ms"] is None
    assert verdicts["vanilla_p50_at_most_every_peer"] is True
    assert verdicts["exits_p50_at_most_0.6x_best_peer"] is True  # 1.0 against 0.6 × kserve's 3.3


def test_the_table_and_plots_show_every_system(tmp_path):
    report = peers_report(every_system())
    console = Console(file=io.StringIO(), width=300)
    console.print(peers_table(report))
    text = console.file.getvalue()
    assert all(name in text for name in SYSTEMS)
    assert "error" in text  # triton's column; why is in `peers_notes`
    assert "2.00 (1.80–2.20)" in text  # vanilla's median p50 and its range
    assert "400 rps (load 0.2)" in text
    paths = write_peer_plots(report, tmp_path)
    assert [p.name for p in paths] == ["peers_sweep.png", "peers_rounds.png"]
    assert all(p.stat().st_size > 0 for p in paths)


# --- settings, installations, processes -------------------------------------------------------------------------------

def test_peer_settings_refuse_what_cannot_be_measured():
    for wrong in ({"systems": ("mlserver",)}, {"systems": (BASELINE, "torchserve")},
                  {"systems": (BASELINE, BASELINE)}, {"rounds": 0}, {"sweep_clients": (0, 2)},
                  {"sweep_s": 1.0, "sweep_settle_s": 1.0},
                  {"live": LiveSettings(loads=(0.1, 0.2))}):
        with pytest.raises(ValueError):
            PeerSettings(**wrong)
    assert set(TRANSPORTS) == set(SYSTEMS) == {BASELINE, EXITS, *PEERS}
    assert {name for name, transport in TRANSPORTS.items() if transport == "binary"} == {BASELINE, EXITS, "triton",
                                                                                         "kserve"}


def test_triton_declares_fixed_dimensions_and_leaves_varying_ones_open():
    feeds = [{"input_ids": np.zeros((1, n), np.int64), "image": np.zeros((1, 1, 28, 28), np.float32)}
             for n in (7, 9)]
    assert input_specs(feeds) == [("input_ids", "int64", [-1]), ("image", "float32", [1, 28, 28])]


def test_a_venv_made_from_the_current_requirements_is_not_made_again(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("package==1.0\n")
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "rampserve-requirements.txt").write_text("package==1.0\n")
    missing_python = tmp_path / "no-python"
    assert ensure_venv(venv, requirements, missing_python, lambda _: None) == venv / "bin"
    requirements.write_text("package==2.0\n")  # changed pins: it must be made again, with a Python that is not there
    with pytest.raises(RuntimeError, match="no-python"):
        ensure_venv(venv, requirements, missing_python, lambda _: None)


READY_ON_ONE_PATH = """
import http.server, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v2/models/m/ready" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
try:
    server.serve_forever()
except KeyboardInterrupt:
    sys.exit(0)
"""


def test_a_server_process_waits_on_its_ready_path_and_stops_with_its_signal(tmp_path):
    def command(port: int, _grpc_port: int) -> list[str]:
        return [sys.executable, "-c", READY_ON_ONE_PATH, str(port)]

    with ServerProcess(command, tmp_path / "model.log", 30.0, ready_path="/v2/models/m/ready",
                       stop_signal=signal.SIGINT) as server:
        with urllib.request.urlopen(server.url("/v2/models/m/ready"), timeout=10) as response:
            assert response.status == 200
    assert server.outcome() == {"exit_code": 0, "killed": False}  # it handled the SIGINT: a clean stop
    with pytest.raises(RuntimeError, match="not ready within"):
        with ServerProcess(command, tmp_path / "health.log", 1.0):  # it never answers /v2/health/ready
            pass
