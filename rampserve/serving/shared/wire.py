"""What passes between the front end and a model's executor process (`serving.executor`): framed messages on a
Unix socket, and input tensors in shared memory.

A frame is its length (4 bytes), its kind (1 byte), then a JSON header (length-prefixed) and raw bytes. Headers are
small (ids, shapes, exit sites); tensors travel as their bytes, never pickled: a request's inputs are written into a
slot of the `SlotArena` (or, when they do not fit one, follow the header in the frame), answers carry their labels,
confidences and logits after the header.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from collections.abc import Callable, Mapping

import numpy as np
import orjson

from rampserve.control.records import BatchRecord
from rampserve.serving.shared.contract import Answer, ExecutionFailed, Exits, ModelRequest, Shed, Stamps

FRAME = struct.Struct("<IB")  # bytes after this prefix, kind
HEADER = struct.Struct("<I")  # bytes of the JSON header

# Front end -> executor
HELLO = ord("H")  # what to serve and how (the first frame)
REQUEST = ord("R")
CACHED = ord("C")  # answers the prediction cache gave: labels for the controller's books
STATUS = ord("S")
METRICS = ord("M")
QUIT = ord("Q")  # answer everything accepted, then exit
# The server's background processes (a training job), which the executor's polling must not starve
BACKGROUND = ord("B")
# Executor -> front end
READY = ord("Y")
ANSWER = ord("A")
# A request's final answer, after its batch ran to the end (for the prediction cache): sent before the request's
# ANSWER when that carries the final answer, after it when a ramp released it early
FINAL = ord("F")
REFUSED = ord("E")  # shed at admission or in the queue, or the batch failed
REPLY = ord("P")  # to STATUS and METRICS
CONFIGURATION = ord("K")  # the executor adopted a configuration
# A controller the front end holds (one that several replicas share): the executor's control thread asks it
OBSERVE = ord("O")  # executor -> front end: a batch record
REFRESH = ord("U")  # executor -> front end: a configuration published meanwhile?
CONTROL_REPLY = ord("V")  # front end -> executor: the controller's answer to OBSERVE or REFRESH


def frame(kind: int, header: object, *buffers: bytes | memoryview) -> bytes:
    head = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    size = HEADER.size + len(head) + sum(len(b) for b in buffers)
    return b"".join((FRAME.pack(size, kind), HEADER.pack(len(head)), head, *buffers))


class FrameReader:
    """Frames out of a byte stream that arrives in pieces of any size."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, dict, memoryview]]:
        """Every frame completed by `data`: its kind, header and body."""
        self._buffer += data
        start = 0
        frames = []
        while len(self._buffer) - start >= FRAME.size:
            size, kind = FRAME.unpack_from(self._buffer, start)
            end = start + FRAME.size + size
            if len(self._buffer) < end:
                break
            (head,) = HEADER.unpack_from(self._buffer, start + FRAME.size)
            at = start + FRAME.size + HEADER.size
            frames.append((kind, orjson.loads(bytes(self._buffer[at:at + head])),
                           memoryview(bytes(self._buffer[at + head:end]))))
            start = end
        del self._buffer[:start]
        return frames


# ---- tensors ---------------------------------------------------------------------------------------------------

# Where each input lies: [name, dtype, shape, offset] (offset in the slot, or in the frame's body)
Layout = list[tuple[str, str, tuple[int, ...], int]]


def layout_of(inputs: Mapping[str, np.ndarray]) -> tuple[Layout, int]:
    layout, offset = [], 0
    for name, array in inputs.items():
        layout.append((name, array.dtype.str, array.shape, offset))
        offset += array.nbytes
    return layout, offset


def pack_into(buffer: memoryview, inputs: Mapping[str, np.ndarray], layout: Layout) -> None:
    for (_, _, _, offset), array in zip(layout, inputs.values()):
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buffer[offset:offset + len(data)] = data


def unpack(buffer: memoryview | mmap.mmap, layout: Layout, base: int = 0) -> dict[str, np.ndarray]:
    """The inputs, copied out of `buffer` (a slot is reused once the request is answered)."""
    return {name: np.frombuffer(buffer, dtype, math.prod(shape), base + offset).reshape(shape).copy()
            for name, dtype, shape, offset in layout}


