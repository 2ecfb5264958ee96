"""The live benches over gRPC: the load generator (its own process, as in `bench live` and `bench peers`) drives a
real server's gRPC front end and reads the same answers, exit sites included, as over HTTP; the benches point each
system's jobs at the transport asked for (correctness only: speed is `rampserve bench transports`' business)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_serving import MODEL, fixed_exits

from rampserve.bench.harness import ServerProcess, rampserve_serve, run_loadgen
from rampserve.bench.live import LiveSettings
from rampserve.bench.loadgen import Job, grpc_url
from rampserve.bench.peers import BASELINE, EXITS, GRPC, JSON, PeerSettings, transport_of
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.server import ServerSettings, build_state, running_server


def test_the_load_generator_gets_the_same_answers_over_grpc_as_over_http(resnet_bundle, fmnist_feeds,
                                                                          tmp_path) -> None:
    served = loaded(load_served(str(resnet_bundle)))
    site = served.prepared.site_names[0]
    settings = fixed_exits(served, 0, 1.0, executor="thread", torchscript=False)  # threshold 1: every row exits
    server_settings = ServerSettings(port=0, grpc_port=0)
    state = build_state([served], settings, server_settings)
    feeds = [{"x": fmnist_feeds[i:i + 1]} for i in range(len(fmnist_feeds))]
    arrivals, warmup = np.arange(12) * 4.0, np.arange(4) * 4.0
    with running_server(state, server_settings) as url:
        http = Job(f"{url}/v2/models/{MODEL}/infer", (("x", "FP32"),), "label", f"{url}/status", clients=2,
                   requests=24)
        over = {transport: job for transport, job in (("http", http), ("grpc", replace(
            http, url=grpc_url(state.grpc.port, MODEL))))}
        closed = {t: run_loadgen(job, feeds, tmp_path, f"closed {t}", 1.0, False) for t, job in over.items()}
        opened = {t: run_loadgen(replace(job, clients=0, requests=None), feeds, tmp_path, f"open {t}", 1.0, False,
                                 arrivals, warmup) for t, job in over.items()}
        # The lean client (blocking sockets, one thread) reads the same answers in both loops, and a refusal as a
        # refusal on a connection that goes on serving
        lean = replace(http, lean=True)
        closed["lean"] = run_loadgen(lean, feeds, tmp_path, "closed lean", 1.0, False)
        opened["lean"] = run_loadgen(replace(lean, clients=0, requests=None), feeds, tmp_path, "open lean", 1.0,
                                     False, arrivals, warmup)
        unknown = run_loadgen(replace(lean, url=f"{url}/v2/models/nothing/infer", clients=1, requests=3), feeds,
                              tmp_path, "closed lean, unknown model", 1.0, False)
    assert (unknown.status == 404).all() and len(unknown.status) == 3
    assert any("unknown model 'nothing'" in error for error in unknown.errors), unknown.errors
    for runs in (closed, opened):
        for result in runs.values():
            assert result.ok.all() and result.early.all() and result.sites == (site,), result.errors
            assert (result.exit_site == 0).all() and isinstance(result.status_after, dict)
        for other in ("grpc", "lean"):
            np.testing.assert_array_equal(runs[other].label, runs["http"].label)
    assert (opened["lean"].sent_ms >= opened["lean"].scheduled_ms).all()  # never sent before its arrival
    assert len(closed["grpc"].label) == 24 and len(opened["grpc"].label) == len(arrivals)


def test_the_benches_send_each_system_what_it_was_told_to(tmp_path) -> None:
    server = ServerProcess(rampserve_serve("m", 1.0, 4, 0.0, True), tmp_path / "m.log", 1.0)  # not started
    assert server.command[server.command.index("--grpc-port") + 1] == str(server.grpc_port) != str(server.port)
    assert server.infer_url("m", "grpc") == f"grpc://127.0.0.1:{server.grpc_port}/m"
    assert server.infer_url("m", "http") == f"http://127.0.0.1:{server.port}/v2/models/m/infer"
    assert Job(server.infer_url("m", "grpc"), (), "label", None).over_grpc
    assert not Job(server.infer_url("m", "http"), (), "label", None).over_grpc
    with pytest.raises(ValueError, match="lean client speaks HTTP only"):
        Job(server.infer_url("m", "grpc"), (), "label", None, clients=1, lean=True)
    assert [transport_of(name, "grpc") for name in (BASELINE, EXITS, "triton", "mlserver", "ray_serve")] == \
        [GRPC, GRPC, GRPC, GRPC, JSON]  # Ray Serve's peer has no gRPC
    assert transport_of("mlserver", "http") == JSON
    for refused in (lambda: server.infer_url("m", "smtp"), lambda: LiveSettings(transport="smtp"),
                    lambda: LiveSettings(client="smtp"),
                    lambda: PeerSettings(transport="smtp")):
        with pytest.raises(ValueError, match="smtp"):
            refused()
