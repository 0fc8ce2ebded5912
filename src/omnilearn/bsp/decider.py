"""A window's decision, made beside the training: one thread per session waits for the meeting and decides.

A window's meeting is started at its last step ``s`` (the all-gather is
launched from the training thread, in the order of the step's other
collectives) and read at step ``s + 1`` (:mod:`omnilearn.bsp.steppers`).
What lies between, waiting for the table and running the control loop on
it (hundreds of microseconds of Python and small numpy), does not need the
training thread: :class:`Decider`'s thread does it while step ``s + 1``
computes, mostly while the training thread is inside C++ (the backward, the
gradient all-reduce, the optimizer's kernels) and has let go of the GIL. The
training thread joins it where it needs the outcome (:meth:`Pending.result`,
from ``_decide``): at step ``s + 1``'s ``ol.step()``, before reading a plan
past the hold, or where every rank flushes the meeting. Where the training
thread holds the GIL throughout, the work costs what it cost inline.

Nothing changes in what is decided: the thread runs the same function on the
same table and loop state, and nothing else touches the loop or the
schedule's future until the join (the training thread reads only plans at or
before the hold, which a decision cannot change: a change lands after every
step any rank may have sampled). An error in the thread (a peer that never
came, ranks out of step) is raised by the training thread at the join, as it
was inline.

Run: ``python -m pytest -q tests/unit/test_decider.py tests/dist/test_api.py``
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class Pending:
    """A submitted function's outcome: :meth:`result` waits for it and returns it, or raises its error."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class Decider:
    """One daemon thread running submitted functions in order (started at the first :meth:`submit`)."""

    def __init__(self, name: str = "omnilearn-decide") -> None:
        self.name = name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> Pending:
        pending = Pending()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        self.jobs.put((fn, pending))
        return pending

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, pending = job
            try:
                pending.value = fn()
            except BaseException as e:  # raised again by the training thread at the join
                pending.error = e
            finally:
                pending.done.set()

    def stop(self) -> None:
        """End the thread after the jobs queued (idempotent; a job blocked on a gone peer is left, as a daemon)."""
        if self.thread is not None:
            self.jobs.put(None)
            self.thread = None
