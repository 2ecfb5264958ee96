"""Tables in the docs rendered from the kept JSON of the runs they quote (`rampserve bench headlines`), so that a
figure cannot drift from its run: the README's headline results, docs/control.md's table of what each accuracy
promise costs, and docs/freeze.md's and docs/selection.md's figures (rendered by rampserve/bench/freeze_tables.py
and selection_tables.py). Each figure is read from its run's JSON (or computed from several, as said beside it), and
a test renders every table and compares it with its page. SECTIONS is the registry of them all: a page's tables
whose rows are long live in a module of their own, registered here.

A headline row names its runs' files (under bench-results/, listed in its JSON column), the page that holds the
command and its spread, and the commit the page names for the run; its result cell is a template whose `{}` are its
figures, in order. A bar from an issue is text of the template, not a figure. A promise row names one `bench sim`
run of several seeds; its columns are the same figures for every run."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rampserve.bench import freeze_tables, selection_tables
from rampserve.bench.rendering import header, read_run, seed_values, spread, table_row

RESULTS = Path("bench-results")  # as the README links it
KEPT = Path(__file__).resolve().parents[2] / RESULTS  # the checkout's
HEADER = header(("what", "result", "page", "code", "JSON"))

Runs = Sequence[Any]  # a row's runs' JSON, in the order of its files


def get(run: Any, path: str) -> Any:
    """The value at a dotted path of keys and list indices; "*" takes the rest of the path in every element."""
    if not path:
        return run
    head, _, rest = path.partition(".")
    if head == "*":
        return [get(item, rest) for item in run]
    return get(run[int(head)] if isinstance(run, list) else run[head], rest)


@dataclass(frozen=True)
class Figure:
    value: Callable[[Runs], Any]
    shown: str | Callable[[Any], str]  # a format string, or what shows the value

    def render(self, runs: Runs) -> str:
        value = self.value(runs)
        return self.shown(value) if callable(self.shown) else self.shown.format(value)


def at(path: str, shown: str | Callable[[Any], str], file: int = 0,
       then: Callable[[Any], Any] | None = None) -> Figure:
    """The value at `path` of the row's `file`-th run, through `then` where given."""
    return Figure(lambda runs: (then or (lambda value: value))(get(runs[file], path)), shown)


def with_span(path: str, shown: str, spec: str = "{:.2f}", file: int = 0) -> tuple[Figure, Figure, Figure]:
    """The median at `path` (a `median_ratio`: median and min_max) and its range's two ends."""
    return (at(f"{path}.median", shown, file), at(f"{path}.min_max.0", spec, file),
            at(f"{path}.min_max.1", spec, file))


def counted(what: str) -> Callable[[int], str]:
    return lambda count: f"none {what}" if count == 0 else f"{count} {what}"


def seeds_below_hindsight(seeds: list[dict]) -> int:
    """Seeds where rampserve keeps less of the oracle than the best fixed configuration in hindsight, minus 0.1
    (issue 50's bar)."""
    return sum(seed["systems"]["rampserve"]["oracle_share"] < seed["systems"]["static_hindsight"]["oracle_share"] - 0.1
               for seed in seeds)


def verdict(bar: float, at_most: bool = False) -> Callable[[float], str]:
    """Whether a figure reaches `bar` (at least it, or at most it), in the words the tables use."""
    return lambda value: "met" if (value <= bar if at_most else value >= bar) else "missed"


def each_run(path: str, shown: str, runs: int) -> tuple[Figure, ...]:
    """The value at `path` of each of the row's first `runs` runs."""
    return tuple(at(path, shown, file) for file in range(runs))


def over_runs(path: str, reduce: Callable[[list], float], bar: float, at_most: bool = False) -> Figure:
    """The values at `path` over the row's runs, reduced (median, the worst) and judged against `bar`."""
    return Figure(lambda runs: reduce([get(run, path) for run in runs]), verdict(bar, at_most))


def budget_spent(run: dict) -> float:
    """The share of the accuracy constraint the median seed spends."""
    constraint = run["seeds"][0]["controller"]["accuracy_constraint"]
    return (1 - run["summary"]["rampserve"]["accuracy"]["median"]) / constraint


def answerable(runs: Runs, kind: str) -> list[float]:
    """Per site of every run but each model's last, the median over seeds of the share of inputs a cache (or a
    ramp) could answer within the constraint."""
    return [statistics.median(site[kind]) for run in runs for site in run["sites"][:-1]]


def rounds_span(figure: str, file: int = 0) -> tuple[Figure, Figure, Figure]:
    """A `bench live` run's `figure` (p50_ms, p99_ms) as a ratio to vanilla in the median round, and its lowest and
    highest round."""
    ratios = f"loads.0.versus_vanilla.{figure}.ratio_rounds"
    return (at(f"loads.0.versus_vanilla.{figure}.ratio", "{:.2f}×", file), at(ratios, "{:.2f}", file, then=min),
            at(ratios, "{:.2f}", file, then=max))