class SlotArena:
    """Shared memory for requests' input tensors: an anonymous memory file (memfd) that both processes map, cut
    into slots of equal size. It has no name in /dev/shm, so nothing of it can outlive the processes that hold
    it, however they end. The front end takes a free slot per request and gives it back when the request is
    answered; the executor copies the inputs out as it reads the request, before any answer can leave."""

    def __init__(self, fd: int, slot_bytes: int, slots: int) -> None:
        self.fd, self.slot_bytes, self.slots = fd, slot_bytes, slots
        self._map = mmap.mmap(fd, slot_bytes * slots)
        self.view = memoryview(self._map)
        self.free_all()

    @classmethod
    def create(cls, name: str, slot_bytes: int, slots: int) -> SlotArena:
        fd = os.memfd_create(f"rampserve-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, slot_bytes * slots)  # sparse: a page takes memory only once written
        return cls(fd, slot_bytes, slots)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_all(self) -> None:
        self._free = list(range(self.slots - 1, -1, -1))

    def give(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def close(self) -> None:
        self.view.release()
        self._map.close()
        os.close(self.fd)


# ---- requests --------------------------------------------------------------------------------------------------


def request_frame(request_id: int, request: ModelRequest, layout: Layout, slot: int | None,
                  body: bytes | bytearray) -> bytes:
    """`request`, its inputs packed by `layout` into arena slot `slot` (or, with no slot, in `body`). Its parameters
    stay in the front end (an application's, which a bundle does not read); its `on_final` is a flag ("keep"): the
    front end wants its final answer after an early one (a FINAL frame)."""
    return frame(REQUEST, {"i": request_id, "final": request.needs_final, "deadline": request.deadline_ms,
                           "priority": request.priority, "arrival": request.arrival,
                           "keep": request.on_final is not None, "slot": slot, "layout": layout}, body)


def read_request(header: dict, inputs: dict[str, np.ndarray],
                 on_final: Callable[[Answer], None] | None = None) -> ModelRequest:
    """The request a REQUEST frame carries; `on_final` sends its final answer back where the frame keeps it."""
    return ModelRequest(inputs, header["final"], header["deadline"], header["priority"], header["arrival"],
                        on_final=on_final if header["keep"] else None)


# ---- answers ---------------------------------------------------------------------------------------------------


def answer_frame(kind: int, request: int, answer: Answer) -> bytes:
    logits = None if answer.logits is None else np.ascontiguousarray(answer.logits, dtype=np.float32)
    stamps, exits = answer.stamps, answer.exits  # the executor's own: the front end adds when it received the answer
    header = {"i": request, "s": exits.sites, "e": exits.error_scores, "v": exits.config_version,
              "b": exits.batch_id, "t": [stamps.admitted, stamps.started, stamps.ran, stamps.signalled, stamps.released],
              "c": None if logits is None else logits.shape[1]}
    buffers = [np.ascontiguousarray(answer.labels, dtype=np.int64).tobytes(),
               np.ascontiguousarray(answer.confidences, dtype=np.float64).tobytes()]
    if logits is not None:
        buffers.append(logits.tobytes())
    return frame(kind, header, *buffers)


def read_answer(header: dict, body: memoryview) -> Answer:
    rows = len(header["s"])
    labels = np.frombuffer(body, np.int64, rows)
    confidences = np.frombuffer(body, np.float64, rows, rows * 8)
    classes = header["c"]
    logits = None if classes is None else np.frombuffer(body, np.float32, rows * classes, rows * 16).reshape(
        rows, classes)
    return Answer(labels, confidences, logits, Exits(tuple(header["s"]), tuple(header["e"]), header["v"], header["b"]),
                  Stamps(*header["t"], received=time.monotonic()))


def refused_frame(request: int, error: BaseException) -> bytes:
    """A request shed (`Shed`, with its status and reason) or failed (anything else), as the front end gets it."""
    if isinstance(error, Shed):
        return frame(REFUSED, {"i": request, "shed": [error.status, error.reason, error.message, error.retry_after_s]})
    return frame(REFUSED, {"i": request, "failed": str(error)})


def read_refusal(header: dict) -> Exception:
    if "shed" in header:
        return Shed(*header["shed"])
    return ExecutionFailed(header["failed"])


# ---- batch records ---------------------------------------------------------------------------------------------

RECORD_ARRAYS = ("labels", "errors", "final", "exits", "served_in", "forced")


def record_frame(request: int, record: BatchRecord) -> bytes:
    """A batch record for a controller the front end holds (`executor.RelayedControl`)."""
    arrays = {name: getattr(record, name) for name in RECORD_ARRAYS if getattr(record, name) is not None}
    layout, size = layout_of(arrays)
    body = bytearray(size)
    pack_into(memoryview(body), arrays, layout)
    header = {"i": request, "layout": layout, "version": record.version, "sites": record.sites,
              "queue_ms": record.queue_ms, "compute_ms": record.compute_ms, "unverified": record.unverified,
              "cached": record.cached, "feedback_share": record.feedback_share}
    return frame(OBSERVE, header, body)


def read_record(header: dict, body: memoryview) -> BatchRecord:
    arrays = unpack(body, header["layout"])
    return BatchRecord(header["version"], tuple(header["sites"]), arrays["labels"], arrays["errors"], arrays["final"],
                       arrays["exits"], header["queue_ms"], header["compute_ms"], header["unverified"],
                       header["cached"], arrays.get("served_in"), header["feedback_share"], arrays.get("forced"))
