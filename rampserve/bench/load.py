"""What a bench's load means, the same in every bench that replays a trace (`bench sim`, `bench live`, `bench
peers`, the demo): the replay's mean arrival rate as a share of what vanilla sustains back to back. The simulator has
no server to measure and takes the model's batch-1 capacity (`batch1_capacity_rps`: the profiled model alone, one
input after another); the live benches measure vanilla's closed-loop saturation (its server, batching and HTTP
included). Imports nothing heavy: the command line reads its default."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module for its default: no numpy on the way
    from rampserve.bundle_format.latency import LatencyProfile

# 0.2: on the bursty maf trace vanilla meets its SLO there in the simulator and is far from overload live, where a
# latency-first comparison belongs (at 0.5 of its live saturation, vanilla's own p95 was 930 ms)
DEFAULT_LOAD = 0.2


def batch1_capacity_rps(profile: LatencyProfile) -> float:
    """What the model serves back to back at batch 1, charged nothing else: the simulator's measure of what vanilla
    sustains."""
    return 1000.0 / profile.full(1)


def rate_at_load(load: float, saturation_rps: float) -> float:
    """The mean arrival rate at `load`, that share of what vanilla sustains back to back (`saturation_rps`)."""
    return load * saturation_rps
