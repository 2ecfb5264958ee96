"""Applications: several models behind one name (Clipper, seed 003; speculative serving, seed 004).

Each query fans out to the models its policy asks, and the answer is decided from the answers that arrive
within the application's SLO:
- `exp3` asks one model, drawn by Clipper's Exp3 weights;
- `exp4` asks every model and combines their labels by Exp4 weights; at the deadline it answers from the
  models that have answered, its confidence lowered by the weight of those that have not (stragglers);
- `race` asks every model and lets a decider (first, consensus, best confidence, confidence-weighted, learned,
  or the user's own) pick an answer.
With no answer by the deadline the application answers its default output, marked `default: true`, with the
reason. Feedback (`update`) adapts the Exp3/Exp4 weights, or the learned race decider's trust in each model, of
the query's context (application and user key), kept in a state store so that several servers share them and
they outlive a restart. Answers that arrive after the deadline are not wasted: they are kept for the feedback on
that query.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial

import numpy as np

from rampserve.control.deciders import Candidate, Decision, Trust, first, learn, learned, make_decider
from rampserve.control.selection import SelectionState, exp3_choose, exp3_update, exp4_update, exp4_votes
from rampserve.serving.frontend.apps.state_store import StateStore
from rampserve.serving.frontend.cache import cache_key
from rampserve.serving.frontend.repository.predictors import Predictor
from rampserve.serving.shared.contract import Answer, ModelRequest
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.protocol import DATATYPES, ProtocolError, TensorSpec

POLICIES = ("exp3", "exp4", "race")
# Learning rates of the bandits. Exp3 divides the loss by the chosen model's probability, so one mistake of a
# model drawn at p = 0.2 already costs it exp(-0.1 / 0.2) = 0.61 of its weight; Exp4 sees every model's loss.
DEFAULT_ETA = {"exp3": 0.1, "exp4": 0.1}
RECENT_QUERIES = 10_000  # queries whose answers are kept for feedback
APPLICATIONS_NAMESPACE = "applications"
LEARNED_DECIDER = "learned"  # the race decider that learns from feedback, its trust kept in the store
DEFAULT_CONTEXT = "default"
APPLICATION_VERSION = "1"  # what v2 reports: an application is redefined in place, never versioned
# Application names share the URL space with the server's own routes (`/{app}/predict`).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RESERVED_NAMES = frozenset({"v2", "metrics", "status", "admin", "apps"})


@dataclass(frozen=True)
class ApplicationSpec:
    name: str
    models: tuple[str, ...]
    policy: str = "exp4"
    slo_ms: float = 100.0  # the deadline of every query, from its arrival
    default_output: int | float | str | bool | None = None  # answered, with `default: true`, when none arrives
    decider: str = "first"  # race only: a built-in decider or `module:function`
    quorum: int | None = None  # consensus: agreeing models needed (None: a majority)
    enough: float | None = None  # best_confidence: a confidence that decides at once
    eta: float | None = None  # exp3/exp4 learning rate (None: DEFAULT_ETA)
    seed: int | None = None  # Exp3's draws, for reproducible selection (None: fresh randomness)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"application {self.name!r}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        found = []
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name) or self.name in RESERVED_NAMES:
            found.append(f"name must match {NAME_PATTERN.pattern} and not be one of {sorted(RESERVED_NAMES)}")
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            found.append("models must be a non-empty list of model names")
        elif len(set(self.models)) != len(self.models):
            found.append("models must not repeat")
        if self.policy not in POLICIES:
            found.append(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if not _positive(self.slo_ms):
            found.append(f"slo_ms must be a positive number, got {self.slo_ms!r}")
        if self.default_output is not None and not isinstance(self.default_output, int | float | str | bool):
            found.append("default_output must be a number, a string, true/false or null")
        if self.quorum is not None and (not isinstance(self.quorum, int) or isinstance(self.quorum, bool)
                                        or not 1 <= self.quorum <= len(self.models)):
            found.append(f"quorum must be an integer from 1 to the number of models, got {self.quorum!r}")
        if self.enough is not None and not (_number(self.enough) and 0 < self.enough <= 1):
            found.append(f"enough must be a confidence in (0, 1], got {self.enough!r}")
        if self.eta is not None and not _positive(self.eta):
            found.append(f"eta must be a positive number, got {self.eta!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            found.append(f"seed must be an integer, got {self.seed!r}")
        if not found and self.policy == "race":
            try:
                make_decider(self.decider, self.quorum, self.enough)
            except ValueError as exc:
                found.append(str(exc))
        return found

    @property
    def learning_rate(self) -> float:
        return DEFAULT_ETA.get(self.policy, 0.0) if self.eta is None else float(self.eta)

    def to_json(self) -> dict:
        return {**asdict(self), "models": list(self.models)}

    @classmethod
    def from_json(cls, data: object) -> ApplicationSpec:
        """Checked: unknown fields and wrong types are refused with a message saying which."""
        if not isinstance(data, dict):
            raise ValueError("an application must be a JSON object")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(data) - known):
            raise ValueError(f"unknown application fields {unknown}; known: {sorted(known)}")
        if missing := [k for k in ("name", "models") if k not in data]:
            raise ValueError(f"an application needs {missing}")
        if not isinstance(data["models"], list):
            raise ValueError("models must be a list of model names")
        return cls(**{**data, "models": tuple(data["models"])})


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: object) -> bool:
    return _number(value) and value > 0


def parse_query_input(value: object, specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """A Clipper-style `input` as one query of the application's models: nested lists for a model with one
    input, or an object of them by input name; the batch dimension is added here."""
    if len(specs) == 1 and not isinstance(value, dict):
        value = {specs[0].name: value}
    if not isinstance(value, dict):
        raise ProtocolError(f"'input' must be an object with the inputs {[s.name for s in specs]}")
    if missing := [s.name for s in specs if s.name not in value]:
        raise ProtocolError(f"'input' lacks {missing}; the models take {[s.name for s in specs]}")
    if extra := sorted(set(value) - {s.name for s in specs}):
        raise ProtocolError(f"'input' has unknown inputs {extra}; the models take {[s.name for s in specs]}")
    arrays = {}
    for spec in specs:
        try:
            array = np.asarray(value[spec.name], dtype=DATATYPES[spec.datatype])
        except (ValueError, TypeError, OverflowError):
            raise ProtocolError(f"input '{spec.name}' must be a (nested) list of {spec.datatype} values") from None
        want = spec.shape[1:]
        if array.ndim != len(want) or any(w != -1 and w != g for w, g in zip(want, array.shape)):
            raise ProtocolError(f"input '{spec.name}' has shape {list(array.shape)}, the models take "
                                f"{['*' if w == -1 else w for w in want]}")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ProtocolError(f"input '{spec.name}' holds NaN or infinite values")
        arrays[spec.name] = array[None]
    return arrays


@dataclass
class ModelStats:
    asked: int = 0
    answered: int = 0  # before the decision
    late: int = 0  # after the query was decided: kept for feedback only
    failed: int = 0
    wins: int = 0  # answers that carried the decision
    latency_min_ms: float = math.inf
    latency_max_ms: float = 0.0
    latency_sum_ms: float = 0.0
    feedback: int = 0
    correct: int = 0
    last_error: str | None = None

    def observe(self, latency_ms: float) -> None:
        self.latency_min_ms = min(self.latency_min_ms, latency_ms)
        self.latency_max_ms = max(self.latency_max_ms, latency_ms)
        self.latency_sum_ms += latency_ms

    def to_json(self) -> dict:
        timed = self.answered + self.late
        return {"asked": self.asked, "answered": self.answered, "late": self.late, "failed": self.failed,
                "wins": self.wins,
                "latency_ms": {"min": self.latency_min_ms if timed else None,
                               "mean": self.latency_sum_ms / timed if timed else None,
                               "max": self.latency_max_ms if timed else None},
                "feedback": self.feedback, "accuracy": self.correct / self.feedback if self.feedback else None,
                "last_error": self.last_error}


@dataclass
class _Query:
    """A recent query, kept for the feedback on it."""

    chosen: str | None  # exp3: the model drawn
    labels: dict[str, int] = field(default_factory=dict)  # every answer, including late ones
    confidences: dict[str, float] = field(default_factory=dict)  # and each answer's confidence
    decided: bool = False
    stragglers: set[asyncio.Task] = field(default_factory=set)  # asks still running after the decision


@dataclass(frozen=True)
class AppAnswer:
    query_id: str
    output: object
    default: bool
    confidence: float | None
    models: tuple[str, ...]  # whose answers made the output
    explanation: str | None
    latency_ms: float  # arrival at the application to the decision, as the server measured it

    def to_json(self) -> dict:
        body = {"query_id": self.query_id, "output": self.output, "default": self.default,
                "confidence": self.confidence, "models": list(self.models), "server_ms": self.latency_ms}
        if self.explanation:
            body["explanation"] = self.explanation
        return body


class Application:
    """One application's queries and feedback. Runs on the server's event loop; models are looked up by
    name at every query, so a model swapped for a new version serves the next query."""

    def __init__(self, spec: ApplicationSpec, model: Callable[[str], Predictor], store: StateStore,
                 metrics: ServerMetrics) -> None:
        self.spec = spec
        self._model = model
        self.store = store
        self.metrics = metrics
        self.decider = make_decider(spec.decider, spec.quorum, spec.enough) if spec.policy == "race" else None
        self.stats = {name: ModelStats() for name in spec.models}
        self.requests = 0
        self.defaults = 0
        self.latency_sum_ms = 0.0
        self.latency_max_ms = 0.0
        self._random = random.Random(spec.seed)
        self._recent: OrderedDict[bytes, _Query] = OrderedDict()
        self._stragglers: set[asyncio.Task] = set()

    @property
    def name(self) -> str:
        return self.spec.name

    def signature(self) -> tuple[TensorSpec, ...]:
        """The inputs of the application's models (they take the same ones; checked at registration)."""
        for name in self.spec.models:
            try:
                inputs = self._model(name).inputs
            except KeyError:
                continue
            if inputs is not None:
                return inputs
        raise ProtocolError(f"application {self.name}: none of its models {list(self.spec.models)} is loaded", 503)

    # ---- selection state ------------------------------------------------------------------------------------

    @property
    def _namespace(self) -> str:
        return f"selection/{self.name}"

    def _state(self, stored: dict | None) -> SelectionState:
        """The stored state over the application's current models: a model linked since starts at the mean
        weight of the others, one removed is dropped."""
        if stored is None:
            return SelectionState.uniform(self.spec.models)
        return SelectionState.from_json(stored).over(self.spec.models)

    async def weights(self, context: str = DEFAULT_CONTEXT) -> dict[str, float]:
        state = self._state(await self.store.get(self._namespace, context))
        return dict(zip(state.models, state.probabilities().tolist()))

    @property
    def learns(self) -> bool:
        """A race whose decider learns from feedback."""
        return self.spec.policy == "race" and self.spec.decider == LEARNED_DECIDER

    @property
    def _trust_namespace(self) -> str:
        return f"race/{self.name}"

    def _trust(self, stored: dict | None) -> Trust:
        """The learned decider's trust in the application's current models (a model linked since starts with
        no feedback of its own)."""
        return (Trust.fresh(self.spec.models) if stored is None else Trust.from_json(stored)).over(self.spec.models)

    async def trust(self, context: str = DEFAULT_CONTEXT) -> Trust:
        return self._trust(await self.store.get(self._trust_namespace, context))

    # ---- queries ------------------------------------------------------------------------------------------

    def _remember(self, key: bytes, query: _Query) -> None:
        self._recent[key] = query
        self._recent.move_to_end(key)
        while len(self._recent) > RECENT_QUERIES:
            self._recent.popitem(last=False)

    async def predict(self, inputs: Mapping[str, np.ndarray], context: str = DEFAULT_CONTEXT) -> AppAnswer:
        started = time.perf_counter()
        query_id = uuid.uuid4().hex
        spec = self.spec
        state = self._state(await self.store.get(self._namespace, context)) if spec.policy != "race" else None
        if spec.policy == "exp3":
            asked = (state.models[exp3_choose(state, self._random.random())],)
        else:
            asked = spec.models
        query = _Query(asked[0] if spec.policy == "exp3" else None)
        self._remember(cache_key(self.name, context, inputs), query)
        if spec.policy == "exp4":
            decide = self._exp4_decider(state)
        elif self.learns:
            decide = partial(learned, trust=await self.trust(context))
        else:
            decide = self.decider or first  # exp3 asks one model
        decision, arrived = await self._fan_out(asked, inputs, query, started, decide)
        latency_ms = (time.perf_counter() - started) * 1000.0
        self.requests += 1
        self.latency_sum_ms += latency_ms
        self.latency_max_ms = max(self.latency_max_ms, latency_ms)
        self.metrics.app_latency.labels(app=self.name).observe(latency_ms / 1000.0)
        if decision is None:
            self.defaults += 1
            self.metrics.app_requests.labels(app=self.name, outcome="default").inc()
            return AppAnswer(query_id, spec.default_output, True, None, (),
                             self._explain(asked, arrived), latency_ms)
        for model in decision.models:
            self.stats[model].wins += 1
            self.metrics.app_model_answers.labels(app=self.name, model=model, outcome="won").inc()
        self.metrics.app_requests.labels(app=self.name, outcome="answered").inc()
        return AppAnswer(query_id, decision.label, False, decision.confidence, decision.models, None, latency_ms)

    def _explain(self, asked: Sequence[str], arrived: Sequence[Candidate]) -> str:
        if not arrived:
            failures = {m: self.stats[m].last_error for m in asked if self.stats[m].last_error}
            return (f"no model answered within the SLO of {self.spec.slo_ms:g} ms (asked {list(asked)}"
                    + (f"; last errors {failures})" if failures else ")"))
        return (f"the {self.spec.decider} decider found no answer among {len(arrived)} of {len(asked)} models "
                f"within the SLO of {self.spec.slo_ms:g} ms")

    async def _fan_out(self, asked: Sequence[str], inputs: Mapping[str, np.ndarray], query: _Query, started: float,
                       decide: Callable[[Sequence[Candidate], int, bool], Decision | None]
                       ) -> tuple[Decision | None, list[Candidate]]:
        """Ask the models at once; after each answer ask the decider, and once more when all have answered or
        the SLO is spent. Models still running then go on in the background, their answers kept for feedback."""
        deadline = started + self.spec.slo_ms / 1000.0
        pending = {asyncio.ensure_future(self._ask(name, inputs, query, deadline)) for name in asked}
        arrived: list[Candidate] = []
        decision = None
        while pending and decision is None:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            fresh = sorted((c for c in (t.result() for t in done) if c is not None), key=lambda c: c.latency_ms)
            for candidate in fresh:
                arrived.append(candidate)
                decision = decide(arrived, len(asked), not pending and candidate is fresh[-1])
                if decision is not None:
                    break
        if decision is None:  # all have answered or failed, or the SLO is spent: decide from what arrived
            decision = decide(arrived, len(asked), True)
        query.decided = True
        for task in pending:
            for running in (self._stragglers, query.stragglers):
                running.add(task)
                task.add_done_callback(running.discard)
        return decision, arrived

    async def _ask(self, name: str, inputs: Mapping[str, np.ndarray], query: _Query,
                   deadline: float) -> Candidate | None:
        stats = self.stats[name]
        stats.asked += 1
        started = time.perf_counter()
        try:
            answer = await self._model(name).predict(inputs, max(deadline - started, 1e-3) * 1000.0)
        except KeyError:
            outcome, stats.last_error = "failed", f"model {name} is not loaded"
        except Exception as exc:  # any model's failure is that model's missing answer, never the query's
            outcome, stats.last_error = "failed", f"{type(exc).__name__}: {exc}"
        else:
            latency_ms = (time.perf_counter() - started) * 1000.0
            stats.observe(latency_ms)
            self.metrics.app_model_latency.labels(app=self.name, model=name).observe(latency_ms / 1000.0)
            label = int(answer.labels[0])
            query.labels[name] = label
            query.confidences[name] = float(answer.confidences[0])
            late = query.decided
            stats.late += late
            stats.answered += not late
            self.metrics.app_model_answers.labels(app=self.name, model=name,
                                                  outcome="late" if late else "answered").inc()
            return None if late else Candidate(name, label, float(answer.confidences[0]), latency_ms)
        stats.failed += 1
        self.metrics.app_model_answers.labels(app=self.name, model=name, outcome=outcome).inc()
        return None

    def _exp4_decider(self, state: SelectionState) -> Callable[[Sequence[Candidate], int, bool], Decision | None]:
        """Exp4's weighted vote, decided before every model has answered once the models still out could not
        change the winner (their weight is less than the leader's margin)."""
        weights = state.probabilities()
        index = {m: i for i, m in enumerate(state.models)}

        def decide(arrived: Sequence[Candidate], expected: int, final: bool) -> Decision | None:
            if not arrived:
                return None
            predictions = np.full(len(state.models), -1)
            for candidate in arrived:
                predictions[index[candidate.model]] = candidate.label
            votes = exp4_votes(state, predictions, int(predictions.max()) + 1)
            label = int(votes.argmax())
            confidence = float(votes[label])
            if not final:
                runner_up = np.sort(votes)[-2] if len(votes) > 1 else 0.0
                if confidence - runner_up <= 1.0 - weights[predictions >= 0].sum():
                    return None
            return Decision(label, confidence, tuple(c.model for c in arrived if c.label == label))

        return decide

    # ---- feedback -----------------------------------------------------------------------------------------

    async def update(self, inputs: Mapping[str, np.ndarray], label: int, context: str = DEFAULT_CONTEXT) -> dict:
        """Clipper's feedback: the true label of a query. It scores the answers that query got (late ones
        included); models with no answer on record are asked now. Exp3 learns from the model it drew; the
        learned race decider from every answer and its confidence."""
        query = self._recent.get(cache_key(self.name, context, inputs))
        if self.spec.policy == "exp3":
            chosen = query.chosen if query is not None else None
            if chosen is None or chosen not in self.spec.models:
                state = self._state(await self.store.get(self._namespace, context))
                chosen = state.models[exp3_choose(state, self._random.random())]
            needed = [chosen]
        else:
            needed = list(self.spec.models)
        if query is not None and query.stragglers:
            # Feedback that comes right after the answer waits for the query's late answers (as long as a fresh
            # ask would) instead of asking those models a second time.
            await asyncio.wait(set(query.stragglers), timeout=self.spec.slo_ms / 1000.0)
        known = dict(query.labels) if query is not None else {}
        confidences = dict(query.confidences) if query is not None else {}
        missing = [m for m in needed if m not in known]
        if missing:
            fresh = _Query(None)
            await self._fan_out(missing, inputs, fresh, time.perf_counter(), _never)
            known.update(fresh.labels)
            confidences.update(fresh.confidences)
        losses = {m: float(known[m] != label) for m in needed if m in known}
        for model, loss in losses.items():
            self.stats[model].feedback += 1
            self.stats[model].correct += loss == 0.0
        if self.learns and losses:
            return {"updated": True, "losses": losses,
                    "trust": await self._learn({m: (known[m], confidences[m]) for m in losses}, label, context)}
        if self.spec.policy == "race" or not losses:
            return {"updated": bool(losses), "losses": losses}
        eta = self.spec.learning_rate

        def change(stored: dict | None) -> dict:
            state = self._state(stored)
            if self.spec.policy == "exp3":
                return exp3_update(state, state.models.index(chosen), losses[chosen], eta).to_json()
            vector = np.array([losses.get(m, np.nan) for m in state.models])
            return exp4_update(state, vector, eta).to_json()

        new = SelectionState.from_json(await self.store.update(self._namespace, context, change))
        return {"updated": True, "losses": losses,
                "weights": dict(zip(new.models, new.probabilities().tolist()))}

    async def _learn(self, answers: dict[str, tuple[int, float]], label: int,
                     context: str) -> dict[str, float | None]:
        """The learned decider's trust after this feedback, kept in the store; returned as each model's accuracy
        over its answers (faded as the trust fades them)."""

        def change(stored: dict | None) -> dict:
            return learn(self._trust(stored), answers, label).to_json()

        trust = Trust.from_json(await self.store.update(self._trust_namespace, context, change))
        seen = trust.scored.sum(axis=1)
        return {m: float(r / n) if n else None for m, r, n in zip(trust.models, trust.right.sum(axis=1), seen)}

    # ---- statistics ---------------------------------------------------------------------------------------

    def status(self) -> dict:
        return {
            "spec": self.spec.to_json(),
            "requests": self.requests,
            "defaults": self.defaults,
            "latency_ms": {"mean": self.latency_sum_ms / self.requests if self.requests else None,
                           "max": self.latency_max_ms if self.requests else None},
            "stragglers_running": len(self._stragglers),
            "models": {name: stats.to_json() for name, stats in self.stats.items()},
        }


