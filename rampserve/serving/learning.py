"""A model served before it was prepared (`rampserve serve model.onnx`): it answers from its first request, vanilla,
while its traffic becomes the data its ramps learn on.

A model's life here, each phase visible in `/status`, `/metrics` (`rampserve_learning_phase`) and the dashboard:
1. recording: the whole model answers (ONNX Runtime); the first N distinct requests it answers are kept in its
   folder, each a line of JSON exactly as a v2 infer request's body (`{"inputs": [{name, shape, datatype, data}]}`),
   the request log `rampserve prepare --data` reads;
2. training, then profiling: `rampserve prepare MODEL --data recording.jsonl --out bundle` runs as a background job
   (`rampserve.background`: SCHED_IDLE, one thread per pool, killed with the server) and writes the bundle whole or
   not at all;
3. certifying: the bundle's executor starts beside the vanilla model, then takes its name (`Catalogue.replace`: a
   request goes wholly to one of them, and the vanilla model answers everything it accepted before it closes); its
   controller serves no exit until its guarantee certifies thresholds on live inputs;
4. managed: the controller has certified an exit;
5. relearning (unless --no-relearn): once the share of answers given early falls far below the level it held and
   stays there (`control.relearning`), the next `record` distinct requests are recorded while the bundle in service
   answers (recording again), a new generation of ramps is trained on them and adopted as the first was (training,
   profiling, certifying, managed). Its bundle lies beside the first (`bundle-2`, ...); once it serves, the older
   generations are removed.
A training that fails leaves the model served vanilla, phase failed, with the reason; a relearning that fails leaves
the generation before it serving, the reason in `/status`. Everything is on disk in the
model's folder, so a server started again resumes where its predecessor stood: a bundle there is served at once, a
partial recording goes on, a recording that was complete is trained on again, a failure stays until more is
recorded (a larger --record); a relearning goes on from its recording.

The folder (`ModelFolder`) is the model's own directory when the server is given one holding `model.onnx`, else one
per model source under RAMPSERVE_HOME/learning.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import orjson

from rampserve.background import job_command, job_environment
from rampserve.bundle_format.manifest import MANIFEST
from rampserve.control.ramps import no_ramp_fits
from rampserve.control.relearning import ExitShareWatch, RelearnRule
from rampserve.paths import home
from rampserve.serving.executor.loading import read_served
from rampserve.serving.executor.process_worker import make_worker
from rampserve.serving.frontend.repository.predictors import Predictor, WorkerPredictor
from rampserve.serving.plain_models import onnx_predictor
from rampserve.serving.shared.contract import Answer, ModelRequest
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.protocol import TensorSpec
from rampserve.serving.shared.settings import DEFAULT_RECORD, ModelSettings

if TYPE_CHECKING:
    from rampserve.serving.frontend.repository.catalogue import Catalogue

log = logging.getLogger("rampserve.serving")

# Phases, in the order a model goes through them; "vanilla" is a model served without recording (--no-record)
VANILLA, RECORDING, TRAINING, PROFILING, CERTIFYING, MANAGED, FAILED = (
    "vanilla", "recording", "training", "profiling", "certifying", "managed", "failed")
PHASES = (VANILLA, RECORDING, TRAINING, PROFILING, CERTIFYING, MANAGED, FAILED)
MODEL_FILE = "model.onnx"  # a folder holding this alone is a model to serve unprepared
CERTIFYING_DETAIL = "the controller certifies thresholds on live inputs before it serves an exit"
CERTIFICATION_POLL_S = 1.0  # how often the certifying phase reads the executor's configuration
STOP_WAIT_S = 10.0  # how long a stopping server waits for its training job to end on SIGTERM before killing it
RECENT_WINDOWS = 10  # windows of the early-answer share /status shows
FAILURE_LINES = 60  # lines of the training job's output kept to say why it failed

# What the training job's progress bars are called (their tqdm descriptions), and the phase each belongs to
JOB_STAGES = (("engines, batch", TRAINING), ("running the model for ramp features", TRAINING),
              ("training ramps", TRAINING), ("building caches", TRAINING), ("profiling latency", PROFILING))
BOX_CHARACTERS = " │╭╮╰╯─┃━"
# The training job's terminal width: its error box keeps a message on one line instead of cutting it mid-word
JOB_COLUMNS = {"COLUMNS": "1000"}


@dataclass(frozen=True)
class LearningSettings:
    record: int = DEFAULT_RECORD  # distinct requests recorded before the ramps are trained
    recording: bool = True  # False (--no-record): serve the model vanilla and keep nothing
    prepare_args: tuple[str, ...] = ()  # more options for the training job's `rampserve prepare`
    relearn: RelearnRule | None = RelearnRule()  # when exits stop paying, train ramps again (None: never)

    def __post_init__(self) -> None:
        if self.record < 1:
            raise ValueError(f"--record must be at least 1, got {self.record}")


@dataclass(frozen=True)
class ModelFolder:
    """Where a model served unprepared keeps its state: what it recorded, the bundle prepared from it, and why a
    training failed."""

    path: Path

    @property
    def recording(self) -> Path:
        return self.path / "recording.jsonl"

    @property
    def bundle(self) -> Path:
        return self.path / "bundle"

    @property
    def training_log(self) -> Path:
        return self.path / "training.log"

    @property
    def failure_file(self) -> Path:
        return self.path / "failed.json"

    @property
    def exported(self) -> Path:
        """Where a model that is not an ONNX file is exported to one, to serve it vanilla."""
        return self.path / "vanilla.onnx"

    def generation_bundle(self, generation: int) -> Path:
        """A generation's bundle: the first, trained on the recording, at `bundle`; each relearned one beside it."""
        return self.bundle if generation == 1 else self.path / f"bundle-{generation}"

    def relearning_recording(self, generation: int) -> Path:
        """The recent requests a generation after the first is trained on."""
        return self.path / f"relearning-{generation}.jsonl"

    def served_generation(self) -> int:
        """The newest generation whose bundle is whole; 0 if none is."""
        generations = [int(found.group(1)) for path in self.path.glob("bundle-*")
                       if (found := re.fullmatch(r"bundle-(\d+)", path.name))]
        return max((g for g in [1, *generations] if (self.generation_bundle(g) / MANIFEST).is_file()), default=0)

    def drop_generations_before(self, generation: int) -> None:
        """Remove the bundles and relearning recordings older than `generation` (none serves any more); the first
        recording stays, the user's record of what the model was first trained on."""
        for older in range(1, generation):
            shutil.rmtree(self.generation_bundle(older), ignore_errors=True)
            self.relearning_recording(older).unlink(missing_ok=True)

    def failure(self) -> dict | None:
        """Why the last training failed, and on how many recorded requests; None if none failed."""
        try:
            return orjson.loads(self.failure_file.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None

    def record_failure(self, reason: str, recorded: int) -> None:
        self.failure_file.write_bytes(orjson.dumps({"reason": reason, "recorded": recorded, "at": time.time()}))


@dataclass(frozen=True)
class UnpreparedModel:
    """A model given to `serve` with no bundle: its name, its source as `rampserve prepare` takes it, and its
    folder."""

    name: str
    source: str
    folder: ModelFolder


def unprepared_model(ref: str) -> UnpreparedModel | None:
    """The model `serve` was given as `ref` if it is one to serve unprepared: an .onnx file, hf:DIR, or a folder
    holding model.onnx and no bundle; None for anything else (a bundle, a zoo name)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if (path / MANIFEST).is_file() or not (path / MODEL_FILE).is_file():
            return None
        return UnpreparedModel(path.resolve().name, str(path.resolve() / MODEL_FILE), ModelFolder(path.resolve()))
    if ref.startswith("hf:"):
        located = Path(ref.removeprefix("hf:")).expanduser().resolve()
        source = f"hf:{located}"
    elif ref.endswith(".onnx"):
        if not path.is_file():
            raise ValueError(f"ONNX file {ref} does not exist")
        located = path.resolve()
        source = str(located)
    else:
        return None
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]  # two models of one name keep apart
    name = located.name if ref.startswith("hf:") else located.stem
    return UnpreparedModel(name, source, ModelFolder(home() / "learning" / f"{name}-{digest}"))


def request_line(inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str]) -> bytes:
    """One request as a line of the request log: a v2 infer request's JSON body, each tensor's data flat."""
    return orjson.dumps({"inputs": [{"name": name, "shape": list(array.shape), "datatype": datatypes[name],
                                     "data": np.ascontiguousarray(array).ravel()}
                                    for name, array in inputs.items()]}, option=orjson.OPT_SERIALIZE_NUMPY)


class RequestRecorder:
    """The first `target` distinct requests a model answers, appended to its request log as they are answered (a
    request whose inputs the log already holds is not counted again). A log left by an earlier server is read back
    (a last line it did not finish is dropped) and added to."""

    def __init__(self, path: Path, target: int, inputs: tuple[TensorSpec, ...]) -> None:
        self.path, self.target = path, target
        self.datatypes = {spec.name: spec.datatype for spec in inputs}
        self.seen: set[bytes] = set()
        self.on_full: Callable[[], None] = lambda: None
        kept = self._read_back()
        self._file = None
        if not self.full:
            self._file = path.open("ab")
            self._file.truncate(kept)

    def _read_back(self) -> int:
        """Count the requests already on disk; the bytes of whole lines among them."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        whole = data[:data.rfind(b"\n") + 1]
        for line in whole.splitlines():
            self.seen.add(self._key(line))
        return len(whole)

    @staticmethod
    def _key(line: bytes) -> bytes:
        return hashlib.blake2b(line, digest_size=16).digest()

    @property
    def count(self) -> int:
        return len(self.seen)

    @property
    def full(self) -> bool:
        return self.count >= self.target

    def record(self, inputs: Mapping[str, np.ndarray]) -> None:
        if self._file is None:
            return
        line = request_line(inputs, self.datatypes)
        key = self._key(line)
        if key in self.seen:
            return
        self.seen.add(key)
        self._file.write(line + b"\n")
        self._file.flush()  # in the kernel's hands: a server that is killed loses nothing it answered
        if self.full:
            self.close()
            self.on_full()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RecordingPredictor(Predictor):
    """A model that keeps what it answers while it has a recorder: each request it answered goes to it. Everything
    else is the model's own (a bundle's executor, its text input), so it is served as the model is."""

    def __init__(self, model: Predictor, recorder: RequestRecorder | None = None) -> None:
        self.model, self.recorder = model, recorder
        self.name, self.version, self.kind, self.inputs = model.name, model.version, model.kind, model.inputs
        self.outputs, self.cacheable, self.worker, self.text = model.outputs, model.cacheable, model.worker, model.text

    @property
    def platform(self) -> str:
        return self.model.platform

    @property
    def available(self) -> bool:
        return self.model.available

    async def start(self) -> None:
        await self.model.start()

    async def predict(self, inputs: Mapping[str, np.ndarray], deadline_ms: float | None = None) -> Answer:
        return await self.model.predict(inputs, deadline_ms)

    def problem_with(self, inputs: Mapping[str, np.ndarray], rows: int) -> str | None:
        return self.model.problem_with(inputs, rows)

    async def infer(self, request: ModelRequest) -> Answer:
        answer = await self.model.infer(request)
        recorder = self.recorder
        if recorder is not None:
            recorder.record(request.inputs)
        return answer

    def count_cached(self, labels: np.ndarray) -> None:
        self.model.count_cached(labels)

    async def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        await self.model.close()

    async def status(self, latest_decisions: int | None = None) -> dict:
        return await self.model.status(latest_decisions)


def certified(status: dict) -> bool:
    """Whether a managed model's executor serves an exit: a configuration with a ramp above threshold 0, which its
    controller sets only once its guarantee certifies it (an executor restarting has no configuration to show)."""
    configuration = status.get("configuration")
    return configuration is not None and any(t > 0 for t in configuration["thresholds"])


def certifying_detail(status: dict) -> str:
    """What a certifying model waits for: certified thresholds, or (its latest search judged no set but "no ramp")
    a batch size served at which some ramp fits the budget; the load decides the batch size, so a later search may
    find one."""
    if status.get("ramps_fit", True):
        return CERTIFYING_DETAIL
    return (f"{no_ramp_fits(status['ramp_budget'], status['budget_batch'])}: the original model answers until a "
            "search at a batch size where one fits")


def job_stage(line: str) -> str | None:
    """The phase a line of the training job's output shows it in (one of its progress bars), or None."""
    return next((phase for description, phase in JOB_STAGES if line.startswith(description)), None)


def failure_reason(lines: list[str]) -> str | None:
    """Why the training job failed, from the end of its output: the message of the error box the command line
    draws around a refused value, else the last line (an exception's)."""
    top = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("╭")), None)
    if top is not None:
        inside = [line.strip(BOX_CHARACTERS) for line in lines[top + 1:] if not line.startswith("╰")]
        message = " ".join(part for part in inside if part)
        if message:
            return message
    return next((line for line in reversed(lines) if line.strip()), None)


