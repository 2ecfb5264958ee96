"""Where a ramp that runs Python mid-run hands its column when the batch in progress can take it on the same thread.

A compiled run tells the executor which ramp may release inputs by writing the ramp's column to a pipe, read by a
releasing thread (`serving.executor.batch.RampSignals`): the torch operator runs in C++ and cannot call Python. A
ramp in an ONNX Runtime session signals through a Python operator, which runs on the thread that called the session
(the executor's), between the model's layers: there the column is handed straight to the batch in progress, and its
early answers leave without waking another thread. On 2 cores whose both threads run the model, that wake-up waited
for a core: minilm-rt's answers released after layer 2 came back 1.1 ms before its final ones at batch 1, where the
model's remaining half takes 2.6 ms; handed over here, 2.1 ms before (5.2-5.5 ms against 4.2, sequential
requests, 4 alternating server runs)."""

from __future__ import annotations

from collections.abc import Callable

_handlers: dict[int, Callable[[int], None]] = {}  # by the notify pipe's write end


def hand_columns_to(notify: int, on_column: Callable[[int], None] | None) -> None:
    """Columns signalled to pipe `notify` go to `on_column` on the signalling thread (None: to the pipe again)."""
    if on_column is None:
        _handlers.pop(notify, None)
    else:
        _handlers[notify] = on_column


def column_handler(notify: int) -> Callable[[int], None] | None:
    """What takes the columns signalled to pipe `notify` on the signalling thread, if anything does."""
    return _handlers.get(notify)
