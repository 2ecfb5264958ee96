"""/dashboard: the sampler's arithmetic (pure, property-tested), and the page itself in a real headless Chromium
against a real server under load, its charts compared with what the server counted."""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.control.controller import ControllerSettings
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.frontend.apps.applications import ApplicationSpec
from rampserve.serving.frontend.dashboard.sampler import LATENCY_BOUNDS
from rampserve.serving.frontend.dashboard.series import (
    ModelReading,
    SampleRing,
    bucket_deltas,
    counter_delta,
    histogram_quantile,
    model_point,
)
from rampserve.serving.server import ServerSettings, build_state, running_server
from rampserve.serving.shared.settings import ModelSettings

MODEL = "resnet18-small"
APP = "watched"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# docs/dashboard.md shows this test's screenshot: `RAMPSERVE_DASHBOARD_PNG=docs/dashboard.png bash scripts/test.sh
# tests/test_dashboard.py` refreshes it; otherwise it goes to the test's temporary folder, leaving the tree clean.
SCREENSHOT_ENV = "RAMPSERVE_DASHBOARD_PNG"
CHARTS = ("load", "latency", "queue", "exits", "thresholds", "accuracy")


# ---- the arithmetic (pure) -------------------------------------------------------------------------------------------

def histogram(values: list[float], bounds: tuple[float, ...]) -> list[float]:
    """Cumulative bucket counts of `values`, as a Prometheus histogram keeps them."""
    return [float(sum(v <= bound for v in values)) for bound in bounds]


BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.05, 0.1, math.inf)
latencies = st.lists(st.floats(0.0, 0.2, allow_nan=False), max_size=60)


@settings(max_examples=200, deadline=None)
@given(latencies.filter(bool), st.floats(0.01, 0.99))
def test_a_quantile_from_buckets_lies_in_the_bucket_of_the_true_quantile(values: list[float], q: float) -> None:
    estimate = histogram_quantile(BOUNDS, histogram(values, BOUNDS), q)
    ranked = sorted(values)
    true = ranked[max(0, math.ceil(q * len(values)) - 1)]  # the smallest value with at least q of them at or below
    bucket = next(i for i, bound in enumerate(BOUNDS) if true <= bound)
    lower, upper = (0.0 if bucket == 0 else BOUNDS[bucket - 1]), BOUNDS[bucket]
    if math.isinf(upper):  # beyond the last finite bound: that bound is all a histogram can say
        assert estimate == BOUNDS[-2]
    else:
        assert lower <= estimate <= upper


@settings(max_examples=100, deadline=None)
@given(latencies.filter(bool), st.lists(st.floats(0.01, 0.99), min_size=2, max_size=5))
def test_quantiles_from_buckets_rise_with_q(values: list[float], qs: list[float]) -> None:
    counts = histogram(values, BOUNDS)
    estimates = [histogram_quantile(BOUNDS, counts, q) for q in sorted(qs)]
    assert estimates == sorted(estimates)


def test_a_quantile_of_nothing_is_none_and_bad_arguments_are_refused() -> None:
    assert histogram_quantile(BOUNDS, [0.0] * len(BOUNDS), 0.5) is None
    with pytest.raises(ValueError, match="strictly between"):
        histogram_quantile(BOUNDS, [1.0] * len(BOUNDS), 1.0)
    with pytest.raises(ValueError, match=r"\+Inf"):
        histogram_quantile((0.1, 0.2), [1.0, 1.0], 0.5)


@settings(max_examples=100, deadline=None)
@given(latencies, latencies)
def test_bucket_deltas_are_the_histogram_of_what_came_in_between(earlier: list[float], later: list[float]) -> None:
    before, after = histogram(earlier, BOUNDS), histogram(earlier + later, BOUNDS)
    assert bucket_deltas(before, after) == histogram(later, BOUNDS)
    if earlier:  # a reset (an executor process started again): the interval is all the new histogram holds
        assert bucket_deltas(after, histogram(later, BOUNDS)) == histogram(later, BOUNDS)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["a", "b", "final"]), st.integers(0, 50), min_size=1), min_size=2,
                max_size=12))
