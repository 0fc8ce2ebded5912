"""The TensorFlow ASP chief's watch on its calls in flight (:class:`CallWatch`): which worker is hung.

Each worker's thread in the chief tells it when its gradient call starts (with what it was dealt) and when the
call is back (answered or failed). A call older than its allowance is late: ``heartbeat_s``, or for a worker
that never answered yet (its first call traces the function) ``max(timeout_s, heartbeat_s)``. :meth:`late`
hands each late call over once and marks its worker hung; the chief drops it as it drops a dead one. A call
leaves the watch without the chief's lock (a dict operation), so an evaluation holding that lock cannot make a
call that came back meanwhile look late.

Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations


class CallWatch:
    def __init__(self, workers: int, heartbeat_s: float, timeout_s: float) -> None:
        self.heartbeat_s, self.first_s = heartbeat_s, max(timeout_s, heartbeat_s)
        self.calls: dict[int, tuple[float, int, list[int]]] = {}  # per worker: its call in flight (began, deal)
        self.answered = [False] * workers
        self.hung: set[int] = set()  # handed over as late (its thread is left in TensorFlow)

    def begin(self, worker: int, began: float, epoch: int, indices: list[int]) -> None:
        self.calls[worker] = (began, epoch, indices)

    def back(self, worker: int) -> None:
        self.calls.pop(worker, None)

    def late(self, now: float) -> list[tuple[int, float, int, list[int]]]:
        """``(worker, seconds waited, epoch, indices)`` of every call past its allowance, each once."""
        out = []
        for worker, (began, epoch, indices) in list(self.calls.items()):
            if now - began > (self.heartbeat_s if self.answered[worker] else self.first_s):
                if self.calls.pop(worker, None) is not None:  # else it came back meanwhile
                    self.hung.add(worker)
                    out.append((worker, now - began, epoch, indices))
        return out
