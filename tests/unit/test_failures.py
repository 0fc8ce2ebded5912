"""The failure announcement protocol (:mod:`omnilearn.distributed.failures`) over one in-process store, with listener
threads that record what they heard instead of ending the process.

- A rank's announcement reaches its peer's listener, which acknowledges (so ``announce`` returns) and gets the
  line ``rank R failed: <Type>: <message>``; the failing rank's own listener goes on.
- Two ranks failing together: both name the lower one.
- A peer that never listens (dead) holds the failing rank at most ``ack_s``; one that stopped listening not at all.

Run: ``python -m pytest -q tests/unit/test_failures.py`` (the processes: ``tests/dist/test_rank_errors.py``)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omnilearn.distributed.failures import LISTENING, PREFIX, FailureListener, failure_line

LONG_S = 600.0  # an acknowledgement wait that only a broken listener would reach


def listener(store: dist.Store, rank: int, heard: list[str], world: int = 2, ack_s: float = LONG_S,
             poll_s: float = 0.01) -> FailureListener:
    return FailureListener(store, rank, world, heard.append, poll_s=poll_s, ack_s=ack_s)


def test_the_line_names_the_rank_the_type_and_the_first_line_of_the_message():
    assert failure_line(1, torch.OutOfMemoryError("CUDA out of memory.\nmore")) == \
        "rank 1 failed: OutOfMemoryError: CUDA out of memory."
    assert failure_line(0, KeyError()) == "rank 0 failed: KeyError"
    assert len(failure_line(0, ValueError("x" * 1000))) < 350


def test_a_peer_hears_an_announcement_and_acknowledges_it():
    store = dist.HashStore()
    heard0, heard1 = [], []
    zero, one = listener(store, 0, heard0).start(), listener(store, 1, heard1).start()
    line = one.announce(torch.OutOfMemoryError("emulated"))  # returns once rank 0 acknowledged
    zero._thread.join()  # a listener that heard a peer ends its process, here its thread
    assert line == "rank 1 failed: OutOfMemoryError: emulated" and heard0 == [line]
    assert one._thread.is_alive() and heard1 == []  # its own announcement ends nothing
    assert one.announce(ValueError("a second error")) == line  # announced once
    one.stop()


def test_two_ranks_failing_together_both_name_the_lower_one():
    store = dist.HashStore()
    store.set(f"{PREFIX}/1", failure_line(1, RuntimeError("one")))
    store.set(f"{PREFIX}/0", failure_line(0, RuntimeError("zero")))
    store.set(PREFIX, "1")
    heard0, heard1 = [], []
    zero, one = listener(store, 0, heard0).start(), listener(store, 1, heard1).start()
    one._thread.join()
    assert heard1 == ["rank 0 failed: RuntimeError: zero"] and heard0 == [] and zero._thread.is_alive()
    zero.stop()


def test_a_dead_peer_holds_the_failing_rank_at_most_ack_s_and_a_stopped_one_not_at_all():
    store = dist.HashStore()
    store.add(LISTENING, 1)  # a peer that listened, then died without a word
    alone = listener(store, 1, [], ack_s=0.05).start()
    assert alone.announce(RuntimeError("boom")) == "rank 1 failed: RuntimeError: boom"  # returned: waited ack_s
    alone.stop()
    store = dist.HashStore()
    gone, failing = listener(store, 0, []).start(), listener(store, 1, []).start()
    gone.stop()
    assert failing.announce(RuntimeError("boom")).startswith("rank 1 failed")  # no wait of LONG_S
    failing.stop()
