"""A tier every process of a job sees (a shared directory, GCS) holds one
manifest per writer of a step. What one process of a big job does there must
not grow with the number of writers: a reload reads only its own writers'
manifests and those of its part (the labels that are its rank modulo the
job's size; between them the job's processes read and report each writer's
share once), a restore of the save's shape only those of the writers whose boxes its
devices hold, and a delete removes only its part of the shares, so the
processes together remove the whole step. A step of 4 writers is made here
from a real one-process save, its chunks split among 4 re-signed manifests:
by the writer of each box's device, as a 4-process save leaves it
(`by_device`), or by chunk index (`shared`: a layout no prediction guesses)."""
import dataclasses
import os
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt.catalog import tier_steps
from resilient_ckpt.catalog.catalog import Catalog, JobView
from resilient_ckpt.core import layout, manifest as mf, shares
from resilient_ckpt.core.planner import plan_target
from resilient_ckpt.core.sharding import index_to_box
from resilient_ckpt.multihost.agree import Peers
from resilient_ckpt.save import packing
from resilient_ckpt.storage.files import FileStorage
from resilient_ckpt.storage.wrapper import StorageWrapper
from resilient_ckpt.testing.kvservice import KeyValueService
from tests.support.corruption import device_state

WRITERS = 4


def _split(m: mf.Manifest, i: int) -> mf.Manifest:
    """Writer i's share of a one-process save: every WRITERS-th chunk of each leaf."""
    items = tuple(dataclasses.replace(it, leaves=tuple(
        dataclasses.replace(leaf, chunks=leaf.chunks[i::WRITERS]) for leaf in it.leaves))
        for it in m.items)
    return dataclasses.replace(m, process_index=i, process_count=WRITERS, items=items)


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """A local tier holding steps 1 and 2, each written by 4 writers, with
    their claims; returns its storage. The one save is split among the
    writers chunk by chunk, so each chunk is written as its own object (no
    packs: a pack would be shared by the writers)."""
    monkeypatch.setattr(packing, "PACK_BYTES", 1)
    return _four_writers(tmp_path, _split)


