"""The lean load generator's bookkeeping when the other end misbehaves: each request ends exactly once, as an
answer, a refusal, a failed connection or a timeout, and the requests after a failure are still served. The other
end is a real HTTP/1.1 peer on loopback that does, per request, what its body asks (a real server cannot be told
to drop a connection or never answer)."""

from __future__ import annotations

import asyncio
import json
import socketserver
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.bench.loadgen import CLIENT_ERROR, TIMED_OUT, Job, LeanHttpClient

HANG_S = 5.0  # how long the peer holds a request it never answers: past the client's timeout


class _Peer(socketserver.StreamRequestHandler):
    """Answers `label N` with label N, `refuse` with a 503, closes the connection on `close` and holds it on
    `hang`; any number of requests per connection."""

    def handle(self) -> None:
        while self.rfile.readline():  # a request line
            length = 0
            while (header := self.rfile.readline()) not in (b"\r\n", b""):
                name, _, value = header.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            body = self.rfile.read(length).decode()
            if body == "close":
                return
            if body == "hang":
                self.server.hold.wait(HANG_S)
                return
            status, payload = (503, b"overloaded") if body == "refuse" else (200, json.dumps({
                "outputs": [{"name": "label", "data": [int(body.split()[1])]}]}).encode())
            self.wfile.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)


@pytest.fixture(scope="module")
def peer() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Peer)
    server.daemon_threads, server.hold = True, threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v2/models/m/infer"
    finally:
        server.hold.set()
        server.shutdown()
        server.server_close()


def _bodies(kinds: list[str]) -> list[tuple[bytes, dict[str, str]]]:
    return [((f"label {i}" if kind == "label" else kind).encode(), {}) for i, kind in enumerate(kinds)]


def test_each_request_ends_once_and_a_failure_does_not_stop_the_ones_after_it(peer) -> None:
    kinds = ["label", "close", "label", "hang", "refuse", "label", "label"]
    job = Job(peer, (), "label", None, timeout_s=1.0, lean=True)
    client = LeanHttpClient(job)
    try:
        recorder = asyncio.run(client.open_loop(_bodies(kinds), np.arange(len(kinds)) * 20.0))
    finally:
        client.close()
    result = recorder.result(client.origin, None, None)
    expected = {"label": 200, "close": CLIENT_ERROR, "hang": TIMED_OUT, "refuse": 503}
    assert result.status.tolist() == [expected[kind] for kind in kinds]
    assert result.label.tolist() == [i if kind == "label" else -1 for i, kind in enumerate(kinds)]
    assert result.errors == {"ConnectionError: the server closed the connection": 1, "no answer within 1.0 s": 1,
                             "HTTP 503: overloaded": 1}
    hung = kinds.index("hang")
    assert result.done_ms[hung] - result.sent_ms[hung] >= 1000.0  # timed out by the job's timeout, not before it
    assert (result.sent_ms >= result.scheduled_ms).all()


@settings(max_examples=15, deadline=None)
@given(kinds=st.lists(st.sampled_from(["label", "refuse", "close"]), min_size=1, max_size=12),
       clients=st.integers(1, 4))
def test_a_closed_loop_sends_each_request_once_and_stops_at_its_count(peer, kinds, clients) -> None:
    job = Job(peer, (), "label", None, timeout_s=5.0, clients=clients, requests=len(kinds), lean=True)
    client = LeanHttpClient(job)
    try:
        result = asyncio.run(client.closed_loop(_bodies(kinds))).result(client.origin, None, None)
    finally:
        client.close()
    assert len(result.status) == len(kinds)
    assert result.status.tolist() == [{"label": 200, "refuse": 503, "close": CLIENT_ERROR}[kind] for kind in kinds]
    assert result.label.tolist() == [i if kind == "label" else -1 for i, kind in enumerate(kinds)]