def live_ratios(file: int = 0) -> tuple[Figure, ...]:
    """A `bench live` run's p50 ratio to vanilla (the median round's), its range over rounds, its p99 ratio, and the
    accuracy of its worst round."""
    return (*rounds_span("p50_ms", file), at("loads.0.versus_vanilla.p99_ms.ratio", "{:.2f}×", file),
            at("loads.0.versus_vanilla.accuracy", "{:.4f}", file))


def certified_promise(file: int) -> tuple[Figure, ...]:
    """A `bench sim` run under the certified promise: median p50 ratio, oracle share, worst seed's accuracy, and the
    share of the constraint spent."""
    return (at("summary.rampserve.p50_ratio.median", "{:.3f}×", file),
            at("summary.rampserve.oracle_share.median", "{:.2f}", file),
            at("summary.rampserve.accuracy.worst", "{:.4f}", file),
            Figure(lambda runs: budget_spent(runs[file]), "{:.2f}"))


@dataclass(frozen=True)
class Row:
    what: str
    result: str
    figures: tuple[Figure, ...]
    files: tuple[str, ...]
    page: str
    code: str

    def render(self, root: Path) -> str:
        runs = [read_run(root, file) for file in self.files]
        result = self.result.format(*(figure.render(runs) for figure in self.figures))
        links = ", ".join(f"[{file}]({RESULTS / file})" for file in self.files)
        return f"| {self.what} | {result} | {self.page} | {self.code} | {links} |"


def settled_live_runs(runs: tuple[tuple[str, int, str], ...], which: str, page: str) -> Row:
    """Settled `bench live` runs of minilm-rt (file, stream seed, code), `which` saying what they share, against issue
    51's bars: each run's p50 and p99 ratios, accuracy and live saving, and the bars judged over the runs (the median
    run's p50 at most 0.75×, every run's at most 0.85×, every p99 at most 1.0×, every live saving at least 0.8 of the
    simulator's)."""
    p50, p99 = "loads.0.versus_vanilla.p50_ms.ratio", "loads.0.versus_vanilla.p99_ms.ratio"
    saving = "loads.0.versus_vanilla.p50_saving_ms_same_requests.ratio"
    files = tuple(file for file, _, _ in runs)
    n = len(files)
    listed = ", ".join(["{}"] * n)
    return Row(f"`bench live` minilm-rt, 3 rounds after 4,500 warm-up requests, {which}, {n} "
               f"runs (stream seeds {', '.join(str(seed) for _, seed, _ in runs)})",
               f"p50 {listed} (median run ≤ 0.75×: {{}}; every run ≤ 0.85×: {{}}), p99 {listed} (≤ 1.0×: {{}}), "
               f"accuracy {listed}; live p50 saving {listed} of the simulator's on the same requests "
               "(≥ 0.8: {})",
               (*each_run(p50, "{:.2f}×", n), over_runs(p50, statistics.median, 0.75, True),
                over_runs(p50, max, 0.85, True),
                *each_run(p99, "{:.2f}×", n), over_runs(p99, max, 1.0, True),
                *each_run("loads.0.versus_vanilla.accuracy", "{:.4f}", n),
                *each_run(saving, "{:.2f}", n), over_runs(saving, min, 0.8)),
               files, page=page, code=", ".join(dict.fromkeys(code for _, _, code in runs)))


def fresh_clone_demos(runs: tuple[tuple[str, str], ...]) -> Row:
    """`bash scripts/demo.sh` on fresh clones (file, code) against issue 51's demo bar: each draw's p50 and p99 as
    ratios to vanilla over its rounds (the median round's, and the rounds' range), its early share and agreement, and
    the bar judged over the draws (p50 at most 0.85×, p99 at most 1.05×, in every draw)."""
    p50, p99 = "loads.0.versus_vanilla.p50_ms.ratio", "loads.0.versus_vanilla.p99_ms.ratio"
    n = len(runs)
    spans = ", ".join(["{} ({}–{})"] * n)
    listed = ", ".join(["{}"] * n)
    return Row(f"The demo on a fresh clone (minilm-rt), {n} draws",
               f"p50 {spans} by round (≤ 0.85× in each draw: {{}}), p99 {spans} (≤ 1.05×: {{}}); "
               f"{listed} early at agreement {listed}",
               (*(figure for draw in range(n) for figure in rounds_span("p50_ms", draw)),
                over_runs(p50, max, 0.85, True),
                *(figure for draw in range(n) for figure in rounds_span("p99_ms", draw)),
                over_runs(p99, max, 1.05, True),
                *each_run("loads.0.systems.rampserve.exit_share", "{:.0%}", n),
                *each_run("loads.0.versus_vanilla.accuracy", "{:.4f}", n)),
               tuple(file for file, _ in runs), page="[demo](docs/demo.md)",
               code=", ".join(code for _, code in runs))


