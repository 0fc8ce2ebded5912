"""N "nodes" on one machine for tests that run one real ``torchrun`` agent per node (c10d rendezvous).

Where the test can make network namespaces (root, ``ip``), each node gets one of its own with its own address
(``10.231.<k>.<i+1>/24``), joined by a bridge in a namespace of its own: each node's veth has its other end there.
So the agents and their workers see one another only through those addresses, as on separate machines. Else
every node uses the loopback (``isolated`` False; the tests print which). :func:`nodes` makes them and, at its
end, SIGKILLs every process started through it and everything below (torchrun's workers sit in sessions of their
own: :func:`listeners.tree`) and deletes the namespaces, whatever the test did::

    with nodes(3) as net:
        port = free_port()
        agent = net.agent(0, port, out, ["--max-restarts", "2", "--nproc-per-node", "1"], script, "arg")
        assert agent.wait(timeout=...) == 0
    assert not net.left()

Node 0 hosts the rendezvous (``is_host=1``: in a namespace the hostname resolves outside it); in namespaces
each agent runs under ``ip netns exec`` with ``--local-addr`` (the address it advertises) and its workers'
gloo on the node's interface (``GLOO_SOCKET_IFNAME``). Agent ``i``'s output goes to ``OUT/agent-<letter>.log``.

Run: ``python -m pytest -q tests/faults/test_rescue_torchrun.py tests/faults/test_grow_torchrun.py``
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import listeners

# the default last call (30 s) would wait that long per round; a dead node's keep-alive is missed after 3 s, not 15;
# a store read (an agent's role info after a restart) may wait 120 s, not 60: a whole-suite run's load outlasted 60
RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=120"


def letter(node: int) -> str:
    return "ABCDEFGH"[node]


class Nodes:
    """``count`` nodes: network namespaces with their own addresses where possible, else loopback."""

    def __init__(self, count: int) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        subnet = random.randrange(1, 250)
        self.count, self.hub, self.bridge = count, f"olH{tag}", f"br{tag}"
        self.names = [f"ol{letter(i)}{tag}" for i in range(count)]
        self.links = [f"v{letter(i)}{tag}" for i in range(count)]  # in the node's namespace
        self.ports = [f"h{letter(i)}{tag}" for i in range(count)]  # their other ends, on the hub's bridge
        self.addrs = [f"10.231.{subnet}.{i + 1}" for i in range(count)]
        self.isolated = False
        self.procs: list[subprocess.Popen] = []

    @staticmethod
    def possible() -> bool:
        return os.geteuid() == 0 and shutil.which("ip") is not None

    def make(self) -> None:
        if not self.possible():
            return
        hub, br = self.hub, self.bridge
        steps = [["netns", "add", hub], ["-n", hub, "link", "add", br, "type", "bridge"],
                 ["-n", hub, "link", "set", br, "up"], ["-n", hub, "link", "set", "lo", "up"]]
        for name, link, port, addr in zip(self.names, self.links, self.ports, self.addrs):
            steps += [["netns", "add", name], ["link", "add", link, "type", "veth", "peer", "name", port],
                      ["link", "set", link, "netns", name], ["link", "set", port, "netns", hub],
                      ["-n", hub, "link", "set", port, "master", br], ["-n", hub, "link", "set", port, "up"],
                      ["-n", name, "addr", "add", f"{addr}/24", "dev", link],
                      ["-n", name, "link", "set", link, "up"], ["-n", name, "link", "set", "lo", "up"]]
        for step in steps:
            if subprocess.run(["ip", *step], capture_output=True).returncode != 0:
                self.remove()
                return
        self.isolated = True

    def remove(self) -> None:
        """Delete the namespaces (their links go with them) and any link a failed make left outside them."""
        if not self.possible():
            return
        for name in [*self.names, self.hub]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)

    def left(self) -> list[str]:
        """The namespaces of these nodes that still exist (none after :func:`nodes`)."""
        if not self.possible():
            return []
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return [name for name in [*self.names, self.hub] if name in listed]

    def host(self) -> str:
        """The rendezvous endpoint's address (node 0's)."""
        return self.addrs[0] if self.isolated else "127.0.0.1"

    def rdzv(self, node: int, port: int, max_nodes: int, conf: str = RDZV_CONF) -> list[str]:
        """torchrun's elastic rendezvous arguments for ``node``: ``--nnodes 1:max_nodes``, c10d at node 0."""
        return ["--nnodes", f"1:{max_nodes}", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.host()}:{port}",
                "--rdzv-id", f"job{port}", "--rdzv-conf", f"{conf},is_host={int(node == 0)}"]

    def agent(self, node: int, port: int, out: Path, args: list[str], script: Path, *script_args: str,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start node ``node``'s torchrun agent (``--nnodes 1:<count>``, c10d at node 0, then ``args``) running
        ``script`` in a session of its own; its output in ``out/agent-<letter>.log``."""
        full = [*self.rdzv(node, port, self.count), *args]
        extra = {"OMP_NUM_THREADS": "1"}
        if self.isolated:  # each node's own address: advertised to the peers, and gloo's interface
            cmd = ["ip", "netns", "exec", self.names[node], *torchrun(*full, "--local-addr", self.addrs[node])]
            extra["GLOO_SOCKET_IFNAME"] = self.links[node]
        else:
            cmd = torchrun(*full)
        with open(out / f"agent-{letter(node)}.log", "w") as log:
            # the node's own interface wins over the caller's environment: an in-process local launch earlier in this
            # test process sets GLOO_SOCKET_IFNAME=lo in os.environ, and gloo on lo in a namespace connects nowhere
            proc = subprocess.Popen([*cmd, str(script), *script_args], env={**os.environ, **(env or {}), **extra},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def kill(self) -> None:
        """SIGKILL every agent started here and everything below it, and reap the agents."""
        for p in self.procs:
            for pid in listeners.tree(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@contextmanager
def nodes(count: int) -> Iterator[Nodes]:
    """``count`` nodes (namespaces where possible), said on stdout; their processes and namespaces gone after."""
    net = Nodes(count)
    net.make()
    print(f"nodes: {'network namespaces ' + ', '.join(net.addrs) if net.isolated else 'loopback'}")
    try:
        yield net
    finally:
        net.kill()
        net.remove()
