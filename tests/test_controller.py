"""The controller: history, ramp-set search, budget, settling, risk control, monitor, determinism (pure logic,
hand-made profiles)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.monitor import AccuracyWindow, ExitHistory
from rampserve.control.objective import serving_waits
from rampserve.control.ramps import (
    SetEstimate,
    affordable_sites,
    evenly_spaced,
    fits_budget,
    initial_sites,
    search_sets,
)
from rampserve.control.records import (
    NO_EXIT,
    NO_LABEL,
    BatchRecord,
    Configuration,
    RecordJoiner,
    validation_record,
)
from rampserve.control.risk import served_scale

SITES = tuple(f"s{i}" for i in range(8))


def profile(ramp_ms: float = 0.01, sites: tuple[str, ...] = SITES, full_ms: float = 1.0) -> LatencyProfile:
    """Equal segments; a ramp costs `ramp_ms` at batch 1 and half as much per input at batch 4."""
    segment = full_ms / (len(sites) + 1)
    return LatencyProfile(
        batch_sizes=(1, 4), sites=sites, full_ms=(full_ms, 2 * full_ms),
        segment_ms={s: (segment, 2 * segment) for s in (*sites, "output")},
        ramp_ms={s: (ramp_ms, 2 * ramp_ms) for s in sites})


def record(config: Configuration, labels: np.ndarray, errors: np.ndarray, final: np.ndarray) -> BatchRecord:
    return BatchRecord(config.version, config.sites, labels, errors, final, config.exits(errors))


def test_configuration_and_record_shapes_are_checked():
    with pytest.raises(ValueError, match="2 sites but 1 thresholds"):
        Configuration(0, ("a", "b"), (0.1,))
    with pytest.raises(ValueError, match="do not fit"):
        BatchRecord(0, ("a",), np.zeros((2, 2), int), np.zeros((2, 1)), np.zeros(2, int), np.zeros(2, int))


def test_record_releases_the_exit_ramps_label_or_the_final_one():
    config = Configuration(1, ("a", "b"), (0.2, 0.5))
    rec = record(config, np.array([[1, 2], [3, 4], [5, 6]]), np.array([[0.1, 0.9], [0.9, 0.4], [0.9, 0.9]]),
                 np.array([1, 0, 7]))
    np.testing.assert_array_equal(rec.exits, [0, 1, NO_EXIT])
    np.testing.assert_array_equal(rec.released(), [1, 4, 7])
    np.testing.assert_array_equal(rec.correct(), [True, False, True])


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), st.floats(0.1, 1.0))
def test_the_disagreement_at_the_served_thresholds_is_the_served_answers(seed, thresholds, feedback_share):
    """What the monitor tests at the thresholds a batch was served at is the estimate of its served answers' own
    disagreement, in stop mode too (the exits the feedback draw left out stopped: NaN scores after their exit)."""
    rng = np.random.default_rng(seed)
    sites = SITES[:len(thresholds)]
    config = Configuration(1, sites, tuple(thresholds))
    n = 12
    labels, errors, final = rng.integers(0, 2, (n, len(sites))), rng.random((n, len(sites))), rng.integers(0, 2, n)
    exits = config.exits(errors)
    stopped = (exits != NO_EXIT) & (rng.random(n) >= feedback_share)
    after_exit = np.arange(len(sites))[None, :] > exits[:, None]
    errors = np.where(stopped[:, None] & after_exit, np.nan, errors)
    labels = np.where(stopped[:, None] & after_exit, NO_LABEL, labels)
    served = BatchRecord(1, sites, labels, errors, np.where(stopped, NO_LABEL, final), exits,
                         feedback_share=feedback_share)
    np.testing.assert_allclose(served.wrong_estimate_at(sites, np.array(thresholds)), served.wrong_estimate())


def test_accuracy_window_slides_and_keeps_totals():
    window = AccuracyWindow(4)
    window.add(np.array([True, False, False, False, False]))  # whether each answer is wrong
    assert window.accuracy == 1.0 and window.cumulative == 0.8
    window.add(np.array([True]))
    assert window.accuracy == 0.75
    window.clear()
    assert window.accuracy == 1.0 and window.served == 6


def test_the_history_keeps_the_newest_rows_in_order_with_every_sites_column():
    history = ExitHistory(("a", "b"), capacity=5)
    config = Configuration(0, ("a",), (0.0,))
    for start in range(0, 12, 3):
        errors = np.arange(start, start + 3, dtype=float)[:, None]
        history.add(record(config, np.zeros((3, 1), int), errors, np.zeros(3, int)), first=start)
    rows = history.rows(("a",))
    _, errors = history.columns(rows, ("a", "b"))
    np.testing.assert_array_equal(errors[:, 0], [7, 8, 9, 10, 11])
    assert np.isinf(errors[:, 1]).all() and len(history.rows(("a", "b"))) == 0  # b never ran for them
    assert history.oldest() == 7 and (history.design(rows)[0] == 3).all()
    assert history.rows(("a",), before=9).tolist() == rows[:2].tolist()


def test_initial_sites_spread_the_most_ramps_the_budget_allows():
    costs = CostModel(profile(ramp_ms=0.006))  # 0.6% each: three fit in 2%
    sites = initial_sites(costs, 0.02, 1)
    assert len(sites) == 3 and fits_budget(costs, sites, 0.02, 1)
    assert sites == tuple(SITES[p] for p in evenly_spaced(8, 3)) == ("s2", "s4", "s5")
    assert initial_sites(CostModel(profile(ramp_ms=0.05)), 0.02, 1) == ()


def test_the_search_judges_only_sets_within_the_budget_and_returns_the_best_first():
    costs = CostModel(profile(ramp_ms=0.006))
    judged = []

    def judge(sites: tuple[str, ...]) -> SetEstimate:  # later sites and more of them are better, here
        judged.append(sites)
        value = -sum(costs.position[s] for s in sites)
        return SetEstimate(sites, (0.0,) * len(sites), float(value), float(value), 0.0)

    found = search_sets(costs, judge, budget=0.02, budget_batch=1, beam=2, excluded=lambda s: s == ("s7",))
    assert all(fits_budget(costs, s, 0.02, 1) for s in judged) and ("s7",) not in judged
    assert len(judged) == len(set(judged)) and max(len(s) for s in judged) == 3
    assert [e.key() for e in found] == sorted(e.key() for e in found)
    assert found[0].sites == ("s5", "s6", "s7")  # reached by growing ("s6",), although ("s7",) was excluded


def shadowed_drive(controller: Controller, batches: list) -> float:
    """Serve hand-made batches as a server would: each configuration's shadow batches evaluate every site. Returns
    the share of released answers that differ from the final ones."""
    served, wrong = {}, 0
    for labels, errors, final in batches:
        config = controller.configuration()
        index = served.get(config.version, 0)
        served[config.version] = index + 1
        if config.is_shadow_batch(index):
            config = config.shadowed()
        columns = [SITES.index(s) for s in config.sites]
        answered = record(config, labels[:, columns], errors[:, columns], final)
        wrong += int((~answered.correct()).sum())
        controller.observe(answered)
    return wrong / sum(len(final) for *_, final in batches)


def two_kinds_of_input(rng: np.random.Generator, count: int, early_share: float, late_share: float) -> list:
    """Batches of one input: s1 answers `early_share` of inputs confidently and right, s6 `late_share` of them
    (those s1 answers included); every other answer is unsure (error 0.8) and wrong half the time."""
    batches = []
    for _ in range(count):
        u = rng.random()
        errors = np.full((1, len(SITES)), 0.8)
        labels = np.where(rng.random((1, len(SITES))) < 0.5, 0, 1)
        if u < early_share:
            errors[0, 1], labels[0, 1] = 0.05, 0
        if u < late_share:
            errors[0, 6], labels[0, 6] = 0.05, 0
        batches.append((labels, errors, np.zeros(1, dtype=int)))
    return batches


@pytest.mark.parametrize(("objective", "chosen"), [("p50", ("s6",)), ("mean", ("s1",))])
def test_the_set_is_chosen_for_the_objective_asked(objective, chosen):
    """One ramp fits the budget. s1 releases 30% of inputs early, s6 70% late: the median input only gains with
    s6, the mean gains more with s1 (0.3 x 0.78 ms against 0.7 x 0.22 ms)."""
    controller = Controller(profile(ramp_ms=0.006), ControllerSettings(ramp_budget=0.01, objective=objective))
    shadowed_drive(controller, two_kinds_of_input(np.random.default_rng(0), 3000, 0.3, 0.7))
    config = controller.configuration()
    assert config.sites == chosen and config.thresholds[0] > 0.05
    assert controller.status()["set_changes"] == 1


@pytest.mark.parametrize(("search_span", "holds"), [(ControllerSettings.search_span, True), (300, False)])
def test_a_phase_that_cannot_move_the_median_does_not_take_the_set_from_the_one_that_moves_the_streams(
        search_span, holds):
    """Phases of 3,000 inputs alternate: in the easy ones s1 answers 80% of inputs early, in the hard ones 35%, where
    s6 answers 75% late. One ramp fits the budget. Over the stream s1 answers 57.5%: the best fixed set for the
    median, which a hard phase alone (its own median moved only by s6) would give up. Judged over a span of the
    stream, the search holds s1 through the hard phases; judged on the newest 300 shadow inputs (a phase's, too few
    to certify thresholds on: the average promise), it leaves it."""
    rng = np.random.default_rng(0)
    settings_ = ControllerSettings(ramp_budget=0.01, search_span=search_span, search_every=1024, guarantee="average")
    controller = Controller(profile(ramp_ms=0.006), settings_)
    for phase in range(6):
        shadowed_drive(controller, two_kinds_of_input(rng, 3000, *((0.8, 0.8) if phase % 2 == 0 else (0.35, 0.75))))
    deployed = [d.configuration.sites for d in controller.decisions[1:]]
    assert deployed[0] == ("s1",)
    assert (set(deployed) == {("s1",)}) == holds, set(deployed)


def test_a_set_replaces_the_deployed_one_only_after_winning_as_many_searches_as_asked():
    """s1 pays on the easy inputs, s6 on the hard ones; one ramp fits the budget and sets are judged on the newest
    300 shadow inputs (3,000 inputs). A hard stretch of 3,000 inputs lets s6 win one search: asked for one win, the
    controller takes s6 and goes back to s1 after it; asked for two, it holds s1. Where the stream stays hard, s6
    replaces s1 either way, one search round later when it must win twice."""
    search_every = 1024

    def driven(wins: int, hard: int, easy_after: int) -> Controller:
        rng = np.random.default_rng(hard)
        controller = Controller(profile(ramp_ms=0.006), ControllerSettings(
            ramp_budget=0.01, search_span=300, search_every=search_every, guarantee="average",
            challenger_wins=wins))
        shadowed_drive(controller, two_kinds_of_input(rng, 4096, 0.8, 0.8) + two_kinds_of_input(rng, hard, 0.35, 0.75)
                       + two_kinds_of_input(rng, easy_after, 0.8, 0.8))
        return controller

    def served(wins: int, hard: int, easy_after: int) -> list[tuple[int, tuple[str, ...]]]:
        return [(d.observed, d.configuration.sites) for d in driven(wins, hard, easy_after).decisions[1:]]

    assert [sites for _, sites in served(1, 3000, 4096)] == [("s1",), ("s6",), ("s1",)]
    # Asked for two wins, s6 won the search right after the hard stretch and no other since: the status says so
    assert driven(2, 3000, 4096).status()["challengers"] == {"wins_needed": 2, "sets": [{"sites": ["s6"], "wins": 1}]}
    assert [sites for _, sites in served(2, 3000, 4096)] == [("s1",)]
    (_, first), (once, taken) = served(1, 8192, 0)
    (_, first_twice), (twice, taken_twice) = served(2, 8192, 0)
    assert first == first_twice == ("s1",) and taken == taken_twice == ("s6",)
    assert twice == once + search_every


def test_a_ramp_that_pays_gets_exits_right_after_the_warm_up():
    """The first search runs once `warmup` shadow inputs are in: a ramp that pays from the start is deployed then,
    with certified thresholds, never at threshold 0 to gather outputs first."""
    settings_ = ControllerSettings(ramp_budget=0.01)
    controller = Controller(profile(ramp_ms=0.006), settings_)
    batches = two_kinds_of_input(np.random.default_rng(1), settings_.warmup, 0.0, 0.8)
    shadowed_drive(controller, batches[:-1])
    assert controller.configuration().sites == () and controller.configuration().shadow_every == 1
    shadowed_drive(controller, batches[-1:])
    deployed = controller.configuration()
    assert deployed.sites == ("s6",) and deployed.thresholds[0] > 0.05
    assert deployed.shadow_every == settings_.shadow_every == 10
    assert controller.decisions[-1].observed == settings_.warmup


def validation_of(batches: list) -> dict[str, np.ndarray]:
    """Hand-made batches of every site's ramp outputs as a bundle keeps its validation inputs'."""
    labels, errors, final = (np.concatenate(part) for part in zip(*batches))
    return {"labels": labels, "errors": errors, "final": final}


def test_a_primed_controller_exits_from_its_first_request_on_what_its_bundle_validated():
    """The bundle's validation inputs stand for the warm-up: the first search is made on them when the controller
    starts, so the set that pays is deployed with certified thresholds before any request; unprimed, the same
    controller serves shadow batches without an exit until its warm-up is in."""
    settings_ = ControllerSettings(ramp_budget=0.01)
    validation = validation_of(two_kinds_of_input(np.random.default_rng(1), settings_.warmup, 0.0, 0.8))
    primed = Controller(profile(ramp_ms=0.006), settings_, validation_record(SITES, validation))
    deployed = primed.configuration()
    assert deployed.sites == ("s6",) and deployed.thresholds[0] > 0.05
    assert deployed.shadow_every == settings_.shadow_every  # warm: one batch in ten evaluates every ramp
    assert primed.decisions[-1].observed == 0 and "inputs served before" in primed.decisions[-1].reason
    assert primed.window.served == 0  # nothing was released to anyone
    for unprimed in (Controller(profile(ramp_ms=0.006), settings_),
                     Controller(profile(ramp_ms=0.006), replace(settings_, prime=False),
                                validation_record(SITES, validation))):
        assert unprimed.configuration().sites == () and unprimed.configuration().shadow_every == 1
    # thresholds given to start from are served as given
    given = replace(settings_, initial=("s1",), start_thresholds={"s1": 0.5})
    assert Controller(profile(ramp_ms=0.006), given, validation_record(SITES, validation)).configuration() == \
        Controller(profile(ramp_ms=0.006), given).configuration()
    # live inputs join the evidence: the next search comes once as many have been served, on both together
    live = two_kinds_of_input(np.random.default_rng(2), settings_.warmup, 0.0, 0.8)
    shadowed_drive(primed, live[:-1])
    assert len(primed.times.adjust_ms) == 1
    shadowed_drive(primed, live[-1:])
    assert len(primed.times.adjust_ms) == 2 and primed.configuration().sites == ("s6",)


def test_a_prior_smaller_than_the_warm_up_gives_exits_and_leaves_the_rest_of_the_warm_up_to_gather():
    """Exits from the first request, yet every batch stays a shadow batch until the prior and the live shadow
    inputs make a warm-up: the search judges sets on shadow inputs alone."""
    settings_ = ControllerSettings(ramp_budget=0.01)
    batches = two_kinds_of_input(np.random.default_rng(3), settings_.warmup, 0.0, 0.8)
    prior = validation_of(batches[:600])
    controller = Controller(profile(ramp_ms=0.006), settings_, validation_record(SITES, prior))
    assert controller.configuration().sites == ("s6",) and controller.configuration().thresholds[0] > 0.05
    assert controller.configuration().shadow_every == 1
    shadowed_drive(controller, batches[600:-1])
    assert len(controller.times.adjust_ms) == 1 and controller.configuration().shadow_every == 1
    shadowed_drive(controller, batches[-1:])
    assert len(controller.times.adjust_ms) == 2 and controller.configuration().shadow_every == settings_.shadow_every


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), wrong_share=st.floats(0.1, 0.6))
def test_a_prior_unlike_the_live_stream_cannot_break_the_long_run_bound(seed, wrong_share):
    """Primed on validation inputs where s6 is confident and right, then served a stream where s6 is just as
    confident and wrong on `wrong_share` of inputs: rolling risk control holds the mean disagreement of the answers
    released to its bound whatever the prior said, target + (1 + step) / (step * T) at batches of one."""
    settings_ = ControllerSettings(ramp_budget=0.01)
    prior = validation_of(two_kinds_of_input(np.random.default_rng(seed), 1000, 0.0, 0.8))
    controller = Controller(profile(ramp_ms=0.006), settings_, validation_record(SITES, prior))
    assert controller.configuration().sites == ("s6",)
    live = two_kinds_of_input(np.random.default_rng(seed + 1), 3000, 0.0, 0.8)
    rng = np.random.default_rng(seed + 2)
    for labels, errors, _ in live:
        if errors[0, 6] < 0.5 and rng.random() < wrong_share:
            labels[0, 6] = 1
    shadowed_drive(controller, live)
    served = controller.window.served
    bound = settings_.risk_target + (1 + settings_.rolling_step) / (settings_.rolling_step * served)
    assert served == len(live) and 1.0 - controller.window.cumulative <= bound


@pytest.mark.parametrize("seed", range(3))
def test_the_set_settles_on_a_stationary_stream(seed):
    """After the first search, at most one set change per search round, and never back to a set left in the last
    two rounds, where both kinds of input answer at a ramp and noise alone separates the sets' estimates."""
    settings_ = ControllerSettings(ramp_budget=0.015, search_every=512, warmup=512)
    controller = Controller(profile(ramp_ms=0.006), settings_)
    shadowed_drive(controller, two_kinds_of_input(np.random.default_rng(seed), 12_000, 0.45, 0.55))
    changes = [d for a, d in zip(controller.decisions, controller.decisions[1:])
               if a.configuration.sites != d.configuration.sites]
    assert 1 <= len(changes)
    times = [d.observed for d in changes]
    assert all(b - a >= settings_.search_every for a, b in zip(times, times[1:]))
    for i, change in enumerate(changes):
        earlier = [c for c in changes[:i] if change.observed - c.observed < 2 * settings_.search_every]
        left = {changes[changes.index(c) - 1].configuration.sites if changes.index(c) else () for c in earlier}
        assert change.configuration.sites not in left
    assert len(changes) <= 1 + (12_000 - settings_.warmup) // (4 * settings_.search_every)


