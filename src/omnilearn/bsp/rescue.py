"""A crash costs one step: when a peer dies, every survivor can save the last completed step, alone.

Why it is sound. In data parallelism every rank holds the whole model and
optimizer state, identical after every step (DDP averages the gradients
before the update). A peer that dies makes the survivors' next collective
fail (:mod:`omnilearn.distributed.lost`): in a step's backward (gradient
all-reduce: the parameters and the optimizer are still those after the last
completed step) or in ``ol.step()``'s meeting (after ``optimizer.step()``:
the session counted that step first, so its state and the model agree). So
each survivor holds a complete, consistent checkpoint of ``ol.next_step``,
and the samples of a step do not depend on the worker count: a restart at
any count from it learns what the uninterrupted run learns. Two survivors
may stand one step apart (one finished the all-reduce the dead peer had
joined, one did not): both states are exact, each saves its own step and
the restart takes the newest.

Who writes what, when. No collective (the group is broken) and no store
(its host may be the dead rank): each survivor, in the thread that saw the
error, takes the session's state with its own part only (its random
streams; the open window's rows are dropped, so every rank of the restart
starts the same window) and the model, optimizer and LR scheduler given to
:meth:`Rescue.save_on_failure` (or to the last ``load_checkpoint`` /
``save_checkpoint``), and writes them with
:meth:`~omnilearn.checkpoint.CheckpointStore.save_once`: one writer per step
(an ``O_EXCL`` claim), atomic (the ``.pt``, then its manifest), nothing
pruned. The manifest's ``meta["rescue"]`` says which rank saved it, why,
and when it saw the error. The survivor then prints one line and raises on;
its exit closes its sockets, so a survivor that waited only on it fails in
turn and saves (or finds the step saved). Ranks of the restart that were not
the saver get random streams seeded from ``(seed, rank)``, as in an elastic
resume. A run that never said where to save prints that nothing was saved.

Where the error is seen: ``run_step``, ``ol.backward``, the meeting's read
(``ol.step()``, a loader reading ahead, ``sync_buffers``, ``save_checkpoint``),
``finish()`` and ``close()`` (also in a ``finally:`` while the error
propagates), and, for a plain ``loss.backward()`` whose error leaves the
script, ``sys.excepthook`` (installed by ``omnilearn.setup()``, chained), or
``threading.excepthook`` where it leaves a thread's ``run()`` (a session set
up off the main thread: ``sys.excepthook`` never sees a thread's error).
Not armed in a Ray Train worker: Ray catches the training thread's error and
restarts the group from its last report, never from a survivor's file
(:mod:`omnilearn.integrations.ray`).
SIGTERM from a launcher or torchrun's agent meanwhile only sets the stop
flag (``handle_signals=True``), so the save finishes; the launcher allows it
(``omnilearn train``: the failure grace covers a save; torchrun: 30 s).

Weights ahead of the count. Between ``optimizer.step()`` and ``ol.step()``
the weights hold step N's update while the session still says "next step
N": a survivor that sees the loss there (the user's own
``dist.all_reduce(loss)`` for logging, a metric's sync) would save step N's
update under step N, and the restart would apply it a second time. Which
step the weights hold is known, not guessed: an optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``, every
optimizer of the process, one assignment a step) notes the step count at
each update, and a survivor whose optimizer moved since the last counted
step saves nothing and says so in its line.

Not rescued: FSDP2 (each rank holds a shard; the survivors' shards are not
the model): one line names the last checkpoint the restart will use. A hung
peer the heartbeat watchdog names (no error: a SIGSTOP, a frozen VM) is
rescued from the watchdog's thread while this rank waits in the open step's
gradient all-reduce (:meth:`Rescue._hung`); past it, or with no watchdog (a
timeout), the step boundary is not known: nothing is saved.

Run: ``python -m pytest -q tests/unit/test_survivor_save.py tests/faults/test_rescue.py tests/ray/test_threads.py``
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from omnilearn import stopping
from omnilearn.bsp import checkpointing, sharded
from omnilearn.checkpoint import CheckpointStore
from omnilearn.distributed import watchdog
from omnilearn.distributed.lost import PeerLost, first_line, peer_lost, why_lost

_GUARDED: "weakref.WeakSet[Rescue]" = weakref.WeakSet()  # the sessions sys.excepthook rescues
_UPDATES: list = []  # the optimizer step hooks' handles, registered once per process
_SAVING = threading.Lock()  # held by the watchdog's thread while it saves; optimizer.step() waits on it


class Rescue:
    """``save_on_failure`` and the survivors' save (see the module docstring); a mixin of the Session."""

    rescue_to: tuple[Path, dict[str, Any]] | None = None  # (directory, the objects) to save when a peer is lost
    rescue_saver: Callable[[int], str] | None = None  # a door's own save in its own format (step -> what it did)
    rescued: str | None = None  # the line said, once a peer was lost
    updated_at: int | None = None  # next_step when an optimizer last finished step(): equal to it, weights are ahead
    guarded_in: threading.Thread | None = None  # where guard() ran: its uncaught error is rescued (not by its ident:
    # a thread's ident is reused by a later thread)

    def save_on_failure(self, directory: str | Path, *, model=None, optimizer=None, scheduler=None) -> None:
        """Where, and what, this rank saves if a peer dies: ``directory`` (a checkpoint directory, the one
        ``load_checkpoint`` resumes from) and the objects, as :meth:`save_checkpoint` takes them.
        ``load_checkpoint`` and ``save_checkpoint`` set it too, so a script that resumes is covered."""
        if not isinstance(directory, (str, Path)) or (model is not None and not hasattr(model, "state_dict")):
            bad = f"directory={directory!r}" if not isinstance(directory, (str, Path)) else f"model={type(model).__name__}"
            raise TypeError(f"save_on_failure({bad}): give a directory (str or Path) and the model, optimizer and "
                            "scheduler as save_checkpoint takes them")
        self.rescue_to = (Path(directory), {"model": model, "optimizer": optimizer, "scheduler": scheduler})

    def rescue_with(self, saver: Callable[[int], str] | None) -> None:
        """A front door that keeps checkpoints in its own format (Hugging Face's Trainer folders) saves the last
        completed step itself: ``saver(step)`` writes it without collectives and says what it did."""
        self.rescue_saver = saver

    def _lost(self, error: BaseException) -> str:
        """A peer is gone (``error``): save the last completed step, once; the line said (also on stderr)."""
        if self.rescued is None:
            seen = time.time()
            stopping.leaving()  # the agent's SIGTERM now waits for the save, without "stopping after ..."
            said = why_lost(error)
            self.rescued = f"omnilearn: rank {self.rank} lost a peer at step {self.next_step} ({said}); " \
                           + self._save_rescue(seen)
            print(self.rescued, file=sys.stderr, flush=True)
        return self.rescued

    def _hung(self, verdict: str) -> None:
        """The watchdog named a hung peer and ends this process next (its thread calls this). While this rank waits
        in the open step's gradient all-reduce, the weights and optimizer are still the last step's and the main
        thread touches nothing: save them, as for a dead peer. Past that wait the optimizer may be mid-update:
        nothing is saved, and the line says so."""
        if self.rescued is not None:
            return
        with _SAVING:  # a false verdict (a slow peer): the all-reduce may end now; optimizer.step() waits for this
            if self.ledger.open is None or self.timer.reduced_s:
                self.rescued = (f"omnilearn: rank {self.rank}: {verdict}; nothing was saved: this rank was past the "
                                "step's gradient all-reduce (its optimizer may be mid-update); a restart resumes "
                                "from the last checkpoint")
                print(self.rescued, file=sys.stderr, flush=True)
                return
            self._lost(PeerLost(verdict))

    def _save_rescue(self, seen: float) -> str:
        if self.updated_at == self.next_step:
            return (f"nothing was saved: its optimizer had applied step {self.next_step} and ol.step() had not "
                    "counted it (the loss was seen between optimizer.step() and ol.step(), in a collective of "
                    "the script's own), so no step number fits the weights; a restart resumes from the last checkpoint")
        if self.rescue_saver is not None:
            try:
                return self.rescue_saver(self.next_step)
            except Exception as e:  # the run is failing already: say why nothing was saved, raise the peer's error
                return f"the save failed ({type(e).__name__}: {first_line(e)}); a restart resumes from the last checkpoint"
        if self.rescue_to is None or self.rescue_to[1].get("model") is None:
            return ("nothing was saved: no checkpoint directory was given (ol.save_on_failure(directory, model=..., "
                    "optimizer=...) or ol.load_checkpoint(directory, ...) gives one); a restart resumes from the "
                    "last checkpoint")
        directory, objects = self.rescue_to
        store = CheckpointStore(directory)
        if sharded.is_sharded(objects["model"]):
            done = store.steps()
            return (f"FSDP2's state is sharded across the ranks, so survivors cannot save it: a restart resumes from "
                    f"the last checkpoint in {directory} ({f'step {done[-1]}' if done else 'none yet'})")
        step = self.next_step
        full = {"session": checkpointing.session_state(self, rows=False), "extra": {},
                **checkpointing.objects_state(self, objects)}
        meta = {"workers": self.world_size, "global_batch": self.global_batch,
                "rescue": {"rank": self.rank, "seen_at": seen, "step": step}}
        path = store.save_once(step, full, meta, after_parts=_fault)
        if path is None:
            return f"the checkpoint of step {step} in {directory} is saved by another survivor"
        return f"saved the checkpoint of step {step} in {time.time() - seen:.2f} s to {path}: a restart resumes there"