def training_command(model: UnpreparedModel, data: Path, out: Path, prepare_args: tuple[str, ...]) -> list[str]:
    return job_command("rampserve.cli", ["prepare", model.source, "--data", str(data), "--out", str(out),
                                         *prepare_args])


def reap(job: subprocess.Popen) -> tuple[int, float]:
    """Wait for the job to end: its exit status, and the CPU seconds it took (all its threads', user and system, as
    the kernel counts them: a figure the machine's other work does not change, unlike its wall-clock time)."""
    _, status, usage = os.wait4(job.pid, 0)
    job.returncode = os.waitstatus_to_exitcode(status)
    return job.returncode, usage.ru_utime + usage.ru_stime


async def end_job(job: subprocess.Popen, reaped: asyncio.Future) -> None:
    """Ask the job to stop (SIGTERM), and kill it if it has not within STOP_WAIT_S; `reaped` is its `reap`. Signalled by
    pid, never through `job` (whose poll would race the thread that reaps it: the pid is the job's until reaped)."""
    os.kill(job.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(reaped), STOP_WAIT_S)
    except TimeoutError:
        os.kill(job.pid, signal.SIGKILL)
        await reaped


def bundle_predictor(model: UnpreparedModel, generation: int, settings: ModelSettings,
                     metrics: ServerMetrics) -> RecordingPredictor:
    """A generation of the model's bundle, served with early exits (recording when it is given a recorder)."""
    bundle = model.folder.generation_bundle(generation)
    return RecordingPredictor(WorkerPredictor(make_worker(read_served(bundle, model.name), settings, metrics)))