def executor_overheads(runs: tuple[tuple[str, str], ...]) -> Row:
    """`bench executor` runs (file, code) against issue 51's bars: the executor process's overhead one request at a
    time over the bare uvicorn echo of the same round, binary tensors from the lean client (and from aiohttp) and
    gRPC, each run's median over its rounds with their range, and the bars judged over the runs (at most 3× and 5×
    in every run)."""
    n = len(runs)
    spans = ", ".join(["{} ({}–{})"] * n)
    listed = ", ".join(["{}"] * n)
    lean, binary, grpc = (f"over_uvicorn_echo.process.overhead_{kind}_ms" for kind in ("lean", "binary", "grpc"))
    return Row(f"The executor process's overhead over a bare uvicorn echo, one request at a time, 5 rounds, {n} runs",
               f"binary tensors from the lean client (the echo's) {spans} (bar ≤ 3× in each run: {{}}), from "
               f"aiohttp {listed}; gRPC {spans} (≤ 5× in each: {{}}); the echo {listed}",
               (*(figure for run in range(n) for figure in with_span(lean, "{:.2f}×", file=run)),
                over_runs(f"{lean}.median", max, 3.0, True),
                *each_run(f"{binary}.median", "{:.2f}×", n),
                *(figure for run in range(n) for figure in with_span(grpc, "{:.2f}×", file=run)),
                over_runs(f"{grpc}.median", max, 5.0, True),
                *each_run("http_cores.median_ms.uvicorn", "{:.2f} ms", n)),
               tuple(file for file, _ in runs), page="[journal](docs/journal/2026-11-30-fresh-machine.md)",
               code=", ".join(code for _, code in runs))