def _never(arrived: Sequence[Candidate], expected: int, final: bool) -> Decision | None:
    """Feedback waits for every model it asked (within the SLO)."""
    return None


def context_of(uid: object) -> str:
    """The selection context of a query: the user or session key it names, or the application's default."""
    if uid is None:
        return DEFAULT_CONTEXT
    if not isinstance(uid, str | int) or isinstance(uid, bool) or not str(uid):
        raise ProtocolError(f"'uid' must be a non-empty string, got {uid!r}")
    return str(uid)


class ApplicationPredictor(Predictor):
    """An application as the data plane asks a model (`infer`): one query per request, its context from the
    request's `uid` parameter, its decided output as the label (-1 where that is not an integer class) and the
    rest of its answer as the response's parameters. Its deadline is its SLO, whatever the request's. Never
    cached: its answers follow weights that feedback moves, and a default at the deadline is no answer to keep.
    Not a model another application can ask (`predict`)."""

    kind = "application"
    version = APPLICATION_VERSION
    cacheable = False

    def __init__(self, app: Application) -> None:
        self.app, self.name = app, app.name

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.app.signature()

    def problem_with(self, inputs: Mapping[str, np.ndarray], rows: int) -> str | None:
        return None if rows == 1 else f"application '{self.name}' answers one query per request, got {rows}"

    async def infer(self, request: ModelRequest) -> Answer:
        decided = await self.app.predict(request.inputs, context_of(request.parameters.get("uid")))
        output = decided.output
        label = output if isinstance(output, int) and not isinstance(output, bool) else -1
        decision = {k: v for k, v in decided.to_json().items() if k != "output"}
        if decided.default:
            decision["default_output"] = output
        return Answer(np.array([label]), np.array([np.nan if decided.confidence is None else decided.confidence]),
                      decision=decision)


def check_compatible(name: str, signatures: Mapping[str, tuple[TensorSpec, ...] | None]) -> None:
    """An application's models must take the same inputs: one query goes to all of them."""
    known = {model: tuple((s.name, s.datatype) for s in inputs) for model, inputs in signatures.items()
             if inputs is not None}
    if len(set(known.values())) > 1:
        raise ValueError(f"application {name}: its models take different inputs: "
                         + "; ".join(f"{m}: {list(v)}" for m, v in known.items()))