def test_exits_per_point_add_up_to_what_the_counters_counted(increments: list[dict[str, int]]) -> None:
    """Points between consecutive readings of growing counters telescope: their exits sum to the last reading's
    counts (the first reading is taken before anything was counted, as the sampler starts with the server)."""
    totals: Counter[str] = Counter()
    readings = [ModelReading()]
    for step in increments:
        totals.update(step)
        readings.append(ModelReading(requests=float(sum(totals.values())), exits=dict(totals)))
    points = [model_point(a, b, 1.0, BOUNDS) for a, b in zip(readings, readings[1:])]
    summed: Counter[str] = Counter()
    for point in points:
        summed.update(point["exits"])
    assert +summed == +totals
    assert sum(p["rps"] for p in points) == sum(totals.values())


def test_a_point_after_a_reset_counts_from_zero_and_rates_are_per_second() -> None:
    before = ModelReading(requests=100.0, errors=4.0, batches=50.0, inputs=200.0, exits={"final": 150.0})
    after = ModelReading(requests=130.0, errors=4.0, batches=10.0, inputs=30.0, exits={"final": 30.0, "a": 5.0},
                         latency=tuple(histogram([0.003] * 30, LATENCY_BOUNDS)), queued=7, config_version=2,
                         thresholds={"a": 0.25}, window_accuracy=0.99, accuracy_bound=0.97)
    point = model_point(before, after, 2.0, LATENCY_BOUNDS)
    assert point["rps"] == 15.0 and point["errors_ps"] == 0.0
    assert point["batch"] == 3.0  # the executor restarted: its counters began again at 0
    assert point["exits"] == {"final": 30.0, "a": 5.0}
    assert 2.0 <= point["p50_ms"] <= 3.0 and 2.0 <= point["p99_ms"] <= 3.0
    assert (point["queue"], point["config_version"], point["thresholds"]) == (7, 2, {"a": 0.25})
    assert counter_delta(10.0, 3.0) == 3.0
    with pytest.raises(ValueError, match="apart in time"):
        model_point(before, after, 0.0, LATENCY_BOUNDS)


def test_a_restarted_executors_counts_start_from_zero_and_a_silent_one_shows_nothing_new() -> None:
    old = ModelReading(executor=11, batches=10.0, inputs=20.0, exits={"final": 20.0}, queued=3, config_version=4)
    # A new process counted more in its first second than the old one had in all: its counts are still its own
    new = ModelReading(executor=12, batches=30.0, inputs=60.0, exits={"final": 50.0, "a": 10.0}, queued=0,
                       config_version=4)
    point = model_point(old, new, 1.0, LATENCY_BOUNDS)
    assert point["exits"] == {"final": 50.0, "a": 10.0} and point["batch"] == 2.0
    stale = ModelReading(executor=12, stale=True, batches=30.0, inputs=60.0, exits=new.exits)
    quiet = model_point(new, stale, 1.0, LATENCY_BOUNDS)
    assert quiet["exits"] == {"final": 0.0, "a": 0.0} and quiet["batch"] is None
    assert (quiet["queue"], quiet["config_version"], quiet["accuracy"], quiet["thresholds"]) == (None, None, None, {})
    # Its next answer counts from the last one it gave, not from nothing
    back = ModelReading(executor=12, batches=31.0, inputs=62.0, exits={"final": 52.0, "a": 10.0})
    assert model_point(stale, back, 1.0, LATENCY_BOUNDS)["exits"] == {"final": 2.0, "a": 0.0}


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(0, 30), st.integers(0, 40))
def test_the_ring_gives_exactly_the_kept_samples_after_a_number(capacity: int, appended: int, since: int) -> None:
    ring = SampleRing(capacity)
    numbers = [ring.append({"i": i}) for i in range(appended)]
    assert numbers == list(range(1, appended + 1)) and len(ring) == min(capacity, appended)
    kept = numbers[-capacity:] if appended else []
    got = ring.since(since)
    assert [s["seq"] for s in got] == [n for n in kept if n > since]
    assert all(s["i"] == s["seq"] - 1 for s in got)
    assert ring.last_seq == (numbers[-1] if numbers else 0)


# ---- the page, in a real browser ---------------------------------------------------------------------------------------

def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def exits_counted(metrics: str) -> dict[str, float]:
    """rampserve_exits_total per site, from the server's Prometheus text."""
    counts = {}
    for line in metrics.splitlines():
        if line.startswith(f'rampserve_exits_total{{model="{MODEL}"'):
            site = line.split('site="', 1)[1].split('"', 1)[0]
            counts[site] = float(line.rsplit(" ", 1)[1])
    return counts