ROWS = (
    fresh_clone_demos((("demo-minilm-rt-fresh-clone-dc2b4cd.json", "dc2b4cd"),
                       ("demo-minilm-rt-fresh-clone-a1f568b.json", "a1f568b"),
                       ("demo-minilm-rt-fresh-clone-3d074c1.json", "3d074c1"),
                       ("demo-minilm-rt-fresh-clone-392f365.json", "392f365"),
                       ("demo-minilm-rt-fresh-machine-762b502.json", "762b502"),
                       ("demo-minilm-rt-fresh-machine-0577824.json", "0577824"))),
    Row("`bench sim` minilm-rt, 3 seeds (median / worst)",
        "p50 {} / {}, p99 {} / {}, accuracy {} / {}",
        (at("summary.rampserve.p50_ratio.median", "{:.2f}×"),
         at("summary.rampserve.p50_ratio.worst", "{:.2f}×"),
         at("summary.rampserve.p99_ratio.median", "{:.2f}×"),
         at("summary.rampserve.p99_ratio.worst", "{:.2f}×"),
         at("summary.rampserve.accuracy.median", "{:.4f}"),
         at("summary.rampserve.accuracy.worst", "{:.4f}")),
        ("sim-minilm-rt-maf-seeds3-auto.json",),
        page="[journal](docs/journal/2026-11-26-fastest-engine.md)", code="2bcaab6"),
    Row("`bench live` minilm-rt, 3 rounds after 4,500 warm-up requests",
        "p50 {} ({}–{}; bar ≤ 0.8×: missed), p99 {}, accuracy {}",
        live_ratios(),
        ("live-minilm-rt-zoo-rt-drift-rounds3-warmup4500-primed.json",),
        page="[own data](docs/own-data.md#beside-the-zoo-bundle-in-one-session)", code="5282781"),
    settled_live_runs((("live-minilm-rt-load0.2-settled-f2534ae-run1.json", 0, "f2534ae"),
                       ("live-minilm-rt-load0.2-settled-65903d5-seed1.json", 1, "65903d5"),
                       ("live-minilm-rt-load0.2-settled-f2a132d-seed2.json", 2, "f2a132d"),
                       ("live-minilm-rt-load0.2-settled-181ba35-seed0-traced.json", 0, "181ba35"),
                       ("live-minilm-rt-load0.2-settled-fafd9bf-seed3.json", 3, "fafd9bf"),
                       ("live-minilm-rt-load0.2-settled-3d074c1-seed0.json", 0, "3d074c1"),
                       ("live-minilm-rt-load0.2-settled-3d074c1-seed1.json", 1, "3d074c1"),
                       ("live-minilm-rt-load0.2-settled-3d074c1-seed2.json", 2, "3d074c1")),
                      "its bundle prepared afresh, each system replaying whole after its warm-up (from 3d074c1 its "
                      "ramps one ONNX Runtime operator each)", "[journal](docs/journal/2026-11-30-ramp-operator.md)"),
    settled_live_runs(tuple((f"live-minilm-rt-load0.2-settled-sliced-34cdd9a-seed{seed}.json", seed, "34cdd9a")
                            for seed in (0, 1, 2)),
                      "the two systems taking each round's 4 slices in turns after both warm-ups",
                      "[journal](docs/journal/2026-11-30-paired-slices.md)"),
    settled_live_runs(tuple((f"live-minilm-rt-load0.2-settled-fresh-bundle-aff2185-seed{seed}.json", seed, "aff2185")
                            for seed in (0, 1, 2)),
                      "in slices, on a machine that prepared the bundle afresh, a status question no longer waiting "
                      "for the controller on the executor thread", "[journal](docs/journal/2026-11-30-fresh-machine.md)"),
    Row("The same on the user's path (an HF folder, a texts file)",
        "p50 {} ({}–{}; bar ≤ 0.9×: missed), p99 {}, accuracy {}",
        live_ratios(),
        ("live-minilm-hf-rt-drift-texts-rounds3-warmup4500-primed.json",),
        page="[own data](docs/own-data.md#beside-the-zoo-bundle-in-one-session)", code="5282781"),
    Row("From cold: an HF folder served unprepared (minilm-rt)",
        "managed at {} (bar 600 s), p99 while training {} vanilla, accuracy {}, {}",
        (at("managed_s", "{:.0f} s"),
         at("during_training.p99_ratio", "{:.2f}×"),
         at("accuracy", "{:.4f}"),
         at("unanswered", counted("lost"))),
        ("live-from-cold-minilm-rt-hf-rt-drift-quiet.json",),
        page="[serve your model](docs/serve-your-model.md#measured-on-a-quiet-machine)", code="937cbc2"),
    Row("`bench sim` lite0-fmnist, 3 seeds (median / worst)",
        "p50 {} / {}, p99 ≤ {}, accuracy ≥ {}",
        (at("summary.rampserve.p50_ratio.median", "{:.3f}×"),
         at("summary.rampserve.p50_ratio.worst", "{:.3f}×"),
         at("summary.rampserve.p99_ratio.worst", "{:.3f}×"),
         at("summary.rampserve.accuracy.worst", "{:.4f}")),
        ("sim-lite0-fmnist-sampled-seeds3.json",),
        page="[journal](docs/journal/2026-11-26-ramps-at-1pct.md)", code="93cb759"),
    Row("`bench sim` lite0-fmnist per promise, 5 seeds, its bundle prepared afresh (median p50 × vanilla, oracle "
        "share; accuracy, worst seed)",
        "average {}, {} ({}-{}; bar 0.8: {}; {} seeds below hindsight − 0.1, bar 0), {} (bar 0.99: {}); certified {}, "
        "{}, {} (budget spent {}; bar 0.6: {}); windowed {}, {} (bar 0.6: {}), {} of 1k windows below in the median "
        "seed (bar 5%). Ramp sets changed {}-{} times a stream under the average promise. A set replacing the deployed "
        "one after one win (4c27305): average {} of the oracle at accuracy {}, {}-{} set changes; certified {}, "
        "windowed {}",
        (at("summary.rampserve.p50_ratio.median", "{:.3f}×"),
         at("summary.rampserve.oracle_share.median", "{:.2f}"),
         at("summary.rampserve.oracle_share.worst", "{:.2f}"),
         at("seeds.*.systems.rampserve.oracle_share", "{:.2f}", then=max),
         at("summary.rampserve.oracle_share.median", verdict(0.8)),
         at("seeds", "{}", then=seeds_below_hindsight),
         at("summary.rampserve.accuracy.worst", "{:.4f}"),
         at("summary.rampserve.accuracy.worst", verdict(0.99)),
         *certified_promise(1),
         Figure(lambda runs: budget_spent(runs[1]), verdict(0.6)),
         at("summary.rampserve.p50_ratio.median", "{:.3f}×", 2),
         at("summary.rampserve.oracle_share.median", "{:.2f}", 2),
         at("summary.rampserve.oracle_share.median", verdict(0.6), 2),
         at("summary.rampserve.windows_below_share.median", "{:.1%}", 2),
         at("seeds.*.set_changes", "{}", then=min),
         at("seeds.*.set_changes", "{}", then=max),
         at("summary.rampserve.oracle_share.median", "{:.2f}", 3),
         at("summary.rampserve.accuracy.worst", "{:.4f}", 3),
         at("seeds.*.set_changes", "{}", 3, then=min),
         at("seeds.*.set_changes", "{}", 3, then=max),
         at("summary.rampserve.oracle_share.median", "{:.2f}", 4),
         at("summary.rampserve.oracle_share.median", "{:.2f}", 5)),
        tuple(f"sim-lite0-fmnist-promise-{promise}-seeds5-{run}.json"
              for run in ("wins2-ea0c9d4", "h8192-4c27305") for promise in ("average", "certified", "windowed")),
        page="[control](docs/control.md)", code="ea0c9d4"),
    Row("`bench sim` minilm-rt per promise, 5 seeds, its bundle prepared afresh (median p50 × vanilla, oracle share; "
        "accuracy, worst seed)",
        "average {}, {} (bar 0.5: {}; {} seeds below hindsight − 0.1, bar 0), {} (bar 0.99: {}); certified {}, {}, {} "
        "(budget spent {}; bar 0.6: {}); windowed {}, {}, {}, {} 1k window below 0.99 in the median seed. Its earlier "
        "bundle (cfa1bd6; windowed 4d5f935, tuned, not certified): average {}, certified {}, windowed {} of the oracle",
        (at("summary.rampserve.p50_ratio.median", "{:.3f}×"),
         at("summary.rampserve.oracle_share.median", "{:.2f}"),
         at("summary.rampserve.oracle_share.median", verdict(0.5)),
         at("seeds", "{}", then=seeds_below_hindsight),
         at("summary.rampserve.accuracy.worst", "{:.4f}"),
         at("summary.rampserve.accuracy.worst", verdict(0.99)),
         *certified_promise(1),
         Figure(lambda runs: budget_spent(runs[1]), verdict(0.6)),
         at("summary.rampserve.p50_ratio.median", "{:.3f}×", 2),
         at("summary.rampserve.oracle_share.median", "{:.2f}", 2),
         at("summary.rampserve.accuracy.worst", "{:.4f}", 2),
         at("summary.rampserve.windows_below_share.median",
            lambda share: "no" if share == 0 else f"{share:.1%} of", 2),
         at("summary.rampserve.oracle_share.median", "{:.2f}", 3),
         at("summary.rampserve.oracle_share.median", "{:.2f}", 4),
         at("summary.rampserve.oracle_share.median", "{:.2f}", 5)),
        (*(f"sim-minilm-rt-promise-{promise}-seeds5-ea0c9d4.json" for promise in ("average", "certified", "windowed")),
         "sim-minilm-rt-promise-average-seeds5-cfa1bd6.json",
         "sim-minilm-rt-promise-certified-seeds5-cfa1bd6.json",
         "sim-minilm-rt-promise-windowed-seeds5-4d5f935.json"),
        page="[control](docs/control.md)", code="ea0c9d4"),
    Row("`bench sim` lite0-fmnist, a stream whose classes change (one draw)",
        "worst 1k window {} in stop mode, {} in release ({} / {} before thresholds followed the change)",
        (at("systems.rampserve.worst_window_accuracy", "{:.3f}"),
         at("systems.rampserve.worst_window_accuracy", "{:.3f}", 1),
         at("systems.rampserve.worst_window_accuracy", "{:.3f}", 2),
         at("systems.rampserve.worst_window_accuracy", "{:.3f}", 3)),
        ("sim-lite0-fmnist-class-change-stop-cb8b94e.json", "sim-lite0-fmnist-class-change-release-cb8b94e.json",
         "sim-lite0-fmnist-class-change-stop-63f0d35.json", "sim-lite0-fmnist-class-change-release-63f0d35.json"),
        page="[control](docs/control.md)", code="cb8b94e"),
    Row("From cold, a stream whose classes change (lite0-fmnist as an ONNX file, 25 rps)",
        "relearned and managed again at {}; exit share {} and p50 saving {} of before the change; accuracy {}, "
        "worst 1k window {} (bar 0.99: missed); p50 while the relearning job ran {}",
        (at("change.relearned_managed_s", "{:.0f} s"),
         at("change.early_share_recovered", "{:.2f}×"),
         at("change.p50_saving_recovered", "{:.2f}×"),
         at("accuracy", "{:.4f}"),
         at("worst_window_accuracy", "{:.3f}"),
         at("phases.training, relearning.p50_ms", "{:.1f} ms")),
        ("live-from-cold-lite0-fmnist-class-change-short-546e78b.json",),
        page="[serve your model](docs/serve-your-model.md"
             "#again-with-thresholds-that-follow-a-change-issue-50-item-3-2026-11-29)", code="546e78b"),
    Row("`bench live` lite0-fmnist, 3 rounds",
        "p50 {} (bar ≤ 0.8×: missed), p99 {}, accuracy {}",
        (at("loads.0.versus_vanilla.p50_ms.ratio", "{:.3f}×"),
         at("loads.0.versus_vanilla.p99_ms.ratio", "{:.2f}×"),
         at("loads.0.versus_vanilla.accuracy", "{:.4f}")),
        ("live-lite0-fmnist-maf-sampled.json",),
        page="[journal](docs/journal/2026-11-26-ramps-at-1pct.md)", code="93cb759"),
    Row("`bench live` lite0-fmnist, settled (4,500 warm-up requests), 3 rounds, its bundle prepared afresh",
        "p50 {} ({}–{} by round; bars ≤ 0.8× and ≤ 0.6×: met), p99 {} ({}–{}), accuracy {} to {} by round (bar "
        "0.99: missed; the simulator on the same requests {}); live p50 saving {} of the simulator's",
        (*rounds_span("p50_ms"), *rounds_span("p99_ms"),
         at("loads.0.rounds.*.rampserve.accuracy", "{:.4f}", then=min),
         at("loads.0.rounds.*.rampserve.accuracy", "{:.4f}", then=max),
         at("loads.0.oracle_sim.rampserve.accuracy", "{:.4f}"),
         at("loads.0.versus_vanilla.p50_saving_ms_same_requests.ratio", "{:.2f}")),
        ("live-lite0-fmnist-load0.2-settled-c1015a6.json",),
        page="[journal](docs/journal/2026-11-29-executor-parts.md)", code="c1015a6"),
    Row("A ramp's cost on the serving path, batch 1",
        "minilm-rt {} of the model per ramp ({} active; the model {}), {} on 5d2fd3d ({}–{}; the model {}), {} on "
        "3d074c1 with its ramps as one operator each ({}–{}; the model {}); lite0-fmnist {} ({} active; bar ≤ 0.01: "
        "missed)",
        (at("ramp_cases.2.marginal_share", "{:.4f}"),
         at("ramp_cases.2.active", "{}"),
         at("ramp_cases.2.none_ms", "{:.1f} ms"),
         at("ramp_cases.2.marginal_share", "{:.4f}", 6),
         at("ramp_cases.2.marginal_share_ci95.0", "{:.4f}", 6),
         at("ramp_cases.2.marginal_share_ci95.1", "{:.4f}", 6),
         at("ramp_cases.2.none_ms", "{:.1f} ms", 6),
         at("ramp_cases.2.marginal_share", "{:.4f}", 7),
         at("ramp_cases.2.marginal_share_ci95.0", "{:.4f}", 7),
         at("ramp_cases.2.marginal_share_ci95.1", "{:.4f}", 7),
         at("ramp_cases.2.none_ms", "{:.1f} ms", 7),
         Figure(lambda runs: statistics.median(run["ramp_cases"][2]["marginal_share"] for run in runs[1:6]),
                "{:.4f}"),
         at("ramp_cases.2.active", "{}", 1)),
        ("staging-minilm-rt-b1-after.json",
         "staging-lite0-fmnist-b1-one-output.json",
         "staging-lite0-fmnist-b1-one-output-b.json",
         "staging-lite0-fmnist-b1-one-output-c.json",
         "staging-lite0-fmnist-b1-one-output-d.json",
         "staging-lite0-fmnist-b1-one-output-e.json",
         "staging-minilm-rt-b1-5d2fd3d.json",
         "staging-minilm-rt-b1-3d074c1.json"),
        page="[journal](docs/journal/2026-11-26-ramps-at-1pct.md)", code="93cb759, 5d2fd3d, 3d074c1"),
    Row("Against peers, resnet18-fmnist, 5 rounds",
        "rampserve vanilla p50 {} (KServe {}, Triton {}), saturation {} (Triton {})",
        (at("systems.rampserve_vanilla.p50_ms", "{:.2f} ms"),
         at("systems.kserve.p50_ms", "{:.2f}"),
         at("systems.triton.p50_ms", "{:.2f}"),
         at("systems.rampserve_vanilla.saturation_rps", "{:,.0f} rps"),
         at("systems.triton.saturation_rps", "{:,.0f}")),
        ("peers-resnet18-fmnist.json",),
        page="[peers](docs/peers.md)", code="bf692ae"),
    Row("Start to ready, 3 starts (ONNX bundles), the executor without torch and, second, with it",
        "resnet18-fmnist {} ({}), minilm-rt {} ({}); executor {} and {} ({} and {}); front end {}",
        (at("models.resnet18-fmnist.ready_s", "{:.2f} s"),
         at("models.resnet18-fmnist.ready_s", "{:.2f} s", file=1),
         at("models.minilm-rt.ready_s", "{:.2f} s"),
         at("models.minilm-rt.ready_s", "{:.2f} s", file=1),
         at("models.resnet18-fmnist.executor_rss_mib", "{:.0f} MiB"),
         at("models.minilm-rt.executor_rss_mib", "{:.0f} MiB"),
         at("models.resnet18-fmnist.executor_rss_mib", "{:.0f}", file=1),
         at("models.minilm-rt.executor_rss_mib", "{:.0f}", file=1),
         at("models.resnet18-fmnist.front_end_rss_mib", "{:.0f} MiB")),
        ("startup-resnet18-minilm-executor-without-torch-2596d40-run1.json",
         "startup-resnet18-minilm-executor-with-torch-1ceb5c3-run1.json"),
        page="[serving](docs/serving.md)", code="2596d40"),
    executor_overheads((("executor-resnet18-fmnist-df084f4.json", "df084f4"),
                        ("executor-resnet18-fmnist-a1f568b.json", "a1f568b"),
                        ("executor-resnet18-fmnist-fresh-machine-80dd4cf.json", "80dd4cf"))),
    Row("Executor killed (SIGKILL), 3 rounds",
        "ready again in {} idle, {} under {} clients",
        (at("models.resnet18-fmnist.restart_serving_s", "{:.2f} s"),
         at("models.resnet18-fmnist.restart_loaded_serving_s", "{:.2f} s"),
         at("settings.restart_clients", "{}")),
        ("startup-restart-resnet18-fmnist.json",),
        page="[serving](docs/serving.md)", code="081424a"),
    Row("Model selection, the best model failing, 5 seeds (zoo CNNs)",
        "Exp4 takes it back in {} queries; error after {} against {} before; over the failure {} on the best static "
        "model (bar < 0: missed)",
        (at("summary.forgetting.detect+share.exp4.regained_after.median", "{:.0f}"),
         at("summary.forgetting.detect+share.exp4.error_after.median", "{:.4f}"),
         at("summary.forgetting.detect+share.exp4.error_before.median", "{:.4f}"),
         at("bars.detect+share.exp4.during_minus_best_static.median", "{:+.4f}")),
        ("selection-forgetting4-cnn3-logreg-seeds5.json",),
        page="[selection](docs/selection.md)", code="3e08fd3"),
    Row("Speculative race, 3 models, learned decider",
        "{} against {} for the best model alone (bar {}: missed; any decider's offline ceiling {}); {} with that "
        "model failing",
        (at("bars.learned.by_timeout.0.accuracy", "{:.3f}"),
         at("bars.learned.by_timeout.0.best_single_accuracy", "{:.3f}"),
         at("bars.learned.margin", "{:+.2f}"),
         at("best_combined_gain", "{:+.4f}", 1),
         at("bars.learned.by_timeout.0.failure_accuracy", "{:.3f}")),
        ("race-learned-seed0.json", "race-ceiling-cnn3-backers-tie.json"),
        page="[race](docs/race.md)", code="a1a8892"),
    Row("Cache ramps (Freeze) on the flagships, 3 seeds",
        "managed: {}, p50 {} (minilm-rt, lite0-fmnist); all active {} / {}; they answer {}–{} of inputs at {} "
        "where ramps answer {}–{}",
        (Figure(lambda runs: "no cache kept" if all(run["summary"]["caches"]["mean_active_ramps"]["median"] == 0
                                                    for run in runs) else "caches kept", "{}"),
         Figure(lambda runs: " / ".join(sorted({f'{run["summary"]["caches"]["p50_ratio"]["median"]:.3f}×'
                                                for run in reversed(runs)})), "{}"),
         at("summary.caches_every_site.p50_ratio.median", "{:.3f}×", 1),
         at("summary.caches_every_site.p50_ratio.median", "{:.3f}×"),
         Figure(lambda runs: min(answerable(runs, "cache_answerable")), "{:.2f}"),
         Figure(lambda runs: max(answerable(runs, "cache_answerable")), "{:.2f}"),
         at("oracle_disagreement", "{:.0%}"),
         Figure(lambda runs: min(answerable(runs, "ramp_answerable")), "{:.2f}"),
         Figure(lambda runs: max(answerable(runs, "ramp_answerable")), "{:.2f}")),
        ("freeze-lite0-fmnist-seeds3-length30k.json", "freeze-minilm-rt-seeds3-same-load.json"),
        page="[freeze](docs/freeze.md)", code="cf1f5a5"),
    Row("mpnet-rt (12 layers), `bench sim`",
        "accuracy {}, p50 {} (bar ≤ 0.8×: missed)",
        (at("systems.rampserve.accuracy", "{:.4f}"),
         at("systems", "{:.2f}×",
            then=lambda systems: systems["rampserve"]["p50_ms"] / systems["vanilla"]["p50_ms"])),
        ("sim-mpnet-rt-maf.json",),
        page="[zoo](docs/zoo.md)", code="48dcce3"),
    Row("The dashboard's cost, 5 rounds",
        "throughput {} ({}–{}), p99 {} ({}–{}): within the noise",
        (*with_span("on_over_off.closed_rps", "{:.2f}×"), *with_span("on_over_off.closed_p99_ms", "{:.2f}×")),
        ("dashboard-resnet18-fmnist.json",),
        page="[dashboard](docs/dashboard.md)", code="0cc6f89"),
)


