"""The survivors' save, in one process: which errors mean a lost peer, one writer per step, nothing pruned.

The real thing (processes killed mid-run, restarts, exactness) is tests/faults/test_rescue.py.

Run: ``python -m pytest -q tests/unit/test_survivor_save.py``
"""

from __future__ import annotations

import os

import pytest
import torch

from omnilearn.checkpoint import CheckpointStore
from omnilearn.distributed.lost import PeerLost, first_line, peer_lost, why_lost

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:22181: Connection reset by peer. This is typically caused by a remote worker hanging or "
              "bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!")
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:56023. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                "1800000ms for recv operation to complete")


@pytest.mark.parametrize("message", [GLOO_RESET, GLOO_CLOSED, "NCCL error: remote process exited or there was a "
                                     "network error", "[pair.cc:589] Write error: Broken pipe"])
def test_a_dead_peers_error_is_a_lost_peer(message):
    assert peer_lost(RuntimeError(message))


@pytest.mark.parametrize("error", [RuntimeError(GLOO_TIMEOUT), RuntimeError("CUDA out of memory"),
                                   ValueError("Connection reset by peer"), None, KeyboardInterrupt()])
def test_other_errors_are_not(error):
    """A timeout (hung, or a loop that skipped a call), this rank's own errors, a non-runtime error: not lost."""
    assert not peer_lost(error)


def test_a_wrapped_lost_peer_is_seen_through_its_cause():
    """The meeting's own error (ranks did not come) raised from gloo's: still a lost peer."""
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as e:
            raise RuntimeError("rank 0 waited at the interval end after 16 steps and the other ranks did not come") \
                from e
    except RuntimeError as e:
        assert peer_lost(e)
    assert peer_lost(PeerLost("gone"))


def test_a_lost_peer_seen_through_ddps_comm_hook_is_said_by_gloos_own_words():
    wrapped = RuntimeError(f"Got the following error when running the callback: RuntimeError: {GLOO_RESET}")
    assert peer_lost(wrapped) and why_lost(wrapped) == "Read error [127.0.0.1]:22181: Connection reset by peer"


def test_the_line_is_short():
    assert first_line(RuntimeError(GLOO_CLOSED)) == "Connection closed by peer [127.0.0.1]:56023"
    assert first_line(RuntimeError("")) == "RuntimeError"


class UnavailableError(Exception):
    """Stands for TensorFlow's (no TensorFlow here): its module is what tells a backend's error."""


UnavailableError.__module__ = "tensorflow.python.framework.errors_impl"
TF_ABORTED = ("Graph execution error:\n\nDetected at node sgd/CollectiveReduceV2 defined at ...\nCollective ops is "
              "aborted by: recvmsg:Connection reset by peer\nAdditional GRPC error information from remote target "
              "/job:worker/replica:0/task:1\nThe error could be from a previous operation. Restart your program.")


def test_tensorflows_aborted_collective_is_a_lost_peer_and_its_line_the_one_that_says_so():
    assert peer_lost(UnavailableError(TF_ABORTED))
    assert why_lost(UnavailableError(TF_ABORTED)) == "Collective ops is aborted by: recvmsg:Connection reset by peer"
    assert not peer_lost(UnavailableError("Graph execution error: Deadline Exceeded"))  # a timeout: not a death
    try:  # the deepest error that says so, not a wrapper quoting it
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as e:
            raise RuntimeError(f"rank 1 waited at sync_buffers() and the others did not come ({GLOO_CLOSED[:80]})") \
                from e
    except RuntimeError as e:
        assert why_lost(e) == "Connection closed by peer [127.0.0.1]:56023"


def state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "session": {"next_step": 7}}


def test_one_writer_per_step(tmp_path):
    store = CheckpointStore(tmp_path)
    claim = tmp_path / ".step-000000007.claim"
    tmp_path.mkdir(exist_ok=True)
    claim.write_text("123\n")  # another survivor is writing step 7
    assert store.save_once(7, state(1.0)) is None
    assert store.steps() == []
    claim.unlink()
    path = store.save_once(7, state(2.0), {"rescue": {"rank": 1}})
    assert path == store.path(7) and store.steps() == [7]
    assert not claim.exists()  # the claim goes once the checkpoint is complete
    assert store.manifest(7)["meta"]["rescue"] == {"rank": 1}
    assert store.save_once(7, state(3.0)) is None  # complete already: the slower survivor leaves it
    assert torch.equal(store.load(7)["model"]["w"], torch.full((3,), 2.0))


def test_a_survivors_save_prunes_nothing_and_the_next_save_sweeps(tmp_path):
    """Another survivor may be writing another step beside it: nothing pruned or swept; the next ordinary save
    prunes to K and sweeps what a survivor killed mid-save left (its .pt without a manifest, its claim)."""
    store = CheckpointStore(tmp_path, keep=1)
    store.save(5, state(0.0))
    cut = store.path(8)
    cut.write_bytes(b"half")  # a survivor killed between its .pt and its manifest
    (tmp_path / ".step-000000008.claim").write_text("9\n")
    store.save_once(7, state(1.0))
    assert store.steps() == [5, 7] and cut.exists()
    store.save(9, state(2.0))
    assert store.steps() == [9]
    assert not cut.exists() and not (tmp_path / ".step-000000008.claim").exists()


