"""The artifact cache's machine-wide lock: while one holder is inside `exclusive`, no other open of the lock can
take it; once it has left, one can (what keeps two processes from building the same bundle at once)."""

from __future__ import annotations

import fcntl

import pytest

from rampserve.paths import exclusive


def can_take(lock_file) -> bool:
    """Whether another open of `lock_file` takes its lock now, without waiting (as another process would)."""
    with open(lock_file, "w") as other:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(other, fcntl.LOCK_UN)
        return True


def test_a_held_lock_excludes_every_other_holder_until_it_is_left(tmp_path) -> None:
    folder = tmp_path / "bundles"  # made by the lock if missing
    with exclusive(folder, "resnet18-fmnist"):
        lock_file = folder / ".resnet18-fmnist.lock"
        assert not can_take(lock_file)
        assert can_take(folder / ".another.lock")  # a lock per artifact: others build meanwhile
    assert can_take(lock_file)


def test_a_lock_is_left_when_its_work_raises(tmp_path) -> None:
    with pytest.raises(RuntimeError):
        with exclusive(tmp_path, "bundle"):
            raise RuntimeError("preparing failed")
    assert can_take(tmp_path / ".bundle.lock")