def _fault() -> None:
    """Fault injection for tests: ``OMNILEARN_FAULT_RESCUE=kill`` SIGKILLs the survivor between its ``.pt`` and
    the manifest (a kill during the survivors' save). Unset (always, outside tests): one environment lookup."""
    if os.environ.get("OMNILEARN_FAULT_RESCUE") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def guard(session: Rescue) -> None:
    """Rescue ``session`` when a lost peer's error leaves the script uncaught (``sys.excepthook``, chained), and
    when the heartbeat watchdog names a hung peer (:func:`omnilearn.distributed.watchdog.before_exit`)."""
    _GUARDED.add(session)
    session.guarded_in = threading.current_thread()
    if not _UPDATES:  # once per process: every optimizer's update notes the step it applies, and waits for a save
        _UPDATES.append(register_optimizer_step_post_hook(_updated))  # the watchdog's thread is making
        _UPDATES.append(register_optimizer_step_pre_hook(_not_while_saving))
    watchdog.before_exit(_hung)
    if sys.excepthook is not _excepthook:
        _excepthook.previous = sys.excepthook  # type: ignore[attr-defined]
        sys.excepthook = _excepthook
    if threading.excepthook is not _thread_excepthook:  # the error of a thread's run(): setup() off the main thread
        _thread_excepthook.previous = threading.excepthook  # type: ignore[attr-defined]
        threading.excepthook = _thread_excepthook