def table(root: Path = KEPT) -> str:
    return "\n".join([HEADER, *(row.render(root) for row in ROWS)])


PROMISE_HEADER = header(("model", "promise", "p50 × vanilla, median (seeds)", "p99 ×", "oracle share",
                         "accuracy, worst seed", "1k windows below 0.99, median (worst)", "worst window", "budget spent",
                         "static hindsight share", "seeds below hindsight − 0.1"))


@dataclass(frozen=True)
class PromiseRow:
    model: str  # as the table says it (the code it ran on where it differs from the row above)
    promise: str
    file: str  # a `bench sim --seeds N --guarantee PROMISE` run

    def render(self, root: Path) -> str:
        run = read_run(root, self.file)
        seeds = run["seeds"]
        accuracy = seed_values(seeds, "rampserve", "accuracy")
        windows = seed_values(seeds, "rampserve", "windows_below_share")
        hindsight = seed_values(seeds, "static_hindsight", "oracle_share")
        cells = [self.model, self.promise, spread(seed_values(seeds, "rampserve", "p50"), ".3f"),
                 spread(seed_values(seeds, "rampserve", "p99"), ".3f"),
                 spread(seed_values(seeds, "rampserve", "oracle_share"), ".2f"), f"{min(accuracy):.4f}",
                 f"{statistics.median(windows):.1%} ({max(windows):.1%})",
                 f"{min(seed_values(seeds, 'rampserve', 'worst_window_accuracy')):.3f}",
                 f"{budget_spent(run):.2f}", f"{statistics.median(hindsight):.2f} ({min(hindsight):.2f})",
                 f"{seeds_below_hindsight(seeds)} of {len(seeds)}"]
        return table_row(cells)


