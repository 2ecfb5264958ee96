"""Settings as users of MLServer and KServe set them. The server's come from `RAMPSERVE_*` environment variables
(pydantic-settings, as MLServer's `MLSERVER_*`), and `rampserve serve`'s flags, made from the same fields, override
them; a model in the repository may bring a `model-settings.json`, whose keys (the per-model flags' names) override
the server's for that model alone. A bad value stops the server at start with a message naming the key that holds
it: the flag, the environment variable, or the file and key.

Torch-free: the command line builds its options from these fields before it knows what it will run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rampserve.control.settings import ControllerSettings

if TYPE_CHECKING:
    from rampserve.serving.shared.contract import ModelSettings

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


def _model_settings() -> type[ModelSettings]:
    # Imported when settings are applied, not when the command line is built (numpy and asyncio come with it)
    from rampserve.serving.shared.contract import ModelSettings

    return ModelSettings


class ModelOptions(BaseModel):
    """How a model is served: the server's default for every model (`ServeOptions`), and the keys a model's
    model-settings.json may set for it alone. The defaults are ModelSettings' and ControllerSettings' own
    (tests/test_settings.py holds them to it); the names are `rampserve serve`'s flags."""

    model_config = ConfigDict(extra="forbid")

    # Batching
    slo_ms: float | None = Field(None, gt=0, description="latency SLO per batch (default 2x batch-1 latency)")
    max_batch: int | None = Field(None, ge=1, description="largest batch (default: the largest within the SLO)")
    max_delay_ms: float = Field(0.0, ge=0, description="longest an input waits for its batch to fill (0: none)")
    adaptive_batching: bool = Field(True, description="AIMD batch size against the SLO (Clipper)")
    max_queue: int = Field(1024, ge=1, description="inputs waiting before requests are refused with 503")
    deadline_ms: float | None = Field(None, gt=0, description="default request deadline (default: none)")
    # How the model runs
    torch_threads: int = Field(1, ge=0, description="intra-op threads per model executor (0: torch's default)")
    torchscript: bool = Field(True, description="run torch models' stages as TorchScript where they trace to the "
                                                "same outputs")
    preload_s: float = Field(30.0, ge=0, description="seconds a starting server waits for the sets its controller "
                                                     "may ask for next to compile, to load them before serving")
    vanilla: bool = Field(False, description="serve the original model, no early exits")
    executor: str = Field("process", description="where each bundle's batches run: process (one of its own, with "
                                                 "its controller and compiler) or thread (in the server's process)")
    idle_poll_ms: float = Field(50.0, ge=0, description="how long an executor process polls for requests after its "
                                                       "last before it sleeps (a sleeping core wakes late; 0: never "
                                                       "poll)")
    executor_policy: str = Field("idle-pools", description="Linux scheduling policy of an executor process: "
                                                           "idle-pools (ONNX Runtime's pool threads under "
                                                           "SCHED_IDLE: any other thread takes their core at once, "
                                                           "so released answers leave while the model runs on), "
                                                           "idle (every thread of the executor) or normal")
    cache_updates: bool = Field(True, description="active cache ramps learn from served final answers")
    # The controller
    accuracy_constraint: float = Field(ControllerSettings.accuracy_constraint,
                                       description="allowed share of answers that differ")
    ramp_budget: float = Field(ControllerSettings.ramp_budget,
                               description="what ramps may add to a non-exiting input, as a share of the model's "
                                           "latency")
    exit_mode: str = Field(ControllerSettings.exit_mode,
                           description="release: every input runs to the end of the model; stop: an input released "
                                       "at a ramp leaves its batch there (compiled sets; on ONNX Runtime a batch "
                                       "stops once all its inputs have left; others serve it as release); auto: "
                                       "stop where the SLO allows batches of at most 2 inputs and sets compile, "
                                       "release otherwise")
    feedback_share: float = Field(ControllerSettings.feedback_share,
                                  description="stop mode: share of the inputs, drawn at random, that run to the end "
                                              "whatever they exit at, to measure agreement")
    objective: str = Field(ControllerSettings.objective,
                           description="what the ramp-set search minimises or raises: p50, p95, mean or throughput")
    guarantee: str = Field(ControllerSettings.guarantee,
                           description="what the accuracy constraint promises: average (over every answer served, "
                                       "Apparate's; long-run, its former name), windowed (at most --windows-below of "
                                       "windows of --promise-window answers break it) or certified (thresholds "
                                       "certified at --confidence on recent inputs, and held below)")
    promise_window: int = Field(ControllerSettings.promise_window,
                                description="the windowed promise: answers per window")
    windows_below: float = Field(ControllerSettings.windows_below,
                                 description="the windowed promise: share of windows that may break the constraint")
    risk_target_share: float | None = Field(ControllerSettings.risk_target_share,
                                            description="share of the constraint rolling risk control holds "
                                                        "long-run disagreement to (default 0.65 with the certified "
                                                        "promise, 1 with average, the windowed promise's rate with "
                                                        "windowed)")
    confidence: float = Field(ControllerSettings.confidence,
                              description="confidence of the bound on disagreement")
    search_every: int = Field(ControllerSettings.search_every, description="inputs between ramp-set searches")
    history: int = Field(ControllerSettings.history, description="recent inputs threshold tuning judges")
    shadow_share: float = Field(ControllerSettings.shadow_share,
                                description="share of batches that also run inactive ramps, to measure them")
    prime: bool = Field(ControllerSettings.prime,
                        description="take the first ramps and thresholds from the inputs the bundle was validated "
                                    "on, so that exits begin with the first requests (--no-prime: after the "
                                    "warm-up's shadow inputs)")

    @field_validator("*")
    @classmethod
    def _checked_where_used(cls, value: object, info: ValidationInfo) -> object:
        """A per-model key is checked by the settings class that takes it, given alone, so that its refusal is
        this key's (pydantic names the key in the error)."""
        name = info.field_name
        if name in CONTROLLER_KEYS:
            ControllerSettings(**{name: value})
        elif name in ModelOptions.model_fields:
            _model_settings()(**{name: value})
        return value

    def per_model(self, only_given: bool = False) -> dict[str, Any]:
        """The per-model keys' values (only those set explicitly, with `only_given`)."""
        keys = set(ModelOptions.model_fields)
        return self.model_dump(include=keys & self.model_fields_set if only_given else keys)