def unguard(session: Rescue) -> None:
    """``session`` is done (released): no longer rescued by the hook."""
    _GUARDED.discard(session)


def _not_while_saving(optimizer, args, kwargs) -> None:
    """Before any optimizer's update: wait while the watchdog's thread copies the model (a false "hung" verdict
    lets the all-reduce end under it; the copy must not see half an update). Uncontended: a lock taken and let go."""
    with _SAVING:
        pass


def _updated(optimizer, args, kwargs) -> None:
    """An optimizer finished ``step()``: the weights now hold the update of the step the sessions count next."""
    for session in _GUARDED:
        session.updated_at = session.next_step


def _hung(verdict: str) -> None:
    for session in list(_GUARDED):
        session._hung(verdict)


def _excepthook(kind, value, tb) -> None:
    previous = getattr(_excepthook, "previous", sys.__excepthook__)
    if not _rescued(list(_GUARDED), kind, value, tb, _prints_only(previous)):
        previous(kind, value, tb)


def _thread_excepthook(args) -> None:
    """``threading.excepthook``: as :func:`_excepthook`, for an error that leaves a thread's ``run()``; only the
    sessions set up in that thread save (another thread's error may come while a session's thread is mid-update)."""
    previous = getattr(_thread_excepthook, "previous", threading.__excepthook__)
    sessions = [s for s in _GUARDED if args.thread is not None and s.guarded_in is args.thread]
    if not _rescued(sessions, args.exc_type, args.exc_value, args.exc_traceback, previous is threading.__excepthook__):
        previous(args)


