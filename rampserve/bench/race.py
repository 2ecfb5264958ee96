"""`rampserve bench race`: speculative serving's race (seed 004), measured live.

Three Fashion-MNIST models of different speed answer every query of a race application; a decider picks one
answer among those that arrived before the race's timeout T (the application's `slo_ms`), and with none it
answers the default output. Everything is real: two rampserve servers on loopback (the first in this process,
the remote one in a process of its own as `rampserve serve`, or with `remote_process=False` in a thread here),
the models as prepared bundles with early exits (or `vanilla`), the remote one reached through `RemotePredictor`
(Open Inference Protocol v2), Fashion-MNIST test images as queries scored against their true labels, and one
HTTP client in a process of its own measuring each answer's time from sending the query to reading the answer.

One run:
1. **Calibration** (also the warm-up): a race that waits for every model (`confidence_weighted`, no timeout to
   speak of) over images that are not among the measured queries. The slowest model's mean latency in it is
   the tight timeout (`timeouts_ms` entry None), rounded to whole milliseconds: the event loop's timers (libuv)
   have millisecond resolution, so a finer T would not be kept anyway.
2. **Measured run**: for every query image, every configuration in a seeded order that changes from image to
   image (interleaved: the machine's noise falls on every configuration alike): one race application per
   decider and per timeout, and each model alone (a one-model application with no timeout to speak of).
3. **Figures**: per configuration, accuracy against the true labels (default answers and errors count as
   wrong), the client's p50/p99/max answer time, the share of default answers, which model's answer won how
   often and each model's latency in the race (the application's own statistics, `GET /apps/{app}`), and
   whether p99 answer time stayed within T + `tolerance_ms`; the consensus race's accuracy beside the best
   single model's, and each original model's own accuracy on the same queries (run here, offline). Each
   model's early-exit configuration at the end comes from its server's `/status/{model}`.

Load: one client, each request sent once the previous one is answered and no sooner than 1 / `rate_rps` after
the previous one started (a paced closed loop), so the models are never queued behind each other's queries
on this small machine, except for the stragglers the race leaves running.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import re
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import orjson
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.results import write_result
from rampserve.workloads.fashion_mnist import load_fashion_mnist, to_model_input

# The servers' modules (torch, ONNX Runtime, uvicorn) are imported in `run_race` only: the client process
# imports this module too, and needs none of them.

DECIDERS = ("first", "consensus", "best_confidence", "confidence_weighted", "learned")
LEARNING_DECIDERS = frozenset({"learned"})  # told every query's true label after its answer (`POST /{app}/update`)
LEARNED_MARGIN = 0.01  # what the learned decider must add to the best single model's accuracy
CALIBRATION_APP = "race-calibration"
CALIBRATION_DECIDER = "confidence_weighted"  # decides once every model has answered: each model's full latency
CLIENT_ERROR = -1  # status of a request whose connection failed
MAX_ERRORS = 10  # distinct error messages kept per configuration
APP_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class RaceSettings:
    # Zoo names or bundle directories, fastest first by convention; each is served under its zoo name or its
    # directory's name.
    models: tuple[str, ...] = ("vgg11-fmnist", "resnet18-fmnist", "resnet50-fmnist")
    remote: str | None = "resnet50-fmnist"  # served by a second rampserve, reached over v2 (None: all local)
    vanilla: bool = False  # False: early exits, as rampserve serves by default
    deciders: tuple[str, ...] = DECIDERS
    # The race's timeouts T; None: the slowest model's mean latency in the calibration race.
    timeouts_ms: tuple[float | None, ...] = (None, 50.0)
    queries: int = 1000  # Fashion-MNIST test images, each sent to every configuration
    calibration_queries: int = 200  # other test images: the calibration race (and the models' warm-up)
    # Other test images sent to the learning races alone, each followed by its true label, before the measured
    # run: what such a race has learned after a while of serving. They go on learning from every measured query.
    feedback_queries: int = 500
    # After the measured run, this model fails (unloaded from the races' server: each ask of it is an error) and
    # the races and the remaining models answer `failure_queries` more images. "best": the model most accurate
    # alone in the measured run; None: no failure run.
    failing: str | None = "best"
    failure_queries: int = 500
    rate_rps: float = 40.0  # the one client's pace, over all configurations
    baseline_slo_ms: float = 10_000.0  # single models and the calibration race: no timeout to speak of
    tolerance_ms: float = 5.0  # what is checked: p99 answer time <= T + tolerance
    remote_timeout_ms: float = 1000.0
    stats_timeout_s: float = 60.0  # how long the race's stragglers may take to finish before stats are read
    client_process: bool = True  # the client in a process of its own (False: a thread of the servers' process)
    # The remote model's rampserve in a process of its own, as a remote server is (False: a server thread of this
    # process, sharing its interpreter and GIL with the first server's models).
    remote_process: bool = True
    start_timeout_s: float = 300.0  # the remote server's process must be ready within this
    seed: int = 0

    def __post_init__(self) -> None:
        names = [model_name(ref) for ref in self.models]
        if len(names) < 2 or len(set(names)) != len(names):
            raise ValueError(f"a race needs at least two models with distinct names, got {names}")
        if self.remote is not None and self.remote not in names:
            raise ValueError(f"the remote model {self.remote!r} is not one of the models {names}")
        if not self.deciders:
            raise ValueError("give at least one decider")
        if not self.timeouts_ms or any(t is not None and not t > 0 for t in self.timeouts_ms):
            raise ValueError(f"timeouts must be positive milliseconds (or None: calibrated), got {self.timeouts_ms}")
        if self.queries < 1 or self.calibration_queries < 1:
            raise ValueError("need at least one query and one calibration query")
        if self.feedback_queries < 0 or (self.failing is not None and self.failure_queries < 1):
            raise ValueError("feedback_queries must be >= 0, and a failure run needs failure_queries >= 1")
        if self.failing not in (None, "best", *names):
            raise ValueError(f"the failing model must be 'best', None or one of {names}, got {self.failing!r}")
        if not self.rate_rps > 0:
            raise ValueError(f"rate_rps must be positive, got {self.rate_rps}")


def model_name(ref: str) -> str:
    """The name a model is served under: its zoo name, or its bundle directory's name."""
    path = Path(ref)
    return path.name if path.is_dir() else ref


