"""`bench live` replays a round's measured requests in slices, the two systems taking turns after both warm-ups,
so that both meet the machine as it is within seconds of each other: the order of the turns, the slices, a replay
joined from its slices, and a round against two real servers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rampserve.bench.harness import ServerProcess, rampserve_serve, run_loadgen
from rampserve.bench.live import (
    LiveSettings,
    ReplaySchedule,
    replay_round,
    slice_bounds,
    slice_turns,
)
from rampserve.bench.loadgen import Job, LoadResult


@given(st.integers(0, 7), st.integers(1, 12))
def test_each_slice_is_replayed_by_both_systems_the_first_alternating_abba(round_index, slices):
    turns = slice_turns(round_index, slices)
    assert len(turns) == 2 * slices
    for k in range(slices):
        pair = turns[2 * k:2 * k + 2]
        assert [s for s, _ in pair] == [k, k] and {v for _, v in pair} == {True, False}
        if k:  # the system that closed the last slice opens this one: V R R V ...
            assert pair[0][1] == turns[2 * k - 1][1]
    assert turns[0][1] == (round_index % 2 == 0)  # rounds alternate which system goes first


@given(st.integers(1, 2000), st.integers(1, 12))
def test_slices_cover_the_measured_requests_in_order_none_empty(requests, slices):
    bounds = slice_bounds(requests, slices)
    assert len(bounds) == min(slices, requests)
    assert bounds[0][0] == 0 and bounds[-1][1] == requests
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


SITES = ("layer 1", "layer 2", "layer 3")


def _part(rows: int, start_label: int, sites: tuple[str, ...] = (), errors: dict | None = None) -> LoadResult:
    """A slice's result whose row i exited at `sites[i % (len(sites) + 1)]`, the last turn at the final layer."""
    times = np.arange(rows, dtype=np.float64)
    exits = np.arange(rows) % (len(sites) + 1)
    exit_site = np.where(exits < len(sites), exits, -1)
    return LoadResult(scheduled_ms=times, sent_ms=times + 0.1, done_ms=times + 2.0, status=np.full(rows, 200),
                      label=np.arange(start_label, start_label + rows), early=exit_site >= 0,
                      exit_site=exit_site, sites=sites, errors=errors or {}, status_before={"at": start_label},
                      status_after={"at": start_label + rows}, trace_ms=np.stack([times, times + 1.0], axis=1))


@given(st.lists(st.tuples(st.integers(1, 6), st.permutations(SITES), st.integers(0, 3)), min_size=1, max_size=5))
def test_a_replay_joined_from_its_slices_keeps_every_row_on_the_schedules_clock(slices):
    """Each slice names the exit sites its answers met, in the order it met them: joined, every row keeps its
    site."""
    sizes = [n for n, _, _ in slices]
    starts = np.cumsum([0, *sizes[:-1]])
    offsets = [100.0 * k for k in range(len(sizes))]
    parts = [_part(n, int(s), tuple(order[:met]), errors={"timed out": 1})
             for (n, order, met), s in zip(slices, starts)]
    joined = LoadResult.joined(parts, offsets)
    named = [part.sites[e] if e >= 0 else None for part in parts for e in part.exit_site]
    assert [joined.sites[e] if e >= 0 else None for e in joined.exit_site] == named
    assert len(set(joined.sites)) == len(joined.sites)
    for name in ("status", "label", "early", "exit_site"):  # each column keeps its kind (`early` masks rows)
        assert getattr(joined, name).dtype == getattr(parts[0], name).dtype
    assert np.array_equal(joined.label, np.arange(sum(sizes)))  # every row, in slice order
    expected = np.concatenate([np.arange(n) + offset for n, offset in zip(sizes, offsets)])
    assert np.array_equal(joined.scheduled_ms, expected) and np.allclose(joined.latency_ms, 2.0)
    assert np.array_equal(joined.trace_ms[:, 0], expected)
    assert joined.errors == {"timed out": len(sizes)}
    assert joined.status_before == parts[0].status_before and joined.status_after == parts[-1].status_after
    assert joined.wall_origin_s is None


def test_slices_with_unmatched_offsets_are_refused():
    with pytest.raises(ValueError, match="2 slices with 1 offsets"):
        LoadResult.joined([_part(2, 0), _part(2, 2)], [0.0])


def test_a_round_replays_both_real_servers_in_turns_after_both_warm_ups(resnet_bundle, fmnist_feeds, tmp_path):
    """Two `rampserve serve` processes of the small ResNet, vanilla and managed: both warm up before any measured
    slice, the slices go in turns, and each system's joined replay answers every measured request, in order, at
    the schedule's times."""
    settings = LiveSettings(replay_slices=2)
    measured, warm = 12, 5
    schedule = ReplaySchedule(0.2, 50.0, np.arange(measured) * 20.0, np.arange(warm) * 20.0)
    requests = [{"x": fmnist_feeds[i % len(fmnist_feeds)][None]} for i in range(warm + measured)]
    calls: list[str] = []

    def start(vanilla: bool) -> ServerProcess:
        return ServerProcess(rampserve_serve(str(resnet_bundle), 50.0, 1, 0.0, vanilla),
                             tmp_path / f"{vanilla}.log", 120.0)

    def run(server: ServerProcess, part, label, expected_s, arrivals, warmup) -> LoadResult:
        calls.append(label)
        job = Job(server.infer_url(resnet_bundle.name, "http"), (("x", "FP32"),), "label", server.url("/status"),
                  lean=True, cpu_pid=server.pid)
        return run_loadgen(job, part, tmp_path, label, expected_s, False, arrivals, warmup)

    runs, outcomes, probed = replay_round(settings, schedule, requests, 1, "round 2", False, start, run, None)
    assert calls[:2] == ["rampserve warm-up at round 2", "vanilla warm-up at round 2"]
    assert calls[2:] == ["rampserve at round 2 slice 1", "vanilla at round 2 slice 1", "vanilla at round 2 slice 2",
                         "rampserve at round 2 slice 2"]
    for result in runs.values():
        assert result.ok.all() and len(result.label) == measured, result.errors
        assert np.array_equal(result.scheduled_ms, schedule.arrivals_ms)
        assert (result.sent_ms >= result.scheduled_ms).all()
    # the same requests: the managed server's final answers are the original model's
    final = ~runs["rampserve"].early
    assert np.array_equal(runs["rampserve"].label[final], runs["vanilla"].label[final])
    assert probed == {} and all(o["exit_code"] is not None and not o["killed"] for o in outcomes.values())