# The job the tests' catalogs stand for: 4 processes of 2 devices each
# (device d on process d // 2), as in a job of 4 hosts.
DEVICES = {d: d // 2 for d in range(8)}
TABLE = ((0, 2, 0), (2, 2, 1), (4, 2, 2), (6, 2, 3))  # DEVICES as a manifest's `writers`


def _by_device(step: int):
    """The split a 4-process save makes: each box from the process whose
    device holds its replica 0 (jax's replica ids of the saved arrays)."""
    first = {}
    for a in jax.tree.leaves(device_state(step)):
        if isinstance(a, jax.Array):
            first[tuple(a.shape)] = {index_to_box(s.index, a.shape): DEVICES[s.device.id]
                                     for s in a.addressable_shards if s.replica_id == 0}

    def split(m: mf.Manifest, i: int) -> mf.Manifest:
        items = tuple(dataclasses.replace(it, leaves=tuple(dataclasses.replace(leaf, chunks=tuple(
            c for c in leaf.chunks if first[leaf.shape][(c.offsets, c.sizes)] == i))
            for leaf in it.leaves)) for it in m.items)
        return dataclasses.replace(m, process_index=i, process_count=WRITERS, items=items)
    return split


@pytest.fixture
def by_device(tmp_path, monkeypatch):
    """The same tier, each step's chunks split among the writers as a save
    by the job of DEVICES leaves them (no packs, as above)."""
    monkeypatch.setattr(packing, "PACK_BYTES", 1)
    return _four_writers(tmp_path, None)


def _four_writers(tmp_path, split) -> FileStorage:
    d = tmp_path / "ckpt"
    with rc.CheckpointManager(str(d), options=rc.CheckpointManagerOptions(
            tiers=[rc.LocalTier(every=1, keep=3)])) as m:
        for s in (1, 2):
            assert m.save(s, args=ocp.args.StandardSave(device_state(s)))
        m.wait_until_finished()
    st = FileStorage(str(d))
    for s in (1, 2):
        (name,) = tier_steps.manifest_names(st, str(s))
        one = mf.parse((d / str(s) / name).read_bytes())
        (d / str(s) / name).unlink()
        for p in (d / str(s)).glob("claim.*"):
            p.unlink()
        one = dataclasses.replace(one, writers=TABLE)  # as the job of DEVICES writes it
        for i in range(WRITERS):
            (d / str(s) / layout.manifest_name(i, WRITERS)).write_bytes(
                mf.to_json((split or _by_device(s))(one, i)))
            (d / str(s) / layout.claim_name(i, WRITERS)).write_bytes(b"{}")
    st.shared = True
    return st


def _reads(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = FileStorage.read

    def read(self, key, max_bytes=None):  # a spy: the real read, recorded
        seen.append(key.rpartition("/")[2])
        return real(self, key, max_bytes)
    monkeypatch.setattr(FileStorage, "read", read)
    return seen


def test_a_reload_with_labels_reads_only_those_writers_manifests(shared, monkeypatch):
    reads = _reads(monkeypatch)
    mine = tier_steps.observe(shared, "local", layout.StepNaming(), labels={2})
    assert sorted(mine) == [1, 2]
    assert sorted(reads) == [layout.manifest_name(2, WRITERS)] * 2
    for ts in mine.values():
        (m,) = ts.manifests
        assert isinstance(m, mf.Manifest) and m.process_index == 2
        assert set(ts.sizes) == {c.key for _, _, c in m.chunks()}
        assert all(n is not None and n > 0 for n in ts.sizes.values())
    reads.clear()
    everything = tier_steps.observe(shared, "local", layout.StepNaming())
    assert len(reads) == 2 * WRITERS
    assert all(len(ts.manifests) == WRITERS for ts in everything.values())


@pytest.mark.parametrize("live", [WRITERS, 3])  # 3: after a process was lost
def test_each_process_deletes_its_part_and_together_the_whole_step(shared, live):
    step_dir = os.path.join(shared.root, "1")
    before = set(os.listdir(step_dir))
    full = tier_steps.observe_step(shared, "local", layout.StepNaming(), 1)
    assert full is not None
    chunks = {i: {c.key for _, _, c in m.chunks()}
              for i, m in enumerate(full.manifests) if isinstance(m, mf.Manifest)}
    gone: set[str] = set()
    for rank in range(live):
        own = [m for m in full.manifests if isinstance(m, mf.Manifest)
               and m.process_index == rank]
        tier_steps.delete_step(shared, layout.StepNaming(), 1, (rank, live), own)
        mine = [i for i in range(WRITERS) if i % live == rank]
        for i in mine:
            gone |= {layout.manifest_name(i, WRITERS), layout.claim_name(i, WRITERS)}
            gone |= chunks[i]
        if rank < live - 1:
            assert set(os.listdir(step_dir)) == before - gone, f"rank {rank} of {live}"
            assert tier_steps.observe_step(shared, "local", layout.StepNaming(), 1,
                                           labels=mine) is None
    assert not os.path.exists(step_dir)  # the last one emptied it
    assert tier_steps.observe_step(shared, "local", layout.StepNaming(), 2) is not None


def _catalog(st: FileStorage, index: int, size: int = WRITERS) -> Catalog:
    """A catalog of process `index` of a simulated job of `size` processes
    (the coordination service in-process, `testing.kvservice`), whose
    devices are DEVICES."""
    job = KeyValueService(size)
    peers = Peers(job=(job.client(index), index, size))
    return Catalog([("local", st)], layout.StepNaming(), st.root, None, peers, DEVICES)


def _agree_on(cat: Catalog, full: mf.Manifest) -> None:
    """Installs what the job's agreement would decide: step 1, whole in the tier."""
    cat.install(JobView({1: shares.AgreedStep(1, full.save_id, full.created, WRITERS,
                                              frozenset({"local"}))}, set(), [], set(), []))


def test_a_process_reads_its_own_shares_until_it_restores(
        shared, monkeypatch):
    reads = _reads(monkeypatch)
    cat = _catalog(shared, 2)
    cat.reload()
    assert sorted(reads) == [layout.manifest_name(2, WRITERS)] * 2
    (m,) = cat.view("local")[1].manifests
    _agree_on(cat, m)
    reads.clear()
    # A restore of step 1 reads the step's other manifests: the writer its
    # devices' boxes would come from in a save by this job first (writer 0
    # for the replicated leaf), which lacks them (this step's chunks were
    # split otherwise), then every one.
    choice = cat.choice(1)
    assert choice is not None and reads == [layout.manifest_name(0, WRITERS)] + [
        layout.manifest_name(i, WRITERS) for i in range(WRITERS)]
    assert not cat.narrowed(1)
    assert {c.key for _, _, c in choice.manifest.chunks()} == {
        c.key for i in range(WRITERS)
        for _, _, c in tier_steps.observe_step(shared, "local", layout.StepNaming(), 1,
                                               labels=[i]).manifests[0].chunks()}
    first = _catalog(shared, 0)
    reads.clear()
    first.reload()
    assert sorted(reads) == [layout.manifest_name(0, WRITERS)] * 2  # the first one too


@pytest.mark.parametrize("size", [2, 3, 1 + WRITERS])
def test_the_parts_of_a_job_of_another_size_cover_every_writer_once(shared, monkeypatch, size):
    """A job of `size` processes opens a save of WRITERS writers (a relaunch
    on fewer hosts, or more): each process reads and reports the writers
    whose label is its rank modulo `size`, so between them the job reads
    each manifest once and reports every share."""
    reads = _reads(monkeypatch)
    seen: dict[int, list[int]] = {}
    for rank in range(size):
        reads.clear()
        cat = _catalog(shared, rank, size)
        cat.reload()
        assert sorted(reads) == sorted(layout.manifest_name(q, WRITERS) for q in
                                       range(rank, WRITERS, size) for _ in (1, 2)), rank
        for s in cat.report(set(), [])["shares"]:
            seen.setdefault(s[0], []).append(s[2])
    assert {step: sorted(q) for step, q in seen.items()} == {
        1: list(range(WRITERS)), 2: list(range(WRITERS))}


def test_a_name_claiming_a_huge_job_costs_one_listing(shared, monkeypatch):
    """A file at a manifest's name claiming a writer count of 10^12 (anyone
    who can write the directory): the part is found by one listing of the
    step's manifests, never by 10^12 / size listings by prefix."""
    step_dir = os.path.join(shared.root, "1")
    with open(os.path.join(step_dir, "manifest.1-of-1000000000000.json"), "wb") as f:
        f.write(b"{}")
    listings: list[str] = []
    real = FileStorage.list

    def spy(self, prefix="", starts_with=""):  # the real listing, counted
        listings.append(starts_with)
        return real(self, prefix, starts_with)
    monkeypatch.setattr(FileStorage, "list", spy)
    cat = _catalog(shared, 1, 2)
    cat.reload()
    assert len(listings) < 10, listings
    held = {m.process_index for m in cat.view("local")[1].manifests if isinstance(m, mf.Manifest)}
    assert held == {1, 3}


def test_a_view_read_before_every_writer_committed_is_read_again_at_restore(shared):
    """The first process listed step 1 while only writer 0 had committed it;
    by the agreement every writer had: its restore reads the step again."""
    step_dir = os.path.join(shared.root, "1")
    later = {n: open(os.path.join(step_dir, n), "rb").read() for n in os.listdir(step_dir)
             if n.startswith(layout.MANIFEST_PREFIX) and n != layout.manifest_name(0, WRITERS)}
    for n in later:
        os.unlink(os.path.join(step_dir, n))
    cat = _catalog(shared, 0)
    cat.reload()
    (m,) = cat.view("local")[1].manifests
    for n, data in later.items():
        with open(os.path.join(step_dir, n), "wb") as f:
            f.write(data)
    _agree_on(cat, m)
    choice = cat.choice(1)
    assert choice is not None
    held = {c.key for _, _, c in choice.manifest.chunks()}
    every = tier_steps.observe_step(shared, "local", layout.StepNaming(), 1)
    assert held == {c.key for x in every.manifests for _, _, c in x.chunks()}


class _Paired(StorageWrapper):
    """A remote store whose every manifest read waits for a second one at the
    same time: reads one after another never meet (BrokenBarrierError)."""
    remote = True

    def __init__(self, inner):
        super().__init__(inner)
        self.meet = threading.Barrier(2, timeout=10)

    def read(self, key, max_bytes=None):
        if layout.parse_manifest_name(key.rpartition("/")[2]):
            self.meet.wait()
        return self.inner.read(key, max_bytes)


def test_a_remote_steps_manifests_are_read_at_once(shared):
    """On a remote store each manifest is a request: the first process reads
    a step's N writers' manifests several at a time, not one after another."""
    ts = tier_steps.observe_step(_Paired(shared), "local", layout.StepNaming(), 1)
    assert ts is not None and [m.process_index for m in ts.manifests] == list(range(WRITERS))


def test_a_part_whose_manifest_is_damaged_or_a_link_deletes_nothing_else(shared, tmp_path):
    """Deleting its part, a process reads the other writers' manifests it
    deletes for (hostile storage): one that does not parse loses its
    manifest and claim, its chunks are left to `cleanup`; a chunk that is a
    link is removed itself, what it points to is kept; nothing outside the
    step directory is touched."""
    step_dir = os.path.join(shared.root, "1")
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep")
    m3 = mf.parse(open(os.path.join(step_dir, layout.manifest_name(3, WRITERS)), "rb").read())
    key = next(c.key for _, _, c in m3.chunks())
    os.unlink(os.path.join(step_dir, key))
    os.symlink(outside, os.path.join(step_dir, key))
    with open(os.path.join(step_dir, layout.manifest_name(1, WRITERS)), "wb") as f:
        f.write(b'{"not": "a manifest"')
    kept = {c.key for _, _, c in mf.parse(open(os.path.join(
        step_dir, layout.manifest_name(0, WRITERS)), "rb").read()).chunks()}
    tier_steps.delete_step(shared, layout.StepNaming(), 1, (1, 2))  # writers 1 and 3
    left = set(os.listdir(step_dir))
    assert not {layout.manifest_name(i, WRITERS) for i in (1, 3)} & left
    assert not {layout.claim_name(i, WRITERS) for i in (1, 3)} & left
    assert key not in left and outside.read_bytes() == b"keep"
    assert {layout.manifest_name(0, WRITERS), layout.manifest_name(2, WRITERS)} <= left
    assert kept <= left


def test_a_process_checks_each_writers_chunks_once_not_at_every_agreement(
        shared, monkeypatch):
    """The first of a job of 2 reports its part of the writers' shares on the
    shared tier (writers 0 and 2). Each share is checked chunk by chunk when
    its tier's view of the step changes, not again at every agreement; a
    copy found bad since then still drops the share at the next report."""
    cat = _catalog(shared, 0, 2)
    cat.reload()
    checked: list[int] = []
    real = shares.has_copy

    def has_copy(*a):  # a spy: the real check, counted
        checked.append(1)
        return real(*a)
    monkeypatch.setattr(shares, "has_copy", has_copy)
    first = cat.report(set(), [])
    assert sorted({(s[0], s[2]) for s in first["shares"] if s[2] >= 0}) == [
        (step, q) for step in (1, 2) for q in (0, 2)]
    n = len(checked)
    assert n > 0
    assert cat.report(set(), []) == first and len(checked) == n  # nothing checked again
    m = next(x for x in cat.view("local")[1].manifests if x.process_index == 2)
    cat.add_bad([("local", next(iter(m.chunks()))[2].key)])
    again = cat.report(set(), [])
    assert (1, 2) not in {(s[0], s[2]) for s in again["shares"]}
    assert (2, 2) in {(s[0], s[2]) for s in again["shares"]}


def _holds(choice, q: int) -> bool:
    """Whether `choice` holds every box process q's devices hold under the
    saved shardings ("w" split over the 8 devices' rows, "b" on every one)."""
    leaves = {leaf.shape: leaf for it in choice.manifest.items for leaf in it.leaves}
    boxes = {(256, 64): [((32 * d, 0), (32, 64)) for d in DEVICES if DEVICES[d] == q],
             (32,): [((0,), (32,))]}
    try:
        for shape, bs in boxes.items():
            for box in bs:
                plan_target(box, leaves[shape].chunks, str(shape))
    except ValueError:
        return False
    return True


def _every_chunk(st: FileStorage) -> set[str]:
    ts = tier_steps.observe_step(st, "local", layout.StepNaming(), 1)
    return {c.key for m in ts.manifests for _, _, c in m.chunks()}


@pytest.mark.parametrize("q", [1, 2, 3])
def test_a_restore_of_the_saves_shape_reads_the_manifests_of_the_writers_it_needs(
        by_device, monkeypatch, q):
    """A relaunch of the job that saved: process q reads, beside its own
    manifest, only writer 0's (the replicated leaf's replica 0 is on device
    0), not all 4; the choice holds every box its devices hold. A target of
    another layout asks for every manifest (`complete`)."""
    reads = _reads(monkeypatch)
    cat = _catalog(by_device, q)
    cat.reload()
    (m,) = cat.view("local")[1].manifests
    _agree_on(cat, m)
    reads.clear()
    choice = cat.choice(1)
    assert reads == [layout.manifest_name(0, WRITERS)]
    assert choice is not None and cat.narrowed(1) and _holds(choice, q)
    assert {x.process_index for x in cat.view("local")[1].manifests} == {0, q}
    assert not _holds(choice, q % 3 + 1)  # another process's boxes are not there
    reads.clear()
    assert cat.choice(1) == choice and reads == []  # read once
    assert cat.narrowed(1, own_only=True) is False  # the shared tier is not in that choice
    whole = cat.choice(1, complete=True)
    assert len(reads) == WRITERS and not cat.narrowed(1)
    assert whole is not None and {c.key for _, _, c in whole.manifest.chunks()} == \
        _every_chunk(by_device)
    cat.reload()
    assert not cat.narrowed(1)


def _rewrite(st: FileStorage, step: int, change) -> None:
    """Every writer's manifest of `step` with `change(sharding)` applied to
    its "w" leaf's sharding description, re-signed (a hostile writer)."""
    for i in range(WRITERS):
        path = os.path.join(st.root, str(step), layout.manifest_name(i, WRITERS))
        m = mf.parse(open(path, "rb").read())
        items = tuple(dataclasses.replace(it, leaves=tuple(
            dataclasses.replace(leaf, sharding=change(dict(leaf.sharding)))
            if leaf.shape == (256, 64) else leaf for leaf in it.leaves)) for it in m.items)
        with open(path, "wb") as f:
            f.write(mf.to_json(dataclasses.replace(m, items=items)))


@pytest.mark.parametrize("change,first", [
    (lambda s: dict(s, device_ids=[100 + i for i in s["device_ids"]]), []),  # absent devices
    (lambda s: dict(s, spec=[]), [0]),   # says replicated: writer 0 would hold all of it
    (lambda s: dict(s, device_ids=s["device_ids"][::-1]), [0]),  # the mesh in another order
], ids=["absent-devices", "replicated", "reversed"])
def test_a_sharding_description_that_misleads_falls_back_to_every_manifest(
        by_device, monkeypatch, change, first):
    """Records that name devices this job lacks, or that do not say where the
    chunks are, never fail the choice: it reads every manifest, and holds
    every chunk (no other chunk stands in for one it needs)."""
    _rewrite(by_device, 1, change)
    reads = _reads(monkeypatch)
    cat = _catalog(by_device, 2)
    cat.reload()
    (m,) = cat.view("local")[1].manifests
    _agree_on(cat, m)
    reads.clear()
    choice = cat.choice(1)
    assert reads == [layout.manifest_name(i, WRITERS) for i in first + list(range(WRITERS))]
    assert choice is not None and not cat.narrowed(1) and _holds(choice, 2)
    assert {c.key for _, _, c in choice.manifest.chunks()} == _every_chunk(by_device)


def _w_rows(choice_or_m, rows: tuple[int, int]) -> dict:
    """`wants` of the "w" leaf (256 x 64, rows split over the 8 devices): one
    target box of those rows, as a restore onto another layout asks."""
    m = getattr(choice_or_m, "manifest", choice_or_m)
    (ii, li), = [(ii, li) for ii, it in enumerate(m.items) for li, leaf in enumerate(it.leaves)
                 if leaf.shape == (256, 64)]
    return {(ii, li): [((rows[0], 0), (rows[1] - rows[0], 64))]}


@pytest.mark.parametrize("q", [1, 2, 3])
def test_a_restore_onto_another_layout_reads_the_writers_its_targets_overlap(
        by_device, monkeypatch, q):
    """Target rows 96-160 of "w" are saved by devices 3 and 4 (32 rows a
    device): writers 1 and 2, read beside those held, not all 4; the choice
    then covers the rows, and is still partial."""
    reads = _reads(monkeypatch)
    cat = _catalog(by_device, q)
    cat.reload()
    (m,) = cat.view("local")[1].manifests
    _agree_on(cat, m)
    first = cat.choice(1)
    assert first is not None and first.partial
    held = {x.process_index for x in cat.view("local")[1].manifests}
    reads.clear()
    choice = cat.choice(1, wants=_w_rows(first, (96, 160)))
    assert reads == [layout.manifest_name(i, WRITERS) for i in sorted({1, 2} - held)]
    assert choice is not None and choice.partial and cat.narrowed(1)
    leaf = next(lf for it in choice.manifest.items for lf in it.leaves if lf.shape == (256, 64))
    plan_target(((96, 0), (64, 64)), leaf.chunks, "w")  # covered: raises where not
    if q != 3:  # writer 3's rows (192-256) are neither wanted nor its own
        with pytest.raises(ValueError):
            plan_target(((192, 0), (64, 64)), leaf.chunks, "w")


@pytest.mark.parametrize("table", [
    tuple((a, n, (w + 1) % WRITERS) for a, n, w in TABLE),  # every writer one off
    ((0, 8, 0),),                                          # says writer 0 wrote it all
], ids=["rotated", "all-writer-0"])
def test_a_writers_table_that_lies_falls_back_to_every_manifest(by_device, monkeypatch, table):
    """A `writers` table that does not say who wrote what (a hostile or buggy
    writer) never fails the choice nor makes it miss a chunk: the writers it
    names do not list the boxes, so every manifest is read."""
    for i in range(WRITERS):
        path = os.path.join(by_device.root, "1", layout.manifest_name(i, WRITERS))
        m = mf.parse(open(path, "rb").read())
        with open(path, "wb") as f:
            f.write(mf.to_json(dataclasses.replace(m, writers=table)))
    reads = _reads(monkeypatch)
    cat = _catalog(by_device, 1)
    cat.reload()
    (m,) = cat.view("local")[1].manifests
    _agree_on(cat, m)
    cat.choice(1)
    reads.clear()
    choice = cat.choice(1, wants=_w_rows(m, (96, 160)))
    assert sorted(set(reads)) == [layout.manifest_name(i, WRITERS) for i in range(WRITERS)]
    assert choice is not None and not choice.partial and not cat.narrowed(1)
    assert {c.key for _, _, c in choice.manifest.chunks()} == _every_chunk(by_device)
