"""Race deciders (seed 004): properties over any arrivals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rampserve.control.deciders import (
    Candidate,
    best_confidence,
    confidence_weighted,
    consensus,
    first,
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
