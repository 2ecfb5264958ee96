"""Prepared models: staged execution, ramp callbacks, sites on the zoo's architectures."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from rampserve.graph.sites import block_of
from rampserve.graph.torch_graph import TorchSplitModel
from rampserve.ramps.kinds import make_ramp
from rampserve.ramps.specs import spec_for
from rampserve.runtime.torch_backend import TorchBackend, site_activations
from rampserve.runtime.prepared import PreparedModel, SiteInfo
from rampserve.runtime.profile import PROFILED_LENGTHS
from rampserve.zoo.registry import get_entry


def test_staged_output_equals_the_original_model_exactly(resnet_prepared, fmnist_feeds) -> None:
    model = resnet_prepared
    name = model.backend.input_names[0]

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.sets(st.sampled_from(model.site_names)), st.integers(1, 16))
    def check(active: set[str], batch: int) -> None:
        out = model.run({name: fmnist_feeds[:batch]}, active=sorted(active))
        reference = model.backend.module(torch.from_numpy(fmnist_feeds[:batch])).detach().numpy()
        assert np.array_equal(out, reference)

    check()


BACKENDS = ["resnet_prepared", "onnx_prepared"]  # the same small ResNet on torch and on ONNX Runtime


@pytest.mark.parametrize("prepared", BACKENDS)
def test_compiled_runs_equal_the_original_model_and_fused_ramps_equal_the_eager_ones(prepared, fmnist_feeds,
                                                                                    request) -> None:
    """Compiled sets (the serving path: on torch, traced stages with the ramps fused in, one scripted runner; on
    ONNX, the whole model in one session whose ramps signal, or where a ramp runs in Python the stages' sessions
    with the ramps inside) give bit for bit the eager path's output (on torch the original model's; in one ONNX
    session the whole model's), and every fused ramp the eager ramp's labels exactly and its error scores to
    float32 rounding, for any active ramps and batch size; every ramp is reported once, in model order."""
    model = replace(request.getfixturevalue(prepared))  # compiled sets of its own
    name = model.backend.input_names[0]
    first = model.sites[0]  # a ramp that runs in Python (stashed on the compiled path) beside fused ones
    model.ramps = {**model.ramps, first.name: make_ramp(spec_for("deep", first.activation_shape,
                                                                 first.ramp.num_classes)).eval()}

    @settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.sets(st.sampled_from(model.site_names)), st.integers(1, 16))
    def check(active: set[str], batch: int) -> None:
        feeds = {name: fmnist_feeds[:batch]}
        ordered = sorted(active, key=model.site_names.index)
        assert model.compile(ordered, {name: fmnist_feeds[-2:]})
        ramps: dict[bool, list] = {True: [], False: []}
        outputs = {compiled: model.run(feeds, ordered, lambda *seen, c=compiled: ramps[c].append(seen),
                                       compiled=compiled)
                   for compiled in (True, False)}
        whole = model.backend.kind == "onnx" and bool(active) and first.name not in active
        assert type(model.compiled_set(ordered).runner).__name__ == ("OnnxSignalledRunner" if whole else
                                                                  "OnnxSetRunner" if model.backend.kind == "onnx"
                                                                  else "RecursiveScriptModule")
        if model.backend.kind == "torch":
            reference = model.backend.module(torch.from_numpy(fmnist_feeds[:batch])).detach().numpy()
            assert np.array_equal(outputs[True], outputs[False])
            assert np.array_equal(outputs[True], reference)
        elif whole:
            assert np.array_equal(outputs[True], model.backend.split.full(feeds))
        else:  # ONNX Runtime fuses other operators in a sub-graph than in the whole graph: float rounding apart
            assert np.array_equal(outputs[True], outputs[False])
            np.testing.assert_allclose(outputs[True], model.backend.split.full(feeds), rtol=1e-4, atol=1e-5)
        assert [site for site, *_ in ramps[True]] == ordered
        eager = {site: (labels, errors) for site, labels, errors in ramps[False]}
        for site, labels, errors in ramps[True]:
            assert np.array_equal(labels, eager[site][0])
            np.testing.assert_allclose(errors, eager[site][1], rtol=0, atol=1e-5)

    check()


def _every_site_compiled(model, feeds: np.ndarray) -> tuple[str, list[str], object]:
    """The model's input name, its sites and its compiled set of every site."""
    name = model.backend.input_names[0]
    sites = model.site_names
    assert model.compile(sites, {name: feeds[-2:]})
    return name, sites, model.compiled_set(sites)


