"""Importable `module:function` references for tests: a user's factory, site policy and race decider."""

from __future__ import annotations

import torch

from rampserve.zoo.cnn import resnet18


def tiny_resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return resnet18(width=4)


def every_other_cut(graph, candidates):
    return candidates[::2]


def largest_label(arrived, expected, final):
    """A user's race decider: once all have answered (or time is up), the largest label given."""
    from rampserve.control.deciders import Decision

    if not final or not arrived:
        return None
    top = max(arrived, key=lambda c: c.label)
    return Decision(top.label, top.confidence, (top.model,))