class Load:
    """Clients sending one-image v2 requests and application queries until stopped, counting the exit sites
    their answers name."""

    def __init__(self, url: str, feeds: np.ndarray, input_name: str, clients: int = 3) -> None:
        self.url, self.feeds, self.input_name = url, feeds, input_name
        self.sites: Counter[str] = Counter()
        self.app_queries = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            x = self.feeds[i % len(self.feeds)][None]
            try:
                if i % 10 == 0:  # an application query now and then, for the applications' panel
                    post_json(f"{self.url}/{APP}/predict", {"input": x[0].tolist()})
                    with self._lock:
                        self.app_queries += 1
                else:
                    answer = post_json(f"{self.url}/v2/models/{MODEL}/infer", {"inputs": [
                        {"name": self.input_name, "shape": list(x.shape), "datatype": "FP32",
                         "data": x.ravel().tolist()}]})
                    with self._lock:
                        self.sites[answer["parameters"]["exit_site"] or "final"] += 1
            except Exception as exc:  # counted, and the test fails on it
                self.failures.append(repr(exc))
            i += 3


def browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        assert path.exists(), f"{path} is missing: scripts/setup.sh installs Debian's chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1750", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver's path is given: Selenium Manager, which could download one, is never asked
    return webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))


def wait_for(what: str, check, timeout_s: float = 30.0, every_s: float = 0.2):
    """Poll `check` until it returns something truthy; fail saying `what` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
    return result


def save_small_png(png: bytes, path: Path) -> None:
    """The screenshot in a 64-colour palette: a fraction of the size, the charts as legible."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)