def app_name(*parts: str) -> str:
    return APP_NAME_CHARS.sub("_", "-".join(parts))[:64]


def calibrated_timeout_ms(calibration: dict) -> float:
    """The slowest model's mean latency in the calibration race, in whole milliseconds (at least 1)."""
    means = [m["latency_ms"]["mean"] for m in calibration["models"].values() if m["latency_ms"]["mean"] is not None]
    if not means:
        raise RuntimeError(f"no model answered in the calibration race: {calibration['models']}")
    return float(max(1, round(max(means))))


# --- the client ---------------------------------------------------------------------------------------------------

class Client:
    """One keep-alive HTTP/1.1 connection; each request is timed from sending it to reading its whole answer."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.timeout_s = parts.hostname, parts.port, timeout_s
        self.connection: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self.connection is None:
            self.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self.connection.connect()
            self.connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.connection

    def post(self, path: str, body: bytes) -> tuple[int, bytes, float]:
        """(status or CLIENT_ERROR, answer body or the error, milliseconds)."""
        connection = self._connect()  # connecting is not part of an answer's time
        started = time.perf_counter()
        try:
            connection.request("POST", path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            elapsed = (time.perf_counter() - started) * 1000.0
            return response.status, data, elapsed
        except (OSError, http.client.HTTPException) as exc:
            elapsed = (time.perf_counter() - started) * 1000.0
            self.close()
            return CLIENT_ERROR, repr(exc).encode(), elapsed

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _register(url: str, spec: object) -> None:
    request = urllib.request.Request(f"{url}/admin/apps", json.dumps(spec.to_json()).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"registering {spec.name} failed: {exc.code} {exc.read().decode()}") from None


def model_status(url: str, model: str) -> dict:
    """What the server that runs a model says of it at the end: its early-exit configuration (the active ramps and
    their thresholds), batches and requests."""
    status = _get_json(f"{url}/status/{model}")
    keys = ("vanilla", "slo_ms", "max_batch", "batches", "requests", "mean_batch_size", "configuration",
            "window_accuracy", "cumulative_accuracy")
    return {k: status[k] for k in keys if k in status}


# --- queries --------------------------------------------------------------------------------------------------

@dataclass
class Answers:
    """Every answer one configuration got, in query order."""

    status: list[int]
    output: list[object]
    default: list[bool]
    confidence: list[float | None]
    winners: list[list[str]]
    query_id: list[str | None]
    latency_ms: list[float]
    errors: Counter

    @classmethod
    def empty(cls) -> Answers:
        return cls([], [], [], [], [], [], [], Counter())

    def add(self, status: int, data: bytes, latency_ms: float) -> None:
        answer = None
        if status == 200:
            try:
                answer = orjson.loads(data)
            except orjson.JSONDecodeError:
                status = CLIENT_ERROR
        self.status.append(status)
        self.latency_ms.append(latency_ms)
        if answer is None:
            self.errors[f"{status}: {data[:200].decode(errors='replace')}"] += 1
            answer = {}
        self.output.append(answer.get("output"))
        self.default.append(bool(answer.get("default", False)))
        self.confidence.append(answer.get("confidence"))
        self.winners.append(list(answer.get("models", [])))
        self.query_id.append(answer.get("query_id"))

    def to_json(self) -> dict:
        return {"status": self.status, "output": self.output, "default": self.default,
                "confidence": self.confidence, "models": self.winners, "query_id": self.query_id,
                "latency_ms": self.latency_ms}


def encode_queries(images: np.ndarray) -> list[bytes]:
    """Each image as the body of `POST /{app}/predict`, encoded before any clock starts."""
    return [orjson.dumps({"input": image.tolist()}) for image in images]


@dataclass(frozen=True)
class Feedback:
    """The applications told each query's true label right after its answer, and the bodies that tell them."""

    apps: frozenset[str]
    bodies: Sequence[bytes]  # per query: `POST /{app}/update {"input", "label"}`

    @classmethod
    def of(cls, apps: Sequence[str], images: np.ndarray, labels: np.ndarray) -> Feedback:
        return cls(frozenset(apps), [orjson.dumps({"input": image.tolist(), "label": int(label)})
                                     for image, label in zip(images, labels)])


NO_FEEDBACK = Feedback(frozenset(), ())


def run_queries(url: str, apps: Sequence[str], bodies: Sequence[bytes], rate_rps: float, seed: int,
                desc: str, progress: bool = True, feedback: Feedback = NO_FEEDBACK) -> tuple[dict[str, Answers], dict]:
    """Every query to every application, the applications in a seeded order drawn afresh for each query, and
    each answer of an application in `feedback` followed by the query's true label; one request at a time over
    one connection, started no sooner than 1 / rate_rps after the previous one. Returns the answers and the
    pacing actually achieved."""
    client = Client(url)
    try:
        return _run_queries(client, apps, bodies, rate_rps, seed, desc, progress, feedback)
    finally:
        client.close()


def run_client(url: str, apps: Sequence[str], bodies: Sequence[bytes], rate_rps: float, seed: int, desc: str,
               progress: bool = True, own_process: bool = True,
               feedback: Feedback = NO_FEEDBACK) -> tuple[dict[str, Answers], dict]:
    """`run_queries` in a process of its own (spawned: the servers' threads are not copied), so the client never
    shares an interpreter, or its GIL, with the servers it measures."""
    if not own_process:
        return run_queries(url, apps, bodies, rate_rps, seed, desc, progress, feedback)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_queries, url, list(apps), list(bodies), rate_rps, seed, desc, progress,
                           feedback).result()


