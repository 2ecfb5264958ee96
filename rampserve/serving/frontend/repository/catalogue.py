"""What a server serves, and how that changes while it serves: models by name (one version live at a time),
loaded from a versioned repository on disk, and the applications over them.

Repository layout: `ROOT/{model}/` holding the model itself (MLServer's and KServe's layout; served as version 1),
or versions of it in `ROOT/{model}/{version}/` with a positive integer version (Triton's). The model is one of
- `manifest.json`: a prepared bundle, served with early exits (`rampserve prepare --out` writes one);
- `model.onnx`: an ONNX graph on ONNX Runtime;
- `remote.json`: `{"url", "model", "version"?, "timeout_ms"?, "retries"?, "label_output"?, "scores_output"?}`,
  a model behind another Open Inference Protocol server.
A bundle's `ROOT/{model}/model-settings.json` (`serving.shared.settings.ModelOptions`' keys) overrides the server's
settings for every version of it. Nothing is unpickled: bundles are safetensors or ONNX with a JSON manifest.

A swap starts the new version first, then points the name at it (one step on the event loop, so a request
goes wholly to one version), then lets the old one answer everything it accepted before it stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from rampserve.bundle_format.manifest import MANIFEST
from rampserve.serving.frontend.apps.applications import (
    APPLICATIONS_NAMESPACE,
    Application,
    ApplicationSpec,
    check_compatible,
)
from rampserve.serving.frontend.apps.state_store import StateStore
from rampserve.serving.frontend.repository.predictors import Predictor, RemotePredictor
from rampserve.serving.shared.contract import Worker
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import VERSION
from rampserve.serving.shared.settings import MODEL_SETTINGS_FILE, ModelSettings, read_model_options, with_options

if TYPE_CHECKING:
    from rampserve.serving.learning import Learner

log = logging.getLogger("rampserve.serving")

FORMATS = {MANIFEST: "bundle", "model.onnx": "onnx", "remote.json": "remote"}
REMOTE_FIELDS = {"url", "model", "version", "timeout_ms", "retries", "label_output", "scores_output"}


class CatalogueError(Exception):
    """An admin request that cannot be done; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


@dataclass(frozen=True)
class ModelLoaders:
    """How a repository's model comes to run, given by the server (the front end loads no model itself): a prepared
    bundle (its folder, name, version and settings) served by its executor, and an ONNX graph (name, path, version)."""

    bundle: Callable[[Path, str, str, ModelSettings], Predictor]
    onnx: Callable[[str, Path, str], Predictor]


class ModelRepository:
    def __init__(self, root: Path, settings: ModelSettings, loaders: ModelLoaders) -> None:
        if not Path(root).is_dir():
            raise ValueError(f"model repository {root} is not a directory")
        self.root = Path(root)
        self.settings, self.loaders = settings, loaders

    def versions(self, name: str) -> list[str]:
        folder = self.root / name
        if not folder.is_dir() or name.startswith("."):
            return []
        if _kinds(folder):
            return [VERSION]
        return sorted((p.name for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0),
                      key=int)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and self.versions(p.name))

    def build(self, name: str, version: str | None = None) -> Predictor:
        """The model's version (the latest if None), ready to start; heavy, so the server runs it in a thread."""
        versions = self.versions(name)
        if not versions:
            raise CatalogueError(f"model {name!r} is not in the repository {self.root}", 404)
        version = versions[-1] if version is None else str(version)
        if version not in versions:
            raise CatalogueError(f"model {name!r} has no version {version!r}; versions: {versions}", 404)
        folder, kind = self._located(name, version)
        settings = self.model_settings(name, kind)
        if kind == "bundle":
            return self.loaders.bundle(folder, name, version, settings)
        if kind == "onnx":
            return self.loaders.onnx(name, folder / "model.onnx", version)
        try:
            config = orjson.loads((folder / "remote.json").read_bytes())
            if not isinstance(config, dict) or set(config) - REMOTE_FIELDS or not {"url", "model"} <= set(config):
                raise ValueError(f"needs url and model, may have {sorted(REMOTE_FIELDS)}")
            remote = RemotePredictor(name, **config)
        except (ValueError, TypeError) as exc:
            raise CatalogueError(f"{folder}/remote.json: {exc}") from None
        remote.version = version  # the repository's version; remote.json's names the remote server's
        return remote

    def _located(self, name: str, version: str) -> tuple[Path, str]:
        """The folder of a version on disk, and what it holds."""
        folder = self.root / name
        folder = folder if _kinds(folder) else folder / version
        kinds = _kinds(folder)
        if len(kinds) != 1:
            raise CatalogueError(f"{folder} must hold exactly one of {sorted(FORMATS)}, found {len(kinds)}")
        return folder, kinds[0]

    def model_settings(self, name: str, kind: str) -> ModelSettings:
        """The server's settings, with those of the model's model-settings.json where it has one."""
        path = self.root / name / MODEL_SETTINGS_FILE
        if not path.is_file():
            return self.settings
        if kind != "bundle":
            raise CatalogueError(f"{path}: settings apply to prepared bundles only, not to {name} ({kind})")
        try:
            return with_options(self.settings, read_model_options(path))
        except ValueError as exc:
            raise CatalogueError(str(exc)) from None

    def check(self) -> None:
        """Every model folder holds a model, with settings that serve: a server stops at start, before it loads
        anything, at the first that does not (the folder or the file, and the key, named)."""
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            versions = self.versions(folder.name)
            try:
                if not versions:
                    raise CatalogueError(f"{folder} holds no model: a prepared bundle ({MANIFEST}, as `rampserve "
                                         "prepare --out` writes), model.onnx or remote.json, or version folders "
                                         "(1/, 2/, ...) holding one")
                self.model_settings(folder.name, self._located(folder.name, versions[-1])[1])
            except CatalogueError as exc:
                raise ValueError(exc.message) from None


