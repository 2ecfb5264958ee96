"""ResNet and VGG for 1x28x28 grayscale inputs (Fashion-MNIST), written without torchvision.

The layouts and attribute names follow torchvision (`conv1, bn1, relu, layer1..layer4, avgpool, fc` and
`features, avgpool, classifier`) so module paths read the way people expect, but the stems are adapted to
28x28 inputs and every width scales with one `width` parameter, so narrow models train on a 2-core CPU.
Every forward is torch.fx-traceable: control flow depends only on the module structure, never on data, and
no op is in-place (the ramp analysis reads the traced graph as pure dataflow).
"""

from __future__ import annotations

import torch
from torch import nn

NUM_CLASSES = 10
IN_CHANNELS = 1


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


def _downsample(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """The 1x1 projection on the skip path, needed only where the block changes shape."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.downsample = _downsample(in_channels, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU()
        self.downsample = _downsample(in_channels, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet with a 3x3 stride-2 stem and no max-pool: 28x28 -> 14 -> 14 -> 7 -> 4 -> 2 across the stages.

    Starting the stages at 14x14 rather than 28x28 costs little accuracy on Fashion-MNIST and cuts the
    compute four-fold, which is what makes full training fit the CPU budget.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int],
        width: int = 16,
        num_classes: int = NUM_CLASSES,
    ) -> None:
        super().__init__()
        self.conv1 = _conv3x3(IN_CHANNELS, width, stride=2)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        channels = width
        stages = []
        for index, depth in enumerate(layers):
            planes = width * 2**index
            stride = 1 if index == 0 else 2
            blocks = []
            for position in range(depth):
                blocks.append(block(channels, planes, stride if position == 0 else 1))
                channels = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        # Zero the last BN of each residual branch so every block starts as the identity: faster early
        # training, which matters with only a couple of epochs.
        for module in self.modules():
            if isinstance(module, (BasicBlock, Bottleneck)):
                last_bn = module.bn3 if isinstance(module, Bottleneck) else module.bn2
                nn.init.zeros_(last_bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# Torchvision's VGG configurations at width 64: numbers are conv output channels, "M" a 2x2 max-pool.
VGG_CONFIGS: dict[str, tuple[int | str, ...]] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
}


class VGG(nn.Module):
    """VGG with batch norm; pools round up (ceil_mode) so all five fit 28x28: 28 -> 14 -> 7 -> 4 -> 2 -> 1."""

    def __init__(self, config: tuple[int | str, ...], width: int = 64, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = IN_CHANNELS
        for item in config:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=True))
            else:
                out_channels = int(item) * width // 64
                layers += [_conv3x3(channels, out_channels), nn.BatchNorm2d(out_channels), nn.ReLU()]
                channels = out_channels
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        # Torchvision's 4096-wide classifier would dwarf these narrow convolutions; one hidden layer as wide
        # as the last feature map is enough for 10 classes.
        self.classifier = nn.Sequential(
            nn.Linear(channels, channels),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(channels, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.classifier(x)


def resnet18(width: int = 16) -> ResNet:
    return ResNet(BasicBlock, (2, 2, 2, 2), width=width)


def resnet50(width: int = 16) -> ResNet:
    return ResNet(Bottleneck, (3, 4, 6, 3), width=width)


def vgg11(width: int = 16) -> VGG:
    return VGG(VGG_CONFIGS["vgg11"], width=width)


def vgg16(width: int = 16) -> VGG:
    return VGG(VGG_CONFIGS["vgg16"], width=width)
