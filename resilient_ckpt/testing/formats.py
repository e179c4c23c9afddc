"""Older manifest formats written from a current manifest's document, for
tests and benches that check what a reader of format 3 and earlier meets
(and what format 4 saves over it)."""
from __future__ import annotations


def as_version_3(doc: dict) -> dict:
    """A format-5 manifest's document (parsed JSON) as format 3 wrote it,
    changed in place and returned: each named sharding with its mesh written
    out, every device id listed, no `meshes` and no `writers`, `version` 3. The trailing
    checksum is left for the caller to sign again."""
    meshes = doc.pop("meshes")
    doc.pop("writers")
    for it in doc["items"]:
        for lf in it["leaves"]:
            s = lf["sharding"]
            if s and s["type"] == "named":
                m = meshes[s["mesh"]]
                lf["sharding"] = {"type": "named", "axis_names": m["axis_names"],
                                  "mesh_shape": m["mesh_shape"], "device_ids": [
                                      i for first, n in m["device_ids"]
                                      for i in range(first, first + n)], "spec": s["spec"]}
    doc["version"] = 3
    return doc