def _kinds(folder: Path) -> list[str]:
    return [kind for file, kind in FORMATS.items() if (folder / file).is_file()]


class Catalogue:
    """Models and applications of one server; every change runs on the event loop, one at a time."""

    def __init__(self, metrics: ServerMetrics, store: StateStore, repository: ModelRepository | None = None,
                 models: Iterable[Predictor] = (), apps: Iterable[ApplicationSpec] = (),
                 learners: Iterable[Learner] = ()) -> None:
        self.metrics, self.store, self.repository = metrics, store, repository
        # Models served before they were prepared, by name: each learns its ramps and has its bundle adopted here
        self.learners = {learner.name: learner for learner in learners}
        self.models: dict[str, Predictor] = {}
        for predictor in models:
            if predictor.name in self.models:
                raise ValueError(f"two models share the name {predictor.name!r}")
            self.models[predictor.name] = predictor
        self.workers: dict[str, Worker] = {}  # the bundles' executors, which answer v2 inference themselves
        self._index_workers()
        self.apps: dict[str, Application] = {}
        self._initial_apps = tuple(apps)
        self._changing = asyncio.Lock()
        self.started = False
        self.background: set[int] = set()  # the server's background processes (training jobs), see `Worker.yield_to`

    def background_started(self, process: int) -> None:
        self.background.add(process)
        self._tell_background()

    def background_ended(self, process: int) -> None:
        self.background.discard(process)
        self._tell_background()

    def _tell_background(self, workers: Iterable[Worker] | None = None) -> None:
        processes = tuple(sorted(self.background))
        for worker in self.workers.values() if workers is None else workers:
            worker.yield_to(processes)

    def _index_workers(self) -> None:
        self.workers = {n: p.worker for n, p in self.models.items() if p.worker is not None}

    def model(self, name: str) -> Predictor:
        return self.models[name]

    async def start(self) -> None:
        for predictor in self.models.values():
            await predictor.start()
        self.started = True
        for name, stored in (await self.store.items(APPLICATIONS_NAMESPACE)).items():
            try:
                self._add_app(ApplicationSpec.from_json(stored))
            except (ValueError, CatalogueError) as exc:  # e.g. its models are not loaded here
                log.warning("stored application %s is not served: %s", name, exc)
        for spec in self._initial_apps:  # given at start: they replace stored definitions of the same name
            await self.register(spec)
        for learner in self.learners.values():
            learner.start(self)

    async def close(self) -> None:
        self.started = False
        await asyncio.gather(*(learner.stop() for learner in self.learners.values()))
        await asyncio.gather(*(p.close() for p in self.models.values()))

    # ---- models -------------------------------------------------------------------------------------------

    async def load(self, name: str, version: str | None = None) -> Predictor:
        """Load a version from the repository (the latest by default), swapping out the one being served."""
        if self.repository is None:
            raise CatalogueError("this server has no model repository (start it with --repository)", 404)
        if name in self.apps:
            raise CatalogueError(f"{name!r} is an application's name")
        async with self._changing:
            predictor = await asyncio.to_thread(self.repository.build, name, version)
            await self.install(predictor)
            return predictor

    async def replace(self, predictor: Predictor) -> None:
        """Serve `predictor` under its name in place of the model there (as `load` does from the repository)."""
        async with self._changing:
            await self.install(predictor)

    async def install(self, predictor: Predictor) -> None:
        """Serve `predictor` under its name, replacing (and draining) the one there."""
        try:
            await predictor.start()
        except Exception as exc:
            await predictor.close()
            raise CatalogueError(f"model {predictor.name} failed to start: {exc}", 503) from None
        for app in self.apps.values():
            if predictor.name in app.spec.models:
                self._check_models(app.spec.name, app.spec.models, replacing=predictor)
        old = self.models.get(predictor.name)
        self.models[predictor.name] = predictor
        self._index_workers()
        if predictor.worker is not None and self.background:
            self._tell_background([predictor.worker])
        if old is not None:
            await old.close()

    async def unload(self, name: str) -> None:
        async with self._changing:
            old = self.models.pop(name, None)
            if old is None:
                raise CatalogueError(f"model {name!r} is not loaded", 404)
            self._index_workers()
            await old.close()

    def index(self) -> list[dict]:
        """Triton's repository index: every model on disk or loaded, with its state."""
        names = set(self.models) | set(self.repository.names() if self.repository else ())
        entries = []
        for name in sorted(names):
            loaded = self.models.get(name)
            on_disk = self.repository.versions(name) if self.repository else []
            for version in on_disk or [loaded.version]:
                ready = loaded is not None and loaded.version == version
                entries.append({"name": name, "version": version, "state": "READY" if ready else "UNAVAILABLE",
                                "reason": "" if ready else "not loaded"})
        return entries

    # ---- applications -------------------------------------------------------------------------------------

    def _check_models(self, app: str, models: Iterable[str], replacing: Predictor | None = None) -> None:
        signatures = {}
        for model in models:
            predictor = replacing if replacing is not None and replacing.name == model else self.models.get(model)
            if predictor is None:
                raise CatalogueError(f"application {app}: model {model!r} is not loaded; loaded: "
                                     f"{sorted(self.models)}", 404)
            signatures[model] = predictor.inputs
        try:
            check_compatible(app, signatures)
        except ValueError as exc:
            raise CatalogueError(str(exc)) from None

    def _add_app(self, spec: ApplicationSpec) -> Application:
        if spec.name in self.models:
            raise CatalogueError(f"{spec.name!r} is a model's name; an application needs a name of its own", 409)
        self._check_models(spec.name, spec.models)
        app = Application(spec, self.model, self.store, self.metrics)
        if (old := self.apps.get(spec.name)) is not None:  # relinked: statistics of the models it keeps go on
            app.stats.update({m: s for m, s in old.stats.items() if m in spec.models})
            app.requests, app.defaults = old.requests, old.defaults
        self.apps[spec.name] = app
        return app

    async def register(self, spec: ApplicationSpec) -> Application:
        """Add or redefine an application; the definition is kept in the store, so a server sharing it (or
        this one, restarted) serves it too."""
        async with self._changing:
            app = self._add_app(spec)
            await self.store.put(APPLICATIONS_NAMESPACE, spec.name, spec.to_json())
            return app

    async def link(self, name: str, models: list[str]) -> Application:
        """Clipper's model links: add models to an application (its selection state keeps the others' weights)."""
        app = self.apps.get(name)
        if app is None:
            raise CatalogueError(f"unknown application {name!r}", 404)
        added = tuple(m for m in models if m not in app.spec.models)
        try:
            spec = replace(app.spec, models=app.spec.models + added)
        except ValueError as exc:
            raise CatalogueError(str(exc)) from None
        return await self.register(spec)

    async def remove(self, name: str) -> None:
        async with self._changing:
            if self.apps.pop(name, None) is None:
                raise CatalogueError(f"unknown application {name!r}", 404)
            await self.store.delete(APPLICATIONS_NAMESPACE, name)

    def app(self, name: str) -> Application:
        app = self.apps.get(name)
        if app is None:
            raise CatalogueError(f"unknown application {name!r}; applications: {sorted(self.apps)}", 404)
        return app
