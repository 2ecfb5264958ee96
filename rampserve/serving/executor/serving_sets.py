"""The configuration an executor serves and the compiled set that runs it, swapped as one.

A configuration the controller chooses is adopted once its set can run: loaded from what the compile service wrote
(compiled in a worker process, `compiler`), or eager where it does not compile. Until then the one in force goes on
serving and the new one waits as pending. Shadow batches run the set of every shadow site, loaded here the same way
and kept across configurations (their thresholds differ, their sites do not). Loads happen on the control thread,
never on the executor's: a load holds the GIL for 10-25 ms on the zoo's CNNs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rampserve.control.records import Configuration
from rampserve.runtime.compiled import CompiledSet
from rampserve.runtime.prepared import COMPILED_SETS_KEPT
from rampserve.serving.executor.compiling import CompileOutcome, likely_next_sets
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings

log = logging.getLogger("rampserve.serving")

# How long a starting server waits for its first configuration's set to compile (in the worker process) before
# it serves that set eagerly
START_COMPILE_WAIT_S = 300.0


class ServingSets:
    """The configuration in force and its compiled set (None: eager), the one waiting for its set, and the shadow
    batches' set. `mode` is the exit mode sets are compiled in ("release" or "stop"); `on_compiled` hears of each
    compile's outcome (on the compile service's thread); `on_configuration` of each configuration adopted."""

    def __init__(self, served: ServedModel, settings: ModelSettings, metrics: ServerMetrics, first: Configuration,
                 mode: str, on_compiled: Callable[[CompileOutcome], None],
                 on_configuration: Callable[[Configuration], None] | None) -> None:
        self.served, self.model, self.settings, self.metrics, self.mode = served, served.prepared, settings, metrics, mode
        self._labels = {"model": served.name}
        self._on_compiled, self._on_configuration = on_compiled, on_configuration
        # Read by the executor thread once per batch, replaced whole by the control thread
        self.in_force: tuple[Configuration, CompiledSet | None] = (first, None)
        self.pending: Configuration | None = None
        # The shadow sites and their set (None: eager) that shadow batches run, once loaded: the same whatever the
        # configuration's thresholds, so one load serves every later configuration
        self.shadow_set: tuple[tuple[str, ...], CompiledSet | None] | None = None
        model = self.model
        self.compiler = None
        if settings.torchscript and model.compiles_to_torchscript and model.bundle_dir is not None:
            from rampserve.serving.executor.compiler import CompileService  # torch: a TorchScript model's sets

            self.compiler = CompileService(model, served.example, self._compile_finished, mode)
        self._published_sites: tuple[str, ...] = ()

    @property
    def configuration(self) -> Configuration:
        return self.in_force[0]

    @property
    def compiled(self) -> bool:
        """Whether the configuration in force runs compiled."""
        return self.in_force[1] is not None

    @property
    def stopping(self) -> bool:
        """Whether the set in force takes exited inputs out of their batch (a compiled set in stop mode)."""
        return self.in_force[1] is not None and self.in_force[1].stops

    def start(self, managed: bool) -> None:
        """Put the first configuration in force: compiled if its set compiles within `START_COMPILE_WAIT_S`, else
        eagerly until it has (adopted then by `advance`). A managed model's likely next sets are compiled and
        loaded ahead."""
        config = self.configuration
        if self.compiler is not None and not self.compiler.wait(config.sites, START_COMPILE_WAIT_S):
            log.warning("model %s: its first set did not compile within %.0f s; serving it eagerly meanwhile",
                        self.served.name, START_COMPILE_WAIT_S)
        if not self.ready(config):
            self.pending = config
        self.adopt(config)
        if self.compiler is not None and managed:
            self.preload(config)
            self._load_shadow_set(config)  # preloaded now, if the compile was in time

    def advance(self, chosen: Configuration | None) -> None:
        """On the control thread: take the controller's newest choice (None: no new one) as pending, adopt the
        pending configuration once its set is ready, and load the shadow batches' set once it is."""
        if chosen is not None:
            self.pending = chosen
        pending = self.pending
        if pending is not None and self.ready(pending):
            self.pending = None
            self.adopt(pending)
        self._load_shadow_set(self.configuration)

    def adopt(self, config: Configuration) -> None:
        """Put `config` in force with its set as loaded (eager where none is): the executor reads it at its next
        batch."""
        compiled = self.model.compiled_set(config.sites, self.mode) if self.settings.torchscript else None
        self._load_shadow_set(config)  # before the swap: the new configuration's first batch is a shadow batch
        self.in_force = (config, compiled)
        self.metrics.config_changes.labels(**self._labels).inc()
        self._publish(config)

    def ready(self, config: Configuration, urgent: bool = True) -> bool:
        """Whether `config` can run now: its compiled set is loaded (the compile service's set on disk, loaded
        here), or it does not compile and runs eagerly. A set still compiling is asked for (urgently, unless told
        otherwise) and the configuration waits."""
        model = self.model
        if not self.settings.torchscript or model.has_compiled(config.sites, self.mode):
            return True
        if self.compiler is None:  # a model not loaded from a bundle: no worker process can load it
            model.compile(config.sites, self.served.example, self.mode)
            return True
        if not self.compiler.ready(config.sites):
            self.compiler.request(config.sites, urgent=urgent)
            return False
        try:
            model.install(config.sites, self.compiler.load(config.sites), self.mode)
        except KeyError:  # a corrupt stage was removed and is compiling again
            return False
        self.metrics.compiles.labels(outcome="loaded", **self._labels).inc()
        return True

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()

    def _compile_finished(self, outcome: CompileOutcome) -> None:
        self.metrics.compiles.labels(outcome=outcome.outcome, **self._labels).inc()
        self.metrics.compile_time.labels(**self._labels).observe(outcome.seconds)
        self._on_compiled(outcome)

    def preload(self, config: Configuration) -> None:
        """Compile the sets the controller's next decisions may ask for and load them before serving starts: a
        load that came with a configuration change under load would stall the event loop. Waits at most
        `preload_s`; later sets go on compiling in the background and load when they are needed. A controller that
        searches no set (no shadow sites) asks for none but the one in force."""
        if not config.shadow_every:
            return
        # The set of every shadow site first: shadow batches run it, and a controller warming up asks for them at once
        shadow = config.shadow_sites
        upcoming = list(dict.fromkeys([shadow, *likely_next_sets(config.sites, shadow)]))[:COMPILED_SETS_KEPT - 1]
        if not self.settings.compile_ahead:  # the sets on disk load now, the others compile once asked for
            upcoming = [sites for sites in upcoming if self.compiler.ready(sites)]
        for sites in upcoming:
            self.compiler.request(sites)
        deadline = time.monotonic() + self.settings.preload_s
        for sites in upcoming:
            if self.compiler.wait(sites, deadline - time.monotonic(), urgent=False):
                self.ready(Configuration(0, sites, (0.0,) * len(sites)))

    def _load_shadow_set(self, config: Configuration) -> None:
        """Where `config` has shadow batches, load the set they run once it is ready (asked for, not urgently:
        the configuration is in force, only its shadow batches wait, served plainly meanwhile)."""
        if not config.shadow_every or (self.shadow_set is not None and self.shadow_set[0] == config.shadow_sites):
            return
        shadowed = config.shadowed()
        if self.ready(shadowed, urgent=False):
            self.shadow_set = (shadowed.sites, self.model.compiled_set(shadowed.sites, self.mode)
                               if self.settings.torchscript else None)

    def _publish(self, config: Configuration) -> None:
        if self._on_configuration is not None:
            self._on_configuration(config)
        m = self.metrics
        m.config_version.labels(**self._labels).set(config.version)
        for site in self._published_sites:
            m.threshold.remove(self.served.name, site)
        self._published_sites = config.sites
        for site, threshold in zip(config.sites, config.thresholds):
            m.threshold.labels(site=site, **self._labels).set(threshold)