def _rescued(sessions: list, kind, value, tb, prints_only: bool) -> bool:
    """A lost peer's error leaving the script: ``sessions`` save; True when its traceback went to a file and one
    line was said instead (``prints_only``: the hook it replaces would only have printed it)."""
    if not sessions or not peer_lost(value):
        return False
    for session in sessions:
        session._lost(value)
    kept = _keep_traceback(sessions, kind, value, tb) if prints_only else None
    if kept is not None:  # the backend's traceback (gloo's advice, C++ frames) in a file; one line here
        print(f"omnilearn: the lost peer's error and its traceback: {kept}", file=sys.stderr, flush=True)
    return kept is not None


def _prints_only(hook) -> bool:
    """Whether ``hook`` only prints the traceback: Python's own, or torch's rank-prefixing wrapper of it
    (``init_process_group``'s ``_distributed_excepthook``, its ``old_hook``: tests/unit/test_torch_private_names.py).
    A user's own hook is always called."""
    for _ in range(4):
        if hook is sys.__excepthook__:
            return True
        if getattr(hook, "__name__", "") != "_distributed_excepthook":
            return False
        hook = inspect.getclosurevars(hook).nonlocals.get("old_hook")
    return False


def _keep_traceback(sessions: list, kind, value, tb) -> Path | None:
    """The traceback into ``error-rank<r>.log`` (:func:`omnilearn.distributed.watchdog.write_error_log`) in the run
    directory (rank 0 with ``out=``), else the directory the survivor saves into; None where there is neither, or
    it cannot be written (it is printed then, as before)."""
    for session in sessions:
        where = session.run_dir or (session.rescue_to[0] if session.rescue_to else None)
        if where is None:
            continue
        Path(where).mkdir(parents=True, exist_ok=True)
        details = "".join(traceback.format_exception(kind, value, tb))
        if watchdog.write_error_log(Path(where), session.rank, f"{kind.__name__}: {first_line(value)}", details):
            return Path(where) / f"error-rank{session.rank}.log"
    return None


SHARED_STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


class RestartStoreWarning(UserWarning):
    """torchrun restarts are on and its store is shared across them: a restarted group may fail to re-form."""


def arm(session: Rescue, saver: Callable[[int], str], who: str) -> None:
    """A front door's own survivors' save (:meth:`Rescue.rescue_with`), and one warning on rank 0 when a torchrun
    restart would fail before any of it: a door whose framework makes the process group from torchrun's store
    (``env://``: accelerate, under ``OmniLearnTrainer``) finds it shared across restarts (torch 2.4+), so a restarted group can read
    the dead attempt's peer addresses (gloo: ``connectFullMesh ... Connection refused``, or a hang)."""
    session.rescue_with(saver)
    env = os.environ
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if session.is_main and restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.warn(f"torchrun --max-restarts {restarts}: a restart of {who} would read the dead attempt's peer "
                      f"addresses from torchrun's shared store; launch with {SHARED_STORE_FIX} in the environment "
                      "(docs/failures.md, 'A crash costs one step')", RestartStoreWarning, stacklevel=3)