def drive(controller: Controller, batches: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list:
    """Serve hand-made batches with whatever configuration the controller holds at each batch."""
    for labels, errors, final in batches:
        config = controller.configuration()
        columns = [SITES.index(s) for s in config.sites]
        controller.observe(record(config, labels[:, columns], errors[:, columns], final))
    return [(d.configuration, d.observed, d.reason) for d in controller.decisions]


def random_batches(seed: int, count: int, size: int = 4) -> list:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        final = rng.integers(0, 3, size)
        agree = rng.random((size, len(SITES))) < np.linspace(0.4, 0.99, len(SITES))
        labels = np.where(agree, final[:, None], (final[:, None] + 1) % 3)
        errors = np.where(agree, rng.random((size, len(SITES))) * 0.5, rng.random((size, len(SITES))))
        batches.append((labels, errors, final))
    return batches


def test_controller_is_deterministic_given_its_records():
    """Decisions, and the modelled time each took (what the simulator charges), are the same run after run."""
    batches = random_batches(seed=1, count=1200)
    settings_ = ControllerSettings(ramp_budget=0.03, warmup=512, search_every=512)
    runs = []
    for _ in range(2):
        controller = Controller(profile(ramp_ms=0.005), settings_)
        shadowed_drive(controller, batches)
        runs.append([(d.configuration, d.observed, d.reason, d.decision_ms) for d in controller.decisions])
    assert runs[0] == runs[1] and len(runs[0]) > 3


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.001, 0.03), st.floats(0.0, 0.06), st.sampled_from([1, 4]))
def test_ramp_adjustment_never_exceeds_the_budget(seed, ramp_ms, budget, batch):
    controller = Controller(profile(ramp_ms=ramp_ms), ControllerSettings(
        ramp_budget=budget, history=128, search_every=32, warmup=64, search_rows=128, budget_batch_size=batch))
    shadowed_drive(controller, random_batches(seed, count=150, size=batch))
    for decision in controller.decisions:
        assert fits_budget(controller.costs, decision.configuration.sites, budget, batch)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.floats(0.001, 0.05), min_size=len(SITES), max_size=len(SITES)),
       st.floats(0.0, 0.04))
