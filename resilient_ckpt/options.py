"""The manager's options, and the one place they are resolved into a plan.

`CheckpointManagerOptions` carries Orbax's common fields plus ours (tiers,
memory budgets). `resolve` is a pure function that turns them, once, into the
`Plan` the rest of the code reads: the tiers fastest first, each with its own
name, interval, retention and encoding, the step naming, the retention rule,
and when a save is due. Nothing else re-reads overlapping option fields.
`due` is the one place that decides which tiers a save goes to, from the plan
and the facts of the call.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Container, Sequence
from typing import Any, Literal

from .core.codec import Encoding
from .core.layout import StepNaming
from .core.retention import BestMode, Retention
from .tiers import FsspecTier, GcsTier, LocalTier, RamTier

OverBudget = Literal["wait", "skip"]
TierConfig = RamTier | LocalTier | GcsTier | FsspecTier


@dataclasses.dataclass(frozen=True)
class CheckpointManagerOptions:
    """Orbax's common options, plus `tiers` and the host-memory budget.

    With no `tiers`, the directory is one local tier (one GCS tier for a gs://
    directory) saving every `save_interval_steps` and keeping `max_to_keep`,
    exactly as in Orbax. `progress`: show a progress bar (tqdm, on stderr) while
    restoring.
    `host_memory_budget`: bytes of snapshots in flight (default: two states);
    when a save would exceed it, `over_budget="wait"` blocks until an older
    snapshot is written; `"skip"` first cancels the queued, not yet started
    writes of older steps (the newer step supersedes them; recorded in their
    SaveRecord), and waits only if that frees too little.
    `agreement_timeout_s`: with several processes, how long a collective call
    (save, restore, reload, wait_until_finished) waits for the slowest peer
    before it raises AgreementError naming it (a restore from a slow tier on
    one host delays the others' by as much).
    `agreement_vote`: with several processes, the agreement of a save (and
    of `wait_until_finished`, a reload, a restore) is one all-reduce of a
    small vector over the job's devices whenever every process's view fits
    one (a job running normally), and goes through the jax.distributed
    key-value store otherwise. None (the default): votes in a job of 64
    processes or more, where a round through the store costs its one
    coordinator more than a vote costs the devices; True: at any size;
    False: never (docs/multihost.md, "The vote").
    `write_on_owning_hosts`: each host that owns devices writes their shards
    to every tier itself, through colocated Python (colocated.py,
    docs/pathways.md), and only the chunks' sizes and checksums reach the
    process that calls `save`, which commits the manifest; for Pathways, where
    that process drives every host's devices. It needs cloudpickle
    (`pip install 'resilient_ckpt[pathways]'`) and durable tiers only
    (`LocalTier` on a file system every host mounts, `GcsTier`).
    `save_decision_policy` / `preservation_policy`: Orbax's policy objects (or
    any with the same method), called with what Orbax's manager passes them
    (policies.py). A save-decision policy replaces `save_interval_steps`,
    `save_on_steps`, `should_save_fn` and the first-save rule for the tiers
    that would take `save_interval_steps`; a tier with its own `every` (a RAM
    tier) keeps it. A preservation policy replaces `max_to_keep`,
    `keep_period` and `best_fn` (which still ranks `best_step`) for the tiers
    that would take `max_to_keep`; a tier's own `keep` stays its own.
    `keep_newest_step`: retention never deletes the newest viable step (nor a
    tier's newest step, nor the newest one a tier can restore alone), so a
    job can always resume where it stopped; False deletes exactly what
    Orbax's rules (or policy) decide, the step just saved included, in every
    tier (steps an upload still reads are kept until it ends).
    `lock_item_mode`: as Orbax, after the first save or restore (or from the
    start, with `item_names` or `item_handlers`) every call takes only
    single-item args or only `Composite` args, and the other kind raises
    ValueError; False accepts either kind on every call
    (docs/orbax_differences.md).
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    keep_period: int | None = None
    best_fn: Callable[[Any], float] | None = None
    best_mode: BestMode = "max"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: str | None = None
    step_format_fixed_length: int | None = None
    create: bool = True
    cleanup_tmp_directories: bool = True
    save_on_steps: Container[int] | None = None
    should_save_fn: Callable[[int, int | None], bool] | None = None
    read_only: bool = False
    enable_async_checkpointing: bool = True
    tiers: Sequence[TierConfig] = ()  # a tuple once constructed
    host_memory_budget: int | None = None
    over_budget: OverBudget = "wait"
    io_threads: int = 8
    restore_memory_budget: int = 256 * 1024 * 1024
    progress: bool = False
    agreement_timeout_s: float = 600.0
    agreement_vote: bool | None = None
    write_on_owning_hosts: bool = False
    save_decision_policy: Any = None
    preservation_policy: Any = None
    enable_should_save_is_saving_in_progress_check: bool = True
    keep_newest_step: bool = True
    lock_item_mode: bool = True

    def __post_init__(self):
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.max_to_keep is not None and self.max_to_keep < 0:
            raise ValueError("max_to_keep must be None or non-negative")
        if self.over_budget not in ("wait", "skip"):
            raise ValueError(f"over_budget must be 'wait' or 'skip', got {self.over_budget!r}")
        if self.preservation_policy is not None and (self.max_to_keep or self.keep_period):
            raise ValueError("preservation_policy replaces max_to_keep and keep_period: give "
                             "either the policy or those options, not both")
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if self.write_on_owning_hosts and any(isinstance(t, RamTier) for t in self.tiers):
            raise ValueError(
                "write_on_owning_hosts=True cannot write a RamTier: its files live in "
                "/dev/shm of the process that calls save (under Pathways, the "
                "controller), which is the traffic this option avoids; drop the "
                "RamTier (an in-memory copy on the owning hosts is the elastic loop's "
                "HostSnapshotTier), or set write_on_owning_hosts=False")

    @staticmethod
    def from_any(options: Any) -> CheckpointManagerOptions:
        """Ours as given, or Orbax's CheckpointManagerOptions field by field
        (its `keep_time_interval`, which ours lacks, becomes the preservation
        policy Orbax itself would build from it and the delete options)."""
        if options is None:
            return CheckpointManagerOptions()
        if isinstance(options, CheckpointManagerOptions):
            return options
        names = {f.name for f in dataclasses.fields(CheckpointManagerOptions)}
        kw = {n: getattr(options, n) for n in names if hasattr(options, n)}
        pp = getattr(options, "preservation_policy", None)
        same = not (kw.get("max_to_keep") or kw.get("keep_period"))  # else __post_init__ raises
        if pp is not None and type(pp).__name__ == "LatestN" and same:  # LatestN is max_to_keep
            kw["max_to_keep"], kw["preservation_policy"] = pp.n, None
        interval = getattr(options, "keep_time_interval", None)
        if interval is not None:
            if pp is not None:
                raise ValueError("preservation_policy replaces keep_time_interval: give "
                                 "either the policy or that option, not both")
            kw.update(preservation_policy=_orbax_rule(kw, interval), max_to_keep=None,
                      keep_period=None)
        return CheckpointManagerOptions(**kw)


def _orbax_rule(kw: dict[str, Any], interval: Any) -> Any:
    """One policy for Orbax's delete options with `keep_time_interval`: a step
    is kept when any of the time, period and count (or best) rules keeps it."""
    from orbax.checkpoint import checkpoint_managers as cm
    rules: list[Any] = [cm.EveryNSeconds(interval_secs=int(interval.total_seconds()))]
    if kw.get("keep_period") is not None:
        rules.append(cm.EveryNSteps(kw["keep_period"]))
    if kw.get("best_fn") is None:
        rules.append(cm.LatestN(n=kw.get("max_to_keep")))
    else:
        rules.append(cm.BestN(get_metric_fn=kw["best_fn"], reverse=kw.get("best_mode") == "min",
                              n=kw.get("max_to_keep"),
                              keep_checkpoints_without_metrics=kw.get(
                                  "keep_checkpoints_without_metrics", True)))
    return cm.AnyPreservationPolicy(rules)


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """One tier as the manager runs it."""

    name: str  # "ram", "local", "gcs" (then "local1", ... for a second one)
    config: TierConfig
    every: int  # save interval in steps (0: only when forced or first)
    keep: int | None  # steps kept (None: all)
    encoding: Encoding
    own_io: int | None  # threads of a pool of its own (GCS, RAM), or None: the shared pool
    replicas: bool = False  # on a per-host tier: keep every shard this host holds
    own_every: bool = False  # its config set `every` (a save-decision policy leaves it)


@dataclasses.dataclass(frozen=True)
class SaveRule:
    """What the options say about when a save is due (`due` reads it)."""

    read_only: bool = False  # no save is ever due
    on_steps: Container[int] | None = None  # `save_on_steps`: due on every tier
    by_fn: bool = False  # a `should_save_fn` decides for all tiers
    by_policy: bool = False  # a `save_decision_policy` decides for the tiers without `every`


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the manager needs from its options, resolved once."""

    directory: str
    tiers: tuple[TierPlan, ...]  # fastest first
    naming: StepNaming
    retention: Retention
    writable: bool  # neither read-only nor asked not to create
    on_owning_hosts: bool = False  # chunks written by the hosts owning the shards
    saving: SaveRule = SaveRule()  # when a save is due (`due`)


def memory_threads(io_threads: int) -> int:
    """Threads of the RAM tier's own pool: its writes are memory copies (and
    first touch of tmpfs pages), bound by cores, not by I/O in flight. Shared
    with the disk tiers, they queued the local tier's writes behind them and
    took the cores its O_DIRECT submissions needed: with pools of their own,
    the local tier writes beside the RAM tier about as fast as alone
    (docs/benchmarks.md)."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere all cores
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, min(io_threads, cores))


