"""Importable `module:function` references for CLI tests (a user's factory and site policy)."""

from __future__ import annotations

import torch

from rampserve.zoo.cnn import resnet18


def tiny_resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return resnet18(width=4)


def every_other_cut(graph, candidates):
    return candidates[::2]
