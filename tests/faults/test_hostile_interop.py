"""`export` and `import` (cli/interop.py) given hostile names and hostile
Orbax steps: names that are not one path component, metadata that points
outside the step, shapes no memory holds, FIFOs, malformed and fuzzed JSON,
step numbers past the range. Each gets a clean CheckpointError naming the
file, leaf or step; nothing is written outside the destination, nothing hangs.
"""
from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier
from resilient_ckpt.cli import interop
from resilient_ckpt.compat import foreign
from resilient_ckpt.core import codec, layout
from resilient_ckpt.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
from resilient_ckpt.native import crc32c
from tests.support import effort
from tests.support.cli import run


def tree(seed=0):
    return {"a": np.arange(6, dtype=np.float32).reshape(2, 3) + seed,
            "b": {"c": np.arange(4, dtype=np.int64)}}


def ours(d, items):
    """Step 5 of our format at `d` holding one StandardSave per item name.
    A name `save` refuses is written as `save` would not: saved under another
    name, then renamed in the manifest, re-signed (a hostile writer's step)."""
    opts = CheckpointManagerOptions(tiers=[LocalTier()])
    given = {n if layout.is_name(n) else f"item{i}": n for i, n in enumerate(items)}
    with CheckpointManager(d, options=opts) as m:
        m.save(5, args=ocp.args.Composite(**{n: ocp.args.StandardSave(tree()) for n in given}))
        m.wait_until_finished()
    path = os.path.join(d, "5", "manifest.0-of-1.json")
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc.pop("manifest_crc32c")
    for it in doc["items"]:
        it["name"] = given[it["name"]]
    body = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    with open(path, "wb") as f:
        f.write(body + b',"manifest_crc32c":%d}' % crc32c.value(body))
    return d


