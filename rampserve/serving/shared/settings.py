"""Every setting of the server and of a model, declared once, and read as users of MLServer and KServe set them.

Each is a field of a settings class (`ModelSettings`, `ControllerSettings`, `ServerSettings`, `RayOptions`) declared
with `options.option`: its default, what it does, the values it takes. From those fields come `rampserve serve`'s
flags, the `RAMPSERVE_*` environment variables they override (pydantic-settings, as MLServer's `MLSERVER_*`) and the
keys of a repository model's `model-settings.json`, which override the server's for that model alone (`ModelOptions`,
`ServeOptions`, made here). A bad value stops the server at start with a message naming the key that holds it: the
flag, the environment variable, or the file and key.

Torch-free: the command line builds its options from these fields before it knows what it will run."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rampserve.bundle_format.latency import serving_limits
from rampserve.control.settings import ControllerSettings
from rampserve.options import check_options, option, options_of

if TYPE_CHECKING:
    from rampserve.bundle_format.latency import LatencyProfile

ENV_PREFIX = "RAMPSERVE_"
MODEL_SETTINGS_FILE = "model-settings.json"
# Distinct requests a model served before it was prepared records to train its ramps on (`serve --record`; see
# `serving.learning` and docs/serve-your-model.md). `prepare --data` asks for 500 at least (a tenth held back to
# validate); more is better ramps, later. rt-drift's first 12,000 requests hold 853 distinct texts and the next new
# one comes at request 12,001 (5 minutes later at load 0.2): 800 are recorded in its first 800 requests, 1,000 would
# take past request 12,146
DEFAULT_RECORD = 800
CONTROLLER_KEYS = frozenset(f.name for f in fields(ControllerSettings))
LOOPBACK = "127.0.0.1"
EXECUTORS = ("process", "thread")
EXECUTOR_POLICIES = ("normal", "idle-pools", "idle")
T = TypeVar("T")


@dataclass(frozen=True)
class ModelSettings:
    """How a model is served. Each field that is an `option` is also `rampserve serve`'s flag, RAMPSERVE_<NAME> and
    a model-settings.json key of that name (`shared.settings`)."""

    slo_ms: float | None = option(None, "latency SLO per batch (default 2x batch-1 latency)", gt=0)
    # None: the largest profiled batch size that fits the SLO (Clockwork)
    max_batch: int | None = option(None, "largest batch (default: the largest within the SLO)", ge=1)
    # 0: work-conserving (a free executor takes what is queued at once), which suits latency: on these CPUs a batch of
    # 2 costs nearly two batches of 1
    max_delay_ms: float = option(0.0, "longest an input waits for its batch to fill (0: none)", ge=0)
    adaptive_batching: bool = option(True, "AIMD batch size against the SLO (Clipper)")
    max_queue: int = option(1024, "inputs waiting before requests are refused with 503", ge=1)
    # A request that cannot meet its deadline is refused (429) rather than answered late; without one, the bounded
    # queue still sheds
    deadline_ms: float | None = option(None, "default request deadline (default: none)", gt=0)
    torch_threads: int = option(1, "intra-op threads per model executor (0: torch's default, one per core)", ge=0)
    # Eager torch retakes the GIL after every operator, and waits for the event loop to give it back; traced stages
    # are bit-equal to the eager ones (see `trace_stages`)
    torchscript: bool = option(True, "run torch models' stages as TorchScript where they trace to the same outputs")
    vanilla: bool = option(False, "serve the original model, no early exits")
    # Freeze's caches, kept current by live traffic
    cache_updates: bool = option(True, "active cache ramps learn from served final answers")
    # The rest load when needed
    preload_s: float = option(30.0, "seconds a starting server waits for the sets its controller may ask for next to "
                                    "compile, to load them before serving", ge=0)
    # Whether those sets are compiled ahead, before the controller asks for them. A restarted executor process's are
    # not: it loads the ones on disk and serves, and its compile worker starts once a set not on disk is asked for
    compile_ahead: bool = True
    # "process": a process of its own (`serving.executor`), so that the front end's parsing and writing never holds
    # the GIL the model's Python parts need. A model built in memory, with no bundle on disk to load, always runs in
    # the server's process
    executor: str = option("process", "where each bundle's batches run: process (one of its own, with its controller "
                                      "and compiler) or thread (in the server's process)", choices=EXECUTORS)
    # A sleeping core wakes late, and to a colder model: on this 2-core VM, minilm-rt served one request at a time
    # took 0.7-1.6 ms longer after 20-50 ms idle when the executor slept than when it polled, and polling cut a
    # request's overhead by 0.13-0.37 ms (one wake-up fewer; DESIGN, the executor process). The price is the CPU of a
    # core within the window of any frame, given to any other runnable thread first (and to the server's SCHED_IDLE
    # work: see `executor.wait_readable`)
    idle_poll_ms: float = option(50.0, "how long an executor process polls for requests after its last before it "
                                       "sleeps (a sleeping core wakes late; 0: never poll)", ge=0)
    # An answer a ramp releases mid-run goes out through the front end while ONNX Runtime's threads run on every core,
    # and under the normal policy the front end waits for one's slice to end: 1.9-3.5 ms on this 2-core VM
    # (minilm-rt, one request at a time after 30-100 ms idle), 0.2-0.6 ms when those threads are SCHED_IDLE, which
    # any other thread that wakes preempts at once (DESIGN, the executor yields). "idle" sent released answers out
    # sooner still but cost a fifth of the saturation throughput of both vanilla and managed servers with a bench's
    # clients on the same cores, which "idle-pools" did not (docs/journal, bench live)
    executor_policy: str = option("idle-pools", "Linux scheduling policy of an executor process: idle-pools (ONNX "
                                                "Runtime's pool threads under SCHED_IDLE: any other thread takes "
                                                "their core at once, so released answers leave while the model runs "
                                                "on), idle (every thread of the executor) or normal",
                                  choices=EXECUTOR_POLICIES)
    controller: ControllerSettings = field(default_factory=ControllerSettings)

    def __post_init__(self) -> None:
        check_options(self)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def serving_limits(self, profile: LatencyProfile) -> tuple[float, int]:
        """The SLO and batch limit of a model with this latency profile (`latency.serving_limits`)."""
        return serving_limits(profile, self.slo_ms, self.max_batch)

    def controller_for(self, profile: LatencyProfile) -> ControllerSettings:
        """The controller's settings for a model with this latency profile, its exit mode resolved (a vanilla model
        has no ramp to stop at: every input runs to the end)."""
        return self.controller.resolved(self.serving_limits(profile)[1], self.torchscript and not self.vanilla)

    @classmethod
    def from_json(cls, data: dict) -> ModelSettings:
        controller = dict(data["controller"])
        if controller["initial"] is not None:
            controller["initial"] = tuple(controller["initial"])
        return cls(**{**data, "controller": ControllerSettings(**controller)})


@dataclass(frozen=True)
class ServerSettings:
    host: str = option(LOOPBACK, "address to bind (loopback unless told otherwise)")
    port: int = option(8000, "port (0: any free one)", ge=0, le=65535)
    grpc: bool = option(True, "serve KServe v2 over gRPC too, on --grpc-port of the same host")
    grpc_port: int = option(8001, "port of KServe v2 over gRPC (0: any free one)", ge=0, le=65535)
    repository: Path | None = option(None, "model repository: a folder per model holding a prepared bundle (or "
                                           "versions of it, {model}/{version}/), each with an optional "
                                           f"{MODEL_SETTINGS_FILE}")
    cache_mb: float = option(0.0, "prediction cache per model in MiB (0: off)", ge=0)
    max_body_mb: float = option(64.0, "largest request body accepted", gt=0)
    graceful_timeout_s: float = option(30.0, "longest a stopping server waits for requests in flight before it "
                                             "closes their connections", ge=0)
    store: str | None = option(None, "state store for selection and applications: memory (the default) or "
                                     "redis://host:port/db")
    store_prefix: str = option("rampserve", "Redis keys' prefix: servers sharing it share applications and state")
    update_stream: bool = option(False, "follow model updates pushed to the Redis Stream rampserve:model-updates "
                                        "(needs a redis store)")
    # The sampler behind it runs in the front end
    dashboard: bool = option(True, "serve /dashboard, sampling every model once a second")
    # Admin endpoints (applications, model loading) need `Authorization: Bearer <token>` when set
    admin_token: str | None = option(None, "token the admin endpoints require (needed when bound beyond loopback)")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class RayOptions:
    """How `rampserve serve --ray` deploys (`ray.serve.RayDeployment` takes them)."""

    ray: bool = option(False, "deploy on Ray Serve (RAY_ADDRESS, or a local Ray); each model gets one controller for "
                              "all replicas")
    replicas: int = option(1, "Ray Serve replicas (with --ray)", ge=1)
    autoscaling: str | None = option(None, "Ray Serve autoscaling_config as JSON (with --ray; replaces --replicas)")

    def __post_init__(self) -> None:
        check_options(self)


def declared_fields(*settings: type) -> dict[str, Any]:
    """The options of `settings` as pydantic fields: each one's type, default, description and bounds."""
    made: dict[str, Any] = {}
    for cls in settings:
        types = typing.get_type_hints(cls)
        for name, (declared_field, declared) in options_of(cls).items():
            if name in made:
                raise TypeError(f"option {name} is declared twice")
            default = None if declared_field.default is MISSING else declared_field.default
            made[name] = (types[name], Field(default, description=declared.help, ge=declared.ge, gt=declared.gt,
                                             le=declared.le, lt=declared.lt))
    return made


