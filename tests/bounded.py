"""Runs a test's coroutine with a bound, so a hang (a Redis that never answers, a listener that never delivers)
fails the test instead of stalling the run."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

HANG_GUARD_S = 30


def run_bounded(coro: Coroutine):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))