def _run_queries(client: Client, apps: Sequence[str], bodies: Sequence[bytes], rate_rps: float, seed: int,
                 desc: str, progress: bool, feedback: Feedback) -> tuple[dict[str, Answers], dict]:
    rng = np.random.default_rng(seed)
    answers = {name: Answers.empty() for name in apps}
    updates = Answers.empty()
    gap_s = 1.0 / rate_rps
    behind = 0  # requests that could not start on time (the previous answer came later than the pace)
    started = time.perf_counter()
    due = started

    def post(path: str, body: bytes) -> tuple[int, bytes, float]:
        nonlocal behind, due
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        else:
            behind += now - due > 0.001
        due = max(due, now) + gap_s
        return client.post(path, body)

    for k, body in enumerate(tqdm(bodies, desc=desc, unit="query", disable=not progress)):
        for index in rng.permutation(len(apps)):
            answers[apps[index]].add(*post(f"/{apps[index]}/predict", body))
            if apps[index] in feedback.apps:
                updates.add(*post(f"/{apps[index]}/update", feedback.bodies[k]))
    duration_s = time.perf_counter() - started
    requests = len(bodies) * len(apps) + len(updates.status)
    return answers, {"requests": requests, "duration_s": duration_s, "achieved_rps": requests / duration_s,
                     "late_starts": behind, "feedback": {
                         "requests": len(updates.status), "errors": sum(s != 200 for s in updates.status),
                         "error_messages": dict(updates.errors.most_common(MAX_ERRORS)),
                         "latency_ms": _quantiles(updates.latency_ms)}}


def wait_for_stragglers(url: str, timeout_s: float) -> dict:
    """Every application's statistics once no model it asked is still running (the race leaves the slower
    models running after it decides; their answers count as late once they arrive)."""
    give_up = time.monotonic() + timeout_s
    while True:
        apps = _get_json(f"{url}/apps")
        running = {name: a["stragglers_running"] for name, a in apps.items() if a["stragglers_running"]}
        if not running:
            return apps
        if time.monotonic() > give_up:
            raise RuntimeError(f"stragglers still running after {timeout_s} s: {running}")
        time.sleep(0.05)


# --- figures (pure) -----------------------------------------------------------------------------------------------

def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    if not len(values):
        return {"p50": None, "p99": None, "max": None, "mean": None}
    array = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99)),
            "max": float(array.max()), "mean": float(array.mean())}


def correct_answers(answers: dict, labels: Sequence[int]) -> np.ndarray:
    """Per query: answered (200), not the default output, and the true label."""
    return np.array([status == 200 and not default and output == int(label)
                     for status, default, output, label in zip(answers["status"], answers["default"],
                                                               answers["output"], labels)], dtype=bool)


def summarize(answers: Answers, labels: Sequence[int], app: dict, kind: str, decider: str,
              timeout_ms: float | None, tolerance_ms: float, timeouts_ms: Sequence[float]) -> dict:
    """One configuration's figures. Accuracy is over every query (defaults and errors count as wrong);
    `accuracy_answered` over the queries that got a model's answer."""
    raw = answers.to_json()
    n = len(raw["status"])
    correct = correct_answers(raw, labels)
    ok = np.array(raw["status"]) == 200
    defaults = int(np.sum(ok & np.array(raw["default"], dtype=bool)))
    answered = int(ok.sum()) - defaults
    latency = _quantiles(raw["latency_ms"])
    models = {name: {k: s[k] for k in ("asked", "answered", "late", "failed", "wins", "latency_ms", "feedback",
                                       "accuracy", "last_error")}
              for name, s in app["models"].items()}
    summary = {
        "kind": kind, "decider": decider, "timeout_ms": timeout_ms, "models": list(app["models"]),
        "queries": n, "errors": int(n - ok.sum()), "error_messages": dict(answers.errors.most_common(MAX_ERRORS)),
        "defaults": defaults, "default_share": defaults / n if n else None,
        "accuracy": float(correct.mean()) if n else None,
        "accuracy_answered": float(correct.sum() / answered) if answered else None,
        "latency_ms": latency,
        # The application's own figure, from a query's arrival to its decision: what the client adds on top is
        # HTTP, parsing the query and sending the answer.
        "app_latency_ms": app["latency_ms"],
        "client_minus_app_mean_ms": (None if latency["mean"] is None or app["latency_ms"]["mean"] is None
                                     else latency["mean"] - app["latency_ms"]["mean"]),
        "wins": {name: s["wins"] for name, s in models.items()},
        "win_share": {name: s["wins"] / n if n else None for name, s in models.items()},
        "model_stats": models,
        "app_requests": app["requests"], "app_defaults": app["defaults"],
        "answers": raw,
    }
    if kind == "race":
        bound = timeout_ms + tolerance_ms
        summary["p99_bound_ms"] = bound
        summary["p99_within_bound"] = latency["p99"] is not None and latency["p99"] <= bound
    else:  # a model alone: how often it would have answered within each race timeout (client-measured)
        within = np.asarray(raw["latency_ms"])[ok]
        summary["within_timeout_share"] = {f"{t:g}": float(np.mean(within <= t)) if len(within) else None
                                           for t in timeouts_ms}
    return summary


