"""Sharding descriptions (`core.sharding`): the leaves of one mesh share its
lists, a manifest writes the mesh once and parses back to the same
descriptions, and `rebuild` makes each saved mesh once per memo, on 8 real
CPU devices."""
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt.core import manifest as mf
from resilient_ckpt.core.sharding import describe, rebuild


def _mesh(order=None) -> Mesh:
    devices = jax.devices()[:8] if order is None else [jax.devices()[i] for i in order]
    return Mesh(np.array(devices).reshape(4, 2), ("data", "model"))


def test_the_leaves_of_one_mesh_share_its_lists_and_round_trip_through_a_manifest():
    mesh, other = _mesh(), _mesh([7, 6, 5, 4, 0, 1, 2, 3])
    descs = [describe(NamedSharding(mesh, P("data"))), describe(NamedSharding(mesh, P())),
             describe(NamedSharding(other, P(None, "model")))]
    assert descs[0]["device_ids"] is descs[1]["device_ids"]
    assert descs[2]["device_ids"] == [7, 6, 5, 4, 0, 1, 2, 3]
    leaves = tuple(mf.LeafRecord((("key", f"w{i}"),), "array", (8, 4), "float32", d)
                   for i, d in enumerate(descs))
    m = mf.Manifest(1, "ab" * 16, 1.0, 0, 1, (mf.ItemRecord("default", "pytree", leaves),))
    data = mf.to_json(m)
    assert data.count(b'"device_ids"') == 2  # once per mesh, not per leaf
    back = mf.parse(data)
    assert back == m
    for d, lf in zip(descs, back.items[0].leaves, strict=True):
        assert rebuild(lf.sharding) == rebuild(d)


def test_rebuild_makes_each_saved_mesh_once_per_memo_and_refuses_a_missing_device():
    mesh = _mesh()
    a, b = describe(NamedSharding(mesh, P("data"))), describe(NamedSharding(mesh, P("model")))
    memo: dict = {}
    sa, sb = rebuild(a, memo), rebuild(b, memo)
    assert sa == NamedSharding(mesh, P("data")) and sb == NamedSharding(mesh, P("model"))
    assert sa.mesh is sb.mesh and len(memo) == 1
    # equal lists that are other objects: rebuilt again, never taken for another's
    c = dict(a, device_ids=list(a["device_ids"]))
    assert rebuild(c, memo) == sa and len(memo) == 2
    gone = dict(a, device_ids=[0, 1, 2, 3, 4, 5, 6, 99])
    assert rebuild(gone, memo) is None and rebuild(gone) is None
    assert rebuild({"type": "single_device", "device_id": 3}) == \
        jax.sharding.SingleDeviceSharding(jax.devices()[3])
    assert rebuild({"type": "other", "device_ids": [0], "repr": ""}) is None