def orbax_step(root, step=1, ocdbt=False, json_item=False):
    """An Orbax CheckpointManager step at `root/<step>` (zarr per array when
    not `ocdbt`, so each array has its own directory and `.zarray`)."""
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add("default", ocp.args.PyTreeSave, handler)
    reg.add("default", ocp.args.PyTreeRestore, handler)
    if json_item:
        reg.add("extra", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        reg.add("extra", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
    items = {"default": ocp.args.PyTreeSave(tree())}
    if json_item:
        items["extra"] = ocp.args.JsonSave({"lr": 0.1})
    with ocp.CheckpointManager(root, handler_registry=reg) as m:
        m.save(step, args=ocp.args.Composite(**items))
        m.wait_until_finished()
    return root / str(step)


# ---------------------------------------------------------------- export

BAD_NAMES = ["..", "../evil", "a/b", "x" * 300, "nul\x00byte"]


@pytest.mark.parametrize("name", BAD_NAMES + ["ABS"])
def test_export_refuses_an_item_name_that_is_not_one_path_component(tmp_path, name):
    if name == "ABS":
        name = str(tmp_path / "outside")
    d = ours(tmp_path / "ours", [name])  # written by a hostile writer: `save` refuses the name
    dest = tmp_path / "dest"
    with pytest.raises(CorruptCheckpointError, match="item name .*one path component"):
        interop.export_step(d, 5, dest)
    assert not dest.exists() and not (tmp_path / "outside").exists()
    assert not (tmp_path / "evil").exists() and os.listdir(tmp_path) == ["ours"]


def test_check_name_is_the_one_rule():
    for good in ["default", "a.b", "step_7", "x" * 255]:
        assert layout.check_name(good, "item name") == good
        assert layout.check_item_name(good, "save") == good and layout.is_name(good)
    for bad in BAD_NAMES + ["", ".", "/abs", 7, None, "\udcff" * 300, "\ud800"]:
        assert not layout.is_name(bad)
        with pytest.raises(CorruptCheckpointError, match="one path component"):
            layout.check_name(bad, "item name")
        with pytest.raises(ValueError, match="one path component") as info:
            layout.check_item_name(bad, "save")
        assert not isinstance(info.value, CheckpointError)  # the caller's input, not storage


@pytest.mark.parametrize("name", BAD_NAMES + ["", ".", "/abs", "back\\slash"])
@pytest.mark.parametrize("kind", ["StandardSave", "JsonSave"])
def test_save_refuses_an_item_name_that_is_not_one_path_component(tmp_path, name, kind):
    """Before, `save` took any Composite key (chunks are not named by it) and
    the step was then refused by `export`, or exported outside DEST by an
    older tool: now a ValueError naming the item, before anything is written."""
    value = ocp.args.StandardSave(tree()) if kind == "StandardSave" else ocp.args.JsonSave({"a": 1})
    d = tmp_path / "ours"
    with CheckpointManager(d, options=CheckpointManagerOptions(tiers=[LocalTier()])) as m:
        with pytest.raises(ValueError, match="item name .*one path component") as info:
            m.save(1, args=ocp.args.Composite(good=ocp.args.StandardSave(tree()),
                                              **{name: value}))
        assert repr(name)[:40].strip("'") in str(info.value)
        assert m.all_steps() == [] and m.latest_step() is None
        m.save(1, args=ocp.args.Composite(good=ocp.args.StandardSave(tree())))  # the step is free
        m.wait_until_finished()
        assert m.all_steps() == [1]
    assert sorted(os.listdir(d)) == [".rc-tiers.json", ".rc-writer.lock", "1"]


def own(path):
    return {n if not n.startswith("ocdbt.process_") else "ocdbt.process_*"
            for n in os.listdir(path)}


def test_an_exported_step_is_one_orbax_restores_without_args(tmp_path):
    d = tmp_path / "ours"
    with CheckpointManager(d, options=CheckpointManagerOptions(tiers=[LocalTier()])) as m:
        m.save(5, args=ocp.args.StandardSave(tree()))
        m.wait_until_finished()
    dest, real = tmp_path / "orbax", tmp_path / "real"
    interop.export_step(d, 5, dest, group_bytes=8)
    with ocp.CheckpointManager(real) as theirs:  # the same step, written by Orbax itself
        theirs.save(5, args=ocp.args.StandardSave(tree()))
        theirs.wait_until_finished()
    assert os.listdir(dest) == ["5"]  # no temporary left beside it
    assert own(dest / "5") == own(real / "5")
    # the same files in the item but for the ocdbt sub-stores' names (one per partial save)
    assert own(dest / "5" / "default") == own(real / "5" / "default")
    seen: list = []
    for where in (dest, real):
        with ocp.CheckpointManager(where) as theirs:
            known = theirs.item_metadata(5) is not None  # Orbax 0.12.8: not before a restore
            got = theirs.restore(5)  # no args: the way Orbax restores its own steps
            assert theirs.item_metadata(5) is not None
        seen.append(known)
        assert np.asarray(got["a"]).tobytes() == tree()["a"].tobytes()
        assert np.asarray(got["b"]["c"]).tobytes() == tree()["b"]["c"].tobytes()
    assert seen[0] == seen[1]


def test_a_failed_export_leaves_no_directory_it_created(tmp_path):
    d = ours(tmp_path / "ours", ["default"])
    for n in os.listdir(d / "5"):
        if layout.is_chunk_name(n):  # every chunk damaged: the export fails part way
            p = d / "5" / n
            data = bytearray(p.read_bytes())
            data[0] ^= 0xFF
            p.write_bytes(bytes(data))
    dest = tmp_path / "new" / "deeper"
    with pytest.raises(CheckpointError, match="step 5"):
        interop.export_step(d, 5, dest)
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- import

def _rewrite(path, fn):
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(fn(doc)))


def _absolute_key(step, tmp_path):
    """Points the step's array `a` at another step's array (one it must not reach)."""
    outside = orbax_step(tmp_path / "elsewhere")
    target = str(outside / "default" / "a")

    def point_outside(doc):
        meta = doc["tree_metadata"].pop("('a',)")
        meta["key_metadata"][0]["key"] = target
        doc["tree_metadata"][repr((target,))] = meta
        return doc

    _rewrite(step / "default" / "_METADATA", point_outside)


def test_import_refuses_an_array_named_by_an_absolute_path(tmp_path):
    step = orbax_step(tmp_path / "theirs")
    _absolute_key(step, tmp_path)
    with pytest.raises(CorruptCheckpointError, match="one path component"):
        interop.import_step(step, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("key", ["..", "../elsewhere", "a/b", ""])
def test_import_refuses_array_keys_that_make_paths(tmp_path, key):
    step = orbax_step(tmp_path / "theirs")

    def rename(doc):
        doc["tree_metadata"]["('a',)"]["key_metadata"][0]["key"] = key
        return doc

    _rewrite(step / "default" / "_METADATA", rename)
    with pytest.raises(CorruptCheckpointError, match=r"_METADATA.*one path component"):
        interop.import_step(step, tmp_path / "ours")


def test_a_shape_no_memory_holds_is_refused_before_reading(tmp_path):
    step = orbax_step(tmp_path / "theirs")

    def huge(doc):
        doc["shape"] = [2**40, 2**20]
        doc["chunks"] = [2**40, 2**20]
        return doc

    _rewrite(step / "default" / "a" / ".zarray", huge)
    # in a subprocess: before the fix this aborted the process (std::bad_alloc)
    p = run("import", step, tmp_path / "ours", code=1, installed=True)
    assert "bytes" in p.stderr and "default" in p.stderr and "Traceback" not in p.stderr


def _bomb(step, rows, name="a", chunks=None):
    """Array `name` of `step` made to claim `rows` x 3 float32 in one chunk,
    that chunk a zstd frame of that many bytes of ones: a file of a few KiB
    that decodes to rows * 12 bytes (Orbax reads whatever it decodes to)."""
    arr = step / "default" / name
    zarray = json.loads((arr / ".zarray").read_text())
    zarray["shape"], zarray["chunks"], zarray["dtype"] = [rows, 3], chunks or [rows, 3], "<f4"
    (arr / ".zarray").write_text(json.dumps(zarray))
    for f in arr.iterdir():
        if f.name != ".zarray":
            f.unlink()
    (arr / ".".join("0" * len(zarray["shape"]))).write_bytes(
        codec.compress(np.ones((rows, 3), np.float32)))
    return rows * 12


MIB = 1 << 20


def test_an_array_past_max_item_bytes_is_refused_before_reading(tmp_path):
    """A 2 KiB file that decodes to 24 MiB: the import reads it only when the
    caller allows an item that large (before, there was no such bound)."""
    step = orbax_step(tmp_path / "theirs")
    claimed = _bomb(step, 2 * MIB)
    assert (step / "default" / "a" / "0.0").stat().st_size < 8192
    with pytest.raises(CorruptCheckpointError) as e:
        interop.import_step(step, tmp_path / "ours", max_item_bytes=16 * MIB)
    msg = str(e.value)
    assert "'a'" in msg and str(claimed) in msg and str(16 * MIB) in msg, msg
    assert "--max-item-bytes" in msg and "max_item_bytes" in msg, msg
    assert not (tmp_path / "ours").exists()  # nothing written at the destination
    moved = interop.import_step(step, tmp_path / "ours", max_item_bytes=32 * MIB)
    assert moved.bytes == claimed + tree()["b"]["c"].nbytes  # genuine once allowed
    with CheckpointManager(tmp_path / "ours") as m:
        assert float(np.asarray(m.restore(1)["a"]).sum()) == 2 * MIB * 3


def test_the_default_bound_is_a_quarter_of_memory(tmp_path, monkeypatch):
    """On a host of 64 MiB (mocked: no test can shrink this host), an item of
    24 MiB, less than its memory, is refused by default (before, imported:
    an import holds the step, our save a second copy and the RAM tier a
    third, so an item near the memory ended the process)."""
    monkeypatch.setattr(foreign, "memory_bytes", lambda: 64 * MIB)
    step = orbax_step(tmp_path / "theirs")
    claimed = _bomb(step, 2 * MIB)
    with pytest.raises(CorruptCheckpointError, match=f"{claimed}.*{16 * MIB}"):
        interop.import_step(step, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
    assert foreign.default_item_bytes() == 16 * MIB


def test_an_item_whose_arrays_together_pass_the_bound_is_refused(tmp_path):
    step = orbax_step(tmp_path / "theirs")
    _bomb(step, MIB // 2, "a")  # 6 MiB each, 12 MiB together
    _bomb(step, MIB // 2, "b.c")
    with pytest.raises(CorruptCheckpointError, match=r"item .* to \d+ bytes") as e:
        interop.import_step(step, tmp_path / "ours", max_item_bytes=8 * MIB)
    assert str(8 * MIB) in str(e.value) and str(step / "default") in str(e.value)
    assert not (tmp_path / "ours").exists()


def test_a_chunk_past_the_bound_is_refused_even_in_a_small_array(tmp_path):
    step = orbax_step(tmp_path / "theirs")
    _rewrite(step / "default" / "a" / ".zarray", lambda doc: {**doc, "chunks": [2 * MIB, 3]})
    with pytest.raises(CorruptCheckpointError, match=f"chunks .*{24 * MIB} bytes"):
        interop.import_step(step, tmp_path / "ours", max_item_bytes=MIB)
    assert not (tmp_path / "ours").exists()


def test_the_tool_takes_max_item_bytes(tmp_path):
    step = orbax_step(tmp_path / "theirs")
    claimed = _bomb(step, 2 * MIB)
    p = run("import", step, tmp_path / "ours", "--max-item-bytes", "16M", code=1)
    assert str(claimed) in p.stderr and "--max-item-bytes" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "ours").exists()
    for bad in ("0", "-5", "lots", "1.5G", "16Q"):
        p = run("import", step, tmp_path / "ours", "--max-item-bytes", bad, code=2)
        assert "--max-item-bytes" in p.stderr, p.stderr
    for bad in (0, -1, 1.5, True, "16M"):
        with pytest.raises(ValueError, match="max_item_bytes"):
            interop.import_step(step, tmp_path / "ours", max_item_bytes=bad)
    run("import", step, tmp_path / "ours", "--max-item-bytes", "32M")
    assert os.listdir(tmp_path / "ours" / "1")


def _unblock(fifo):
    try:  # a reader still blocked on the FIFO gets EOF and lets the thread go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _raised_within(fn, fifo, seconds=30):
    """What `fn()` raised (None if nothing), run in a thread; the test fails
    if it is still blocked after `seconds` (the FIFO is then opened to free it)."""
    out: list = []

    def go():
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        _unblock(fifo)
        t.join(5)
        pytest.fail(f"blocked on the FIFO {fifo}")
    return out[0]


@pytest.mark.parametrize("where", ["_CHECKPOINT_METADATA", "default/_METADATA",
                                   "default/a/.zarray", "default/a/0.0", "extra/metadata"])
def test_a_fifo_anywhere_in_the_step_is_refused_without_a_hang(tmp_path, where):
    step = orbax_step(tmp_path / "theirs", json_item=True)
    fifo = step / where
    os.remove(fifo)
    os.mkfifo(fifo)
    err = _raised_within(lambda: interop.import_step(step, tmp_path / "ours"), fifo)
    assert isinstance(err, CheckpointError), err
    assert where.rpartition("/")[2] in str(err) and "regular file" in str(err)


@pytest.mark.parametrize("where,content", [
    ("_CHECKPOINT_METADATA", "[]"),
    ("_CHECKPOINT_METADATA", '{"item_handlers": 5}'),
    ("_CHECKPOINT_METADATA", '{"metrics": [1]}'),
    ("_CHECKPOINT_METADATA", "[" * 100000 + "]" * 100000),
    ("_CHECKPOINT_METADATA", "not json"),
    ("default/_METADATA", '{"tree_metadata": []}'),
    ("default/_METADATA", '{"tree_metadata": {"x": 5}}'),
    ("default/_METADATA", '{"tree_metadata": {"x": {"key_metadata": 3}}}'),
    ("default/_METADATA", "{" * 100000),
    ("default/a/.zarray", '{"shape": "big"}'),
    ("default/a/.zarray", "[]"),
    ("extra/metadata", "[" * 100000),
    ("extra/metadata", '{"lr": Infinity}'),  # Orbax's JSON takes it; ours does not
])
def test_malformed_metadata_is_a_clean_error_naming_the_file(tmp_path, where, content):
    step = orbax_step(tmp_path / "theirs", json_item=True)
    (step / where).write_text(content)
    with pytest.raises(CheckpointError) as e:
        interop.import_step(step, tmp_path / "ours")
    assert str(step) in str(e.value)


def test_a_step_directory_past_the_step_range_is_refused(tmp_path):
    root = tmp_path / "theirs"
    orbax_step(root, step=3)
    big = root / str(2**63)
    os.rename(root / "3", big)
    with pytest.raises(CheckpointError, match=str(2**63)):
        interop.import_step(big, tmp_path / "ours")
    with pytest.raises(StepNotFoundError, match="not an Orbax checkpoint"):
        interop.import_step(root, tmp_path / "ours")  # not listed as a step
    assert not (tmp_path / "ours").exists()


# ---------------------------------------------------------------- fuzz

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                    | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
@st.composite
def mutations(draw, template):
    """(file, new bytes) for any file of the step: random JSON, random bytes,
    the file cut short, or (a JSON file) its own JSON with one value replaced."""
    files = sorted(os.path.relpath(os.path.join(r, f), template)
                   for r, _, fs in os.walk(template) for f in fs)
    where = draw(st.sampled_from(files))
    data = (template / where).read_bytes()
    how = draw(st.sampled_from(["json", "bytes", "cut", "replace", "replace"]))
    try:
        doc = json.loads(data)
    except ValueError:
        how = how if how != "replace" else "bytes"
    if how == "json":
        return where, json.dumps(draw(JSON)).encode()
    if how == "bytes":
        return where, draw(st.binary(max_size=64))
    if how == "cut":
        return where, data[:draw(st.integers(0, max(0, len(data) - 1)))]
    spots, todo = [], [((), doc)]
    while todo:
        path, v = todo.pop()
        spots.append(path)
        kids = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        todo.extend(((*path, k), x) for k, x in kids)
    path = draw(st.sampled_from(spots))
    new = draw(JSON)
    if not path:
        return where, json.dumps(new).encode()
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = new
    return where, json.dumps(doc).encode()


@pytest.fixture(scope="module", params=["zarr", "ocdbt"])
def template(tmp_path_factory, request):
    return orbax_step(tmp_path_factory.mktemp("fuzz") / "theirs", ocdbt=request.param == "ocdbt",
                      json_item=True)


@given(data=st.data())
@settings(max_examples=effort.examples(40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
def test_fuzzed_orbax_metadata_gets_only_clean_errors(template, tmp_path_factory, data):
    where, content = data.draw(mutations(template))
    work = tmp_path_factory.mktemp("case")
    step = work / "1"
    shutil.copytree(template, step)
    (step / where).write_bytes(content)
    try:
        interop.import_step(step, work / "ours")
    except CheckpointError as e:
        assert "Traceback" not in str(e)


@pytest.mark.parametrize("field,value", [("step_prefix", "../up"), ("step_prefix", "a/b"),
                                         ("step_format_fixed_length", 10**12)])
def test_a_tiers_record_whose_step_names_are_not_one_component_is_ignored(
        tmp_path, field, value):
    d = ours(tmp_path / "ours", ["default"])
    rec = d / ".rc-tiers.json"
    _rewrite(rec, lambda doc: {**doc, field: value})
    p = run("export", d, 5, tmp_path / "dest")  # the record is a hint: ignored, with a warning
    assert field in p.stderr and str(rec) in p.stderr and "ignored" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["dest", "ours"]  # nothing made from its names
    assert os.listdir(tmp_path / "dest") == ["5"]


# ---------------------------------------------------------------- Orbax steps read in place

def _huge_chunks(step, tmp_path):
    _rewrite(step / "default" / "a" / ".zarray", lambda doc: {**doc, "chunks": [2**40, 2**20]})


@pytest.mark.parametrize("damage", [_absolute_key, _huge_chunks])
def test_a_manager_reading_an_orbax_step_in_place_checks_it_first(tmp_path, damage):
    step = orbax_step(tmp_path / "theirs")
    damage(step, tmp_path)
    with CheckpointManager(tmp_path / "theirs") as m:
        assert m.all_steps() == [1]
        for read in (lambda: m.restore(1), lambda: m.item_metadata(1)):
            with pytest.raises(CorruptCheckpointError, match=str(step / "default")):
                read()


def test_an_ocdbt_item_keeps_keys_with_slashes_and_never_reads_outside(tmp_path):
    src = tmp_path / "haiku"
    with ocp.StandardCheckpointer() as c:  # Haiku names modules 'mlp/~/linear_0'
        c.save(src, {"mlp/~/linear_0": {"w": np.arange(3.0)}})
    interop.import_step(src, tmp_path / "ours", step=1)
    with CheckpointManager(tmp_path / "ours") as m:
        got = m.restore(1)
    assert np.asarray(got["mlp/~/linear_0"]["w"]).tobytes() == np.arange(3.0).tobytes()
    step = orbax_step(tmp_path / "theirs", ocdbt=True)
    _absolute_key(step, tmp_path)  # in an OCDBT item a key names no file: nothing is found
    with pytest.raises(CorruptCheckpointError, match=str(step / "default")):
        interop.import_step(step, tmp_path / "ours2")


def test_a_fifo_in_another_orbax_step_is_refused_without_a_hang(tmp_path):
    root = tmp_path / "theirs"
    orbax_step(root, step=1)
    orbax_step(root, step=2)
    fifo = root / "2" / "_CHECKPOINT_METADATA"  # Orbax's manager reads every step's
    os.remove(fifo)
    os.mkfifo(fifo)
    with CheckpointManager(root) as m:
        assert m.all_steps() == [1, 2]
        err = _raised_within(lambda: m.restore(1), fifo)
    assert isinstance(err, CorruptCheckpointError) and str(fifo) in str(err), err
