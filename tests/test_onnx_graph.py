"""ONNX front end: sites of exported models (EfficientNet-Lite0 and tiny CNNs) and staged execution."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn
from torch.nn import functional as F

from rampserve.graph.onnx_graph import OnnxSplitModel, export_onnx, onnx_dataflow, scope_from_node_name
from rampserve.graph.sites import block_of, cut_values, data_path_values
from rampserve.zoo.efficientnet_lite import SameConv2d, build_efficientnet_lite0, build_lite0_classifier, lite0_blocks

# Export at batch 2 and run at batches 1 and 3, so a batch size baked in anywhere would show.
EXPORT_BATCH = 2
BATCHES = (1, 3)


class TinyBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else None
        )
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + skip)


class TinyResNet(nn.Module):
    BLOCKS = ("layer1.0", "layer1.1", "layer2.0", "layer2.1")

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(TinyBlock(4, 4, 1), TinyBlock(4, 4, 1))
        self.layer2 = nn.Sequential(TinyBlock(4, 8, 2), TinyBlock(8, 8, 1))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class TinyVGG(nn.Module):
    CONVS = 3

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class GatedBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x)) * gate


class MaskedNet(nn.Module):
    """Every block reads the mask (through a value computed from it once), as attention masks are read."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.blocks = nn.ModuleList(GatedBlock(4) for _ in range(3))
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(mask)
        x = F.relu(self.stem(x)) * gate
        for block in self.blocks:
            x = block(x, gate)
        return self.fc(x.mean(dim=(2, 3)))


def _tiny(cls: type[nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        module = cls()
        for m in module.modules():  # non-trivial BatchNorm statistics, so folding them into convs is exercised
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        return module

    return build


# Per model: how to build it and its inputs' shapes without the batch dimension.
MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, tuple[int, ...]]]] = {
    "lite0": (build_efficientnet_lite0, {"x": (3, 224, 224)}),
    "resnet": (_tiny(TinyResNet), {"x": (1, 16, 16)}),
    "vgg": (_tiny(TinyVGG), {"x": (1, 16, 16)}),
    "masked": (_tiny(MaskedNet), {"x": (1, 8, 8), "mask": (1, 8, 8)}),
}


def _module(name: str) -> nn.Module:
    torch.manual_seed(0)  # the same weights every time a test builds the module again
    return MODELS[name][0]().eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    @functools.cache
    def export(name: str) -> Path:
        example = tuple(torch.randn(EXPORT_BATCH, *shape) for shape in MODELS[name][1].values())
        return export_onnx(_module(name), example, list(MODELS[name][1]), tmp_path_factory.mktemp(name) / "m.onnx")

    return export


@pytest.fixture(scope="module")
def split(exported: Callable[[str], Path]) -> Callable[[str], OnnxSplitModel]:
    return functools.cache(lambda name: OnnxSplitModel(exported(name)))


