"""The TensorFlow runtime's pure parts, without TensorFlow: TF_CONFIG, the step clock, the scripted timings, the CLI's refusals.

Run: ``python -m pytest -q tests/tf/test_tf_cluster.py``
"""

from __future__ import annotations

import json
import random
import socket
import time

import pytest

from omnilearn.config import ConfigError
from omnilearn.decisions import SCRIPTED_ENV, scripted_times
from omnilearn.experiments.cli import main
from omnilearn.tf.cluster import LOCAL_WORKERS_ENV, ephemeral_range, free_ports, from_env, local_config
from omnilearn.tf.timing import StepClock


def test_local_configs_make_one_cluster_with_each_worker_its_index():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    clusters = [from_env({"TF_CONFIG": local_config(ports, r)}) for r in range(3)]
    assert [c.rank for c in clusters] == [0, 1, 2] and [c.world_size for c in clusters] == [3, 3, 3]
    assert clusters[0].is_main and not clusters[2].is_main
    assert clusters[1].workers == tuple(f"localhost:{p}" for p in ports)
    assert clusters[1].local_workers({}) == 3  # all on one host
    assert clusters[1].local_workers({LOCAL_WORKERS_ENV: "2"}) == 2


def test_free_ports_are_bindable_distinct_and_outside_the_ephemeral_range(tmp_path):
    """A port from bind(0) is ephemeral: closed again before TensorFlow binds it, an outgoing connection could
    take it in between (a worker's "Could not start gRPC server"); the picked ones are outside that range."""
    low, high = ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8 and not any(low <= p <= high for p in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("localhost", port))  # still free: nothing was left holding it
    first = free_ports(1, random.Random(7))[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("localhost", first))  # a listener holds the first draw: the same draws skip it
        assert free_ports(1, random.Random(7))[0] != first
    (tmp_path / "range").write_text("10000\t65000\n")
    assert ephemeral_range(str(tmp_path / "range")) == (10000, 65000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_no_tf_config_is_one_worker():
    cluster = from_env({})
    assert (cluster.rank, cluster.world_size, cluster.is_main, cluster.local_workers({})) == (0, 1, True, 1)


def test_workers_on_other_hosts_do_not_share_this_hosts_cores():
    config = {"cluster": {"worker": ["a:1", "a:2", "b:1"]}, "task": {"type": "worker", "index": 2}}
    assert from_env({"TF_CONFIG": json.dumps(config)}).local_workers({}) == 1


@pytest.mark.parametrize("text, said", [
    ("{not json", "TF_CONFIG is not JSON"),
    ('{"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}', "needs a 'worker' list"),
    ('{"cluster": {"worker": ["nohostport"]}, "task": {"type": "worker", "index": 0}}', "'host:port' strings"),
    ('{"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "worker", "index": 0}}', "omnilearn.tf.asp.Chief"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}', "must be {'type': 'worker'"),
    ('{"cluster": {"worker": ["a:1", "a:2"]}, "task": {"type": "worker", "index": 2}}', "index 2 must be"),
    ('{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}', "address twice"),
])
def test_a_bad_tf_config_is_one_line_naming_what_is_wrong(text, said):
    with pytest.raises(ConfigError) as e:
        from_env({"TF_CONFIG": text})
    assert said in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("mode, said", [("asp", "train asynchronously with omnilearn.tf.asp.Chief"),
                                         ("async", "mode is 'bsp' (the default)")])
def test_setup_refuses_asynchronous_training_naming_the_route(monkeypatch, mode, said):
    import omnilearn.tf

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ConfigError) as e:
        omnilearn.tf.setup(global_batch=8, mode=mode)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_step_clock_splits_compute_and_wait_and_counts_the_delay(monkeypatch):
    now_s = iter([100.0, 100.02, 100.05, 200.0, 200.01])  # scripted wall clock: begin, ready, end; begin, end
    monkeypatch.setattr(time, "perf_counter", lambda: next(now_s))
    clock = StepClock(single_thread=False)
    clock.begin()
    clock.add_delay(0.005)
    clock.mark_ready()
    times = clock.end()
    assert times.compute_s == pytest.approx(0.02, abs=1e-9) and times.wait_s == pytest.approx(0.03, abs=1e-9)
    assert times.step_s == pytest.approx(0.05, abs=1e-9) and times.delay_s == 0.005
    clock.begin()
    assert clock.end() == (pytest.approx(0.01, abs=1e-9), 0.0, pytest.approx(0.01, abs=1e-9), 0.0)  # never ready


def test_a_single_thread_worker_measures_native_compute_in_cpu_time():
    clock = StepClock(single_thread=True)
    clock.begin()
    time.sleep(0.05)  # a sleep is no compute
    assert clock.native_compute_s() < 0.02 and clock.elapsed_s() >= 0.05


def test_scripted_timings_are_parsed_and_checked(monkeypatch):
    monkeypatch.delenv(SCRIPTED_ENV, raising=False)
    assert scripted_times(3) is None
    monkeypatch.setenv(SCRIPTED_ENV, "0.02:0.0001,0.0002")
    assert scripted_times(2) == ((0.02, 0.0001), (0.0, 0.0002))
    for bad in ("0.1,x", "0.1,-1", "1:0.1"):
        monkeypatch.setenv(SCRIPTED_ENV, bad)
        with pytest.raises(ValueError, match=SCRIPTED_ENV):
            scripted_times(2)


@pytest.mark.parametrize("flags, said", [
    (["--mode", "asp", "--max-restarts", "2"], "--framework tensorflow --mode asp has no --max-restarts yet"),
    (["--mode", "asp", "--speed-schedule", "paper", "--workers", "4"], "--mode asp has no --speed-schedule yet"),
    (["--model", "resnet18", "--dataset", "cifar10", "--data-dir", "/nowhere"], "trains --model cnn1d or mlp"),
    (["--accumulation-steps", "2"], "has no --accumulation-steps yet"),
    (["--loader-workers", "2"], "has no --loader-workers yet"),
    (["--emulator", "affinity"], "has no --emulator affinity yet"),
    (["--framework", "jax"], "invalid choice: 'jax'"),
])
def test_the_cli_refuses_what_the_tensorflow_runtime_lacks_in_one_line(tmp_path, capsys, flags, said):
    code = main(["train", "--framework", "tensorflow", "--out", str(tmp_path / "run"), "--max-steps", "3", *flags])
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing written
