"""A Hypothesis state machine over save, crash, corrupt, delete, restore and
reopen, on real RAM-tier and local-tier directories, checked against a model
of what each step holds and which steps are restorable.

The model: a step is restorable iff each of its chunks has, in some tier, an
intact copy beside an intact manifest (format.md, section 8); `restore()`
gives the newest restorable step, `restore(s)` gives step s exactly or
raises; every restorable step is listed. Retention keeps everything here, so
only `delete` removes steps.

Two sizes: `TestCheckpoints` (the default run: 30 examples of up to 16
rules at the default Hypothesis profile) and `TestCheckpointsLong` (marked
slow: 200 examples of up to 40 rules). Both scale with the profile
(tests/support/effort.py): `--hypothesis-profile=thorough` runs ten times as
many examples, and up to 40 rules in the default-size machine too.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import shutil
import tempfile
import uuid

import orbax.checkpoint as ocp
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import resilient_ckpt as rc
from resilient_ckpt.core import layout, manifest as mf
from resilient_ckpt.save import claim
from tests.support import effort, writer as _writer

TIERS = ("ram", "local")


@dataclasses.dataclass
class Step:
    """What the model knows of one committed step."""

    seed: int
    keys: list[str]
    # chunk -> (the file holding it, its offset there, its size): the same in
    # both tiers (one writer's chunks are packed alike wherever they go)
    places: dict[str, tuple[str, int, int]]
    bad: dict[str, set[str]]  # tier -> chunks whose copy there is damaged
    torn: set[str]  # tiers whose manifest is damaged
    # (tier, file) -> byte offsets flipped an odd number of times: flipping a
    # byte twice restores it, so a file is damaged while this set is not empty
    flips: dict[tuple[str, str], set[int]] = dataclasses.field(default_factory=dict)

    def flip(self, tier: str, name: str, at: int, manifest: bool) -> None:
        odd = self.flips.setdefault((tier, name), set())
        odd ^= {at}
        damaged = self.torn if manifest else self.bad[tier]
        key = tier if manifest else name
        if odd:
            damaged.add(key)
        else:
            damaged.discard(key)

    def restorable(self) -> bool:
        return all(any(t not in self.torn and k not in self.bad[t] for t in TIERS)
                   for k in self.keys)


class Checkpoints(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.roots = {"ram": tempfile.mkdtemp(prefix="rc-sm-", dir="/dev/shm"),
                      "local": tempfile.mkdtemp(prefix="rc-sm-")}
        self.model: dict[int, Step] = {}
        self.next_step, self.seeds = 1, 0
        self.m = self._open()

    def _open(self) -> rc.CheckpointManager:
        return rc.CheckpointManager(self.roots["local"], options=rc.CheckpointManagerOptions(
            tiers=(rc.RamTier(path=self.roots["ram"], keep=None),
                   rc.LocalTier(path=self.roots["local"], keep=None, fsync=False))))

    def _dir(self, tier: str, step: int) -> str:
        return os.path.join(self.roots[tier], str(step))

    def _restorable(self) -> list[int]:
        return sorted(s for s, m in self.model.items() if m.restorable())

    def teardown(self):
        try:
            self.m.close()
        finally:
            for root in self.roots.values():
                shutil.rmtree(root, ignore_errors=True)

    # ------------------------------------------------------------ rules

    @initialize()
    def first_save(self):
        self.save()

    @rule()
    def save(self):
        step, self.seeds = self.next_step, self.seeds + 1
        assert self.m.save(step, args=ocp.args.StandardSave(_writer.state(self.seeds)))
        self.m.wait_until_finished()
        with open(os.path.join(self._dir("local", step), layout.manifest_name(0, 1)), "rb") as f:
            chunks = [c for _, _, c in mf.parse(f.read()).chunks()]
        self.model[step] = Step(self.seeds, [c.key for c in chunks],
                                {c.key: (c.object, c.pack_offset, c.stored_nbytes)
                                 for c in chunks}, {t: set() for t in TIERS}, set())
        self.next_step += 1

    @rule(tiers=st.sampled_from([("ram",), ("local",), TIERS]))
    def crash(self, tiers):
        """Leaves the next step torn, as a writer killed mid-save would: chunks,
        its marker and its claim, no manifest. A kill cannot be aimed from
        inside this process, so the files are made by hand (the one fault
        simulated here); then a new manager opens, as a restarted job does."""
        self.m.close()
        me = layout.Writer.me()
        dead = layout.Writer(me.host, os.getpid(), 1)  # this pid, another start: dead
        sid = uuid.uuid4().hex
        for t in tiers:
            d = self._dir(t, self.next_step)
            os.makedirs(d, exist_ok=True)
            for i in range(3):
                with open(os.path.join(d, f"{sid[:8]}.c0.1.{8 * i}_0"), "wb") as f:
                    f.write(os.urandom(1024))
            open(os.path.join(d, dead.marker_name()), "wb").close()
            with open(os.path.join(d, layout.claim_name(0, 1)), "wb") as f:
                f.write(claim.encode(sid, dead))
        self.m = self._open()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from(TIERS), what=st.integers(-1, 3))
    def corrupt(self, data, tier, what):
        """Flips a byte of one tier's copy of a chunk (what >= 0) or of its
        manifest (what == -1, its first byte: it no longer parses)."""
        step = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[step]
        if what < 0:
            name, at = layout.manifest_name(0, 1), 0
            held_in, start = name, 0
        else:
            name = sorted(m.keys)[what % len(m.keys)]
            held_in, start, size = m.places[name]  # a range of a pack
            at = data.draw(st.integers(0, size - 1))
        m.flip(tier, name, at, manifest=what < 0)
        _flip(os.path.join(self._dir(tier, step), held_in), start + at)
        self.m.reload()  # the manager sees the damage as a reader opening now would

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        step = data.draw(st.sampled_from(sorted(self.model)))
        if step not in self.m.all_steps():
            assert not self.model[step].restorable()
            return
        self.m.delete(step)
        del self.model[step]
        assert not any(os.path.exists(self._dir(t, step)) for t in TIERS)

    @rule()
    def restore_latest(self):
        want = self._restorable()
        target = ocp.args.StandardRestore(_writer.abstract())
        if not want:
            with pytest.raises(rc.StepNotFoundError):
                self.m.restore(None, args=target)
            return
        out = self.m.restore(None, args=target)
        assert _writer.exact(out, self.model[want[-1]].seed), (out["n"], want)

    @rule(data=st.data())
    def restore_step(self, data):
        step = data.draw(st.integers(0, self.next_step))
        target = ocp.args.StandardRestore(_writer.abstract())
        m = self.model.get(step)
        if m is None or not m.restorable():
            with pytest.raises(rc.CheckpointError):
                self.m.restore(step, args=target)
            return
        assert _writer.exact(self.m.restore(step, args=target), m.seed)

    @rule()
    def reopen(self):
        self.m.close()
        self.m = self._open()

    @invariant()
    def restorable_steps_are_listed(self):
        assert set(self._restorable()) <= set(self.m.all_steps())


def _flip(path: str, at: int) -> None:
    """Writes `path` again with byte `at` inverted, by rename: a mapping of the
    old file (a restored RAM-tier array) keeps its bytes."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[at] ^= 0xFF
    tmp = os.path.join(os.path.dirname(path), ".flip")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


Checkpoints.TestCase.settings = settings(
    max_examples=effort.examples(30), stateful_step_count=40 if effort.long() else 16,
    deadline=None)
TestCheckpoints = Checkpoints.TestCase


class CheckpointsLong(Checkpoints):
    """The same machine, longer: more examples, more rules each."""


CheckpointsLong.TestCase.settings = settings(
    max_examples=effort.examples(200), stateful_step_count=40, deadline=None)
# About 40 s at the default profile, ten times that at "thorough".
TestCheckpointsLong = pytest.mark.timeout(1800)(pytest.mark.slow(CheckpointsLong.TestCase))