def test_shadow_batches_evaluate_only_the_ramps_a_search_could_deploy(seed, ramp_ms, budget):
    """A site whose ramp alone exceeds the budget at every batch size can be in no set that fits: shadow batches
    leave it out, and where every site is so, nothing is shadowed or searched and every batch runs the
    configuration in force (vanilla's, with no initial set)."""
    segment = 1.0 / (len(SITES) + 1)
    costly = LatencyProfile(batch_sizes=(1, 4), sites=SITES, full_ms=(1.0, 2.0),
                            segment_ms={s: (segment, 2 * segment) for s in (*SITES, "output")},
                            ramp_ms={s: (ms, 1.5 * ms) for s, ms in zip(SITES, ramp_ms)})
    controller = Controller(costly, ControllerSettings(ramp_budget=budget, history=128, search_every=32, warmup=64,
                                                       search_rows=128))
    fitting = {s for s, ms in zip(SITES, ramp_ms) if min(ms, 1.5 * ms / 2) <= budget}
    assert set(controller.shadow_sites) == fitting == set(affordable_sites(controller.costs, budget))
    shadowed_drive(controller, random_batches(seed, count=150))
    for decision in controller.decisions:
        config = decision.configuration
        assert set(config.sites) <= fitting
        assert bool(config.shadow_every) == bool(fitting) and set(config.shadow_sites) == fitting
    if not fitting:
        assert len(controller.decisions) == 1 and controller.shadow.size == 0 and not controller.times.adjust_ms


