"""The controller: monitor, ramp utilities and adjustment, budget, determinism (pure logic, hand-made profiles)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.guarantee import smallest_certifying
from rampserve.control.monitor import AccuracyWindow, RampHistory
from rampserve.control.ramps import adjust_ramps, evenly_spaced, fits_budget, initial_sites, ramp_utilities
from rampserve.control.records import NO_EXIT, NO_LABEL, BatchRecord, Configuration, merged
from rampserve.control.risk import served_scale
from rampserve.runtime.latency import LatencyProfile

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


def test_accuracy_window_slides_and_keeps_totals():
    window = AccuracyWindow(4)
    window.add(np.array([True, False, False, False, False]))  # whether each answer is wrong
    assert window.accuracy == 1.0 and window.cumulative == 0.8
    window.add(np.array([True]))
    assert window.accuracy == 0.75
    window.clear()
    assert window.accuracy == 1.0 and window.served == 6


def test_ramp_history_keeps_the_newest_rows_in_order():
    history = RampHistory(("a",), capacity=5)
    config = Configuration(0, ("a",), (0.0,))
    for start in range(0, 12, 3):
        errors = np.arange(start, start + 3, dtype=float)[:, None]
        history.add(record(config, np.zeros((3, 1), int), errors, np.zeros(3, int)))
    _, errors, batch = history.latest()
    np.testing.assert_array_equal(errors[:, 0], [7, 8, 9, 10, 11])
    assert history.latest(2)[1][:, 0].tolist() == [10, 11] and (batch == 3).all()


def test_initial_deployment_spreads_the_most_ramps_the_budget_allows():
    costs = CostModel(profile(ramp_ms=0.006))  # 0.6% each: three fit in 2%
    sites = initial_sites(costs, 0.02, 1)
    assert len(sites) == 3 and fits_budget(costs, sites, 0.02, 1)
    assert sites == tuple(SITES[p] for p in evenly_spaced(8, 3)) == ("s2", "s4", "s5")
    assert initial_sites(CostModel(profile(ramp_ms=0.05)), 0.02, 1) == ()


def test_utilities_charge_ramps_only_to_inputs_that_pass_them():
    costs = CostModel(profile(ramp_ms=0.01, full_ms=0.9))  # segments of 0.1 ms
    sites = ("s1", "s5")
    errors = np.array([[0.0, 0.9], [0.9, 0.0], [0.9, 0.9]])
    utility, exits = ramp_utilities(costs, sites, np.array([0.5, 0.5]), errors, np.ones(3, dtype=np.int64))
    assert exits.tolist() == [1, 1]
    # s1: input 0 leaves at 0.2 + 0.01 ms (saves 0.69), inputs 1 and 2 pay its 0.01 ms
    # s5: input 1 leaves at 0.6 + 0.02 ms (saves 0.28), input 2 pays its 0.01 ms
    np.testing.assert_allclose(utility, [0.69 - 0.02, 0.28 - 0.01])


def negative_late_ramp(late: str, late_exits: int) -> tuple[CostModel, tuple[str, ...], np.ndarray]:
    """s1 exits a third of 60 inputs; `late` exits `late_exits` of the 40 that reach it and costs the rest."""
    costs = CostModel(profile(ramp_ms=0.01, full_ms=0.9))  # segments of 0.1 ms
    sites = ("s1", late)
    errors = np.array([[0.0, 0.9], [0.9, 0.9], [0.9, 0.9]] * 20)
    errors[1:1 + 3 * late_exits:3, 1] = 0.0
    assert ramp_utilities(costs, sites, np.array([0.5, 0.5]), errors, np.ones(60, dtype=np.int64))[0][1] < 0
    return costs, sites, errors


def test_negative_ramp_is_replaced_by_a_trial_at_threshold_zero_in_the_middle_of_its_interval():
    costs, sites, errors = negative_late_ramp("s7", late_exits=2)
    adjustment = adjust_ramps(costs, sites, np.array([0.5, 0.5]), errors, np.ones(60, dtype=np.int64),
                              budget=0.05, budget_batch=1, retune=None, start={})
    # the interval from the last positive ramp s1 to the dropped s7 has its middle at s4; its exits are bounded
    # by s7's two: 2 x 0.39 ms saved against 38 x 0.01 ms
    assert adjustment.sites == ("s1", "s4") and adjustment.thresholds == (0.5, 0.0)


def test_the_range_after_the_last_deactivation_is_explored_too():
    costs, sites, errors = negative_late_ramp("s5", late_exits=1)
    adjustment = adjust_ramps(costs, sites, np.array([0.5, 0.5]), errors, np.ones(60, dtype=np.int64),
                              budget=0.05, budget_batch=1, retune=None, start={"s6": 0.2})
    # (s5, end) has no deactivated ramp to bound it: every input reaching s6 might exit, which beats s3's bound
    assert adjustment.sites == ("s1", "s6") and adjustment.thresholds == (0.5, 0.2)


def test_all_positive_with_budget_left_adds_a_ramp_before_the_best_one():
    costs = CostModel(profile(ramp_ms=0.01, full_ms=0.9))
    errors = np.array([[0.0, 0.9], [0.9, 0.0], [0.9, 0.0], [0.9, 0.0]])  # s5 saves the most
    adjustment = adjust_ramps(costs, ("s1", "s5"), np.array([0.5, 0.5]), errors, np.ones(4, dtype=np.int64),
                              budget=0.05, budget_batch=1, retune=None, start={})
    assert adjustment.sites == ("s1", "s4", "s5") and adjustment.thresholds == (0.5, 0.0, 0.5)
    # without budget for a third ramp the weakest moves one site earlier instead
    moved = adjust_ramps(costs, ("s1", "s5"), np.array([0.5, 0.5]), errors, np.ones(4, dtype=np.int64),
                         budget=0.025, budget_batch=1, retune=None, start={})
    assert moved.sites == ("s0", "s5") and moved.thresholds == (0.0, 0.5)


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
    batches = random_batches(seed=1, count=300)
    settings_ = ControllerSettings(ramp_budget=0.03)
    first = drive(Controller(profile(ramp_ms=0.005), settings_), batches)
    second = drive(Controller(profile(ramp_ms=0.005), settings_), batches)
    assert first == second and len(first) > 3


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.001, 0.03), st.floats(0.0, 0.06), st.sampled_from([1, 4]))
def test_ramp_adjustment_never_exceeds_the_budget(seed, ramp_ms, budget, batch):
    controller = Controller(profile(ramp_ms=ramp_ms), ControllerSettings(ramp_budget=budget, history=128,
                                                                         adjust_every=32, budget_batch_size=batch))
    drive(controller, random_batches(seed, count=150, size=batch))
    for decision in controller.decisions:
        assert fits_budget(controller.costs, decision.configuration.sites, budget, batch)


def test_disagreements_scale_the_thresholds_down_and_agreement_scales_them_back():
    settings_ = ControllerSettings(initial=("s3",), window=16, ramp_adjustment=False, adjust_every=1024)
    controller = Controller(profile(), settings_)
    final = np.zeros(4, dtype=int)
    confident_right = (np.zeros((4, 8), int), np.full((4, 8), 0.1), final)
    drive(controller, [confident_right] * 300)  # the periodic retune at 1,024 inputs certifies a threshold
    certified = controller.configuration()
    assert certified.version == 1 and certified.thresholds[0] > 0.15
    # s3 exits and is wrong on 16 inputs: rolling risk control scales the certified threshold down at once
    confident_wrong = (np.ones((16, 8), int), np.full((16, 8), 0.15), np.zeros(16, dtype=int))
    drive(controller, [confident_wrong])
    lowered = controller.configuration()
    assert lowered.version == 2 and "risk control" in controller.decisions[-1].reason
    assert lowered.thresholds[0] < 0.15  # the wrong answers (error 0.15) no longer exit
    assert lowered.thresholds[0] == pytest.approx(served_scale(controller.scale) * certified.thresholds[0])
    assert controller.status()["risk_scale"] < 1.0
    # enough agreement brings the scale back to the thresholds tuning chose
    drive(controller, [confident_right] * 1000)
    assert controller.status()["risk_scale"] == 1.0
    assert controller.configuration().thresholds[0] > 0.15


def test_a_ramp_keeps_threshold_zero_until_its_bound_can_be_met():
    """The bound lets nothing exit before a ramp has as many right answers as certify the constraint."""
    controller = Controller(profile(), ControllerSettings(initial=("s3",), ramp_adjustment=False))
    # half the inputs choose thresholds, the other half must certify them
    needed = 2 * smallest_certifying(controller.settings.accuracy_constraint, controller.look_delta())
    assert needed > controller.settings.min_ramp_outputs
    right = (np.zeros((1, 8), int), np.full((1, 8), 0.1), np.zeros(1, dtype=int))
    drive(controller, [right] * (needed - 1))  # every one right and confident
    assert controller.tuned_thresholds().tolist() == [0.0]
    assert controller.configuration().thresholds == (0.0,)
    drive(controller, [right])
    assert controller.tuned_thresholds()[0] > 0.1


def test_a_new_active_set_keeps_the_history_of_the_ramps_it_keeps():
    history = RampHistory(("a", "b"), capacity=4)
    config = Configuration(0, ("a", "b"), (0.0, 0.0))
    history.add(record(config, np.array([[1, 2], [3, 4]]), np.array([[0.1, 0.2], [0.3, 0.4]]), np.array([1, 4])))
    moved = history.for_sites(("b", "c"))
    correct, errors, _ = moved.latest()
    np.testing.assert_array_equal(errors, [[0.2, np.inf], [0.4, np.inf]])
    np.testing.assert_array_equal(correct, [[False, False], [True, False]])


def test_records_of_a_replaced_active_set_are_not_learned_from():
    controller = Controller(profile(), ControllerSettings(initial=("s3",)))
    stale = Configuration(0, ("s1",), (0.0,))
    controller.observe(record(stale, np.zeros((2, 1), int), np.zeros((2, 1)), np.zeros(2, int)))
    assert controller.history.size == 0 and controller.window.served == 2


def test_settings_are_validated():
    with pytest.raises(ValueError, match="history"):
        ControllerSettings(history=64, adjust_every=128)
    with pytest.raises(ValueError, match="accuracy constraint"):
        ControllerSettings(accuracy_constraint=1.5)
    with pytest.raises(ValueError, match="not sites"):
        Controller(profile(), ControllerSettings(initial=("nope",)))


def test_a_lone_ramp_that_pays_off_explores_the_next_site_and_returns_to_the_better_one():
    costs = CostModel(profile(ramp_ms=0.01, full_ms=0.9))
    errors = np.array([[0.0], [0.9]] * 10)  # s3 exits half the inputs: it pays off
    one_ramp = dict(budget=0.015, budget_batch=1, retune=None, start={})
    trial = adjust_ramps(costs, ("s3",), np.array([0.5]), errors, np.ones(20, dtype=np.int64), **one_ramp)
    assert trial.sites == ("s4",) and trial.thresholds == (0.0,)
    # s4 was measured earlier, tuned, and saved more per input than s3 does now: go back to it as it was
    back = adjust_ramps(costs, ("s3",), np.array([0.5]), errors, np.ones(20, dtype=np.int64), **one_ramp,
                        known={("s4",): (1.0, (0.3,))})
    assert back.sites == ("s4",) and back.thresholds == (0.3,)
    # a later site measured to save less is not probed again
    assert adjust_ramps(costs, ("s3",), np.array([0.5]), errors, np.ones(20, dtype=np.int64), **one_ramp,
                        known={("s4",): (0.01, (0.3,))}) is None


def test_a_new_ramp_is_judged_on_the_inputs_that_reached_it():
    """Past inputs never saw a ramp added later; counting them would dilute its mistakes."""
    settings_ = ControllerSettings(initial=("s5", "s6"), history=4096, ramp_adjustment=False)
    controller = Controller(profile(), settings_)
    final = np.zeros(8, dtype=int)
    before = RampHistory(("s6",), 4096)  # 3,584 inputs served while s6 was the only ramp
    for _ in range(448):
        before.add(record(Configuration(0, ("s6",), (0.1,)), np.zeros((8, 1), int), np.full((8, 1), 0.01), final))
    controller.history = before.for_sites(("s5", "s6"))
    slip = np.zeros((8, 8), int)
    slip[0, 5] = 1  # s5 is confidently wrong on 24 of its first 512 inputs
    sure = (np.zeros((8, 8), int), np.full((8, 8), 0.01), final)
    drive(controller, [(slip, np.full((8, 8), 0.01), final)] * 24 + [sure] * 40)
    # 24 mistakes are 0.6% of the 4,096 inputs kept (within the bound), but 4.7% of the 512 that reached s5
    s5, s6 = controller.tuned_thresholds()
    assert s5 == 0.0 and s6 > 0.01  # s6 alone, whose confident answers are always right


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
                                                           ramp_adjustment=False, adjust_every=1024))
        for score, ok in zip(scores[:1000], right[:1000]):  # before the first periodic retune (1,024 inputs)
            control.observe(record(control.configuration(), np.array([[1 if ok else 2]]), np.array([[score]]),
                                   np.array([1])))
        before = control.configuration()
        if fail:
            served, history = control.window.served, control.history.size
            failed = BatchRecord(before.version, before.sites, np.ones((3, 1), int), np.zeros((3, 1)),
                                 np.full(3, NO_LABEL), np.zeros(3, int), unverified=True)
            tightened = control.observe(failed)  # rolling risk control counts them as disagreements at once
            assert tightened is None or tightened.thresholds[0] < before.thresholds[0]
            assert control.unverified == 3 and control.window.served == served + 3
            assert control.history.size == history  # nothing to learn from answers with no final label
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
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.booleans()), min_size=1, max_size=12))
def test_merged_records_keep_every_input_in_order_with_its_batch_size(batches) -> None:
    """Joining consecutive records of one configuration and kind loses no input, keeps their order, and each input
    the size of the batch it was served in; records of another configuration or kind are never joined."""
    rng = np.random.default_rng(0)
    configs = [Configuration(v, ("a", "b")[:v % 2 + 1], (0.1, 0.2)[:v % 2 + 1]) for v in range(3)]
    records = []
    for version, size, unverified in batches:
        config = configs[version]
        errors = rng.random((size, len(config.sites)))
        records.append(BatchRecord(config.version, config.sites, rng.integers(0, 3, (size, len(config.sites))),
                                   errors, rng.integers(0, 3, size), config.exits(errors), unverified=unverified))
    joined = merged(records)
    assert np.array_equal(np.concatenate([r.final for r in joined]), np.concatenate([r.final for r in records]))
    assert np.array_equal(np.concatenate([r.batch_sizes() for r in joined]),
                          np.concatenate([np.full(r.inputs, r.inputs) for r in records]))
    assert len(joined) == 1 + sum((a.version, a.unverified) != (b.version, b.unverified)
                                  for a, b in zip(records, records[1:]))
    for record in joined:
        assert record.labels.shape == (record.inputs, len(record.sites))
