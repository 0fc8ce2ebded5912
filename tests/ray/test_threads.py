"""``omnilearn.setup()`` off the main thread, outside Ray (Ray Train runs training functions that way; so may a user).

- ``handle_signals=True`` (the default) is refused in one line naming ``handle_signals=False``, before any group is
  joined: Python installs signal handlers from the main thread only, so ``should_stop`` would never turn true.
- ``handle_signals=False`` works there; the survivors' save then also fires for a lost peer's error that leaves
  the thread's ``run()`` (``threading.excepthook``, chained to the one before; ``sys.excepthook`` never sees it):
  a session with a checkpoint directory writes the step in flight's start, and one line replaces the traceback;
  another thread's error saves nothing (the session's thread may be mid-update).
- A Ray Train worker (tests/ray/test_ray_faults.py) installs neither: Ray owns the thread and its restarts.

Needs no Ray. Run: ``python -m pytest -q tests/ray/test_threads.py``
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch.utils.data import TensorDataset

import omnilearn
from omnilearn.bsp import rescue
from omnilearn.checkpoint import CheckpointStore
from omnilearn.integrations import ray as ol_ray

GLOO_CLOSED = "[pair.cc:553] Connection closed by peer [127.0.0.1]:56023. This is typically caused by a remote crash."


def in_thread(fn):
    """``fn()`` in a thread of its own; what it returned or raised."""
    done: dict = {}

    def run():
        try:
            done["value"] = fn()
        except BaseException as e:  # handed to the test
            done["error"] = e

    worker = threading.Thread(target=run, name="trainer")
    worker.start()
    worker.join(timeout=60)
    return done


def test_stop_signals_off_the_main_thread_are_refused_in_one_line_and_nothing_is_joined():
    done = in_thread(lambda: omnilearn.setup(global_batch=8, device="cpu"))
    error = done.get("error")
    assert isinstance(error, omnilearn.ConfigError), done
    message = str(error)
    assert "\n" not in message and message.startswith("omnilearn.setup() in thread 'trainer':")
    assert "handle_signals=False" in message
    assert not torch.distributed.is_initialized()


def test_the_ray_helpers_outside_ray_are_refused_in_one_line():
    class Session:  # what report() is given: the helpers refuse before they look at it
        pass

    with pytest.raises(omnilearn.ConfigError, match=r"outside a Ray Train training function") as e:
        ol_ray.report(Session(), model=None)
    assert "\n" not in str(e.value) and not ol_ray.in_worker()


def test_a_lost_peers_error_leaving_a_thread_is_rescued(tmp_path, capsys, monkeypatch):
    """A session set up in a thread (``handle_signals=False``); the thread's script ends in a lost peer's error
    (one process stands in for a survivor: the error is gloo's words, raised): the hook saves the last step."""
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # Python's, not pytest's; put back after
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)

    def script():
        ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)
        torch.manual_seed(0)
        model = ol.wrap_model(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = ol.data_loader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)))
        ol.save_on_failure(tmp_path, model=model, optimizer=opt)
        rescue.guard(ol)  # what setup() does with peers (a world of one has none to lose)
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ol.step(loss)
            if i == 2:
                raise RuntimeError(GLOO_CLOSED)  # as a plain loss.backward() raises it when a peer died

    worker = threading.Thread(target=script, name="trainer")
    worker.start()
    worker.join(timeout=60)
    assert threading.excepthook is rescue._thread_excepthook
    err = capsys.readouterr().err
    assert "omnilearn: rank 0 lost a peer at step 3" in err and "saved the checkpoint of step 3" in err, err
    assert "Traceback" not in err and f"traceback: {tmp_path / 'error-rank0.log'}" in err
    assert CheckpointStore(tmp_path).manifest(3)["meta"]["rescue"]["step"] == 3


def test_another_threads_lost_peer_error_saves_nothing(tmp_path, capsys, monkeypatch):
    """A thread the session was not set up in (a logging thread of the user's) may fail while the session's own thread
    is mid-update: its error is printed as before, and nothing is saved."""
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)
    model = ol.wrap_model(torch.nn.Linear(4, 1))
    ol.save_on_failure(tmp_path, model=model)
    rescue.guard(ol)
    other = threading.Thread(target=lambda: (_ for _ in ()).throw(RuntimeError(GLOO_CLOSED)), name="logger")
    other.start()
    other.join(timeout=60)
    err = capsys.readouterr().err
    assert "lost a peer" not in err and "Exception in thread logger" in err and GLOO_CLOSED in err
    assert CheckpointStore(tmp_path).steps() == []
    ol.release()