@pytest.mark.parametrize("served_batch, fits", [(1, False), (4, True)])
def test_status_says_when_no_ramp_fits_the_batch_size_served(served_batch, fits):
    """Every ramp costs 5% of the model at batch 1 and 2% at batch 4, against a 3% budget: the controller shadows
    them (some batch size fits), and its search at the batch size served says whether any set fits there."""
    segment = 1.0 / (len(SITES) + 1)
    costly = LatencyProfile(batch_sizes=(1, 4), sites=SITES, full_ms=(1.0, 2.0),
                            segment_ms={s: (segment, 2 * segment) for s in (*SITES, "output")},
                            ramp_ms={s: (0.05, 0.04) for s in SITES})
    controller = Controller(costly, ControllerSettings(ramp_budget=0.03, history=128, search_every=32, warmup=64,
                                                       search_rows=128))
    assert controller.searches and controller.status()["ramps_fit"]  # no search yet
    shadowed_drive(controller, random_batches(0, count=400 // served_batch, size=served_batch))
    status = controller.status()
    assert controller.last_search and status["budget_batch"] == served_batch
    assert status["ramps_fit"] is fits and (len(controller.last_search) > 1) is fits


def certified_on_confident_right_answers() -> tuple[Controller, Configuration, tuple]:
    settings_ = ControllerSettings(initial=("s3",), window=16, ramp_adjustment=False, warmup=1024)
    controller = Controller(profile(), settings_)
    confident_right = (np.zeros((4, 8), int), np.full((4, 8), 0.1), np.zeros(4, dtype=int))
    drive(controller, [confident_right] * 300)  # the first tuning, at 1,024 inputs, certifies a threshold
    certified = controller.configuration()
    assert certified.version == 1 and certified.thresholds[0] > 0.15
    return controller, certified, confident_right


def test_disagreements_scale_the_thresholds_down_and_agreement_scales_them_back():
    controller, certified, confident_right = certified_on_confident_right_answers()
    # s3 exits and is wrong on 3 inputs just under its threshold: too few for the monitor to find the constraint
    # broken, but rolling risk control scales the certified threshold down at once
    error = 0.95 * certified.thresholds[0]
    drive(controller, [(np.ones((3, 8), int), np.full((3, 8), error), np.zeros(3, dtype=int))])
    lowered = controller.configuration()
    assert lowered.version == 2 and "risk control" in controller.decisions[-1].reason
    assert lowered.thresholds[0] < error  # the wrong answers no longer exit
    assert lowered.thresholds[0] == pytest.approx(served_scale(controller.scale) * certified.thresholds[0])
    assert controller.status()["risk_scale"] < 1.0
    # enough agreement brings the scale back to the thresholds tuning chose (retuned on more inputs meanwhile)
    drive(controller, [confident_right] * 1000)
    assert controller.status()["risk_scale"] == 1.0
    assert controller.configuration().thresholds[0] >= certified.thresholds[0]


def test_the_monitor_retunes_when_released_answers_break_the_constraint():
    """16 confident wrong answers in a row are evidence beyond 1 / delta that the certified thresholds no longer
    hold, and far above the constraint: the stream changed where the wrong answers began. The inputs before are
    forgotten and the thresholds certified again at once on those since."""
    controller, certified, _ = certified_on_confident_right_answers()
    change_point = controller.window.served
    drive(controller, [(np.ones((16, 8), int), np.full((16, 8), 0.15), np.zeros(16, dtype=int))])
    assert controller.decisions[-1].reason.startswith("monitor")
    assert controller.configuration().thresholds[0] < 0.15 and controller.monitor.answers == 0
    status = controller.status()
    assert status["stream_changes"] == 1 and status["forgotten_before"] == change_point
    assert controller.tuning_data(("s3",)).sequence.min() >= change_point


@pytest.mark.parametrize(("wrong_every", "changed"), [(6, False), (4, True)])
def test_an_alarm_forgets_the_history_only_where_answers_break_the_constraint_far(wrong_every, changed):
    """At a constraint of 10%, thresholds certified on confident right answers; then one answer in `wrong_every` is
    as confident and wrong. At 1 in 6 (1.7 times the constraint) the alarm certifies again on the whole history, as
    for a slow drift; at 1 in 4 (2.5 times) the stream changed: the inputs before the first wrong one are
    forgotten."""
    controller = Controller(profile(), ControllerSettings(initial=("s3",), ramp_adjustment=False, warmup=1024,
                                                          accuracy_constraint=0.1))
    drive(controller, [(np.zeros((4, 8), int), np.full((4, 8), 0.1), np.zeros(4, dtype=int))] * 300)
    assert controller.configuration().thresholds[0] > 0.1
    wrong = (np.arange(800) % wrong_every == 0).reshape(200, 4)
    drive(controller, [(np.repeat(w[:, None], 8, axis=1).astype(int), np.full((4, 8), 0.1), np.zeros(4, dtype=int))
                       for w in wrong])
    alarms = [d.reason for d in controller.decisions if d.reason.startswith("monitor")]
    assert alarms and ("stream changed" in alarms[0]) == changed
    status = controller.status()
    assert status["stream_changes"] == int(changed)
    assert status["forgotten_before"] == (1200 if changed else 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_after_the_stream_changes_the_controller_forgets_the_old_one_and_finds_the_set_of_the_new(seed):
    """Until input 3,000, s1 answers 80% of inputs confidently and right; after it, s1 is as confident and wrong on
    half of those (inputs of a kind its ramp never saw), while s6 answers 70% confidently and right. One ramp fits
    the budget. The monitor finds the change within a few answers; the controller forgets the inputs before it,
    gathers a new warm-up and deploys s6: the answers after the change stay within the constraint."""
    rng = np.random.default_rng(seed)
    settings_ = ControllerSettings(ramp_budget=0.01)
    controller = Controller(profile(ramp_ms=0.006), settings_)
    before = two_kinds_of_input(rng, 3000, 0.8, 0.0)
    assert shadowed_drive(controller, before) <= settings_.accuracy_constraint
    assert controller.configuration().sites == ("s1",)
    after = two_kinds_of_input(rng, 3000, 0.0, 0.7)
    for labels, errors, _ in after:
        if rng.random() < 0.8:
            errors[0, 1], labels[0, 1] = 0.05, int(rng.random() < 0.5)
    assert shadowed_drive(controller, after) <= settings_.accuracy_constraint
    status = controller.status()
    # forgotten: what came before the change point the change detector found
    assert status["stream_changes"] == 1 and abs(status["forgotten_before"] - 3000) <= 50, status["forgotten_before"]
    deployed = controller.configuration()
    assert deployed.sites == ("s6",) and deployed.thresholds[0] > 0.05
    assert deployed.shadow_every == settings_.shadow_every


@pytest.mark.parametrize(("guarantee", "exit_mode"), [
    ("average", "stop"), ("certified", "stop"), ("windowed", "stop"), ("average", "release")])
def test_one_wrong_answer_observed_moves_the_scale_by_the_step(guarantee, exit_mode):
    """Stop mode: an exit sampled to run to the end stands for 1 / feedback share (10) answers. Under every promise
    one such wrong answer moves rolling risk control's scale by `risk_step` (0.05), as one wrong answer does in
    release mode, not by its estimate (0.5: the median input's ramp closed for a thousand answers)."""
    settings_ = ControllerSettings(initial=("s3",), ramp_adjustment=False, guarantee=guarantee, exit_mode=exit_mode,
                                   start_thresholds={"s3": 0.5}, threshold_tuning=False)
    controller = Controller(profile(), settings_)
    share = settings_.kept_share
    wrong_exit = BatchRecord(0, ("s3",), np.ones((1, 1), int), np.full((1, 1), 0.1), np.zeros(1, int),
                             np.zeros(1, int), feedback_share=share)
    controller.observe(wrong_exit)
    assert controller.scale == pytest.approx(1.0 - settings_.risk_step + settings_.rolling_step * settings_.risk_target)


def test_records_of_a_replaced_configuration_teach_their_ramps_outputs_but_not_the_monitor():
    """Ramp outputs do not depend on the thresholds that served them; the monitor watches only the answers the
    deployed thresholds released."""
    controller = Controller(profile(), ControllerSettings(initial=("s3",)))
    stale = Configuration(-1, ("s1",), (1.0,))
    controller.observe(record(stale, np.ones((2, 1), int), np.zeros((2, 1)), np.zeros(2, int)))
    assert controller.recent.size == 2 and len(controller.recent.rows(("s1",))) == 2
    assert len(controller.recent.rows(("s3",))) == 0 and controller.window.served == 2
    assert controller.monitor.answers == 0


def test_settings_are_validated():
    with pytest.raises(ValueError, match="history"):
        ControllerSettings(history=0)
    with pytest.raises(ValueError, match="objective"):
        ControllerSettings(objective="p42")
    with pytest.raises(ValueError, match="guarantee"):
        ControllerSettings(guarantee="hopeful")
    with pytest.raises(ValueError, match="accuracy_constraint must be < 1"):
        ControllerSettings(accuracy_constraint=1.5)
    with pytest.raises(ValueError, match="at least one search"):
        ControllerSettings(challenger_wins=0)
    with pytest.raises(ValueError, match="not sites"):
        Controller(profile(), ControllerSettings(initial=("nope",)))


def test_a_set_is_tuned_on_the_inputs_that_saw_every_one_of_its_ramps():
    """Inputs served by another set never saw a ramp it lacks; counting them as not exiting there would dilute
    that ramp's mistakes. A set's data are the shadow inputs (every ramp) and the inputs served with its ramps."""
    controller = Controller(profile(), ControllerSettings(initial=("s6",), history=64))
    served = Configuration(0, ("s6",), (0.0,))
    controller.observe(record(served, np.zeros((40, 1), int), np.full((40, 1), 0.01), np.zeros(40, int)))
    shadow = Configuration(0, SITES, (0.0,) * len(SITES))
    controller.observe(record(shadow, np.ones((8, 8), int), np.full((8, 8), 0.01), np.zeros(8, int)))
    assert controller.tuning_data(("s5", "s6")).size == 8  # the shadow inputs alone
    assert controller.tuning_data(("s6",)).size == 48
    assert not controller.tuning_data(("s5", "s6")).correct.any()  # the shadow inputs' s5 and s6 were wrong
    # once the history overflows, older shadow inputs still count for a set that only they saw
    controller.observe(record(served, np.zeros((64, 1), int), np.full((64, 1), 0.01), np.zeros(64, int)))
    assert controller.tuning_data(("s5", "s6")).size == 8 and controller.tuning_data(("s6",)).size == 64 + 8


@pytest.mark.parametrize("seed", range(5))
def test_a_failed_batch_counts_its_released_answers_as_disagreements_and_never_loosens_thresholds(seed):
    """Answers released before their batch failed reach the controller unverified: they count against the window
    and in total, teach the history nothing, and tighten the thresholds at once; on a stream where an identical
    controller that saw no failure loosens them, the thresholds end lower than that controller's."""
    rng = np.random.default_rng(seed)
    site = SITES[3]
    scores = rng.uniform(0.0, 0.6, 1400)
    right = rng.random(1400) < 0.995

    def fed(fail: bool) -> tuple[Controller, Configuration, Configuration]:
        control = Controller(profile(), ControllerSettings(initial=(site,), start_thresholds={site: 0.02},
                                                           ramp_adjustment=False, warmup=1024))
        for score, ok in zip(scores[:1000], right[:1000]):  # before the first tuning (1,024 inputs)
            control.observe(record(control.configuration(), np.array([[1 if ok else 2]]), np.array([[score]]),
                                   np.array([1])))
        before = control.configuration()
        if fail:
            served, history = control.window.served, control.recent.size
            failed = BatchRecord(before.version, before.sites, np.ones((3, 1), int), np.zeros((3, 1)),
                                 np.full(3, NO_LABEL), np.zeros(3, int), unverified=True)
            tightened = control.observe(failed)  # rolling risk control counts them as disagreements at once
            assert tightened is None or tightened.thresholds[0] < before.thresholds[0]
            assert control.unverified == 3 and control.window.served == served + 3
            assert control.recent.size == history  # nothing to learn from answers with no final label
        for score, ok in zip(scores[1000:], right[1000:]):
            control.observe(record(control.configuration(), np.array([[1 if ok else 2]]), np.array([[score]]),
                                   np.array([1])))
        return control, before, control.configuration()

    _, before, unchecked = fed(fail=False)
    assert unchecked.thresholds[0] > before.thresholds[0]  # this stream loosens
    _, _, after_failure = fed(fail=True)
    assert after_failure.thresholds[0] < unchecked.thresholds[0]


def test_a_successor_catches_up_with_its_predecessors_counts_once():
    """Each replica brings the latest checkpoint it saw; only what one adds beyond those taken counts."""
    predecessor = Controller(profile(), ControllerSettings(initial=(SITES[2],), start_thresholds={SITES[2]: 1.0}))
    config = predecessor.configuration()
    checkpoints = []
    for right in ([1, 1, 2], [1, 2, 2, 2], [1]):
        predecessor.observe(record(config, np.array([[label] for label in right]), np.zeros((len(right), 1)),
                                   np.ones(len(right), int)))
        checkpoints.append(predecessor.checkpoint())
    successor = Controller(profile(), ControllerSettings(initial=(SITES[2],), start_thresholds={SITES[2]: 1.0}))
    successor.observe(record(config, np.array([[1]]), np.zeros((1, 1)), np.ones(1, int)))  # its own first record
    for checkpoint in (checkpoints[1], checkpoints[0], checkpoints[2], checkpoints[1]):  # replicas in any order
        successor.catch_up(checkpoint)
    assert successor.window.served == predecessor.window.served + 1
    assert successor.window.correct == predecessor.window.correct + 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.booleans(), st.booleans()), min_size=1,
                max_size=12), st.integers(1, 12))
