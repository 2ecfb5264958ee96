"""The engine a model is prepared and served on: the choice from a timing table, and a model served on ONNX
Runtime answering as the original torch model does."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rampserve.bundle_format.manifest import read_manifest
from rampserve.cli import app
from rampserve.runtime.bundle import load_bundle, save_bundle
from rampserve.runtime.engines import (
    CHOSEN_BY_TIMING,
    CHOSEN_BY_USER,
    ENGINES,
    EngineChoice,
    EngineTiming,
    check_engine,
    choose_engine,
)
from rampserve.runtime.prepare import prepare
from rampserve.runtime.sources import ModelSource


@st.composite
def timings(draw) -> list[EngineTiming]:
    def timing(engine: str, batch_size: int) -> EngineTiming:
        median = draw(st.sampled_from([0.1, 0.2, 0.25, 0.5, 1.0]))
        return EngineTiming(engine, batch_size, median, median - draw(st.sampled_from([0.0, 0.05])),
                            median + draw(st.sampled_from([0.0, 0.05, 0.2, 1.0])))

    return draw(st.lists(st.builds(timing, st.sampled_from([*ENGINES, "other"]), st.sampled_from([1, 16])),
                         min_size=1, max_size=12))


@settings(max_examples=500)
@given(timings(), st.randoms(use_true_random=False))
def test_the_choice_is_the_fastest_at_batch_1_within_the_spread_on_the_fewest_cores(table, rng) -> None:
    candidates = [t for t in table if t.batch_size == 1 and t.engine in ENGINES]  # other rows are references
    if not candidates:
        with pytest.raises(ValueError, match="batch size 1"):
            choose_engine(table)
        return
    chosen = choose_engine(table)
    fastest = min(t.median_ms for t in candidates)
    bound = max(t.p75_ms for t in candidates if t.median_ms == fastest)
    within = [t for t in candidates if t.median_ms <= bound]
    assert chosen in {t.engine for t in within}  # never slower than the fastest's upper quartile
    assert ENGINES[chosen].cores == min(ENGINES[t.engine].cores for t in within)
    shuffled = list(table)
    rng.shuffle(shuffled)
    assert choose_engine(shuffled) == chosen
    assert EngineChoice.from_json(EngineChoice(chosen, CHOSEN_BY_TIMING, tuple(table)).to_json()).timings == \
        tuple(table)


def test_a_tie_within_the_spread_goes_to_the_engine_on_fewer_cores() -> None:
    """resnet18-fmnist's table on this 2-core machine: two threads timed faster alone, one thread within the spread
    and served faster; minilm-rt's: one thread far outside it."""
    resnet = [EngineTiming("onnxruntime", 1, 0.214, 0.157, 0.273),
              EngineTiming("onnxruntime-1thread", 1, 0.261, 0.228, 0.368), EngineTiming("torch", 1, 0.805, 0.711, 1.013)]
    minilm = [EngineTiming("onnxruntime", 1, 6.099, 5.641, 6.585),
              EngineTiming("onnxruntime-1thread", 1, 10.146, 9.741, 10.58),
              EngineTiming("torch", 1, 11.637, 10.684, 12.248)]
    assert ENGINES["onnxruntime-1thread"].cores == 1
    assert choose_engine(resnet) == ("onnxruntime-1thread" if ENGINES["onnxruntime"].cores > 1 else "onnxruntime")
    assert choose_engine(minilm) == "onnxruntime"


def test_engines_a_model_cannot_run_on_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="ONNX Runtime only"):
        check_engine("torch", "onnx")
    with pytest.raises(ValueError, match="unknown engine 'tvm'"):
        check_engine("tvm", "zoo")
    check_engine("onnxruntime-1thread", "onnx")
    result = CliRunner().invoke(app, ["prepare", "resnet18-fmnist", "--small", "--engine", "tvm", "--out", "x"])
    assert result.exit_code == 2 and "unknown engine" in result.output


