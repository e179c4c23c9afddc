"""The elastic loop, as a sub-package: survive lost devices in-process, scale back up.

This package owns in-process recovery; its modules, from the loop down:

- `loop`: `Elastic`, the loop itself (run, restore, save, recover, scale up);
- `scaleup`: `ScaleUpWatcher`, when to look for returned devices and grow;
- `hostsnap`: `HostSnapshotTier`, snapshots in the devices' own hosts' memory
  (single controller), over `hostleaf` (a leaf's blocks and copies),
  `hostrestore` (a leaf onto new shardings), `hostplan` (pure: records,
  placement, budget, restore pieces) and `ondevice` (block checksums and
  assembly on the devices);
- `timeline`: `RecoveryEvent`, `format_timeline`, and the `Recorder` timing each event;
- `survivors`: with several processes, the survivors of a lost one going on
  (the step guard `Elastic.step`, the lost processes, telling the manager);
- `devices`: waiting for a usable mesh, dropping arrays on lost devices;
- `state`: resharding the live state onto a new mesh, checking restore targets;
- `programs`: `build(mesh)` results per mesh, built ahead of time in the background,
  and whether one is built (`Elastic.compiled`);
- `mesh`: the default mesh policy `shrink_data_axis`, and mesh keys;
- `policy`: `RecoveryPolicy`, the retry budget;
- `protocol`: `ManagerLike`, what the loop needs of a checkpoint manager;
- `failures`: the classifier (`is_recoverable`), what a failure says (its
  `failed_devices` and `fault_time`; `DeviceLossError` carries both) and the `HealthCheck`.
"""
from .failures import DeviceLossError, HealthCheck, describe_error, is_recoverable
from .hostsnap import HostRestore, HostSnapshotTier
from .loop import Elastic
from .mesh import shrink_data_axis
from .policy import RecoveryPolicy
from .protocol import ManagerLike
from .timeline import RecoveryEvent, format_timeline

__all__ = ["DeviceLossError", "Elastic", "HealthCheck", "HostRestore", "HostSnapshotTier",
           "ManagerLike", "RecoveryEvent",
           "RecoveryPolicy", "describe_error", "format_timeline", "is_recoverable",
           "shrink_data_axis"]
