"""cgroup backend of the OS-level throttles: a CPU quota per worker process.

Worker ``rank`` of run ``run_id`` gets ``r * cpus`` CPUs (v2 ``cpu.max``, v1
``cpu.cfs_quota_us``) in ``<cpu hierarchy>/omnilearn/<run_id>/rank<rank>`` under
``$OMNILEARN_CGROUP_ROOT`` (default ``/sys/fs/cgroup``); ``close`` moves it back
home and removes the groups, :func:`cleanup_run` a whole run's. A group not on a
cgroup fs (a fake tree in tests, per /proc/self/mountinfo) has its plain files
deleted before ``rmdir``; a real one never needs it. Used through
:func:`omnilearn.emulation.throttle.make_throttle`; refusals raise
:class:`omnilearn.emulation.shares.ThrottleError`. Tests: ``pytest tests/unit/test_throttle.py``.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from typing import Sequence

from omnilearn.emulation.shares import ThrottleError, relative_speed

PERIOD_US = 100_000
MIN_QUOTA_US = 1_000
CGROUP_FIX = "run as root with a writable cgroup fs or use --emulator delay"


def cgroup_quota_us(r: float, cpus: float, period_us: int = PERIOD_US) -> int:
    """CFS quota giving ``r * cpus`` CPUs per ``period_us``."""
    return max(MIN_QUOTA_US, round(r * cpus * period_us))


def mount_fstype(mountinfo: str, path: str) -> str:
    """Filesystem type of the mount holding absolute ``path`` (``/proc/self/mountinfo`` text)."""
    best, fstype = "", ""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        point = left.split()[4].replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype = point, right.split()[0]
    return fstype


# ------------------------------------------------------------- cgroup side
@dataclass(frozen=True)
class CgroupLayout:
    version: int  # 1 or 2
    path: str  # root of the hierarchy holding the cpu controller


def cgroup_root() -> str:
    return os.environ.get("OMNILEARN_CGROUP_ROOT", "/sys/fs/cgroup")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def detect_layout(root: str) -> CgroupLayout:
    """cgroup v2 (``cgroup.controllers`` lists cpu) or v1 (``cpu/cpu.cfs_quota_us``) under ``root``."""
    if "cpu" in _read(os.path.join(root, "cgroup.controllers")).split():
        return CgroupLayout(2, root)
    for name in ("cpu", "cpu,cpuacct"):
        if os.path.isfile(os.path.join(root, name, "cpu.cfs_quota_us")):
            return CgroupLayout(1, os.path.join(root, name))
    raise ThrottleError(
        f"cgroup backend: no cpu controller under {root} (no v2 cgroup.controllers listing cpu, "
        f"no v1 cpu/cpu.cfs_quota_us); use --emulator delay or affinity"
    )


def _write(path: str, text: str, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except ProcessLookupError:
        if not missing_ok:
            raise ThrottleError(f"cgroup backend: process {text} is gone; cannot write {path}") from None
    except OSError as e:
        raise ThrottleError(f"cgroup backend: cannot write {path}: {e.strerror}; {CGROUP_FIX}") from None


def _evacuate(group: str, dest: str) -> None:
    """Move every process listed in ``group`` to ``dest`` (processes that exited are skipped)."""
    for pid in _read(os.path.join(group, "cgroup.procs")).split():
        _write(os.path.join(dest, "cgroup.procs"), pid, missing_ok=True)


def _remove_group(path: str) -> bool:
    """rmdir ``path`` if it has no sub-groups; True if removed. Fake trees: files go first."""
    try:
        if any(e.is_dir() for e in os.scandir(path)):
            return False
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno == errno.EBUSY:
            return False
        on_cgroup_fs = mount_fstype(_read("/proc/self/mountinfo"), os.path.realpath(path)).startswith("cgroup")
        if e.errno != errno.ENOTEMPTY or on_cgroup_fs:
            raise ThrottleError(f"cgroup backend: cannot remove {path}: {e.strerror}; {CGROUP_FIX}") from None
    for entry in os.scandir(path):  # not a cgroup fs: a fake tree holding plain files
        if entry.is_file():
            os.unlink(entry.path)
    os.rmdir(path)
    return True


def _make_dirs(layout: CgroupLayout, group: str) -> None:
    """Create ``group`` level by level; on v2 each parent must delegate the cpu controller."""
    parent = layout.path
    for part in os.path.relpath(group, layout.path).split(os.sep):
        control = os.path.join(parent, "cgroup.subtree_control")
        if layout.version == 2 and "cpu" not in _read(control).split():
            _write(control, "+cpu")
        parent = os.path.join(parent, part)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise ThrottleError(f"cgroup backend: cannot create {parent}: {e.strerror}; {CGROUP_FIX}") from None


def _home_group(layout: CgroupLayout, pid: int) -> str:
    """The cpu group ``pid`` is in now (from ``/proc/<pid>/cgroup``), else the hierarchy root."""
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        _, controllers, rel = line.split(":", 2)
        if (layout.version == 2 and controllers == "") or (layout.version == 1 and "cpu" in controllers.split(",")):
            path = os.path.normpath(layout.path + "/" + rel.lstrip("/"))
            if os.path.isdir(path) and "omnilearn" not in rel.split("/"):
                return path
    return layout.path


class CgroupThrottle:
    """CPU quota for process ``pid`` in ``<hierarchy>/omnilearn/<run_id>/rank<rank>``."""

    def __init__(self, pid: int, rank: int, run_id: str, cpus: float, root: str) -> None:
        self.pid, self.rank, self.cpus = pid, rank, cpus
        self.layout = detect_layout(root)
        self.run_dir = os.path.join(self.layout.path, "omnilearn", run_id)
        self.group = os.path.join(self.run_dir, f"rank{rank}")
        self.home = _home_group(self.layout, pid)
        self._joined = self._closed = False
        try:
            _make_dirs(self.layout, self.group)
        except ThrottleError:
            self.close()
            raise

    def apply(self, speeds: Sequence[float]) -> None:
        quota = cgroup_quota_us(relative_speed(speeds, self.rank), self.cpus)
        if self.layout.version == 2:
            _write(os.path.join(self.group, "cpu.max"), f"{quota} {PERIOD_US}")
        else:
            _write(os.path.join(self.group, "cpu.cfs_period_us"), str(PERIOD_US))
            _write(os.path.join(self.group, "cpu.cfs_quota_us"), str(quota))
        if not self._joined:
            _write(os.path.join(self.group, "cgroup.procs"), str(self.pid))
            self._joined = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.path.isdir(self.group):
            _evacuate(self.group, self.home)
            if not _remove_group(self.group) and os.path.isdir(self.group):
                raise ThrottleError(f"cgroup backend: cannot remove {self.group}: processes still in it")
        if _remove_group(self.run_dir):
            _remove_group(os.path.dirname(self.run_dir))


def cleanup_run(run_id: str) -> list[str]:
    """Remove every group of run ``run_id`` (leaf first, processes moved to the root); return them."""
    check_run_id(run_id)
    try:
        layout = detect_layout(cgroup_root())
    except ThrottleError:
        return []
    base = os.path.join(layout.path, "omnilearn")
    removed = []
    for dirpath, _, _ in os.walk(os.path.join(base, run_id), topdown=False):
        _evacuate(dirpath, layout.path)
        if _remove_group(dirpath):
            removed.append(dirpath)
    if os.path.isdir(base) and _remove_group(base):
        removed.append(base)
    return removed


def check_run_id(run_id: str) -> None:
    """Refuse a run id that could not name one cgroup directory."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id) or run_id in (".", ".."):
        raise ThrottleError(f"run id {run_id!r} must be letters, digits, '_', '.', '-' (it names a cgroup)")