def phase_stats(after: dict, before: dict | None) -> dict:
    """One application's statistics (`GET /apps/{app}`) over one phase of a run, from its cumulative ones before
    and after: counts are differences and mean latencies come from the sums; minimum and maximum latencies only
    where the phase was the application's first."""
    if before is None or not any(m["asked"] for m in before["models"].values()):
        return after

    def mean(a: float | None, a_n: int, b: float | None, b_n: int) -> float | None:
        return ((a or 0.0) * a_n - (b or 0.0) * b_n) / (a_n - b_n) if a_n > b_n else None

    models = {}
    for name, a in after["models"].items():
        b = before["models"][name]
        counts = {k: a[k] - b[k] for k in ("asked", "answered", "late", "failed", "wins", "feedback")}
        correct = [(m["accuracy"] or 0.0) * m["feedback"] for m in (a, b)]
        models[name] = {**a, **counts,
                        "accuracy": (correct[0] - correct[1]) / counts["feedback"] if counts["feedback"] else None,
                        "latency_ms": {"min": None, "max": None,
                                       "mean": mean(a["latency_ms"]["mean"], a["answered"] + a["late"],
                                                    b["latency_ms"]["mean"], b["answered"] + b["late"])}}
    return {**after, "requests": after["requests"] - before["requests"],
            "defaults": after["defaults"] - before["defaults"], "models": models,
            "latency_ms": {"mean": mean(after["latency_ms"]["mean"], after["requests"],
                                        before["latency_ms"]["mean"], before["requests"]), "max": None}}


def _best_single(configurations: dict[str, dict]) -> tuple[str | None, float | None]:
    singles = {c["models"][0]: c["accuracy"] for c in configurations.values() if c["kind"] == "single"}
    best = max(singles, key=lambda m: (singles[m] is not None, singles[m] or 0.0)) if singles else None
    return best, singles.get(best)


def _race(configurations: dict[str, dict], decider: str, timeout_ms: float) -> dict | None:
    return next((c for c in configurations.values()
                 if c["kind"] == "race" and c["decider"] == decider and c["timeout_ms"] == timeout_ms), None)


def compare(configurations: dict[str, dict], timeouts_ms: Sequence[float]) -> list[dict]:
    """Per timeout: every decider's accuracy beside the best single model's (whole-test-run accuracy of each
    model alone, measured on the same queries in the same run)."""
    best, best_accuracy = _best_single(configurations)
    rows = []
    for t in timeouts_ms:
        races = {c["decider"]: c for c in configurations.values() if c["kind"] == "race" and c["timeout_ms"] == t}
        consensus = races.get("consensus")
        rows.append({
            "timeout_ms": t,
            "accuracy": {d: c["accuracy"] for d, c in races.items()},
            "minus_best_single": {d: None if best_accuracy is None else c["accuracy"] - best_accuracy
                                  for d, c in races.items()},
            "best_single_model": best,
            "best_single_accuracy": best_accuracy,
            "consensus_accuracy": None if consensus is None else consensus["accuracy"],
            "consensus_accuracy_answered": None if consensus is None else consensus["accuracy_answered"],
            "consensus_minus_best_single": (None if consensus is None or best_accuracy is None
                                            else consensus["accuracy"] - best_accuracy),
            "consensus_default_share": None if consensus is None else consensus["default_share"],
        })
    return rows


def learned_bars(report: dict, decider: str = "learned") -> dict:
    """The issue's bars for a learning decider, per timeout T: its accuracy >= the best single model's +
    LEARNED_MARGIN with its p99 answer time within T + tolerance; and in the failure run, its accuracy >= the best
    remaining model's. Met where both hold at one T."""
    failure = report.get("failure")
    rows = []
    for t in report["timeouts_ms"]:
        race = _race(report["configurations"], decider, t)
        if race is None:
            continue
        best, best_accuracy = _best_single(report["configurations"])
        row = {"timeout_ms": t, "accuracy": race["accuracy"], "best_single_model": best,
               "best_single_accuracy": best_accuracy, "p99_ms": race["latency_ms"]["p99"],
               "p99_bound_ms": race["p99_bound_ms"],
               # a hair of slack for the floating-point sum of the margin, never a query's worth
               "beats_best_single": (race["p99_within_bound"] and best_accuracy is not None
                                     and race["accuracy"] - best_accuracy >= LEARNED_MARGIN - 1e-9)}
        failed = None if failure is None else _race(failure["configurations"], decider, t)
        if failed is not None:
            remaining, remaining_accuracy = _best_single(failure["configurations"])
            row.update({"failure_accuracy": failed["accuracy"], "best_remaining_model": remaining,
                        "best_remaining_accuracy": remaining_accuracy,
                        "failure_at_least_best_remaining": (remaining_accuracy is not None
                                                            and failed["accuracy"] >= remaining_accuracy)})
        rows.append(row)
    return {"decider": decider, "margin": LEARNED_MARGIN, "by_timeout": rows,
            "met_at_ms": [r["timeout_ms"] for r in rows
                          if r["beats_best_single"] and r.get("failure_at_least_best_remaining", True)]}


def diversity(predictions: dict[str, np.ndarray], labels: np.ndarray) -> dict:
    """How differently the original models err on the measured queries (offline): what any combination of their
    labels could gain. `any_right`: share of queries some model answers right (no decider can do better);
    `majority`: the plain vote (ties to the first model listed); pairwise: share of queries two models disagree on,
    and on which both are wrong."""
    names = list(predictions)
    stacked = np.stack([predictions[m] for m in names])
    right = stacked == labels
    votes = np.stack([(stacked == c).sum(axis=0) for c in range(int(stacked.max()) + 1)])
    majority = np.where(votes.max(axis=0) > 1, votes.argmax(axis=0), stacked[0])
    pairs = {f"{a}|{b}": {"disagree": float(np.mean(stacked[i] != stacked[j])),
                          "both_wrong": float(np.mean(~right[i] & ~right[j]))}
             for i, a in enumerate(names) for j, b in enumerate(names) if i < j}
    return {"any_right": float(right.any(axis=0).mean()), "all_right": float(right.all(axis=0).mean()),
            "majority": float(np.mean(majority == labels)), "pairs": pairs}