def test_joined_records_keep_every_input_in_order_with_its_batch_size(batches, cut) -> None:
    """Joining consecutive records of one configuration and kind loses no input, keeps their order, each input the
    size of the batch it was served in and whether it was kept to the end; records of another configuration or kind
    are never joined, and a record joined before joins again the same way."""
    rng = np.random.default_rng(0)
    configs = [Configuration(v, ("a", "b")[:v % 2 + 1], (0.1, 0.2)[:v % 2 + 1]) for v in range(3)]
    records = []
    for version, size, unverified, forced in batches:
        config = configs[version]
        errors = rng.random((size, len(config.sites)))
        records.append(BatchRecord(config.version, config.sites, rng.integers(0, 3, (size, len(config.sites))),
                                   errors, rng.integers(0, 3, size), config.exits(errors), unverified=unverified,
                                   forced=rng.random(size) < 0.5 if forced else None))

    def joined(some: list[BatchRecord]) -> list[BatchRecord]:
        joiner = RecordJoiner()
        for record in some:
            joiner.add_record(record)
        return joiner.joined()

    together = joined(records)
    assert np.array_equal(np.concatenate([r.final for r in together]), np.concatenate([r.final for r in records]))
    assert np.array_equal(np.concatenate([r.batch_sizes() for r in together]),
                          np.concatenate([np.full(r.inputs, r.inputs) for r in records]))
    assert np.array_equal(np.concatenate([np.zeros(r.inputs, bool) if r.forced is None else r.forced
                                          for r in together]),
                          np.concatenate([np.zeros(r.inputs, bool) if r.forced is None else r.forced
                                          for r in records]))
    assert len(together) == 1 + sum((a.version, a.unverified) != (b.version, b.unverified)
                                    for a, b in zip(records, records[1:]))
    for record in together:
        assert record.labels.shape == (record.inputs, len(record.sites))
    in_two_steps = joined(joined(records[:cut]) + joined(records[cut:]))
    assert [r.inputs for r in in_two_steps] == [r.inputs for r in together]
    assert np.array_equal(np.concatenate([r.batch_sizes() for r in in_two_steps]),
                          np.concatenate([r.batch_sizes() for r in together]))


