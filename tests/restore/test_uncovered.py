"""A restore from a partial choice (the manifests of only some writers of a
tier the whole job sees) checks, before it reads or allocates anything, that
its targets' boxes are covered by the chunks it holds; where they are not it
raises Uncovered, naming per leaf (item and leaf index of the step's
records) this process's target boxes, for the caller to read the writers
that hold them (`core.writers.covering`). A choice that is not partial
never pays for the check and fails as before. The partial choice is made
here from a one-process save by dropping the chunks of some devices'
boxes, as a process that holds only its own writers' manifests sees it."""
import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier
from resilient_ckpt.compat import args as args_lib
from resilient_ckpt.core import layout
from resilient_ckpt.restore import assemble
from resilient_ckpt.restore.reader import RestoreRecord
from resilient_ckpt.storage.files import FileStorage
from tests.support.layouts import SHAPE, host_values, mesh, saved


def _choice(root, ram, keep_rows_below: int):
    """The saved step's choice with the chunks of the row-split leaves ("a*",
    "b": 6 rows a device) at rows >= keep_rows_below dropped, made partial."""
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()], read_only=True)
    with CheckpointManager(root, options=opts) as m:
        choice = m.catalog.choice(1)
        storages = m.catalog.storages()
    assert choice is not None and not choice.partial
    def kept(lf):
        if lf.path[0][1][0] not in "ab":
            return lf
        return dataclasses.replace(lf, chunks=tuple(c for c in lf.chunks
                                                    if c.offsets[0] < keep_rows_below))
    items = tuple(dataclasses.replace(it, leaves=tuple(kept(lf) for lf in it.leaves))
                  for it in choice.manifest.items)
    return dataclasses.replace(choice, manifest=dataclasses.replace(choice.manifest, items=items),
                               partial=True), storages


def _restore(choice, storages, target):
    req = {args_lib.DEFAULT_ITEM: args_lib.RestoreRequest("pytree", item=target)}
    return assemble.restore_choice(choice, storages, layout.StepNaming(), req, False,
                                   RestoreRecord(choice.step), set(), None, 1 << 30)


def _target(state, sharding):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding if k[0] in "ab" else
                                    v.sharding) for k, v in state.items()}


def test_uncovered_targets_are_named_before_anything_is_read(dirs, monkeypatch):
    root, ram = dirs
    state = saved(root, ram, host_values())
    choice, storages = _choice(root, ram, 24)  # rows 0-23 of 48: devices 0-3's boxes
    reads = []
    for name in ("read_into", "map", "read"):
        real = getattr(FileStorage, name)

        def spy(self, *a, _real=real, _name=name, **k):
            reads.append(_name)
            return _real(self, *a, **k)
        monkeypatch.setattr(FileStorage, name, spy)
    # another layout: rows split 4 ways over devices 0-3 (12 rows each)
    four = NamedSharding(mesh(4, (4,), ("r",)), P("r"))
    with pytest.raises(assemble.Uncovered) as e:
        _restore(choice, storages, _target(state, four))
    assert reads == []
    leaves = {lf.path[0][1]: (ii, li) for ii, it in enumerate(choice.manifest.items)
              for li, lf in enumerate(it.leaves)}
    want = [((12 * i, 0), (12, SHAPE[1])) for i in range(4)]
    assert e.value.wants == {leaves[k]: want for k in ("a0", "a1", "a2", "a3", "b")}


def test_covered_targets_restore_from_a_partial_choice(dirs):
    """Every chunk held, partial or not: the check finds nothing missing and
    the restore onto another layout is exact."""
    root, ram = dirs
    host = host_values()
    state = saved(root, ram, host)
    choice, storages = _choice(root, ram, SHAPE[0])
    out = _restore(choice, storages, _target(state, NamedSharding(mesh(4, (4,), ("r",)),
                                                                  P("r"))))
    for k, v in host.items():
        assert np.array_equal(np.asarray(out[k]), v), k


def test_a_choice_that_is_not_partial_fails_as_before(dirs):
    root, ram = dirs
    state = saved(root, ram, host_values())
    choice, storages = _choice(root, ram, 24)
    with pytest.raises(ValueError) as e:
        _restore(dataclasses.replace(choice, partial=False), storages,
                 _target(state, NamedSharding(mesh(4, (4,), ("r",)), P("r"))))
    assert not isinstance(e.value, assemble.Uncovered)