def test_a_kill_between_the_pt_and_its_manifest_leaves_no_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)

    def killed() -> None:
        raise SystemExit("killed")  # stands in for SIGKILL at that point (the fault test kills a real process)

    with pytest.raises(SystemExit):
        store.save_once(7, state(1.0), after_parts=killed)
    assert store.steps() == [] and store.read_latest() is None
    assert store.path(7).exists()  # the .pt alone does not count
    assert not any(p.name.endswith(".claim") for p in tmp_path.iterdir())  # the claim goes with the process here
    os.sync()


def test_a_session_saves_once_what_it_was_given(tmp_path, capsys):
    """One process stands in for a survivor: no directory given, one line says so; given one, the checkpoint of
    the step in flight's start loads back into a new session (the restart), with its rescue noted."""
    import omnilearn
    from torch.utils.data import TensorDataset

    def session():
        ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)
        torch.manual_seed(0)
        model = ol.wrap_model(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = ol.data_loader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)))
        return ol, model, opt, loader

    ol, model, opt, loader = session()
    with pytest.raises(TypeError, match="directory=3"):
        ol.save_on_failure(3, model=model)
    for i, (x, y) in enumerate(loader):
        if i == 3:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ol.step(loss)
    lost = RuntimeError(GLOO_CLOSED)
    assert "nothing was saved" in ol._lost(lost)
    ol.rescued = None
    ol.save_on_failure(tmp_path, model=model, optimizer=opt)
    line = ol._lost(lost)
    assert line.startswith("omnilearn: rank 0 lost a peer at step 3 (Connection closed by peer")
    assert ol._lost(lost) is line and capsys.readouterr().err.count("lost a peer") == 2  # once per failure
    assert CheckpointStore(tmp_path).manifest(3)["meta"]["rescue"]["step"] == 3
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ol.release()

    again, model2, opt2, _ = session()
    assert again.load_checkpoint(tmp_path, model=model2, optimizer=opt2)
    assert again.next_step == 3
    assert all(torch.equal(weights[k], v) for k, v in model2.state_dict().items())
    again.release()


def test_weights_ahead_of_the_count_are_not_saved(tmp_path):
    """Between ``optimizer.step()`` and ``ol.step()`` the weights hold the step's update and the count does not: the
    optimizer step hook knows it, and the survivor saves nothing and says so; counted, the next loss saves again.
    Any optimizer's update is noted (the hook is the process's), here a second one's."""
    import omnilearn

    from omnilearn.bsp import rescue

    ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)
    rescue.guard(ol)  # as setup() does for a session of several ranks
    model = ol.wrap_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    ol.save_on_failure(tmp_path, model=model, optimizer=opt)
    loader = iter(ol.data_loader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))))
    for k in range(3):
        x, y = next(loader)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        (opt if k < 2 else other).step()
        if k < 2:
            ol.step()
    assert ol.updated_at == ol.next_step == 2  # the other optimizer moved at step 2, not counted yet
    line = ol._lost(RuntimeError(GLOO_CLOSED))
    assert "nothing was saved: its optimizer had applied step 2 and ol.step() had not counted it" in line
    assert CheckpointStore(tmp_path).steps() == []
    ol.step()
    ol.rescued = None
    assert "saved the checkpoint of step 3" in ol._lost(RuntimeError(GLOO_CLOSED))
    ol.release()


def test_a_meeting_that_fails_for_a_lost_peer_saves_too(tmp_path):
    """The meeting's read (ol.step(), a loader reading ahead, sync_buffers, save_checkpoint) is the other place a
    survivor sees a dead peer, after optimizer.step() (the session counted the step first). A meeting whose wait
    fails as gloo's does stands in for it."""
    import omnilearn
    from omnilearn.bsp.steppers import WindowRead
    from omnilearn.decisions import INTERVAL

    class Broken:
        def table(self):
            raise RuntimeError(GLOO_RESET)

    ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)
    model = ol.wrap_model(torch.nn.Linear(4, 1))
    ol.save_on_failure(tmp_path, model=model)
    ol.meeting = WindowRead(Broken(), INTERVAL, 0, [])
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        ol._read_meeting()
    assert ol.meeting is None and "saved the checkpoint of step 0" in ol.rescued
    assert CheckpointStore(tmp_path).steps() == [0]
    ol.release()


def test_an_optimizer_update_waits_while_the_watchdogs_thread_saves():
    """A false "hung" verdict: the watchdog's thread copies the model while the all-reduce it thought stuck ends
    under it; the update waits (an optimizer step pre-hook on the save's lock) so the copy never sees half of it."""
    import threading

    import omnilearn
    from omnilearn.bsp import rescue

    ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)
    rescue.guard(ol)
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    opt = torch.optim.SGD([weight], lr=0.5)
    order = []
    with rescue._SAVING:  # the watchdog's thread, saving
        step = threading.Thread(target=lambda: (opt.step(), order.append("updated")))
        step.start()
        step.join(0.5)  # time for an update that did not wait (a wait, not a deadline)
        order.append("saved")
        assert torch.equal(weight.detach(), torch.ones(3))
    step.join()
    assert order == ["saved", "updated"] and torch.equal(weight.detach(), torch.full((3,), 0.5))
    ol.release()