def test_sets_are_judged_on_what_requests_wait_for_their_queueing_included():
    """Each shadow input's estimated latency is its batch's queueing plus the model up to its exit; the warm-up's
    waits (every batch running every ramp) do not count: the first search judges service time alone, and later
    ones give warm-up inputs the waits measured since."""
    controller = Controller(profile(), ControllerSettings(warmup=64, search_every=64))
    shadow = controller.configuration()
    assert shadow.shadow_every == 1

    def observe(queue_ms: float) -> None:
        controller.observe(replace(record(shadow.shadowed(), np.zeros((1, 8), int), np.full((1, 8), 0.9),
                                          np.zeros(1, dtype=int)), queue_ms=queue_ms))

    for _ in range(64):
        observe(50.0)
    first_search = controller.last_search
    no_ramp = next(e for e in first_search if e.sites == ())
    assert no_ramp.objective_ms == pytest.approx(1.0) and no_ramp.mean_ms == pytest.approx(1.0)
    for _ in range(64):
        observe(5.0)
    assert controller.last_search is not first_search  # a second search ran
    no_ramp = next(e for e in controller.last_search if e.sites == ())
    assert no_ramp.objective_ms == pytest.approx(5.0 + 1.0) and no_ramp.mean_ms == pytest.approx(6.0)


