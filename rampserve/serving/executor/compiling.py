"""What compiling a set came to, and which sets to compile ahead: what the executor's threads share about compiled
sets, whatever compiles them (a torch model's TorchScript sets are compiled by `compiler`'s worker process, an ONNX
model's built where they are served)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CompileOutcome:
    sites: tuple[str, ...]
    outcome: str  # "compiled", "refused" or "failed"
    seconds: float  # from the request to the outcome
    reason: str = ""


def likely_next_sets(active: Sequence[str], sites: Sequence[str], limit: int = 32) -> list[tuple[str, ...]]:
    """Sets the controller's next decisions may ask for, most likely first: the set with no ramp, each active ramp
    dropped (a ramp that stopped paying), each inactive site added, then each active ramp moved to another site
    (Apparate's adjustment moves one ramp at a time)."""
    current = set(active)
    inactive = [s for s in sites if s not in current]
    candidates = [()] + [tuple(current - {a}) for a in active] + [tuple(current | {s}) for s in inactive]
    candidates += [tuple((current - {a}) | {s}) for a in active for s in inactive]
    order = {s: i for i, s in enumerate(sites)}
    unique = dict.fromkeys(tuple(sorted(c, key=order.__getitem__)) for c in candidates)
    unique.pop(tuple(sorted(current, key=order.__getitem__)), None)
    return list(unique)[:limit]