def resolve(options: CheckpointManagerOptions, directory: str) -> Plan:
    """The plan for `options` at `directory` (a path or a gs:// URL).

    No `tiers`: one tier at the directory (GCS for gs://, else local disk).
    Tiers sort fastest first (by their `rank`); a tier's None `every` / `keep`
    take `save_interval_steps` / `max_to_keep` (a RAM tier's `keep` is its own:
    None there means "keep all" on purpose); a `preservation_policy` governs
    exactly the tiers that take `max_to_keep`. The RAM tier writes through a
    pool of its own (`memory_threads`), a GCS tier through its `concurrency`,
    the disk tiers through the shared `io_threads`.
    """
    o = options
    remote = directory.startswith("gs://")
    configs = sorted(o.tiers or (GcsTier() if remote else LocalTier(),),
                     key=lambda t: t.rank)
    tiers: list[TierPlan] = []
    seen: collections.Counter[str] = collections.Counter()
    by_policy: set[str] = set()
    for t in configs:
        name = t.kind if not seen[t.kind] else f"{t.kind}{seen[t.kind]}"
        seen[t.kind] += 1
        every = t.every if t.every is not None else o.save_interval_steps
        own_keep = t.keep is not None or isinstance(t, RamTier)
        keep = t.keep if own_keep else o.max_to_keep
        if not own_keep and o.preservation_policy is not None:
            by_policy.add(name)
        gcs = t if isinstance(t, (GcsTier, FsspecTier)) else None
        own_io = gcs.concurrency if gcs else (
            memory_threads(o.io_threads) if isinstance(t, RamTier) else None)
        tiers.append(TierPlan(name, t, every, keep,
                              Encoding(gcs.codec, gcs.level) if gcs else Encoding(),
                              own_io,
                              replicas=isinstance(t, RamTier) and t.replicas,
                              own_every=t.every is not None))
    return Plan(directory, tuple(tiers),
                StepNaming(o.step_prefix, o.step_format_fixed_length),
                Retention(o.keep_period, o.best_fn, o.best_mode,
                          o.keep_checkpoints_without_metrics, o.preservation_policy,
                          frozenset(by_policy), o.keep_newest_step),
                writable=o.create and not o.read_only,
                on_owning_hosts=o.write_on_owning_hosts,
                saving=SaveRule(o.read_only, o.save_on_steps, o.should_save_fn is not None,
                                o.save_decision_policy is not None))