class _PerModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _checked_where_used(cls, value: object, info: ValidationInfo) -> object:
        """A per-model key is checked by the settings class that takes it, given alone, so that its refusal is
        this key's (pydantic names the key in the error)."""
        name = info.field_name
        if name in CONTROLLER_KEYS:
            ControllerSettings(**{name: value})
        elif name in MODEL_KEYS:
            ModelSettings(**{name: value})
        return value

    def per_model(self, only_given: bool = False) -> dict[str, Any]:
        """The per-model keys' values (only those set explicitly, with `only_given`)."""
        keys = set(ModelOptions.model_fields)
        return self.model_dump(include=keys & self.model_fields_set if only_given else keys)


MODEL_KEYS = frozenset(options_of(ModelSettings))
# How a model is served: the server's default for every model (`ServeOptions`), and the keys a model's
# model-settings.json may set for it alone; the names are `rampserve serve`'s flags
ModelOptions = create_model("ModelOptions", __base__=_PerModel, __module__=__name__,
                            **declared_fields(ModelSettings, ControllerSettings))


def with_options(base: ModelSettings, options: Mapping[str, Any]) -> ModelSettings:
    """`base` with the per-model keys in `options` (ModelOptions' names and values) in place of its own."""
    model = {key: value for key, value in options.items() if key not in CONTROLLER_KEYS}
    controller = {key: value for key, value in options.items() if key in CONTROLLER_KEYS}
    return replace(base, **model, controller=replace(base.controller, **controller))


