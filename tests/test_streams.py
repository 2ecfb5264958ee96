
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.workloads.fashion_mnist import load_fashion_mnist
from rampserve.workloads.rotten_tomatoes import load_rotten_tomatoes, rt_movie_split
from rampserve.workloads.streams import DAY_LENGTH, FMNIST_PHASE_LENGTH, Stream, get_stream, stream_names

SHORT = 30_000  # long enough for several phases and a full day/night cycle


@pytest.fixture(scope="module")
def fmnist() -> Stream:
    return get_stream("fmnist-drift", length=SHORT, seed=3)


@pytest.fixture(scope="module")
def rt() -> Stream:
    return get_stream("rt-drift", length=SHORT, seed=3)


@pytest.fixture(scope="module", params=stream_names())
def full_length(request: pytest.FixtureRequest) -> Stream:
    return get_stream(request.param, length=120_000)


def _as_list(items: np.ndarray | list[str]) -> list:
    return [item.tolist() if isinstance(item, np.ndarray) else item for item in items]


def test_registry_names_and_unknown_name():
    assert stream_names() == ["fmnist-drift", "rt-drift"]
    with pytest.raises(ValueError, match=r"unknown stream 'nope'.*fmnist-drift, rt-drift"):
        get_stream("nope")


@pytest.mark.parametrize("bootstrap_length", [0, SHORT])
def test_bootstrap_length_must_leave_both_parts(bootstrap_length: int):
    with pytest.raises(ValueError, match="bootstrap_length"):
        get_stream("rt-drift", length=SHORT, bootstrap_length=bootstrap_length)


@pytest.mark.parametrize("name", stream_names())
def test_same_seed_same_stream_other_seed_differs(name: str):
    first, again, other = (get_stream(name, length=5_000, seed=seed) for seed in (1, 1, 2))
    assert first == again
    np.testing.assert_array_equal(first.base_ids(0, 5_000), again.base_ids(0, 5_000))
    assert _as_list(first.items(4_000, 4_100)) == _as_list(again.items(4_000, 4_100))
    assert not np.array_equal(first.base_ids(0, 5_000), other.base_ids(0, 5_000))
    assert _as_list(first.items(4_000, 4_100)) != _as_list(other.items(4_000, 4_100))


@settings(max_examples=25, deadline=None)
@given(data=st.data(), name=st.sampled_from(["fmnist-drift", "rt-drift"]))
def test_slice_equals_cut_of_larger_slice(fmnist: Stream, rt: Stream, data: st.DataObject, name: str):
    stream = fmnist if name == "fmnist-drift" else rt
    outer_start = data.draw(st.integers(0, stream.length - 1))
    outer_stop = data.draw(st.integers(outer_start, min(stream.length, outer_start + 300)))
    start = data.draw(st.integers(outer_start, outer_stop))
    stop = data.draw(st.integers(start, outer_stop))
    cut = slice(start - outer_start, stop - outer_start)
    assert _as_list(stream.items(start, stop)) == _as_list(stream.items(outer_start, outer_stop)[cut])
    for part in (stream.labels, stream.base_ids, stream.phase):
        np.testing.assert_array_equal(part(start, stop), part(outer_start, outer_stop)[cut])


def test_slices_outside_the_stream_are_rejected(rt: Stream):
    for start, stop in [(-1, 5), (5, 4), (0, rt.length + 1)]:
        with pytest.raises(IndexError):
            rt.base_ids(start, stop)


def test_long_streams_bootstrap_first_tenth_and_disjoint_from_evaluation(full_length: Stream):
    stream = full_length
    assert stream.length == 120_000
    assert stream.bootstrap == range(0, 12_000)
    assert stream.evaluation == range(12_000, 120_000)
    bootstrap = set(stream.base_ids(stream.bootstrap.start, stream.bootstrap.stop).tolist())
    evaluation = set(stream.base_ids(stream.evaluation.start, stream.evaluation.stop).tolist())
    assert bootstrap and evaluation and not bootstrap & evaluation
    assert np.all(np.diff(stream.phase(0, stream.length)) >= 0)
    assert len(stream.items(119_000, 120_000)) == 1_000