def _inputs(name: str, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {key: rng.standard_normal((batch, *shape), dtype=np.float32) for key, shape in MODELS[name][1].items()}


def _last_op_of(model: OnnxSplitModel, block: str) -> int:
    return max(i for i, op in enumerate(model.dataflow.ops) if block_of(op.scope) == block)


# ------------------------------------------------------------------------------------------------ model


def test_lite0_pretrained_predictions_depend_on_the_image() -> None:
    # Smooth random colour fields: the ImageNet weights put them in different classes, where untrained (or
    # wrongly wired) weights put every one in the same class.
    torch.manual_seed(0)
    images = F.interpolate(torch.rand(6, 3, 16, 16) * 2 - 1, size=224, mode="bilinear")
    with torch.no_grad():
        top = build_efficientnet_lite0()(images).argmax(1)
    assert len(set(top.tolist())) >= 2


@pytest.mark.parametrize(("kernel", "stride"), [(3, 2), (5, 2), (3, 1), (5, 1), (1, 1)])
def test_same_conv_pads_like_tensorflow(kernel: int, stride: int) -> None:
    conv = SameConv2d(2, 2, kernel, stride)
    x = torch.randn(1, 2, 28, 28)
    out = -(-28 // stride)  # TensorFlow's SAME: ceil(n / s) outputs, the odd padding pixel at the end
    total = max((out - 1) * stride + kernel - 28, 0)
    padded = F.pad(x, (total // 2, total - total // 2) * 2)
    torch.testing.assert_close(conv(x), F.conv2d(padded, conv.weight, stride=stride))


# ---------------------------------------------------------------------------------------------- scopes


@pytest.mark.parametrize(
    ("name", "scope"),
    [
        ("/layer1/layer1.0/conv1/Conv", "layer1.0.conv1"),
        ("/_blocks.3/_depthwise_conv/Conv", "_blocks.3._depthwise_conv"),
        ("/body/body.0/seq/seq.0/seq.0.1/Relu", "body.0.seq.0.1"),
        ("/body/body.0/lst.0.0/Conv", "body.0.lst.0.0"),  # a ModuleList indexed, never called
        ("/1/1.0/Conv", "1.0"),  # a Sequential as the root
        ("/Add", ""),  # an op in the root module's own forward
        ("node_Conv_0", ""),  # another exporter's naming
        ("", ""),
    ],
)
def test_scope_from_node_name(name: str, scope: str) -> None:
    assert scope_from_node_name(name) == scope


@pytest.mark.parametrize("name", ["lite0", "resnet", "vgg"])
def test_conv_scopes_are_the_conv_modules(name: str, split: Callable[[str], OnnxSplitModel]) -> None:
    conv_modules = {path for path, m in _module(name).named_modules() if isinstance(m, nn.Conv2d)}
    assert {op.scope for op in split(name).dataflow.ops if op.kind == "Conv"} == conv_modules


# ------------------------------------------------------------------------------------------- dataflow


class TinyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), dim=-1)
        return self.o(scores @ self.v(x))


def test_matmul_is_heavy_only_with_weights(tmp_path: Path) -> None:
    path = export_onnx(TinyAttention().eval(), (torch.randn(2, 5, 8),), ["x"], tmp_path / "attention.onnx")
    ops = onnx_dataflow(onnx.load(str(path))).ops
    matmuls = [op for op in ops if op.kind == "MatMul"]
    assert len(matmuls) == 6  # four projections (3-D inputs export as MatMul + Add), two activation products
    assert sorted(op.scope for op in matmuls if op.heavy) == ["k", "o", "q", "v"]


def test_constants_are_not_ops_or_inputs(exported: Callable[[str], Path]) -> None:
    model = onnx.load(str(exported("lite0")))
    graph = onnx_dataflow(model)
    weights = {t.name for t in model.graph.initializer}
    assert graph.inputs == ("x",)
    assert not [v for op in graph.ops for v in op.inputs if v in weights]
    assert not [op for op in graph.ops if op.kind in ("Constant", "ConstantOfShape")]
    # Without side inputs, an op that survived constant removal must depend on the image.
    on_path = data_path_values(graph)
    assert all(op.inputs and all(v in on_path for v in op.outputs) for op in graph.ops)
    # Heavy ops: stem, each block's (expand,) depthwise and project convs, head conv, classifier.
    expected_heavy = 1 + sum(3 if spec.expand != 1 else 2 for spec in lite0_blocks()) + 2
    assert sum(op.heavy for op in graph.ops) == expected_heavy


def test_unsorted_graph_is_sorted(exported: Callable[[str], Path], split: Callable[[str], OnnxSplitModel]) -> None:
    model = onnx.load(str(exported("resnet")))
    nodes = list(model.graph.node)
    random.Random(0).shuffle(nodes)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    shuffled, resnet = OnnxSplitModel(model), split("resnet")
    assert [s.value for s in shuffled.sites] == [s.value for s in resnet.sites]
    feeds = _inputs("resnet", 3)
    np.testing.assert_allclose(shuffled.full(feeds), resnet.full(feeds), rtol=1e-5, atol=1e-6)


def _if_model() -> onnx.ModelProto:
    """x -> MatMul -> h1 -> Relu -> MatMul -> h3 -> If(then: h3 + h1, else: h3 - h1) -> MatMul -> Relu -> MatMul.

    The If node lists neither h1 nor h3 as inputs: its branches read them from the enclosing graph.
    """
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((4, 4), dtype=np.float32), f"w{i}") for i in range(4)]
    cond = numpy_helper.from_array(np.array(True), "cond")

    def branch(op: str) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(f"{op}_out", TensorProto.FLOAT, None)
        return helper.make_graph([helper.make_node(op, ["h3", "h1"], [f"{op}_out"])], op, [], [out])

    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w1"], ["h3"]),
        helper.make_node("If", ["cond"], ["mixed"], then_branch=branch("Add"), else_branch=branch("Sub")),
        helper.make_node("MatMul", ["mixed", "w2"], ["y"]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("MatMul", ["r", "w3"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "if", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])], initializer=[*weights, cond],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_values_read_inside_subgraphs_stay_live() -> None:
    model = OnnxSplitModel(_if_model())
    assert [c.value for c in cut_values(model.dataflow)] == ["h1", "mixed", "y", "r"]
    assert [site.value for site in model.sites] == ["h1", "mixed"]
    x = np.random.default_rng(1).standard_normal((3, 4), dtype=np.float32)
    staged = x
    for stage in model.build(("h1", "mixed")):
        staged = stage(staged, {})
    np.testing.assert_allclose(staged, model.full({"x": x}), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- sites


def test_lite0_sites_are_the_stem_and_block_outputs(split: Callable[[str], OnnxSplitModel]) -> None:
    lite0 = split("lite0")
    ops = lite0.dataflow.ops
    specs = lite0_blocks()
    block_ends = [_last_op_of(lite0, f"_blocks.{i}") for i in range(len(specs))]
    # A block ends with its skip addition when it has one, else with its (batch-norm-folded) projection.
    assert [ops[i].kind for i in block_ends] == ["Add" if spec.skip else "Conv" for spec in specs]
    stem_end = min(i for i, op in enumerate(ops) if block_of(op.scope) == "_blocks.0") - 1
    assert ops[stem_end].kind == "Clip"  # ReLU6 after the stem conv
    expected = [ops[i].outputs[0] for i in [stem_end, *block_ends]]
    assert len(expected) == 1 + len(specs) == 17
    assert [site.value for site in lite0.sites] == expected
    for site in lite0.sites:
        assert block_of(site.scope) != block_of(ops[site.index + 1].scope)


def test_lite0_on_grey_images_makes_the_photo_in_its_graph_and_keeps_its_sites(
        split: Callable[[str], OnnxSplitModel], tmp_path: Path) -> None:
    """The vision flagship takes uint8 grey images and scales them up in its first operators: those add no site
    (no layer precedes them), the sites are the photo model's, and ONNX Runtime, whole or cut at every site, gives
    what torch gives."""
    torch.manual_seed(0)
    model = build_lite0_classifier(10, pretrained=False, grey_side=64)
    images = torch.randint(0, 256, (EXPORT_BATCH, 28, 28), dtype=torch.uint8)
    grey = OnnxSplitModel(export_onnx(model, (images,), ["image"], tmp_path / "grey.onnx"))
    assert grey.input_names == ["image"]
    assert [site.scope for site in grey.sites] == [site.scope for site in split("lite0").sites]
    pixels = np.random.default_rng(1).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    with torch.no_grad():
        expected = model(torch.from_numpy(pixels)).numpy()
    np.testing.assert_allclose(grey.full({"image": pixels}), expected, rtol=1e-4, atol=1e-4)
    x: np.ndarray = pixels
    for stage in grey.build([site.value for site in grey.sites]):
        x = stage(x, {})
    np.testing.assert_allclose(x, expected, rtol=1e-4, atol=1e-4)


def test_lite0_drops_the_internal_cuts_of_blocks_without_skip(split: Callable[[str], OnnxSplitModel]) -> None:
    lite0 = split("lite0")
    ops = lite0.dataflow.ops
    site_values = {site.value for site in lite0.sites}
    internal: dict[str, list[str]] = {}
    for cand in cut_values(lite0.dataflow):
        block = block_of(cand.scope)
        if block.startswith("_blocks.") and cand.index != _last_op_of(lite0, block):
            internal.setdefault(block, []).append(cand.value)
    no_skip = {f"_blocks.{i}" for i, spec in enumerate(lite0_blocks()) if not spec.skip}
    # Inside a block without skip every op output is a cut (it is a chain); a skip keeps the input live.
    assert set(internal) == no_skip
    for block in no_skip:
        first = min(i for i, op in enumerate(ops) if block_of(op.scope) == block)
        assert len(internal[block]) == _last_op_of(lite0, block) - first
    assert not site_values & {v for values in internal.values() for v in values}


def test_resnet_sites_are_between_residual_blocks(split: Callable[[str], OnnxSplitModel]) -> None:
    resnet = split("resnet")
    ops = resnet.dataflow.ops
    # After the stem and after every block but the last, which only the classifier follows.
    stem_end = min(i for i, op in enumerate(ops) if block_of(op.scope) == "layer1.0") - 1
    ends = [stem_end, *(_last_op_of(resnet, block) for block in TinyResNet.BLOCKS[:-1])]
    assert [site.value for site in resnet.sites] == [ops[i].outputs[0] for i in ends]
    assert [ops[i].kind for i in ends] == ["Relu"] * 4


def test_vgg_sites_follow_every_conv_layer(split: Callable[[str], OnnxSplitModel]) -> None:
    vgg = split("vgg")
    ops = vgg.dataflow.ops
    # One site per conv layer, after its activation and pooling, i.e. right before the next heavy op.
    assert [site.heavy_before for site in vgg.sites] == list(range(1, TinyVGG.CONVS + 1))
    assert all(ops[site.index + 1].heavy for site in vgg.sites)
    assert [ops[site.index].kind for site in vgg.sites] == ["Relu", "MaxPool", "Flatten"]


def test_side_input_does_not_prevent_sites(split: Callable[[str], OnnxSplitModel]) -> None:
    masked = split("masked")
    assert masked.input_names == ["x", "mask"]
    ops = masked.dataflow.ops
    on_path = data_path_values(masked.dataflow)
    for i in range(3):  # every block reads a value computed from the mask alone
        (gating,) = [op for op in ops if op.scope == f"blocks.{i}" and op.kind == "Mul"]
        assert any(v not in on_path for v in gating.inputs)
    # Sites are where the blocks take their data in; after the last block only the classifier is left.
    block_inputs = [op.inputs[0] for op in ops if op.kind == "Conv" and op.scope.startswith("blocks.")]
    assert len(block_inputs) == 3
    assert [site.value for site in masked.sites] == block_inputs


# -------------------------------------------------------------------------------------- staged execution


def _cut_choices(model: OnnxSplitModel) -> list[tuple[str, ...]]:
    """No cut, every site, and three random subsets (given out of order: `build` sorts them)."""
    values = [site.value for site in model.sites]
    rng = random.Random(len(values))
    subsets = [tuple(rng.sample(values, rng.randint(1, len(values) - 1))) for _ in range(3)]
    return [(), tuple(values), *subsets]


def _staged(model: OnnxSplitModel, cuts: tuple[str, ...], feeds: dict[str, np.ndarray]) -> np.ndarray:
    primary, *side = model.input_names
    value = feeds[primary]
    for stage in model.build(cuts):
        value = stage(value, {name: feeds[name] for name in side})
    return value


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("batch", BATCHES)
def test_staged_equals_full(name: str, batch: int, split: Callable[[str], OnnxSplitModel]) -> None:
    model, feeds = split(name), _inputs(name, batch)
    full = model.full(feeds)
    with torch.no_grad():
        reference = _module(name)(*map(torch.from_numpy, feeds.values())).numpy()
    np.testing.assert_allclose(full, reference, rtol=1e-3, atol=1e-4)  # the export computes the module
    for cuts in _cut_choices(model):
        assert len(model.build(cuts)) == len(cuts) + 1
        np.testing.assert_allclose(_staged(model, cuts, feeds), full, rtol=1e-4, atol=1e-5, err_msg=str(cuts))


def test_stages_are_cached_and_read_side_inputs(split: Callable[[str], OnnxSplitModel]) -> None:
    masked = split("masked")
    cuts = tuple(site.value for site in masked.sites)
    stages = masked.build(cuts)
    assert all(a is b for a, b in zip(stages, masked.build(cuts)))
    feeds = _inputs("masked", 1)
    hidden = stages[0](feeds["x"], {"mask": feeds["mask"]})
    with pytest.raises(KeyError, match="mask"):
        stages[1](hidden, {})


def test_cut_that_is_not_a_site_is_rejected(split: Callable[[str], OnnxSplitModel]) -> None:
    lite0 = split("lite0")
    sites = {site.value for site in lite0.sites}
    # A cut value inside a block without skip: a valid cut of the graph, but not a site.
    internal = next(
        c.value for c in cut_values(lite0.dataflow) if block_of(c.scope) == "_blocks.1" and c.value not in sites
    )
    with pytest.raises(ValueError, match="not sites of this model"):
        lite0.build((lite0.sites[0].value, internal))
    with pytest.raises(ValueError, match="not sites of this model"):
        lite0.build(("no such value",))
    with pytest.raises(ValueError, match="more than once"):
        lite0.build((lite0.sites[0].value,) * 2)