class _Serve(ModelOptions, BaseSettings):  # type: ignore[misc, valid-type]
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    @classmethod
    def read(cls, flags: Mapping[str, object]) -> ServeOptions:
        """The options with `flags` (those given on the command line) over the environment; a bad value raises
        ValueError naming its flag or variable."""
        try:
            return cls(**flags)
        except ValidationError as exc:
            raise ValueError(described(exc, lambda key: f"--{key.replace('_', '-')}" if key in flags
                                       else f"{ENV_PREFIX}{key.upper()}")) from None

    def model_settings(self) -> ModelSettings:
        """Every model's settings, but for what its model-settings.json changes."""
        return with_options(ModelSettings(), self.per_model())

    def server_settings(self) -> ServerSettings:
        return self._declared(ServerSettings)

    def ray_options(self) -> RayOptions:
        return self._declared(RayOptions)

    def _declared(self, settings: type[T]) -> T:
        """The settings class made from the values these options hold for its own options."""
        return settings(**{name: getattr(self, name) for name in options_of(settings)})


# What `rampserve serve` takes beyond its models and applications: each from its flag, else from the environment
# variable RAMPSERVE_<NAME> (as `RAMPSERVE_ADMIN_TOKEN`, `RAMPSERVE_GRPC_PORT`), else the default
ServeOptions = create_model("ServeOptions", __base__=_Serve, __module__=__name__,
                            **declared_fields(ServerSettings, RayOptions))


def read_model_options(path: Path) -> dict[str, Any]:
    """The per-model keys a model-settings.json sets, checked; ValueError naming the file and the key."""
    try:
        options = ModelOptions.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except ValidationError as exc:
        raise ValueError(f"{path}: {described(exc, str)}") from None
    return options.per_model(only_given=True)


def described(error: ValidationError, where: Callable[[str], str]) -> str:
    """Each of pydantic's complaints as `KEY=VALUE: why`, the key as `where` names it (a flag, a variable)."""
    known = ", ".join(ModelOptions.model_fields)
    parts = []
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"])
        if problem["type"] == "extra_forbidden":
            parts.append(f"unknown key {key!r} (a model's settings are {known})")
        elif not key:  # the whole document: not JSON, or not an object
            parts.append(problem["msg"])
        else:
            why = problem["ctx"]["error"] if problem["type"] == "value_error" else problem["msg"]
            parts.append(f"{where(key)}={problem['input']!r}: {why}")
    return "; ".join(parts)