def test_a_young_controller_searches_each_time_its_inputs_double_then_every_search_every():
    """Its first rounds certify on twice the evidence each: after the warm-up, a round whenever the inputs observed
    have doubled since the last, until `search_every` inputs lie between rounds."""
    controller = Controller(profile(), ControllerSettings(warmup=64, search_every=256))
    shadow = controller.configuration().shadowed()
    rounds = []
    for observed in range(1, 1101):
        controller.observe(record(shadow, np.zeros((1, 8), int), np.full((1, 8), 0.9), np.zeros(1, dtype=int)))
        if len(controller.times.adjust_ms) > len(rounds):
            rounds.append(observed)
    assert rounds == [64, 128, 256, 512, 768, 1024]


@given(st.lists(st.one_of(st.none(), st.floats(0.0, 100.0)), min_size=1, max_size=40))
def test_unknown_waits_take_the_measured_ones_distribution(values):
    waits = np.array([np.nan if v is None else v for v in values])
    filled = serving_waits(waits)
    known = waits[~np.isnan(waits)]
    assert not np.isnan(filled).any() and len(filled) == len(waits)
    np.testing.assert_array_equal(filled[~np.isnan(waits)], known)  # measured waits stay as they were
    if len(known):
        assert known.min() <= filled.min() and filled.max() <= known.max()
    else:
        assert (filled == 0.0).all()  # nothing measured: service time alone