def promise_runs(label: str, others: str, file: str) -> tuple[PromiseRow, ...]:
    """One row per promise of one set of runs, certified first: it says `label`, the others `others`; `file` names
    each run with `{promise}`."""
    return tuple(PromiseRow(label if promise == "certified" else others, promise, file.format(promise=promise))
                 for promise in ("certified", "windowed", "average"))


PROMISE_ROWS = (
    *promise_runs("lite0-fmnist (ea0c9d4, a set must win two searches)", "lite0-fmnist",
                  "sim-lite0-fmnist-promise-{promise}-seeds5-wins2-ea0c9d4.json"),
    *promise_runs("before: lite0-fmnist (4c27305, one win)", "before",
                  "sim-lite0-fmnist-promise-{promise}-seeds5-h8192-4c27305.json"),
    *promise_runs("minilm-rt (ea0c9d4, its bundle prepared 2026-11-30)", "minilm-rt",
                  "sim-minilm-rt-promise-{promise}-seeds5-ea0c9d4.json"),
    PromiseRow("minilm-rt, its earlier bundle (cfa1bd6)", "certified",
               "sim-minilm-rt-promise-certified-seeds5-cfa1bd6.json"),
    PromiseRow("earlier bundle (4d5f935, tuned at the rate)", "windowed",
               "sim-minilm-rt-promise-windowed-seeds5-4d5f935.json"),
    PromiseRow("earlier bundle (cfa1bd6)", "average", "sim-minilm-rt-promise-average-seeds5-cfa1bd6.json"),
    PromiseRow("lite0-fmnist at history 4,096 (27b31e2)", "certified",
               "sim-lite0-fmnist-promise-certified-seeds5-h4096-27b31e2.json"),
    PromiseRow("27b31e2 (tuned at the rate)", "windowed", "sim-lite0-fmnist-promise-windowed-seeds5-h4096-27b31e2.json"),
    PromiseRow("27b31e2", "average", "sim-lite0-fmnist-promise-average-seeds5-h4096-27b31e2.json"),
    *promise_runs("lite0-fmnist, its earlier bundle (fbbfb9a)", "earlier bundle",
                  "sim-lite0-fmnist-promise-{promise}-seeds5-fbbfb9a.json"),
)


