"""The request queue is passive: it says when a batch is due and forms it, and the executor's loop lets requests in
through its inbox meanwhile. Batches follow priority, then arrival, and never exceed the batch size but for one
request larger than it alone."""

from __future__ import annotations

import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.serving.executor.batching import AdaptiveBatchSize, BatchTimeEstimate
from rampserve.serving.executor.request_queue import LocalInbox, RequestQueue
from rampserve.serving.shared.contract import ModelRequest
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.settings import ModelSettings

PROFILE = LatencyProfile(batch_sizes=(1, 8), sites=(), full_ms=(2.0, 9.0), segment_ms={}, ramp_ms={})


def make_queue(max_batch: int = 4, max_delay_ms: float = 0.0) -> RequestQueue:
    size = AdaptiveBatchSize(max_batch, 100.0, limit=float(max_batch))
    return RequestQueue("m", ModelSettings(max_delay_ms=max_delay_ms), PROFILE, size, BatchTimeEstimate(9.0),
                        ServerMetrics())


def admit(queue: RequestQueue, rows: int = 1, priority: int = 0, tag: object = None) -> None:
    queue.admit(ModelRequest({"x": np.full((rows, 1), tag if isinstance(tag, int) else 0)}, priority=priority),
                lambda _: None)


def test_a_batch_is_due_when_full_when_its_oldest_waited_or_when_stopping() -> None:
    queue = make_queue(max_batch=2, max_delay_ms=1000.0)
    assert queue.ready_in() is None and not queue.drained  # nothing queued: wait for a request
    admit(queue)
    assert 0.5 < queue.ready_in() <= 1.0  # one input: due once it has waited a second
    admit(queue)
    assert queue.ready_in() == 0.0  # full
    assert len(queue.take_batch()) == 2 and queue.ready_in() is None
    admit(queue)
    queue.request_stop()
    assert queue.ready_in() == 0.0 and not queue.drained  # stopping: what is queued goes at once
    assert len(queue.take_batch()) == 1 and queue.drained


def test_without_a_delay_one_request_is_due_at_once() -> None:
    queue = make_queue(max_batch=8)
    admit(queue, rows=3)
    assert queue.ready_in() == 0.0


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 5), st.integers(-1, 1)), min_size=1, max_size=20),
       max_batch=st.integers(1, 6))
def test_batches_take_priority_then_arrival_within_the_batch_size(requests, max_batch) -> None:
    queue = make_queue(max_batch=max_batch)
    for tag, (rows, priority) in enumerate(requests):
        admit(queue, rows, priority, tag)
    taken = []
    while queue.ready_in() is not None:
        batch = queue.take_batch()
        queue.batch_done()
        assert batch and (len(batch) == 1 or sum(p.rows for p in batch) <= max_batch)
        taken += [int(p.request.inputs["x"][0, 0]) for p in batch]
    assert taken == sorted(range(len(requests)), key=lambda tag: (-requests[tag][1], tag))


def collected(inbox: LocalInbox, then: threading.Thread) -> bool:
    """Whether `inbox.collect(None)`, waiting with no timeout, returned once `then` ran (a lost wake-up would keep
    it waiting: the check gives it a minute)."""
    waiting = threading.Thread(target=inbox.collect, args=(None,), daemon=True)
    waiting.start()
    then.start()
    then.join()
    waiting.join(60.0)
    return not waiting.is_alive()


def test_a_local_inbox_wakes_for_an_admission_and_for_a_stop() -> None:
    queue = make_queue()
    inbox = LocalInbox(queue)
    inbox.collect(0.0)  # nothing there: returns at once
    assert collected(inbox, threading.Thread(target=admit, args=(queue,)))
    assert queue.ready_in() == 0.0
    queue.take_batch()
    assert collected(inbox, threading.Thread(target=queue.request_stop))
    assert queue.drained