def _spread(values: Sequence[float | None]) -> dict:
    known = [v for v in values if v is not None]
    return {"median": float(np.median(known)) if known else None, "min": min(known, default=None),
            "max": max(known, default=None), "values": list(values)}


def _phase_summary(phases: Sequence[dict]) -> dict:
    """Per configuration (by application name: the same in every seed's run, where a calibrated T may differ):
    accuracy, its difference from the best single model of the same run, p50 and p99, over the seeds."""
    summary = {}
    for app, first_config in phases[0]["configurations"].items():
        runs = [(phase, phase["configurations"][app]) for phase in phases]
        summary[app] = {
            "kind": first_config["kind"], "decider": first_config["decider"], "models": first_config["models"],
            "timeout_ms": [c["timeout_ms"] for _, c in runs],
            "accuracy": _spread([c["accuracy"] for _, c in runs]),
            "minus_best_single": _spread([None if best is None else c["accuracy"] - best
                                          for best, c in ((_best_single(p["configurations"])[1], c)
                                                          for p, c in runs)]),
            "p50_ms": _spread([c["latency_ms"]["p50"] for _, c in runs]),
            "p99_ms": _spread([c["latency_ms"]["p99"] for _, c in runs]),
            "p99_within_bound": [c.get("p99_within_bound") for _, c in runs],
        }
    return summary


def seeds_summary(reports: Sequence[dict]) -> dict:
    """Several seeds' runs (each its own images, order of configurations and servers) summed up: every figure's
    median, minimum and maximum, and each seed's verdict on the bars."""
    failures = [r["failure"] for r in reports if r["failure"] is not None]
    return {
        "seeds": [r["settings"]["seed"] for r in reports],
        "configurations": _phase_summary(reports),
        "failure": _phase_summary(failures) if len(failures) == len(reports) else None,
        "failing_models": [r["failure"]["model"] if r["failure"] else None for r in reports],
        "bars": {decider: {"met_at_ms": [r["bars"][decider]["met_at_ms"] for r in reports],
                           "met_in_seeds": sum(bool(r["bars"][decider]["met_at_ms"]) for r in reports)}
                 for decider in reports[0]["bars"]},
    }