def _signal_pipe() -> tuple[int, int]:
    """A pipe for a run's ramps to write their columns to, read without blocking."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    return read, write


@pytest.mark.parametrize("score", ["max_prob", "entropy"])
@pytest.mark.parametrize("prepared", BACKENDS)
def test_a_compiled_run_signals_exactly_the_ramps_where_an_input_may_exit(prepared, score, fmnist_feeds,
                                                                         request) -> None:
    """A compiled run writes a ramp's column to the pipe where some input's error score is under the ramp's
    threshold (so the releasing thread can release it while the model runs on), and nowhere else but within the
    set's margin for rounding (float32 confidences on ONNX), whichever error score the model uses."""
    model = replace(request.getfixturevalue(prepared), error_score=score)
    name, sites, compiled = _every_site_compiled(model, fmnist_feeds)
    read, write = _signal_pipe()

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.floats(0.0, 1.0), min_size=len(sites), max_size=len(sites)), st.integers(1, 16))
    def check(thresholds: list[float], batch: int) -> None:
        outputs = model.ramp_outputs(compiled, batch)
        with torch.inference_mode():
            model.run_compiled(compiled, {name: fmnist_feeds[:batch]}, outputs, thresholds, write)
        try:
            signalled = list(os.read(read, 4096))
        except BlockingIOError:
            signalled = []
        errors = [outputs.scores(j)[1] for j in range(len(sites))]
        exits = {j for j in range(len(sites)) if np.any(errors[j] < thresholds[j])}
        near = {j for j in range(len(sites)) if thresholds[j] > 0
                and np.any(errors[j] < thresholds[j] + 2 * compiled.exit_margin)}
        assert signalled == sorted(signalled) and exits <= set(signalled) <= near

    try:
        check()
    finally:
        os.close(read)
        os.close(write)


def test_an_onnx_run_hands_its_columns_to_the_batch_on_its_own_thread(onnx_prepared, fmnist_feeds) -> None:
    """Where the batch in progress takes columns on the run's thread, an ONNX set's ramps hand them there as they
    are computed (their logits already in the buffer, while the run goes on), exactly those the pipe would get,
    and write nothing to the pipe; a handler that fails sends its column to the pipe, for the executor to take
    after the run."""
    from rampserve.runtime.column_handlers import hand_columns_to

    model = onnx_prepared
    name, sites, compiled = _every_site_compiled(model, fmnist_feeds)
    read, write = _signal_pipe()

    def run(thresholds: list[float], batch: int, handler) -> list[int]:
        """The columns written to the pipe by a run whose columns go to `handler(outputs)` (None: to the pipe)."""
        outputs = model.ramp_outputs(compiled, batch)
        hand_columns_to(write, None if handler is None else handler(outputs))
        try:
            with torch.inference_mode():
                model.run_compiled(compiled, {name: fmnist_feeds[:batch]}, outputs, thresholds, write)
        finally:
            hand_columns_to(write, None)
        try:
            return list(os.read(read, 4096))
        except BlockingIOError:
            return []

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.floats(0.0, 1.0), min_size=len(sites), max_size=len(sites)), st.integers(1, 8))
    def check(thresholds: list[float], batch: int) -> None:
        piped = run(thresholds, batch, None)
        handed: list[tuple[int, int, np.ndarray]] = []  # column, thread, its logits as handed
        assert run(thresholds, batch, lambda outputs: lambda column: handed.append(
            (column, threading.get_ident(), outputs.buffers.logits[:, column].copy()))) == []
        assert [column for column, _, _ in handed] == piped
        outputs = model.ramp_outputs(compiled, batch)  # the same buffers, as the run left them
        for column, thread, logits in handed:
            assert thread == threading.get_ident()
            np.testing.assert_array_equal(logits, outputs.buffers.logits[:, column])

        def failing(outputs):
            def take(column: int) -> None:
                raise RuntimeError("the batch could not take it")
            return take

        assert run(thresholds, batch, failing) == piped

    try:
        check()
    finally:
        os.close(read)
        os.close(write)