def _no() -> bool:
    return False


def due(plan: Plan, step: int, latest: int | None, *, force: bool = False,
        preempted: Callable[[], bool] = _no, fn_says: Callable[[], bool] = _no,
        policy_says: Callable[[], bool] = _no) -> tuple[TierPlan, ...]:
    """The tiers a save of `step` goes to, `latest` being the newest step there
    is (None: no step yet). The one place that decides it.

    None when read-only. All of them when `force`d. Otherwise none when `step`
    is not newer than `latest`; then, with a save-decision policy, the tiers
    without an `every` of their own when `policy_says()`, and each tier with
    its own `every` when that interval divides the step; with a
    `should_save_fn`, all tiers when `fn_says()` or `preempted()`, else none;
    without either, all tiers for the first save, a step in `save_on_steps`
    or a preemption, else each tier whose interval divides the step.

    The answers are questions (a user's function, Orbax's preemption check, a
    policy object), asked only when they decide and in this order, as Orbax's
    manager asks them; a policy is handed the preemption itself.
    """
    rule, tiers = plan.saving, plan.tiers
    if rule.read_only:
        return ()
    if force:
        return tiers
    if latest is not None and latest >= step:
        return ()

    def on_interval(t: TierPlan) -> bool:
        return bool(t.every) and step % t.every == 0
    if rule.by_policy:
        yes = policy_says()
        return tuple(t for t in tiers if (on_interval(t) if t.own_every else yes))
    if rule.by_fn:
        return tiers if fn_says() or preempted() else ()
    if latest is None or (rule.on_steps and step in rule.on_steps) or preempted():
        return tiers
    return tuple(t for t in tiers if on_interval(t))
