"""Asynchronous training: a parameter server and n workers (torch.distributed point-to-point).

- :mod:`omnilearn.asp.rules`: pure rules (data dealing and taking back, coverage, push rate, staleness, liveness).
- :mod:`omnilearn.asp.settings`: :class:`~omnilearn.asp.settings.ASPSettings`, the server's own knobs.
- :mod:`omnilearn.asp.flat`: a model as one float32 vector (the wire format).
- :mod:`omnilearn.asp.control`: cycle-time windows into the shared ControlLoop.
- :mod:`omnilearn.asp.server`: :class:`~omnilearn.asp.server.ParameterServer` (rank 0).
- :mod:`omnilearn.asp.membership`: the server's live workers; a dead or silent one is dropped, the run goes on.
- :mod:`omnilearn.asp.snapshot`: the server's checkpoints, resume, and a stop on a signal.
- :mod:`omnilearn.asp.faults`: test-only fault injection (``OMNILEARN_FAULT_KILL_AT``).
- :mod:`omnilearn.asp.worker`: :class:`~omnilearn.asp.worker.ASPWorker` (ranks 1..n).

The wire protocol is :mod:`omnilearn.distributed.ps`; the record of a run,
:mod:`omnilearn.observe.asplog`. The experiment harness builds the workload
(:mod:`omnilearn.experiments.train.asp`); nothing here imports it.

Run the tests: ``python -m pytest -q tests/unit/test_aspmath.py tests/dist/test_asp_server.py
tests/faults/test_asp_faults.py``
"""