class _DataDependent(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * 2 if h.sum() > 0 else h * 3  # a trace would keep one branch


class _SizeAsNumber(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = int(h.shape[0])  # a trace would keep the example's batch size
        return h + rows


class _WithLeaf(nn.Module):
    def __init__(self, leaf: nn.Module) -> None:
        super().__init__()
        self.rampserve_leaf_types = (type(leaf),)
        self.first, self.leaf, self.last = nn.Linear(4, 4), leaf, nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.leaf(self.first(x))))


@pytest.mark.parametrize("leaf", [_DataDependent(), _SizeAsNumber()], ids=["branch", "size"])
def test_a_model_that_does_not_trace_faithfully_is_served_eagerly(leaf: nn.Module) -> None:
    backend = TorchBackend(_WithLeaf(leaf), policy=lambda graph, candidates: candidates)
    sites = [SiteInfo(s.value, s.index, s.kind, s.scope, (4,), spec_for("linear", (4,), 3)) for s in backend.sites]
    model = PreparedModel(backend, sites, {s.name: make_ramp(s.ramp).eval() for s in sites})
    example = {"x": np.ones((2, 4), np.float32)}
    inputs = np.concatenate([np.full((1, 4), -5.0, np.float32), np.ones((2, 4), np.float32)])
    for cuts in ([], model.site_names):
        assert model.compile(cuts, example) is False and model.has_compiled(cuts)
        for rows in (1, 3):  # each sign for the branch, another batch size for the size
            output = model.run({"x": inputs[:rows]}, cuts, compiled=True)
            with torch.no_grad():
                assert np.array_equal(output, backend.module(torch.from_numpy(inputs[:rows])).numpy())


def test_ramp_callback_sees_every_active_ramp_in_model_order(resnet_prepared, fmnist_feeds) -> None:
    model = resnet_prepared
    active = model.site_names[::2]
    seen = []

    def on_ramp(site: str, labels: np.ndarray, errors: np.ndarray) -> None:
        seen.append(site)
        assert labels.shape == errors.shape == (len(fmnist_feeds),)
        assert np.all((errors >= 0) & (errors <= 1)) and np.all((labels >= 0) & (labels < 10))

    model.run({model.backend.input_names[0]: fmnist_feeds}, active=list(reversed(active)), on_ramp=on_ramp)
    assert seen == active


@pytest.mark.parametrize("every", [1, 3])
def test_hooked_run_reports_the_activations_the_stages_compute(resnet_prepared, fmnist_feeds, every: int) -> None:
    backend = resnet_prepared.backend
    feeds = {backend.input_names[0]: fmnist_feeds}
    cuts = resnet_prepared.site_names[::every]
    reported = []
    with torch.inference_mode():
        output = backend.run_hooked(feeds, cuts[::-1], lambda site, activation: reported.append((site, activation)))
        staged = list(backend.stage_outputs(feeds, cuts))
        original = backend.module(torch.from_numpy(fmnist_feeds))
    assert [site for site, _ in reported] == cuts
    for (site, activation), (cut, expected) in zip(reported, staged[:-1], strict=True):
        assert site == cut and torch.equal(activation, expected)
    assert torch.equal(output, original) and torch.equal(output, staged[-1][1])


