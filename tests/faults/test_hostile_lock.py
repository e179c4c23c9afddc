"""Hostile entries at the writer lock's name (`.rc-writer.lock`) and at a
step's claim (`claim.<i>-of-<n>.json`): a symbolic link, a FIFO, a directory,
a socket, put there by anyone who can write the tier's directory.

The rules, with real files through the real manager and the real command:
the lock is refused with DirectoryInUseError naming the path and what to do,
before anything of the step is written; nothing is truncated, created or
written through a link; nothing hangs on a FIFO (the first save, `gc` and
`gc --apply`); two live managers never both save because the lock could not
be taken. A claim that is not a regular file refuses the save of its step
(StepAlreadyExistsError naming it), never followed. Each call that could
hang runs in a thread with a deadline, and a hung one is freed by opening the
FIFO's other end.
"""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt.core import layout
from tests.support.cli import run

KINDS = ["symlink", "dangling symlink", "fifo", "directory", "socket"]


@pytest.fixture
def odd(tmp_path) -> Iterator[Callable[[str, str], str]]:
    """make(path, kind): puts an entry of `kind` at `path`; returns what a
    link points to. Sockets are closed and FIFOs freed at the end."""
    socks: list[socket.socket] = []
    fifos: list[str] = []

    def make(path: str, kind: str) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        target = str(tmp_path / "outside" / "precious")
        if kind == "symlink":
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                f.write("precious")
            os.symlink(target, path)
        elif kind == "dangling symlink":
            os.symlink(target, path)
        elif kind == "fifo":
            os.mkfifo(path)
            fifos.append(path)
        elif kind == "directory":
            os.mkdir(path)
        else:
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            socks.append(s)
        return target
    yield make
    for s in socks:
        s.close()
    for p in fifos:
        free(p)


def free(fifo: str) -> None:
    """Opens the FIFO's write end, which frees a reader blocked in open()."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() in a thread; fails the test if it does not return in time."""
    out: list = []

    def go() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(("err", e))
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    kind, value = out[0]
    if kind == "err":
        raise value
    return value


def manager(d: str, **kw: Any) -> rc.CheckpointManager:
    return rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(
        tiers=(rc.LocalTier(),), **kw))


def item(v: float = 1.0):
    return ocp.args.StandardSave({"a": np.full(3, v)})


def assert_untouched(kind: str, target: str) -> None:
    if kind == "symlink":
        with open(target) as f:
            assert f.read() == "precious"
    if kind == "dangling symlink":
        assert not os.path.lexists(target)  # nothing created through the link


@pytest.mark.parametrize("kind", KINDS)
def test_a_lock_that_is_not_a_regular_file_refuses_the_save(tmp_path, odd, kind):
    d = str(tmp_path / "c")
    lock = os.path.join(d, layout.WRITER_LOCK)
    target = odd(lock, kind)
    with manager(d) as m:
        with pytest.raises(rc.DirectoryInUseError) as ei:
            within(10, lambda: m.save(1, args=item()))
        msg = str(ei.value)
        assert lock in msg and "not a regular file" in msg and "remove it" in msg
        assert not os.path.exists(os.path.join(d, "1")) and m.all_steps() == []
        assert_untouched(kind, target)
        # Still refused on the next try; and a second manager is refused too.
        with pytest.raises(rc.DirectoryInUseError):
            within(10, lambda: m.save(2, args=item()))
        with manager(d) as other, pytest.raises(rc.DirectoryInUseError):
            within(10, lambda: other.save(3, args=item()))
    assert_untouched(kind, target)
    assert os.path.lexists(lock)  # left for the operator to look at


def test_with_the_lock_mended_the_save_goes_on(tmp_path, odd):
    d = str(tmp_path / "c")
    lock = os.path.join(d, layout.WRITER_LOCK)
    odd(lock, "directory")
    with manager(d) as m:
        with pytest.raises(rc.DirectoryInUseError):
            m.save(1, args=item())
        os.rmdir(lock)
        assert m.save(1, args=item())
        m.wait_until_finished()
        assert m.all_steps() == [1] and os.path.isfile(lock)


@pytest.mark.parametrize("apply", [False, True], ids=["dry run", "apply"])
@pytest.mark.parametrize("kind", KINDS)
def test_gc_skips_a_tier_whose_lock_is_not_a_regular_file(tmp_path, odd, kind, apply):
    d = str(tmp_path / "c")
    with manager(d) as m:
        m.save(1, args=item())
    leftover = os.path.join(d, "7", "00000000.c0.0.s")  # an uncommitted step's chunk
    os.makedirs(os.path.dirname(leftover))
    with open(leftover, "wb") as f:
        f.write(b"x")
    lock = os.path.join(d, layout.WRITER_LOCK)
    os.remove(lock)
    target = odd(lock, kind)
    p = within(20, lambda: run("gc", d, *(["--apply"] if apply else [])))
    assert "skipped" in p.stdout and "not a regular file" in p.stdout, p.stdout
    assert os.path.exists(leftover)  # a tier it cannot lock is left alone
    assert_untouched(kind, target)


@pytest.mark.parametrize("kind", KINDS)
def test_a_claim_that_is_not_a_regular_file_refuses_its_step(tmp_path, odd, kind):
    d = str(tmp_path / "c")
    claim = os.path.join(d, "1", layout.claim_name(0, 1))
    target = odd(claim, kind)
    # No cleanup at open: it would remove the odd entry of this uncommitted step.
    with manager(d, cleanup_tmp_directories=False) as m:
        m.save(1, args=item())
        with pytest.raises(rc.SaveFailedError) as ei:
            within(10, m.wait_until_finished)
        cause = ei.value.__cause__
        assert isinstance(cause, rc.StepAlreadyExistsError), cause
        assert claim in str(cause) and "not a regular file" in str(cause)
        assert m.all_steps() == []
        assert m.save(2, args=item(2.0))  # other steps are not held up
        m.wait_until_finished()
        assert m.all_steps() == [2]
    assert_untouched(kind, target)