def promise_table(root: Path = KEPT) -> str:
    return "\n".join([PROMISE_HEADER, *(row.render(root) for row in PROMISE_ROWS)])


@dataclass(frozen=True)
class Section:
    """A table of a page (relative to the checkout) between two markers, rendered from the kept runs."""

    page: Path
    name: str
    render: Callable[[Path], str]  # the runs' folder -> the table

    @property
    def start(self) -> str:
        rows = self.render.__module__.replace(".", "/") + ".py"  # where its rows are declared
        return (f"<!-- {self.name}: rendered from bench-results/ by `rampserve bench headlines --write`; edit rows "
                f"in {rows} -->")

    @property
    def end(self) -> str:
        return f"<!-- end of {self.name} -->"

    def within(self, page: str, rendered: str) -> str:
        """`page` with `rendered` between its markers, in place of what was there."""
        start, end = page.index(self.start) + len(self.start), page.index(self.end)
        return f"{page[:start]}\n{rendered}\n{page[end:]}"


FREEZE, SELECTION = Path("docs/freeze.md"), Path("docs/selection.md")
SECTIONS = (Section(Path("README.md"), "headlines", table),
            Section(Path("docs/control.md"), "promises", promise_table),
            Section(FREEZE, "minilm-rt systems", freeze_tables.MINILM_SYSTEMS.render),
            Section(FREEZE, "minilm-rt sites", freeze_tables.MINILM_SITES.render),
            Section(FREEZE, "lite0-fmnist systems", freeze_tables.LITE0_SYSTEMS.render),
            Section(SELECTION, "scikit-learn policies", selection_tables.SKLEARN_POLICIES.render),
            Section(SELECTION, "scikit-learn bars", selection_tables.SKLEARN_BARS.render),
            Section(SELECTION, "zoo CNNs policies", selection_tables.CNN_POLICIES_TABLE.render),
            Section(SELECTION, "zoo CNNs bars", selection_tables.CNN_BARS.render))