def test_the_dashboard_shows_in_a_browser_what_the_server_served(resnet_bundle, fmnist_feeds, tmp_path) -> None:
    screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "dashboard.png")
    served = loaded(load_served(str(resnet_bundle)))
    sites = served.prepared.site_names
    seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    final = served.prepared.run({served.inputs[0].name: fmnist_feeds}, sites,
                             lambda site, labels, errors: seen.setdefault(site, (labels, errors))).argmax(axis=1)
    # The ramp that agrees best with the final layer on these inputs, at a threshold among their error scores
    # there (some exit, some run to the end), under a constraint loose enough for the small test model's weak
    # ramps to go on answering: the controller tunes the threshold live, so its decisions show too. It keeps that
    # ramp: which set a search would move to depends on the ramps' costs as this session's profile timed them
    site = max(sites, key=lambda s: np.mean(seen[s][0] == final))
    controller = ControllerSettings(initial=(site,), start_thresholds={site: float(np.median(seen[site][1]))},
                                    accuracy_constraint=0.3, ramp_adjustment=False)
    # Eager stages: the executor process starts without compiling (tens of seconds on a busy 2-core machine)
    model_settings = ModelSettings(controller=controller, preload_s=0.0, deadline_ms=60_000.0, torchscript=False)
    state = build_state([served], model_settings, ServerSettings(port=0, grpc=False),
                        [ApplicationSpec(APP, (MODEL,), "exp4")])
    driver = None
    with running_server(state) as url:
        try:
            # The routes refuse what they cannot serve, saying why, and the page may load from this server alone
            status, headers, body = get(f"{url}/dashboard/data?since=-1")
            assert status == 400 and b"'since' must be a sample number" in body
            assert get(f"{url}/dashboard/static/../app.py")[0] == 404
            status, headers, page = get(f"{url}/dashboard")
            assert status == 200 and b"dashboard.js" in page
            assert "default-src 'none'" in headers["content-security-policy"]

            driver = browser(tmp_path / "chromium-profile")
            driver.set_page_load_timeout(30)
            with Load(url, fmnist_feeds, served.inputs[0].name) as load:
                driver.get(f"{url}/dashboard")
                wait_for("some answers", lambda: sum(load.sites.values()) > 100 and load.app_queries > 5)
                wait_for("ten samples of the load in the charts", lambda: driver.execute_script(
                    "const c = window.rampserveDashboard.charts[arguments[0]];"
                    "return c && c.load && c.load.plot.data[1].filter(v => v > 0).length >= 10;", MODEL))
            assert not load.failures, load.failures[:3]
            # The server's own books, once every input is counted: the v2 requests' and those the application's
            # queries brought the model (some may have been refused at the application's deadline, and some
            # answered after it, late; the executor keeps its books once the answers are out)
            def server_counts():
                stats = json.loads(get(f"{url}/apps/{APP}")[2])["models"][MODEL]
                if stats["asked"] != stats["answered"] + stats["late"] + stats["failed"]:
                    return None
                counts = exits_counted(get(f"{url}/metrics")[2].decode())
                expected = sum(load.sites.values()) + stats["answered"] + stats["late"]
                return counts if sum(counts.values()) == expected else None

            counted = wait_for("the server's books to count every input", server_counts)
            settled = time.time()
            assert all(counted.get(s, 0) >= n for s, n in load.sites.items()), (counted, load.sites)
            assert sum(n for s, n in load.sites.items() if s != "final") > 0, "some answers left at the ramp"

            # The page's exits chart, once it holds a sample taken after that, holds exactly those counts
            def drawn_exits():
                data, sites, last = driver.execute_script(
                    "const d = window.rampserveDashboard; const s = d.samples;"
                    "return [d.chartData()[arguments[0]], d.exitSites()[arguments[0]], s.length ? s[s.length-1].t : 0];",
                    MODEL)
                if last <= settled or data is None:
                    return None
                stacked = [np.array([np.nan if v is None else v for v in layer], dtype=float)
                           for layer in data["exits"][1:]]
                per_site = [layer - (stacked[k - 1] if k else 0.0) for k, layer in enumerate(stacked)]
                return data, dict(zip(sites, (float(np.nansum(v)) for v in per_site)))

            data, drawn = wait_for("a sample after the books settled", drawn_exits)
            assert drawn == counted
            for chart in CHARTS:  # every chart holds its series over the samples, with data in them
                x, *series = data[chart]
                assert len(x) >= 3 and series, chart
                assert all(len(s) == len(x) for s in series), chart
                assert any(v is not None for s in series for v in s), chart
            assert max(v for v in data["latency"][1] if v is not None) > 0  # p50 of answered requests
            assert data["thresholds"][1][-1] is not None  # the active ramp's threshold

            # The applications' panel shows the application's books as the server keeps them
            app_status = json.loads(get(f"{url}/apps/{APP}")[2])
            def app_row():
                cells = driver.execute_script(
                    "return [...document.querySelectorAll('#apps tbody tr:first-child td')].map(td => td.textContent)")
                return cells if cells and cells[2] == str(app_status["requests"]) else None

            cells = wait_for("the applications' panel", app_row)
            stats = app_status["models"][MODEL]
            assert cells[:5] == [APP, "exp4", str(app_status["requests"]), str(app_status["defaults"]), MODEL]
            assert cells[5:] == [str(stats[k]) for k in ("asked", "answered", "wins", "late", "failed")]

            # Configuration changes are marked where the server made them, and nothing came from elsewhere. The
            # controller may still learn from the load's last records after the load stops, so the page is
            # given the time of a few samples to catch up with the server's latest version
            def marked_versions():
                versions = driver.execute_script("return window.rampserveDashboard.events.map(e => e.version)")
                served_version = json.loads(get(f"{url}/status/{MODEL}")[2])["configuration"]["version"]
                return versions if versions and versions[-1] == served_version else None

            versions = wait_for("the page to mark the server's latest configuration", marked_versions)
            assert versions == sorted(set(versions))
            resources = driver.execute_script("return performance.getEntriesByType('resource').map(r => r.name)")
            assert resources and all(r.startswith(url + "/dashboard") for r in resources), resources
            problems = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
            assert not problems, problems
            save_small_png(driver.get_screenshot_as_png(), screenshot)
        finally:
            if driver is not None:
                driver.quit()
    assert screenshot.stat().st_size > 10_000


def test_a_server_without_the_dashboard_says_so() -> None:
    state = build_state([], ModelSettings(), ServerSettings(port=0, grpc=False, dashboard=False))
    with running_server(state) as url:
        for path in ("/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js"):
            status, _, body = get(url + path)
            assert status == 404 and b"--no-dashboard" in body, path
        assert get(url + "/v2/health/ready")[0] == 200