@pytest.fixture(scope="module")
def timed_prepared(small_prepare_config):
    """The small ResNet prepared on whichever engine is fastest here."""
    config = replace(small_prepare_config, engine="auto", bootstrap_items=600, in_domain_items=0,
                     engine_budget_s=0.2)
    return prepare(ModelSource("zoo", "resnet18-fmnist", small=True), config)


def test_auto_times_every_engine_and_serves_on_the_fastest_at_batch_1(timed_prepared, tmp_path) -> None:
    record = timed_prepared.meta["engine"]
    choice = EngineChoice.from_json(record)
    assert choice.chosen_by == CHOSEN_BY_TIMING and choice.unavailable == ()
    assert {(t.engine, t.batch_size) for t in choice.timings} == {(e, b) for e in ENGINES for b in (1, 16)}
    assert all(0 < t.p25_ms <= t.median_ms <= t.p75_ms for t in choice.timings)
    assert choice.engine == choose_engine(choice.timings)
    assert timed_prepared.backend.kind == ENGINES[choice.engine].backend
    bundle = save_bundle(timed_prepared, tmp_path / "bundle")
    assert read_manifest(bundle)["meta"]["engine"] == record
    result = CliRunner().invoke(app, ["inspect", str(bundle)])
    assert result.exit_code == 0 and f"{choice.engine} (serves)" in result.output


def test_a_zoo_model_served_on_onnx_runtime_answers_as_the_torch_model(small_prepare_config, fmnist_feeds,
                                                                       tmp_path) -> None:
    """Exported at prepare, the model on ONNX Runtime gives the torch model's labels exactly and its logits to
    float rounding, staged with every ramp active as whole; the bundle keeps the engine's thread setting."""
    from rampserve.zoo.registry import load_trained

    engine = "onnxruntime-1thread"  # not ONNX Runtime's default threads: the bundle must keep the setting
    config = replace(small_prepare_config, engine=engine, bootstrap_items=600, in_domain_items=0)
    model = load_bundle(save_bundle(prepare(ModelSource("zoo", "resnet18-fmnist", small=True), config),
                                    tmp_path / "bundle"))
    assert model.meta["engine"]["engine"] == engine and model.meta["engine"]["chosen_by"] == CHOSEN_BY_USER
    assert model.backend.kind == "onnx" and model.backend.intra_op_threads == ENGINES[engine].intra_op_threads
    with torch.inference_mode():
        expected = load_trained("resnet18-fmnist", small=True)(torch.from_numpy(fmnist_feeds)).numpy()
    feeds = {model.backend.input_names[0]: fmnist_feeds}
    for active in ((), tuple(model.site_names)):
        served = model.run(feeds, active=active)
        np.testing.assert_array_equal(served.argmax(axis=1), expected.argmax(axis=1))
        np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-4)


def test_served_onnx_sessions_spin_a_bounded_time_after_a_run(tmp_path) -> None:
    """ONNX Runtime's pool threads spin within a run in every engine; rampserve's sessions bound how long an idle
    thread spins (a stage's session must not spin beside the next), the reference for a bare session leaves it."""
    from rampserve.graph.onnx_graph import ONNX_SPIN_US, export_onnx
    from rampserve.runtime.backends import OnnxBackend
    from rampserve.runtime.engines import AS_USERS_RUN_IT, engine_backends

    path = export_onnx(torch.nn.Sequential(torch.nn.Linear(4, 3)), (torch.zeros(2, 4),), ["x"],
                       tmp_path / "model.onnx")

    def setting(backend: OnnxBackend, key: str) -> str:
        options = backend.split.build(())[0].session.get_session_options()
        try:
            return options.get_session_config_entry(key)
        except RuntimeError:  # not set: ONNX Runtime's default
            return ""

    engines = [*(e for e in ENGINES.values() if e.backend == "onnx"), AS_USERS_RUN_IT]
    for name, backend in engine_backends(engines, None, path).items():
        assert isinstance(backend, OnnxBackend)
        assert setting(backend, "session.intra_op.allow_spinning") in ("", "1"), name  # ORT's default: spin
        assert setting(backend, "session.intra_op.spin_duration_us") == (
            "" if name == AS_USERS_RUN_IT.name else str(ONNX_SPIN_US)), name