class _Nested(nn.Module):
    """Submodule paths that flatten to the same name ("a.b_c" and "a_b.c") and a parameter read directly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Module()
        self.a.b_c = nn.Linear(6, 6)
        self.a_b = nn.Module()
        self.a_b.c = nn.Linear(6, 6)
        self.a.scale = nn.Parameter(torch.full((6,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a_b.c(torch.relu(self.a.b_c(x)) * self.a.scale)


def test_hooked_module_keeps_modules_whose_flat_names_collide_apart() -> None:
    split = TorchSplitModel(_Nested(), policy=lambda graph, candidates: candidates)
    cuts = [s.value for s in split.sites]
    x = torch.randn(3, 6)
    reported: list[str] = []
    with torch.no_grad():
        output = split.hooked(cuts)(x, lambda site, _activation: reported.append(site))
        assert torch.equal(output, split.module(x))
    assert reported == cuts and len(cuts) >= 2


def test_unknown_active_site_is_refused(resnet_prepared, fmnist_feeds) -> None:
    with pytest.raises(ValueError, match="not sites"):
        resnet_prepared.run({resnet_prepared.backend.input_names[0]: fmnist_feeds}, active=["nope"])


def test_profile_covers_every_site_and_batch_size(resnet_prepared) -> None:
    profile = resnet_prepared.profile
    assert list(profile.sites) == resnet_prepared.site_names
    assert set(profile.segment_ms) == {*profile.sites, "output"}
    reach = profile.reach(1)
    assert np.all(np.diff(reach) >= 0) and reach[-1] <= profile.full(1)
    # Images come in one size: no time against length, and every batch priced as profiled
    assert profile.lengths == profile.length_ms == profile.batch_lengths == ()
    assert profile.length_scale(1, 999) == 1.0


def _split(name: str) -> TorchSplitModel:
    return TorchSplitModel(get_entry(name, small=True).build().eval())


def test_resnet_sites_lie_between_residual_blocks_only() -> None:
    for name, blocks in (("resnet18-fmnist", 8), ("resnet50-fmnist", 16)):
        split = _split(name)
        ops = split.dataflow.ops
        stem, *rest = split.sites
        assert not stem.scope.startswith("layer")
        # one site after each residual block but the last (only the classifier follows it)
        assert len(rest) == blocks - 1
        for site in rest:
            nxt = ops[site.index + 1]
            assert block_of(site.scope) != block_of(nxt.scope), f"{site.value} is inside a block"
            assert block_of(site.scope).startswith("layer")


def test_vgg_has_a_site_after_every_conv_layer() -> None:
    for name in ("vgg11-fmnist", "vgg16-fmnist"):
        split = _split(name)
        convs = [i for i, op in enumerate(split.dataflow.ops) if op.kind == "Conv2d"]
        assert len(split.sites) == len(convs)
        # each conv is followed by exactly one site before the next conv
        for conv, nxt in zip(convs, [*convs[1:], len(split.dataflow.ops)]):
            assert sum(conv < s.index < nxt for s in split.sites) == 1


def test_minilm_sites_lie_between_encoder_layers() -> None:
    entry = get_entry("minilm-rt", small=True)
    split = TorchSplitModel(entry.build().eval())
    layers = [op for op in split.dataflow.ops if op.heavy and "layer" in op.scope]
    assert len(split.sites) == len(layers) - 1
    for site, layer in zip(split.sites, layers):
        assert site.op_name == layer.name


def test_minilm_prepares_with_masked_mean_ramps_and_stages_exactly(small_prepare_config) -> None:
    """A Hugging Face encoder with a side input (the attention mask) splits between layers, exactly; its ramps
    average each input's own tokens."""
    from dataclasses import replace

    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource
    from rampserve.workloads.streams import get_stream

    config = replace(small_prepare_config, bootstrap_items=200, profile_batch_sizes=(1, 2), profile_repeats=1)
    model = prepare(ModelSource("zoo", "minilm-rt", small=True), config)
    assert all(s.ramp.reduce == "token_mean_masked" and s.activation_shape[-1] == 384 for s in model.sites)
    # Texts come in any length: the profile times the model at each length its signature allows, and keeps the
    # positions of the inputs each batch size was measured on, whose own time scales by 1
    profile = model.profile
    assert profile.lengths == tuple(n for n in PROFILED_LENGTHS if n <= model.signature.max_variable_dim)
    assert len(profile.length_ms) == len(profile.lengths) and min(profile.length_ms) > 0
    assert len(profile.batch_lengths) == 2 and profile.batch_lengths[0] <= profile.batch_lengths[1]
    assert profile.length_scale(1, profile.batch_lengths[0]) == 1.0
    stream = get_stream("rt-drift")
    texts = stream.items(stream.evaluation.start, stream.evaluation.start + 6)
    feeds = dict(zip(model.backend.input_names, get_entry("minilm-rt", small=True).encode(texts).values()))
    reference = model.backend.module(*(torch.from_numpy(feeds[n]) for n in model.backend.input_names))
    for active in ([], model.site_names, model.site_names[1:2]):
        assert np.array_equal(model.run(feeds, active=active), reference.detach().numpy())
        # compiled with an example of another length, and run on a shorter one too
        assert model.compile(active, {n: np.concatenate([feeds[n][:2]] * 2, axis=1) for n in feeds})
        for length in (feeds[model.backend.input_names[0]].shape[1], 7):
            cut = {n: np.ascontiguousarray(feeds[n][:, :length]) for n in feeds}
            eager = model.run(cut, active=active)
            assert np.array_equal(model.run(cut, active=active, compiled=True), eager)


