"""What a run's processes listen on, read from ``/proc``: the tests' check that a local run is reachable from
loopback only.

``exposed(pids)`` lists every listening TCP socket of those processes that the machine's network can reach: one
bound to an address other than loopback (``0.0.0.0``, ``[::]``, an interface's) in a network namespace that has
an interface other than ``lo``. A socket in a namespace of loopback only (a local TensorFlow run's:
:mod:`omnilearn.experiments.launch.netns`) cannot be reached from outside, whatever it is bound to.
``listening(pids)`` lists them all, for the test's output.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def _inodes(pid: int) -> set[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(target[8:-1])
    except OSError:
        pass
    return found


def _interfaces(pid: int) -> list[str]:
    try:
        lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    except OSError:
        return []
    return [line.split(":", 1)[0].strip() for line in lines if ":" in line]


def listening(pids) -> list[dict]:
    """Every listening TCP socket of ``pids``: pid, address, port, the namespace's interfaces."""
    found = []
    for pid in pids:
        mine, interfaces = _inodes(pid), _interfaces(pid)
        for table in ("tcp", "tcp6"):
            try:
                rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in mine:  # TCP_LISTEN
                    host, port = local.split(":")
                    found.append({"pid": pid, "address": str(_address(host)), "port": int(port, 16),
                                  "interfaces": interfaces})
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def exposed(pids) -> list[dict]:
    """The listening sockets of ``pids`` that the machine's network can reach."""
    return [s for s in listening(pids) if not _loopback(s["address"]) and s["interfaces"] != ["lo"]]


def tree(pid: int) -> list[int]:
    """``pid`` and every live process below it (from ``/proc``)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