# --- the run ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Queries:
    """The run's Fashion-MNIST test images, distinct and drawn with the seed: each phase's own."""

    index: np.ndarray  # test-set indices
    images: np.ndarray  # model inputs
    labels: np.ndarray  # true labels
    phases: dict[str, slice]

    def phase(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        part = self.phases[name]
        return self.index[part], self.images[part], self.labels[part]


def query_images(settings: RaceSettings) -> Queries:
    """Calibration images first, then the learning races' feedback, the measured queries and the failure run's."""
    pixels, labels = load_fashion_mnist("test")
    sizes = {"calibration": settings.calibration_queries, "feedback": settings.feedback_queries,
             "measured": settings.queries, "failure": settings.failure_queries if settings.failing else 0}
    total = sum(sizes.values())
    if total > len(labels):
        raise ValueError(f"{total} queries exceed the {len(labels)} Fashion-MNIST test images")
    index = np.random.default_rng(settings.seed).choice(len(labels), total, replace=False)
    ends = np.cumsum(list(sizes.values()))
    phases = {name: slice(int(end - size), int(end)) for (name, size), end in zip(sizes.items(), ends)}
    return Queries(index, to_model_input(pixels[index]), labels[index], phases)


def remote_server(ref: str, model: object, vanilla: bool, start_timeout_s: float, stack: ExitStack) -> object:
    """`rampserve serve` for one model in a process of its own, with the settings the first server gives its own
    models (SLO twice the profiled batch-1 latency, the largest batch within it, no queue delay)."""
    from rampserve.bench.harness import ServerProcess, rampserve_serve
    from rampserve.bundle_format.latency import serving_limits

    slo_ms, max_batch = serving_limits(model.profile)
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rampserve-race-")))
    return ServerProcess(rampserve_serve(ref, slo_ms, max_batch, 0.0, vanilla), workdir / "remote-server.log",
                         start_timeout_s)


def offline_labels(model: object, images: np.ndarray, batch: int = 250) -> np.ndarray:
    """The original model's labels (its final layer, no ramps) for the queries, run here in batches."""
    from rampserve.serving.executor.loading import loaded

    name, prepared = model.inputs[0].name, loaded(model).prepared
    return np.concatenate([prepared.run({name: images[i:i + batch]}).argmax(axis=1)
                           for i in range(0, len(images), batch)])


def _unload(url: str, model: str) -> None:
    request = urllib.request.Request(f"{url}/v2/repository/models/{model}/unload", b"{}",
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def _warm_up_accuracy(answers: dict[str, Answers], labels: np.ndarray) -> dict:
    """Each learning race's accuracy over the feedback images, by quarter: how fast it learned."""
    return {app: [float(part.mean()) for part in np.array_split(correct_answers(a.to_json(), labels), 4)]
            for app, a in answers.items()}


def run_race(settings: RaceSettings, json_out: Path | None = None, note: Callable[[str], None] = lambda _: None,
             progress: bool = True) -> dict:
    from rampserve.serving.executor.loading import load_served
    from rampserve.serving.frontend.apps.applications import ApplicationSpec
    from rampserve.serving.frontend.repository.predictors import RemotePredictor
    from rampserve.serving.server import ServerSettings, build_state, running_server
    from rampserve.serving.shared.contract import GIL_SWITCH_INTERVAL_S
    from rampserve.serving.shared.models import ServedModel
    from rampserve.serving.shared.settings import ModelSettings

    queries = query_images(settings)
    calibration_index, calibration_images, calibration_labels = queries.phase("calibration")
    _, feedback_images, feedback_labels = queries.phase("feedback")
    measured_index, measured_images, measured_labels = queries.phase("measured")
    failure_index, failure_images, failure_labels = queries.phase("failure")
    names = [model_name(ref) for ref in settings.models]

    note(f"loading {', '.join(names)} (bundles are prepared on first use)")
    served: list[ServedModel] = [load_served(ref) for ref in tqdm(settings.models, desc="loading models",
                                                                   unit="model", disable=not progress)]
    # Each original model's own labels for the measured queries (its final layer, in this process): what a served
    # answer is scored against, before early exits and timeouts, and how differently the models err.
    offline = {m.name: offline_labels(m, measured_images) for m in served}
    model_settings = ModelSettings(vanilla=settings.vanilla)
    singles = {name: app_name("single", name) for name in names}
    baseline_apps = [ApplicationSpec(CALIBRATION_APP, tuple(names), "race", slo_ms=settings.baseline_slo_ms,
                                     decider=CALIBRATION_DECIDER)]
    baseline_apps += [ApplicationSpec(singles[name], (name,), "race", slo_ms=settings.baseline_slo_ms,
                                      decider="first") for name in names]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as `rampserve serve` does
    failure = None
    try:
        with ExitStack() as stack:
            predictors: list = []
            remote_url = remote_process = None
            for ref, model in zip(settings.models, served):
                if model.name != settings.remote:
                    predictors.append(model)
                    continue
                if settings.remote_process:
                    remote_process = stack.enter_context(remote_server(ref, model, settings.vanilla,
                                                                          settings.start_timeout_s, stack))
                    remote_url = remote_process.url("")
                else:
                    remote_state = build_state([model], model_settings, ServerSettings(port=0, grpc=False))
                    remote_url = stack.enter_context(running_server(remote_state, ServerSettings(port=0, grpc=False)))
                predictors.append(RemotePredictor(model.name, remote_url, model.name,
                                                  timeout_ms=settings.remote_timeout_ms))
            predictors.sort(key=lambda p: names.index(p.name))
            state = build_state(predictors, model_settings, ServerSettings(port=0, grpc=False), baseline_apps)
            url = stack.enter_context(running_server(state, ServerSettings(port=0, grpc=False)))
            note(f"serving {', '.join(names)} at {url}" + (f"; {settings.remote} behind {remote_url}"
                                                          if remote_url else "") +
                 f" ({'vanilla' if settings.vanilla else 'early exits'})")

            calibration_answers, calibration_load = run_client(
                url, [CALIBRATION_APP], encode_queries(calibration_images), settings.rate_rps, settings.seed,
                "calibration", progress, settings.client_process)
            calibration_stats = wait_for_stragglers(url, settings.stats_timeout_s)[CALIBRATION_APP]
            calibration = {
                "queries": settings.calibration_queries, "decider": CALIBRATION_DECIDER,
                "accuracy": float(correct_answers(calibration_answers[CALIBRATION_APP].to_json(),
                                                  calibration_labels).mean()),
                "latency_ms": _quantiles(calibration_answers[CALIBRATION_APP].latency_ms),
                "models": {m: {k: s[k] for k in ("asked", "answered", "failed", "latency_ms")}
                           for m, s in calibration_stats["models"].items()},
                "load": calibration_load,
            }
            calibrated = calibrated_timeout_ms(calibration)
            timeouts = [calibrated if t is None else float(t) for t in settings.timeouts_ms]
            timeouts = list(dict.fromkeys(timeouts))  # a fixed T equal to the calibrated one runs once
            note("calibration: mean latency in the race "
                 + ", ".join(f"{m} {s['latency_ms']['mean']:.2f} ms" for m, s in calibration["models"].items())
                 + f"; timeouts {', '.join(f'{t:g}' for t in timeouts)} ms")

            races: dict[str, tuple[str, float]] = {}
            for k, timeout in enumerate(timeouts):
                for decider in settings.deciders:
                    name = app_name(f"race{k}", decider)
                    races[name] = (decider, timeout)
                    _register(url, ApplicationSpec(name, tuple(names), "race", slo_ms=timeout, decider=decider))
            learning = [app for app, (decider, _) in races.items() if decider in LEARNING_DECIDERS]

            warm_up = None
            if learning and settings.feedback_queries:
                answers, load = run_client(url, learning, encode_queries(feedback_images), settings.rate_rps,
                                           settings.seed + 2, "feedback to the learning races", progress,
                                           settings.client_process,
                                           Feedback.of(learning, feedback_images, feedback_labels))
                warm_up = {"queries": settings.feedback_queries, "apps": learning, "load": load,
                           "accuracy_by_quarter": _warm_up_accuracy(answers, feedback_labels)}
            before = wait_for_stragglers(url, settings.stats_timeout_s)

            apps = [*singles.values(), *races]
            answers, load = run_client(url, apps, encode_queries(measured_images), settings.rate_rps,
                                       settings.seed + 1, f"race ({len(apps)} configurations)", progress,
                                       settings.client_process,
                                       Feedback.of(learning, measured_images, measured_labels))
            stats = wait_for_stragglers(url, settings.stats_timeout_s)
            serving = {name: model_status(remote_url if name == settings.remote else url, name) for name in names}
            # what every application asked of each model until then (calibration, feedback, measured run)
            asks = {name: {k: sum(a["models"][name][k] for a in stats.values() if name in a["models"])
                           for k in ("asked", "failed")} for name in names}
            configurations = {app: summarize(answers[app], measured_labels, phase_stats(stats[app], before.get(app)),
                                             kind, decider, timeout, settings.tolerance_ms, timeouts)
                              for app, (kind, decider, timeout) in _configurations(singles, races).items()}

            if settings.failing is not None:
                failing = _best_single(configurations)[0] if settings.failing == "best" else settings.failing
                _unload(url, failing)
                note(f"failure run: {failing} unloaded from the races' server")
                remaining = {m: app for m, app in singles.items() if m != failing}
                fail_apps = [*remaining.values(), *races]
                fail_answers, fail_load = run_client(
                    url, fail_apps, encode_queries(failure_images), settings.rate_rps, settings.seed + 3,
                    f"{failing} failing ({len(fail_apps)} configurations)", progress, settings.client_process,
                    Feedback.of(learning, failure_images, failure_labels))
                fail_stats = wait_for_stragglers(url, settings.stats_timeout_s)
                fail_configurations = {
                    app: summarize(fail_answers[app], failure_labels, phase_stats(fail_stats[app], stats[app]),
                                   kind, decider, timeout, settings.tolerance_ms, timeouts)
                    for app, (kind, decider, timeout) in _configurations(remaining, races).items()}
                failure = {"model": failing, "queries": settings.failure_queries,
                           "images": failure_index.tolist(), "labels": failure_labels.tolist(),
                           "load": {"clients": 1, "rate_rps": settings.rate_rps, **fail_load,
                                    "configurations": len(fail_apps)},
                           "configurations": fail_configurations,
                           "comparison": compare(fail_configurations, timeouts),
                           "p99_within_bound": all(c["p99_within_bound"] for c in fail_configurations.values()
                                                   if c["kind"] == "race")}
            remote_predictor = next((p for p in predictors if isinstance(p, RemotePredictor)), None)
            remote = None if remote_predictor is None else {
                "model": remote_predictor.name, "url": remote_url,
                "server": "own process" if remote_process else "thread of the bench's process",
                "attempts": remote_predictor.attempts, "retried": remote_predictor.retried}
    finally:
        sys.setswitchinterval(switch_interval)
    if remote_process is not None:
        remote["outcome"] = remote_process.outcome()

    race_configs = [c for c in configurations.values() if c["kind"] == "race"]
    report = {
        "serving": "vanilla" if settings.vanilla else "early exits",
        "models": {m.name: {"ref": ref, "where": "remote" if m.name == settings.remote else "local",
                            "backend": m.backend,
                            "offline_accuracy": float(np.mean(offline[m.name] == measured_labels)),
                            "serving": serving[m.name], "applications": asks[m.name]}
                   for ref, m in zip(settings.models, served)},
        "diversity": diversity(offline, measured_labels),
        "remote": remote,
        "queries": settings.queries,
        "images": measured_index.tolist(),
        "labels": measured_labels.tolist(),
        "calibration": {**calibration, "images": calibration_index.tolist()},
        "calibrated_timeout_ms": calibrated,
        "timeouts_ms": timeouts,
        "tolerance_ms": settings.tolerance_ms,
        "feedback": warm_up,
        "load": {"clients": 1, "rate_rps": settings.rate_rps, **load, "configurations": len(apps)},
        "configurations": configurations,
        "comparison": compare(configurations, timeouts),
        "p99_within_bound": all(c["p99_within_bound"] for c in race_configs),
        "failure": failure,
        "settings": asdict(settings),
    }
    report["bars"] = {decider: learned_bars(report, decider) for decider in settings.deciders
                      if decider in LEARNING_DECIDERS}
    write_result(report, json_out)
    return report


def _configurations(singles: dict[str, str], races: dict[str, tuple[str, float]]
                    ) -> dict[str, tuple[str, str, float | None]]:
    """Each application of a phase as (kind, decider, timeout): the models alone, then the races."""
    return {**{app: ("single", "alone", None) for app in singles.values()},
            **{app: ("race", decider, timeout) for app, (decider, timeout) in races.items()}}


# --- tables -------------------------------------------------------------------------------------------------------

def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def race_table(report: dict, failure: bool = False) -> Table:
    """The measured run's configurations, or with `failure` the failure run's."""
    phase = report["failure"] if failure else report
    load = phase["load"]
    remote = report["remote"]
    models = list(report["models"])
    table = Table(title=f"speculative race, {report['serving']}"
                        + (f", {phase['model']} FAILING" if failure else "")
                        + f": {phase['queries']} Fashion-MNIST test queries per configuration, one client at "
                          f"{load['achieved_rps']:.0f} rps",
                  caption=f"models {', '.join(models)}"
                          + (f"; {remote['model']} remote ({remote['server']})" if remote else "")
                          + "; wins: share of queries each model's answer carried, in that order; answered acc.: "
                            "accuracy over the answers that were not the default; HTTP: mean answer time at the "
                            "client less the application's own mean")
    for column in ("configuration", "T ms", "accuracy", "answered acc.", "defaults", "p50 ms", "p99 ms", "max ms",
                   f"p99≤T+{report['tolerance_ms']:g}", "wins %", "HTTP ms"):
        table.add_column(column, justify="left" if column == "configuration" else "right", no_wrap=True)
    for c in phase["configurations"].values():
        label = f"{c['models'][0]} alone" if c["kind"] == "single" else c["decider"]
        check = "-" if c["kind"] == "single" else ("yes" if c["p99_within_bound"] else "[red]NO[/red]")
        wins = " · ".join(_fmt(None if s is None else 100 * s, ".0f") for s in c["win_share"].values()) \
            if c["kind"] == "race" else ""
        table.add_row(label, _fmt(c["timeout_ms"], "g"), _fmt(c["accuracy"], ".4f"),
                      _fmt(c["accuracy_answered"], ".4f"), _fmt(c["default_share"], ".1%"),
                      _fmt(c["latency_ms"]["p50"], ".2f"), _fmt(c["latency_ms"]["p99"], ".2f"),
                      _fmt(c["latency_ms"]["max"], ".2f"), check, wins, _fmt(c["client_minus_app_mean_ms"], ".2f"))
    return table


def seeds_table(summary: dict) -> Table:
    table = Table(title=f"speculative race over seeds {', '.join(map(str, summary['seeds']))}: median [min – max]",
                  caption="Δ best: accuracy less the best single model's of the same run (in the failure run, the "
                          "best remaining model's)")
    for column in ("run", "configuration", "T ms", "accuracy", "Δ best", "p50 ms", "p99 ms", "p99≤T+tol"):
        table.add_column(column, justify="left" if column in ("run", "configuration") else "right", no_wrap=True)

    def spread(figure: dict, spec: str) -> str:
        return f"{_fmt(figure['median'], spec)} [{_fmt(figure['min'], spec)} – {_fmt(figure['max'], spec)}]"

    phases = [("measured", summary["configurations"])]
    if summary["failure"] is not None:
        phases.append((f"{'/'.join(sorted(set(summary['failing_models'])))} failing", summary["failure"]))
    for run, configurations in phases:
        for c in configurations.values():
            label = f"{c['models'][0]} alone" if c["kind"] == "single" else c["decider"]
            timeouts = "/".join(dict.fromkeys(_fmt(t, "g") for t in c["timeout_ms"]))
            within = "" if c["kind"] == "single" else f"{sum(c['p99_within_bound'])}/{len(c['p99_within_bound'])}"
            table.add_row(run, label, timeouts, spread(c["accuracy"], ".4f"), spread(c["minus_best_single"], "+.4f"),
                          spread(c["p50_ms"], ".2f"), spread(c["p99_ms"], ".2f"), within)
    return table


def model_table(report: dict) -> Table:
    """Each model in each race: asked, answered in time, late (after the decision), failed (refused, timed
    out), wins and latency as the application measured it."""
    table = Table(title="each model in each race (the application's statistics, GET /apps/{app})")
    for column in ("configuration", "T ms", "model", "asked", "in time", "late", "failed", "wins", "min ms",
                   "mean ms", "max ms"):
        table.add_column(column, justify="left" if column in ("configuration", "model") else "right")
    for c in report["configurations"].values():
        label = "alone" if c["kind"] == "single" else c["decider"]
        for model, s in c["model_stats"].items():
            latency = s["latency_ms"]
            table.add_row(label, _fmt(c["timeout_ms"], "g"), model, str(s["asked"]), str(s["answered"]),
                          str(s["late"]), str(s["failed"]), str(s["wins"]), _fmt(latency["min"], ".1f"),
                          _fmt(latency["mean"], ".2f"), _fmt(latency["max"], ".1f"))
    return table


def comparison_lines(report: dict) -> list[str]:
    alone = {c["models"][0]: c for c in report["configurations"].values() if c["kind"] == "single"}
    lines = [f"each model alone, served ({report['serving']}) / its original model offline: " + ", ".join(
        f"{m} {_fmt(alone[m]['accuracy'], '.4f')} / {_fmt(info.get('offline_accuracy'), '.4f')}"
        for m, info in report["models"].items() if m in alone)]
    if report["serving"] != "vanilla":
        lines.append("active ramps at the end (site: threshold): " + "; ".join(
            f"{m} " + (", ".join(f"{site}: {t:.3f}" for site, t in zip(config["sites"], config["thresholds"]))
                       or "none")
            for m, config in ((m, info.get("serving", {}).get("configuration") or {"sites": [], "thresholds": []})
                              for m, info in report["models"].items())))
    for row in report["comparison"]:
        lines.append(f"T = {row['timeout_ms']:g} ms: consensus accuracy {_fmt(row['consensus_accuracy'], '.4f')} "
                     f"({_fmt(row['consensus_default_share'], '.1%')} defaults, counted wrong; "
                     f"{_fmt(row['consensus_accuracy_answered'], '.4f')} over its other answers) against the best "
                     "single model "
                     f"{row['best_single_model']} {_fmt(row['best_single_accuracy'], '.4f')} "
                     f"(difference {_fmt(row['consensus_minus_best_single'], '+.4f')})")
    held = report["p99_within_bound"]
    lines.append(f"p99 answer time ≤ T + {report['tolerance_ms']:g} ms in every race: "
                 + ("holds" if held else "DOES NOT HOLD for " + ", ".join(
                     f"{c['decider']} at T={c['timeout_ms']:g} (p99 {c['latency_ms']['p99']:.2f} ms)"
                     for c in report["configurations"].values()
                     if c["kind"] == "race" and not c["p99_within_bound"])))
    spread = report["diversity"]
    lines.append(f"how the original models err (offline, same queries): some model right on {spread['any_right']:.4f},"
                 f" all on {spread['all_right']:.4f}, a plain majority {spread['majority']:.4f}; pairs disagree on "
                 + ", ".join(f"{pair.replace('|', '/')} {p['disagree']:.3f}" for pair, p in spread["pairs"].items()))
    if report["feedback"]:
        lines.append(f"learning races over the {report['feedback']['queries']} feedback images before the measured "
                     "run, accuracy by quarter: " + "; ".join(
                         f"{app} " + " → ".join(f"{a:.3f}" for a in quarters)
                         for app, quarters in report["feedback"]["accuracy_by_quarter"].items()))
    for bars in report["bars"].values():
        for row in bars["by_timeout"]:
            line = (f"bar, {bars['decider']} at T = {row['timeout_ms']:g} ms: {row['accuracy']:.4f} against the best "
                    f"single model {row['best_single_model']} {_fmt(row['best_single_accuracy'], '.4f')} + "
                    f"{bars['margin']:g}, p99 {_fmt(row['p99_ms'], '.2f')} ≤ {row['p99_bound_ms']:g} ms: "
                    + ("met" if row["beats_best_single"] else "MISSED"))
            if "failure_accuracy" in row:
                line += (f"; with {report['failure']['model']} failing {row['failure_accuracy']:.4f} against the best "
                         f"remaining {row['best_remaining_model']} {_fmt(row['best_remaining_accuracy'], '.4f')}: "
                         + ("met" if row["failure_at_least_best_remaining"] else "MISSED"))
            lines.append(line)
    return lines