@pytest.mark.parametrize("token_reduce, score, kind", [("first_token", "max_prob", "linear"),
                                                       ("token_mean", "entropy", "linear"),
                                                       ("token_mean_masked", "max_prob", "mlp")])
def test_onnx_ramps_of_a_text_encoder_fuse_as_they_evaluate(token_reduce: str, score: str, kind: str,
                                                            tmp_path) -> None:
    """On an ONNX text encoder with a side input (the attention mask), linear and MLP ramps of every reduction its
    sites take (the tokens' first or mean, a flat head after the last layer) fused into the one session that runs
    the model whole report the eager ramps' labels and error scores (to float32 rounding), and the compiled output
    is the whole model's."""
    from rampserve.graph.onnx_graph import export_onnx
    from rampserve.runtime.backends import OnnxBackend
    from rampserve.workloads.streams import get_stream
    from rampserve.zoo.registry import load_trained

    entry, module = get_entry("minilm-rt", small=True), load_trained("minilm-rt", small=True)
    names = TorchBackend(module).input_names
    stream = get_stream("rt-drift")
    feeds = dict(zip(names, entry.encode(stream.items(stream.evaluation.start, stream.evaluation.start + 6)).values()))
    backend = OnnxBackend(export_onnx(module, tuple(torch.from_numpy(feeds[n][:2]) for n in names), names,
                                      tmp_path / "minilm.onnx"))
    activations, logits = next(site_activations(backend, [feeds], [s.value for s in backend.sites]))
    torch.manual_seed(0)
    sites, ramps = [], {}
    for candidate in backend.sites:
        shape = tuple(activations[candidate.value].shape[1:])
        ramp = make_ramp(spec_for(kind, shape, logits.shape[1], token_reduce=token_reduce)).eval()
        ramp.center.normal_()
        sites.append(SiteInfo(candidate.value, candidate.index, candidate.kind, candidate.scope, shape, ramp.spec))
        ramps[candidate.value] = ramp
    model = PreparedModel(backend, sites, ramps, error_score=score)
    assert {s.ramp.reduce for s in sites} == {token_reduce, "identity"}
    for active in (model.site_names, model.site_names[1:2]):
        assert model.compile(active, {n: feeds[n][-2:] for n in names})
        reported: dict[bool, list] = {True: [], False: []}
        outputs = [model.run(feeds, active, lambda *seen, c=compiled, into=reported: into[c].append(seen), compiled=compiled)
                   for compiled in (True, False)]
        assert type(model.compiled_set(active).runner).__name__ == "OnnxSignalledRunner"
        assert np.array_equal(outputs[0], backend.split.full(feeds))
        np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
        assert [site for site, *_ in reported[True]] == [site for site, *_ in reported[False]] == list(active)
        for (_, labels, errors), (_, eager_labels, eager_errors) in zip(reported[True], reported[False]):
            assert np.array_equal(labels, eager_labels)
            np.testing.assert_allclose(errors, eager_errors, rtol=0, atol=1e-5)