def vanilla_predictor(model: UnpreparedModel) -> Predictor:
    """The whole model on ONNX Runtime (a Hugging Face checkpoint exported to ONNX first, once)."""
    if model.source.endswith(".onnx"):
        return onnx_predictor(model.name, Path(model.source))
    from rampserve.runtime.sources import ModelSource, onnx_file  # imports torch, which an ONNX model never needs

    source = ModelSource.parse(model.source)
    model.folder.path.mkdir(parents=True, exist_ok=True)
    return onnx_predictor(model.name, onnx_file(source, model.folder.exported))


class Learner:
    """Takes one model served unprepared through its phases (see the module's docstring): waits for its recording,
    runs the training job, has the catalogue adopt the bundle, and watches its controller certify an exit; then, with
    relearning on, watches its exits pay and trains a new generation of ramps on recent requests when they stop
    (`control.relearning`). Runs on the server's event loop; `status` is what `/status` shows of it."""

    def __init__(self, model: UnpreparedModel, settings: LearningSettings, model_settings: ModelSettings,
                 metrics: ServerMetrics, phase: str, recorder: RequestRecorder | None = None,
                 reason: str | None = None, generation: int = 0, tap: RecordingPredictor | None = None) -> None:
        """`generation`: the bundle generation served (0: none yet, the model is served vanilla); `tap`: what serves
        it, which records recent requests when the learner gives it a recorder."""
        self.model, self.settings, self.model_settings, self.metrics = model, settings, model_settings, metrics
        self.recorder = recorder
        self.phase, self.reason, self.detail = phase, reason, None
        self.history: list[dict] = [{"phase": phase, "at": time.time()}]
        self.generation, self.tap = generation, tap
        self.relearning: int | None = None  # the generation being recorded for or trained, once the stream drifted
        self.drifts: list[dict] = []  # each time the exits stopped paying: when, and the shares the watch saw
        self.watch: ExitShareWatch | None = None  # on the exits of the generation managed now
        self._job: subprocess.Popen | None = None
        self.job_cpu_s: float | None = None
        self._output: deque[str] = deque(maxlen=FAILURE_LINES)
        self._task: asyncio.Task | None = None
        for each in PHASES:
            metrics.learning_phase.labels(model=model.name, phase=each).set_function(
                lambda each=each: float(self.phase == each))
        metrics.recorded_requests.labels(model=model.name).set_function(
            lambda: 0 if self.recorder is None else self.recorder.count)
        metrics.record_target.labels(model=model.name).set_function(
            lambda: 0 if self.recorder is None else self.recorder.target)

    @property
    def name(self) -> str:
        return self.model.name

    def resume_relearning(self, recorder: RequestRecorder) -> None:
        """Go on with a relearning a stopped server left on disk: its recording, whole or in part."""
        self.relearning, self.recorder = self.generation + 1, recorder
        self.phase = TRAINING if recorder.full else RECORDING
        self.history = [{"phase": self.phase, "at": time.time()}]

    def _enter(self, phase: str, detail: str | None = None) -> None:
        if phase != self.phase:
            self.history.append({"phase": phase, "at": time.time()})
            self._say(phase, detail)
        self.phase, self.detail = phase, detail

    def _say(self, phase: str, detail: str | None) -> None:
        if phase == FAILED:
            log.error("model %s: training its ramps failed, it is served vanilla: %s (see %s)", self.name, self.reason,
                      self.model.folder.training_log)
        else:
            log.warning("model %s: %s%s", self.name, phase, f" ({detail})" if detail else "")

    def start(self, catalogue: Catalogue) -> None:
        """Go on from the phase the model is in, in `catalogue`."""
        recorder = self.recorder
        self._say(self.phase, f"{recorder.count} of {recorder.target} requests recorded in {recorder.path}"
                  if self.phase == RECORDING else f"state in {self.model.folder.path}")
        if self.phase not in (VANILLA, FAILED):
            self._task = asyncio.get_running_loop().create_task(self._run(catalogue), name=f"learning {self.name}")

    async def _run(self, catalogue: Catalogue) -> None:
        if self.generation == 0:
            if self.phase == RECORDING:
                await self._recorded()
            if not await self._learn(catalogue, 1, self.model.folder.recording):
                return
        elif self.relearning is not None:
            await self._relearn(catalogue)
        while True:
            await self._certify(catalogue)
            if self.settings.relearn is None:
                return
            watch = await self._watch(catalogue)
            self._drifted(watch)
            await self._relearn(catalogue)

    async def _recorded(self) -> None:
        """Until the recorder is full."""
        filled = asyncio.Event()
        self.recorder.on_full = filled.set
        if not self.recorder.full:
            await filled.wait()

    async def _learn(self, catalogue: Catalogue, generation: int, data: Path) -> bool:
        """Train `generation` on `data` and serve it; whether it serves. A first generation that fails leaves the
        model vanilla (failed); a later one leaves the generation before it serving, saying why."""
        folder = self.model.folder
        reason = await self._train(catalogue, data, folder.generation_bundle(generation)) \
            or await self._adopt(catalogue, generation)
        if reason is None:  # a relearning that failed before this one no longer says why the model stands as it does
            self.generation, self.reason = generation, None
            folder.drop_generations_before(generation)
            return True
        if generation == 1:
            self.reason = reason
            folder.record_failure(reason, self.recorder.count)
            self._enter(FAILED)
        else:  # its recording goes, or a restart would train on it again
            data.unlink(missing_ok=True)
            self.reason = f"relearning generation {generation} failed, generation {self.generation} serves: {reason}"
            log.error("model %s: %s (see %s)", self.name, self.reason, folder.training_log)
        return False

    async def _train(self, catalogue: Catalogue, data: Path, out: Path) -> str | None:
        """Run the training job on `data` into the bundle `out`; why it failed, or None."""
        folder = self.model.folder
        folder.failure_file.unlink(missing_ok=True)
        self._enter(TRAINING, "starting the training job")
        command = training_command(self.model, data, out, self.settings.prepare_args)
        with folder.training_log.open("ab") as log_file:
            log_file.write(f"\n$ {' '.join(command)}\n".encode())
            log_file.flush()
            # Started from the event loop's thread, which lives as long as the server: the job dies with the thread
            # that started it (see `rampserve.background`)
            self._job = job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=job_environment() | JOB_COLUMNS)
            reader = threading.Thread(target=self._read_job, args=(job, log_file, asyncio.get_running_loop()),
                                      name=f"training {self.name}", daemon=True)
            reader.start()
            catalogue.background_started(job.pid)
            reaped = asyncio.ensure_future(asyncio.to_thread(reap, job))
            try:
                code, self.job_cpu_s = await asyncio.shield(reaped)
            except asyncio.CancelledError:  # the server stops: so does the job, which the next server starts again
                await end_job(job, reaped)
                raise
            finally:
                self._job = None
                catalogue.background_ended(job.pid)
                await asyncio.to_thread(reader.join)
        if code == 0 and (out / MANIFEST).is_file():
            return None
        return failure_reason(list(self._output)) or f"the training job exited with status {code}, see " \
                                                     f"{folder.training_log}"

    def _read_job(self, job: subprocess.Popen, log_file: BinaryIO, loop: asyncio.AbstractEventLoop) -> None:
        """The job's output, line by line (a progress bar's updates are lines ended by a carriage return): into its
        log, and each line to the event loop."""
        for raw in iter(job.stdout.readline, b""):
            log_file.write(raw)
            for part in re.split(r"[\r\n]+", raw.decode(errors="replace")):
                if part.strip():
                    loop.call_soon_threadsafe(self._heard, part.strip())
        log_file.flush()

    def _heard(self, line: str) -> None:
        self._output.append(line)
        stage = job_stage(line)
        if stage is not None and self.phase in (TRAINING, PROFILING):
            self._enter(stage, re.sub(r"\|[^|]*\|", "", line))

    async def _adopt(self, catalogue: Catalogue, generation: int) -> str | None:
        """Serve `generation` in place of what serves the model; why it could not, or None."""
        self._enter(CERTIFYING, "starting the prepared model's executor")
        predictor = None
        try:
            predictor = await asyncio.to_thread(bundle_predictor, self.model, generation, self.model_settings,
                                                self.metrics)
            await catalogue.replace(predictor)
        except asyncio.CancelledError:  # the server stops: the executor it may have started stops too
            if predictor is not None:
                await predictor.close()
            raise
        except Exception as exc:  # noqa: BLE001 - whatever keeps the bundle from serving, what served goes on
            return f"the prepared bundle at {self.model.folder.generation_bundle(generation)} could not be served: " \
                   f"{exc}"
        self.tap = predictor
        return None

    async def _certify(self, catalogue: Catalogue) -> None:
        self._enter(CERTIFYING, CERTIFYING_DETAIL)
        while True:
            predictor = catalogue.models.get(self.name)
            status = None if predictor is None or predictor.worker is None else await predictor.status(1)
            if status is not None and certified(status):
                self._enter(MANAGED, "exits at " + ", ".join(status["configuration"]["sites"]))
                return
            if status is not None and status.get("controller_idle"):  # it will never change its configuration
                self._enter(MANAGED, f"no exit: {status['decisions'][-1]['reason']}")
                return
            if status is not None:
                self.detail = certifying_detail(status)
            await asyncio.sleep(CERTIFICATION_POLL_S)

    async def _watch(self, catalogue: Catalogue) -> ExitShareWatch:
        """Until the exits of the generation served stop paying (`control.relearning`): the watch that saw it."""
        self.watch = watch = ExitShareWatch(self.settings.relearn)
        while True:
            await asyncio.sleep(CERTIFICATION_POLL_S)
            predictor = catalogue.models.get(self.name)
            if predictor is None or predictor.worker is None:
                continue
            try:
                answers = (await predictor.status(1))["answers"]
            except Exception as exc:  # noqa: BLE001 - an executor restarting: its counts start again, as the watch's
                log.debug("model %s: no status to watch its exits by: %s", self.name, exc)
                continue
            if watch.observe(answers["early"], answers["early"] + answers["final"]):
                return watch

    def _drifted(self, watch: ExitShareWatch) -> None:
        """The exits stopped paying: record the next requests, to train the next generation on."""
        generation = self.generation + 1
        path = self.model.folder.relearning_recording(generation)
        path.unlink(missing_ok=True)  # a recording of an earlier drift that was not trained on: these are newer
        self.relearning, self.watch = generation, None
        self.recorder = RequestRecorder(path, self.settings.record, self.tap.inputs)
        rule = watch.rule
        self.drifts.append({"at": time.time(), "generation": generation, "level": watch.level,
                            "shares": watch.shares[-rule.windows:], "window": rule.window})
        log.warning("model %s: its exits stopped paying (the share of answers given early fell from %.3f to %s over "
                    "windows of %d answers): relearning its ramps on recent requests", self.name, watch.level,
                    ", ".join(f"{share:.3f}" for share in watch.shares[-rule.windows:]), rule.window)

    async def _relearn(self, catalogue: Catalogue) -> None:
        """Record recent requests (the next `record` distinct ones) while the generation in service answers, then
        train the next generation on them and serve it."""
        recorder = self.recorder
        if not recorder.full:
            self._enter(RECORDING, f"{recorder.target} recent requests, to train generation {self.relearning} on")
            self.tap.recorder = recorder
            await self._recorded()
            self.tap.recorder = None
        await self._learn(catalogue, self.relearning, recorder.path)
        self.relearning = None

    async def stop(self) -> None:
        """Stop the phases' task, and with it the training job (the next server starts it again)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.recorder is not None:
            self.recorder.close()

    def status(self) -> dict:
        recorder, job, watch = self.recorder, self._job, self.watch
        folder = self.model.folder
        return {"phase": self.phase, "detail": self.detail, "reason": self.reason,
                "job": None if job is None else job.pid,  # the training job's process
                "job_cpu_s": self.job_cpu_s,  # the CPU its last run took, every thread's (user and system)
                "recorded": None if recorder is None else recorder.count,
                "record_target": None if recorder is None else recorder.target,
                "source": self.model.source, "folder": str(folder.path),
                # the bundle serving the model (None: the model itself, vanilla), and its generation
                "bundle": str(folder.generation_bundle(self.generation)) if self.generation else None,
                "generation": self.generation, "relearning": self.relearning, "drifts": self.drifts,
                # the share of answers given early that the generation managed now holds, and its latest windows
                "early_share_level": None if watch is None else watch.level,
                "early_shares": None if watch is None else watch.shares[-RECENT_WINDOWS:],
                "training_log": str(folder.training_log), "phases": self.history}


def open_unprepared(model: UnpreparedModel, settings: LearningSettings, model_settings: ModelSettings,
                    metrics: ServerMetrics) -> tuple[Predictor, Learner]:
    """What serves a model given unprepared, and its learner, from what its folder holds: the newest bundle where one
    was prepared (going on with a relearning it began); else the whole model, recording until its recording is
    full, then (trained again, or failed)."""
    folder = model.folder
    generation = folder.served_generation()
    if generation:
        predictor = bundle_predictor(model, generation, model_settings, metrics)
        learner = Learner(model, settings, model_settings, metrics, CERTIFYING, generation=generation, tap=predictor)
        relearning = folder.relearning_recording(generation + 1)
        if settings.relearn is not None and relearning.is_file():
            learner.resume_relearning(RequestRecorder(relearning, settings.record, predictor.inputs))
        return predictor, learner
    vanilla = vanilla_predictor(model)
    if not settings.recording or model_settings.vanilla:
        return vanilla, Learner(model, settings, model_settings, metrics, VANILLA)
    folder.path.mkdir(parents=True, exist_ok=True)
    recorder = RequestRecorder(folder.recording, settings.record, vanilla.inputs)
    if not recorder.full:
        return RecordingPredictor(vanilla, recorder), Learner(model, settings, model_settings, metrics, RECORDING,
                                                              recorder)
    failure = folder.failure()
    if failure is not None and failure["recorded"] >= recorder.count:  # nothing new to train on since it failed
        return vanilla, Learner(model, settings, model_settings, metrics, FAILED, recorder, failure["reason"])
    return vanilla, Learner(model, settings, model_settings, metrics, TRAINING, recorder)
