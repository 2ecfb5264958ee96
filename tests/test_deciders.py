"""Race deciders (seed 004): properties over any arrivals, and the learned decider over any feedback."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rampserve.control.deciders import (
    CONFIDENCE_EDGES,
    Candidate,
    Trust,
    best_confidence,
    confidence_bucket,
    confidence_weighted,
    consensus,
    first,
    learn,
    learned,
    make_decider,
)

candidates = st.lists(
    st.builds(Candidate, model=st.sampled_from("abcdefg"), label=st.integers(0, 3),
              confidence=st.floats(0, 1), latency_ms=st.floats(0, 100)),
    min_size=0, max_size=7, unique_by=lambda c: c.model)


@given(candidates, st.booleans())
def test_first_takes_the_earliest_arrival_at_once(arrived, final) -> None:
    decision = first(arrived, 7, final)
    if arrived:
        assert (decision.label, decision.models) == (arrived[0].label, (arrived[0].model,))
    else:
        assert decision is None


@given(candidates, st.integers(1, 7), st.booleans())
def test_consensus_decides_exactly_when_a_quorum_agrees(arrived, quorum, final) -> None:
    decision = consensus(arrived, 7, final, quorum=quorum)
    counts = {label: sum(c.label == label for c in arrived) for label in {c.label for c in arrived}}
    assert (decision is not None) == any(n >= quorum for n in counts.values())
    if decision is not None:
        assert counts[decision.label] == max(counts.values())
        assert decision.confidence == pytest.approx(counts[decision.label] / 7)
        assert sorted(decision.models) == sorted(c.model for c in arrived if c.label == decision.label)


@given(candidates)
def test_best_confidence_waits_for_the_end_then_takes_the_most_confident(arrived) -> None:
    assert best_confidence(arrived, 7, False) is None
    decision = best_confidence(arrived, 7, True)
    if arrived:
        assert decision.confidence == max(c.confidence for c in arrived)
        assert decision.label in {c.label for c in arrived if c.confidence == decision.confidence}


@given(candidates)
def test_best_confidence_decides_early_once_one_is_confident_enough(arrived) -> None:
    decision = best_confidence(arrived, 7, False, enough=0.9)
    assert (decision is not None) == any(c.confidence >= 0.9 for c in arrived)


@given(candidates)
def test_confidence_weighted_label_has_the_most_summed_confidence(arrived) -> None:
    decision = confidence_weighted(arrived, 7, True)
    if not arrived:
        assert decision is None
        return
    totals = {}
    for c in arrived:
        totals[c.label] = totals.get(c.label, 0.0) + c.confidence
    assert totals[decision.label] == pytest.approx(max(totals.values()))
    # Models that did not answer count as no confidence at all.
    assert decision.confidence == pytest.approx(totals[decision.label] / 7)
    assert decision.confidence <= len(arrived) / 7 + 1e-12


def test_a_users_decider_loads_by_module_and_function_and_bad_names_are_explained() -> None:
    decider = make_decider("model_factories:largest_label")
    arrived = [Candidate("a", 1, 0.5, 1.0), Candidate("b", 2, 0.4, 3.0)]
    assert decider(arrived, 2, True).models == ("b",)
    with pytest.raises(ValueError, match="unknown decider"):
        make_decider("majority")
    with pytest.raises(ValueError, match="cannot be loaded"):
        make_decider("model_factories:no_such_decider")



# --- the learned decider -------------------------------------------------------------------------------------

MODELS = tuple("abcdefg")
# A confidence inside each bucket, so that a feedback history can cover every bucket of every model.
BUCKET_MIDDLES = [(low + high) / 2 for low, high in zip((0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0))]

answers_of = st.dictionaries(st.sampled_from(MODELS), st.tuples(st.integers(0, 5), st.floats(0, 1)), max_size=7)
feedback = st.lists(st.tuples(answers_of, st.integers(0, 5)), max_size=30)


def history(rounds: list[tuple[dict, int]]) -> Trust:
    trust = Trust.fresh(MODELS)
    for answers, label in rounds:
        trust = learn(trust, answers, label)
    return trust


def majority(arrived: list[Candidate]) -> int:
    """The reference: the most votes; ties to the larger summed confidence, then to the label given first."""
    labels = list(dict.fromkeys(c.label for c in arrived))
    votes = {label: sum(c.label == label for c in arrived) for label in labels}
    backing = {label: sum(c.confidence for c in arrived if c.label == label) for label in labels}
    return max(labels, key=lambda label: (votes[label], backing[label], -labels.index(label)))


@given(candidates, st.booleans(), st.integers(2, 50))
def test_learned_is_a_majority_vote_before_any_feedback(arrived, no_trust, classes) -> None:
    trust = None if no_trust else replace(Trust.fresh(MODELS), classes=classes)
    decision = learned(arrived, 7, True, trust)
    if not arrived:
        assert decision is None
        return
    assert decision.label == majority(arrived)
    assert sorted(decision.models) == sorted(c.model for c in arrived if c.label == decision.label)
    early = learned(arrived, 7, False, trust)
    assert early is None or early.label == decision.label


def test_the_tie_rule_of_the_learned_decider() -> None:
    one_each = [Candidate("a", 4, 0.6, 1.0), Candidate("b", 2, 0.9, 2.0), Candidate("c", 7, 0.7, 3.0)]
    assert learned(one_each, 3, True).label == 2  # equal votes: the larger summed confidence
    pairs = [Candidate("a", 4, 0.5, 1.0), Candidate("b", 2, 0.5, 2.0), Candidate("c", 2, 0.5, 3.0),
             Candidate("d", 4, 0.5, 4.0)]
    assert learned(pairs, 4, True).label == 4  # and equal confidence too: the label given first
    assert learned(pairs[:3], 4, True).label == 2  # more votes beat a label given earlier


@given(candidates, feedback, st.booleans())
def test_learned_never_returns_a_label_no_model_gave(arrived, rounds, final) -> None:
    decision = learned(arrived, 7, final, history(rounds))
    if decision is None:
        assert not arrived or not final  # with any answer in hand, the end of the race always decides
        return
    assert decision.label in {c.label for c in arrived}
    assert sorted(decision.models) == sorted(c.model for c in arrived if c.label == decision.label)
    assert 0.0 <= decision.confidence <= 1.0


@given(st.lists(st.builds(Candidate, model=st.sampled_from(MODELS), label=st.integers(0, 6),
                          confidence=st.floats(0, 1), latency_ms=st.floats(0, 100)),
                min_size=1, max_size=7, unique_by=lambda c: c.model),
       st.integers(1, 7), feedback)
def test_an_early_decision_is_the_one_the_whole_race_gives(everyone, arrived_count, rounds) -> None:
    """Deciding before every model has answered costs nothing: whatever the others answer, the label stays."""
    trust = history(rounds)
    early = learned(everyone[:arrived_count], len(everyone), False, trust)
    if early is not None:
        assert learned(everyone, len(everyone), True, trust).label == early.label


@given(candidates.filter(bool), feedback, st.integers(0, 5))
def test_models_that_did_not_answer_leave_the_decision_to_those_that_did(arrived, rounds, absent) -> None:
    """A late or failed model costs its evidence and nothing else: the decision is the one the answers in hand
    give, however many models the race asked."""
    trust = history(rounds)
    decision = learned(arrived, len(arrived) + absent, True, trust)
    assert decision == learned(arrived, len(arrived), True, trust)
    assert set(decision.models) <= {c.model for c in arrived}


def test_learned_follows_the_model_that_feedback_shows_always_right() -> None:
    trust = Trust.fresh(("oracle", "x", "y"))
    for i in range(20 * len(BUCKET_MIDDLES)):  # each model wrong or right in every bucket, 20 times
        truth = i % 6
        wrong = (truth + 1 + i % 2) % 6  # x and y often give the same wrong label
        trust = learn(trust, {"oracle": (truth, BUCKET_MIDDLES[i % 10]),
                              "x": ((truth + 1) % 6, BUCKET_MIDDLES[i // 3 % 10]),
                              "y": (wrong, BUCKET_MIDDLES[i // 7 % 10])}, truth)

    @given(st.integers(0, 5), st.floats(0, 1), st.lists(st.tuples(st.integers(0, 5), st.floats(0, 1)), min_size=0,
                                                        max_size=2), st.permutations(range(3)))
    def follows(label, confidence, others, order) -> None:
        arrived = [Candidate("oracle", label, confidence, 1.0)]
        arrived += [Candidate(name, given, c, 2.0) for name, (given, c) in zip(("x", "y"), others)]
        arrived = [arrived[k] for k in order if k < len(arrived)]
        assert learned(arrived, 3, True, trust).label == label
        # before the feedback, two that agree outvote it
        if len(others) == 2 and others[0][0] == others[1][0] != label:
            assert learned(arrived, 3, True).label == others[0][0]

    follows()


@given(feedback)
def test_trust_round_trips_through_json(rounds) -> None:
    trust = history(rounds)
    back = Trust.from_json(json.loads(json.dumps(trust.to_json())))
    assert back.to_json() == trust.to_json() and back.models == trust.models
    np.testing.assert_array_equal(back.weights()[0], trust.weights()[0])


def test_bad_trust_records_are_refused() -> None:
    record = Trust.fresh(("a", "b")).to_json()
    with pytest.raises(ValueError, match="buckets per model"):
        Trust.from_json({**record, "scored": [[0.0] * 3] * 2})
    with pytest.raises(ValueError, match="right <= scored"):
        Trust.from_json({**record, "right": [[1.0] * (len(CONFIDENCE_EDGES) + 1)] * 2})


def test_old_evidence_fades_so_a_model_that_turns_bad_loses_trust() -> None:
    trust = Trust.fresh(("turns", "steady"))
    middle = BUCKET_MIDDLES[-1]
    for i in range(1000):
        trust = learn(trust, {"turns": (1 if i < 500 else 2, middle), "steady": (1, middle)}, 1)
    accuracy = trust.accuracies()[0][:, confidence_bucket(middle)]
    assert accuracy[0] < 0.5 < accuracy[1]  # without fading, 500 right and 500 wrong would stay at a half


def test_the_learned_decider_is_built_in() -> None:
    assert make_decider("learned") is learned