@pytest.mark.parametrize("engine", ["onnxruntime", "torch"])
def test_mlp_ramps_prepare_and_run_compiled_as_they_evaluate(engine: str, small_prepare_config, fmnist_feeds,
                                                             tmp_path) -> None:
    """MLP ramps of the hidden width asked for keep their weights through a bundle, and on the compiled path (fused
    into the session that runs the model whole on ONNX Runtime, stashed for Python on torch) report what they
    report evaluated apart."""
    from dataclasses import replace

    from rampserve.runtime.bundle import load_bundle, save_bundle
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource

    config = replace(small_prepare_config, ramp_kind="mlp", ramp_hidden=12, bootstrap_items=400,
                     profile_batch_sizes=(1, 2), engine=engine)
    model = load_bundle(save_bundle(prepare(ModelSource("zoo", "resnet18-fmnist", small=True), config),
                                    tmp_path / "mlp"))
    assert model.backend.kind == ("onnx" if engine == "onnxruntime" else "torch")
    assert {(s.ramp.kind, s.ramp.hidden) for s in model.sites} == {("mlp", 12)}
    feeds = {model.backend.input_names[0]: fmnist_feeds}
    assert model.compile(model.site_names, {name: value[:2] for name, value in feeds.items()})
    reported: dict[bool, list] = {True: [], False: []}
    outputs = [model.run(feeds, model.site_names, lambda *seen, into=reported[compiled]: into.append(seen),
                         compiled=compiled) for compiled in (True, False)]
    if engine == "onnxruntime":
        assert type(model.compiled_set(model.site_names).runner).__name__ == "OnnxSignalledRunner"
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
    assert [site for site, *_ in reported[True]] == [site for site, *_ in reported[False]] == model.site_names
    for (_, labels, errors), (_, eager_labels, eager_errors) in zip(reported[True], reported[False]):
        assert np.array_equal(labels, eager_labels)
        np.testing.assert_allclose(errors, eager_errors, rtol=0, atol=1e-5)


def test_deep_ramps_prepare_and_round_trip(small_prepare_config, fmnist_feeds, tmp_path) -> None:
    from dataclasses import replace

    from rampserve.runtime.bundle import load_bundle, save_bundle
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource

    config = replace(small_prepare_config, ramp_kind="deep", bootstrap_items=400, profile_batch_sizes=(1, 2))
    model = prepare(ModelSource("zoo", "resnet18-fmnist", small=True), config)
    assert {s.ramp.kind for s in model.sites} == {"deep"}
    assert all(s.ramp.reduce == "spatial_grid" for s in model.sites)
    loaded = load_bundle(save_bundle(model, tmp_path / "deep"))
    feeds = {model.backend.input_names[0]: fmnist_feeds}
    seen = {}
    loaded.run(feeds, loaded.site_names, lambda site, labels, errors: seen.setdefault(site, labels))
    model.run(feeds, model.site_names, lambda site, labels, errors: np.testing.assert_array_equal(labels, seen[site]))
