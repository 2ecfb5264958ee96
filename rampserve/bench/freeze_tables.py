"""docs/freeze.md's figure tables, rendered from the `bench freeze --model` runs they quote (registered as sections
in rampserve/bench/headlines.py), so that the page's figures cannot drift from its runs.

Every cell over seeds is computed here from the run's seeds ("per_seed"), not read from its "summary", so that a
seed's figure that changes changes the page. The two systems tables differ in one way, kept as the page typed them:
lite0-fmnist's drops a range whose two ends show as one figure. The per-site table's shares answered are the seeds'
lists kept per site; its charges are seed 0's profiles (the bundles are profiled once, when prepared)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rampserve.bench.rendering import EN_DASHED, header, read_run, seed_values, spread, table_row

MINILM_RUN = "freeze-minilm-rt-seeds3-same-load.json"
LITE0_RUN = "freeze-lite0-fmnist-seeds3-length30k.json"
NONE = "-"  # a figure the system does not have (vanilla's and the oracles' active exits), or the site lacks

SYSTEMS_HEADER = header(("system", "p50 × vanilla", "p99 × vanilla", "accuracy", "1k windows below 0.99", "exit share",
                         "active exits"))
# per column: the figure each seed's system holds, and how it shows (as `bench freeze` prints it)
SYSTEM_COLUMNS = (("p50_ratio", ".3f"), ("p99_ratio", ".3f"), ("accuracy", ".4f"), ("windows_below_share", ".3f"),
                  ("exit_share", ".3f"), ("mean_active_ramps", ".1f"))

SITES_HEADER = header(("site", "lookup µs", "cache charged µs (share of model)", "ramp charged µs (share)",
                       "skipped share", "cache answers", "ramp answers", "break-even share"))


def microseconds(ms: float | None) -> str:
    """Milliseconds as the page's whole microseconds; None (a site without a timed lookup) as NONE."""
    return NONE if ms is None else f"{ms * 1000:.0f}"


@dataclass(frozen=True)
class SystemsTable:
    """Per system of a `bench freeze --model` run (in the run's order), each figure's median over seeds and its
    range; p50/p99 as each seed kept them, against the vanilla model under the system's own bundle's profile."""

    file: str
    single: bool = False  # a range whose two ends show as one figure is dropped (lite0-fmnist's table)

    def cell(self, seeds: list[dict], system: str, figure: str, spec: str) -> str:
        if seeds[0]["systems"][system].get(figure) is None:
            return NONE
        return spread(seed_values(seeds, system, figure), spec, EN_DASHED, self.single)

    def render(self, root: Path) -> str:
        seeds = read_run(root, self.file)["per_seed"]
        rows = [table_row([system, *(self.cell(seeds, system, figure, spec) for figure, spec in SYSTEM_COLUMNS)])
                for system in seeds[0]["systems"]]
        return "\n".join([SYSTEMS_HEADER, *rows])


@dataclass(frozen=True)
class SitesTable:
    """Per site at batch 1: the cache's lookup (timed by the bench), what the cache and the ramp bundles' profiles
    charge (each also as a share of its own profile's model: the bundles were profiled apart under different loads,
    so only the shares compare), the share of the model an exit there skips, the shares of the stream cache and ramp
    answer at 1% disagreement over seeds, and the break-even share (charged / skipped)."""

    file: str

    @staticmethod
    def cells(site: dict, ramps_model_ms: float) -> list[str]:
        even = site["break_even_share"]
        return [site["site"], microseconds(site["lookup_ms"]),
                f"{microseconds(site['charged_ms'])} ({site['charged_share_of_model']:.2%})",
                f"{microseconds(site['ramp_charged_ms'])} ({site['ramp_charged_ms'] / ramps_model_ms:.2%})",
                f"{site['skipped_share_of_model']:.2f}", spread(site["cache_answerable"], ".3f", EN_DASHED),
                spread(site["ramp_answerable"], ".3f", EN_DASHED), NONE if even is None else f"{even:.3f}"]

    def render(self, root: Path) -> str:
        run = read_run(root, self.file)
        ramps_model_ms = run["per_seed"][0]["vanilla_batch1_ms"]["ramps"]  # the ramps bundle's profile, batch 1
        return "\n".join([SITES_HEADER, *(table_row(self.cells(site, ramps_model_ms)) for site in run["sites"])])


MINILM_SYSTEMS = SystemsTable(MINILM_RUN)
MINILM_SITES = SitesTable(MINILM_RUN)
LITE0_SYSTEMS = SystemsTable(LITE0_RUN, single=True)
TABLES = (MINILM_SYSTEMS, MINILM_SITES, LITE0_SYSTEMS)  # in the page's order