def test_custom_bootstrap_length():
    stream = get_stream("fmnist-drift", length=SHORT, bootstrap_length=1_000)
    assert stream.bootstrap == range(0, 1_000) and stream.evaluation == range(1_000, SHORT)


def test_fmnist_labels_and_images_come_from_the_test_split(fmnist: Stream):
    images, labels = load_fashion_mnist("test")
    ids = fmnist.base_ids(0, 500)
    np.testing.assert_array_equal(fmnist.labels(0, 500), labels[ids])
    items = fmnist.items(0, 500)
    assert items.dtype == np.uint8 and items.shape == (500, 28, 28)
    # Around midday (position 0) only faint noise separates an item from its base image.
    assert np.abs(items.astype(float) - images[ids]).mean() < 3


def test_fmnist_phases_favour_different_classes(fmnist: Stream):
    labels, phases = fmnist.labels(0, fmnist.length), fmnist.phase(0, fmnist.length)
    assert np.array_equal(phases, np.arange(fmnist.length) // FMNIST_PHASE_LENGTH)
    histograms = np.stack([np.bincount(labels[phases == p], minlength=10) for p in np.unique(phases)])
    shares = histograms / histograms.sum(axis=1, keepdims=True)
    assert np.all(np.sort(shares, axis=1)[:, -3:].sum(axis=1) > 0.7)  # a few classes dominate each phase
    total_variation = np.abs(shares[:, None, :] - shares[None, :, :]).sum(axis=2) / 2
    assert total_variation.max() > 0.4


def test_fmnist_lighting_drifts_over_the_day(fmnist: Stream):
    midday = fmnist.items(DAY_LENGTH - 250, DAY_LENGTH + 250).astype(float)
    midnight = fmnist.items(DAY_LENGTH // 2 - 250, DAY_LENGTH // 2 + 250).astype(float)
    # Highlights dim as contrast falls, and the raised black level plus noise lift the background off zero.
    assert np.percentile(midday, 95, axis=(1, 2)).mean() > np.percentile(midnight, 95, axis=(1, 2)).mean() + 40
    assert (midday == 0).mean() > (midnight == 0).mean() + 0.1


def test_rt_items_labels_and_pool(rt: Stream):
    corpus = load_rotten_tomatoes()
    ids = rt.base_ids(0, rt.length)
    assert set(ids.tolist()) <= set(rt_movie_split()["stream"].tolist())
    assert rt.items(100, 200) == [corpus.texts[i] for i in ids[100:200]]
    np.testing.assert_array_equal(rt.labels(0, rt.length), corpus.labels[ids])


def test_rt_plays_each_movie_whole_and_consecutively(rt: Stream):
    corpus = load_rotten_tomatoes()
    movies = np.asarray(corpus.movies)
    pool_rows = {movie: sorted(np.flatnonzero(movies == movie).tolist()) for movie in set(movies[rt_movie_split()["stream"]])}
    for part in (rt.bootstrap, rt.evaluation):
        ids = rt.base_ids(part.start, part.stop)
        run_starts = np.flatnonzero(np.r_[True, movies[ids[1:]] != movies[ids[:-1]]])
        runs = np.split(ids, run_starts[1:])
        assert len(runs) > 50
        for run in runs[:-1]:  # the last run may be cut short by the end of the part
            assert sorted(run.tolist()) == pool_rows[movies[run[0]]]


def test_rt_phases_alternate_positive_and_negative_movies(rt: Stream):
    part = rt.evaluation
    labels, phases = rt.labels(part.start, part.stop), rt.phase(part.start, part.stop)
    fresh_share = np.bincount(phases, weights=labels)[phases[0]:-1] / np.bincount(phases)[phases[0]:-1]
    assert len(fresh_share) >= 6
    assert np.all(np.abs(np.diff(fresh_share)) > 0.25)