def with_options(base: ModelSettings, options: Mapping[str, Any]) -> ModelSettings:
    """`base` with the per-model keys in `options` (ModelOptions' names and values) in place of its own."""
    model = {key: value for key, value in options.items() if key not in CONTROLLER_KEYS}
    if "torch_threads" in model:
        model["torch_threads"] = model["torch_threads"] or None  # 0: torch's default, ModelSettings' None
    controller = {key: value for key, value in options.items() if key in CONTROLLER_KEYS}
    return replace(base, **model, controller=replace(base.controller, **controller))


class ServeOptions(ModelOptions, BaseSettings):
    """What `rampserve serve` takes beyond its models and applications: each from its flag, else from the
    environment variable RAMPSERVE_<NAME> (as `RAMPSERVE_ADMIN_TOKEN`, `RAMPSERVE_GRPC_PORT`), else the default."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind (loopback unless told otherwise)")
    port: int = Field(8000, ge=0, le=65535, description="port (0: any free one)")
    grpc_port: int = Field(8001, ge=0, le=65535, description="port of KServe v2 over gRPC, on the same host (0: no "
                                                            "gRPC)")
    repository: Path | None = Field(None, description="model repository: a folder per model holding a prepared "
                                                      "bundle (or versions of it, {model}/{version}/), each with an "
                                                      f"optional {MODEL_SETTINGS_FILE}")
    cache_mb: float = Field(0.0, ge=0, description="prediction cache per model in MiB (0: off)")
    max_body_mb: float = Field(64.0, gt=0, description="largest request body accepted")
    graceful_timeout_s: float = Field(30.0, ge=0, description="longest a stopping server waits for requests in "
                                                              "flight before it closes their connections")
    store: str | None = Field(None, description="state store for selection and applications: memory or "
                                                "redis://host:port/db")
    store_prefix: str = Field("rampserve", description="Redis keys' prefix: servers sharing it share applications "
                                                       "and state")
    update_stream: bool = Field(False, description="follow model updates pushed to the Redis Stream "
                                                   "rampserve:model-updates")
    dashboard: bool = Field(True, description="serve /dashboard, sampling every model once a second")
    admin_token: str | None = Field(None, description="token the admin endpoints require (needed when bound "
                                                      "beyond loopback)")
    ray: bool = Field(False, description="deploy on Ray Serve (RAY_ADDRESS, or a local Ray); each model gets one "
                                         "controller for all replicas")
    replicas: int = Field(1, ge=1, description="Ray Serve replicas (with --ray)")
    autoscaling: str | None = Field(None, description="Ray Serve autoscaling_config as JSON (with --ray; replaces "
                                                      "--replicas)")

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
        return with_options(_model_settings()(), self.per_model())

    def server_settings(self) -> ServerSettings:
        return ServerSettings(host=self.host, port=self.port, grpc_port=self.grpc_port or None,
                              max_body_mb=self.max_body_mb, cache_mb=self.cache_mb,
                              graceful_timeout_s=self.graceful_timeout_s, admin_token=self.admin_token,
                              store=self.store, store_prefix=self.store_prefix, repository=self.repository,
                              update_stream=self.update_stream, dashboard=self.dashboard)


@dataclass(frozen=True)
class ServerSettings:
    host: str = LOOPBACK  # loopback unless told otherwise
    port: int = 8000
    grpc_port: int | None = None  # KServe v2 over gRPC on the same host (0: any free port); None: no gRPC
    max_body_mb: float = 64.0
    cache_mb: float = 0.0  # prediction cache per model; 0: off
    # Longest the server waits, once told to stop, for requests in flight before it closes their connections.
    graceful_timeout_s: float = 30.0
    # Admin endpoints (applications, model loading) need `Authorization: Bearer <token>` when set; a server
    # bound beyond loopback refuses to start without one.
    admin_token: str | None = None
    store: str | None = None  # selection state and applications: None in memory, or a redis:// URL
    store_prefix: str = "rampserve"  # Redis keys' prefix: servers sharing it share applications and state
    repository: Path | None = None  # versioned models on disk, all loaded at start (latest version)
    update_stream: bool = False  # follow model updates pushed to the Redis Stream (needs a redis store)
    dashboard: bool = True  # /dashboard, and the sampler behind it (once a second, in the front end)


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
