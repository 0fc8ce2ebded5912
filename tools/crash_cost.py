"""What a crash costs, per door: steps lost, and the seconds from the kill to training again, broken down.

    python tools/crash_cost.py                 # ~2 minutes on 2 cores; run it alone
    python tools/crash_cost.py --repeats 3 --out /tmp/crash

Each door trains, a worker is SIGKILLed after step ``K - 1`` (so step ``K`` is in flight), and the run
restarts by itself:

- ``cli``: ``omnilearn train`` (cnn1d on MNIST-1D, 2 workers), ``--max-restarts 1``, ``--checkpoint-every
  1000`` (no periodic checkpoint within the run), worker rank 1 killed (``OMNILEARN_FAULT_KILL_AT``);
- ``torchrun``: the API in a script of its own (tests/faults/rescue_script.py: a float64 MLP, 3 workers) under
  ``torchrun --standalone --max-restarts 1``, rank 2 killed;
- ``two agents``: the same script under two torchrun agents with a c10d rendezvous (``--nnodes 1:2``, in network
  namespaces of their own where this runs as root), node B's agent and worker killed: the job goes on on A;
- ``tensorflow``: ``omnilearn train --framework tensorflow`` (the default job, 2 TensorFlow workers), as ``cli``:
  a survivor writes the ``step-<N>/`` checkpoint (``session.json``'s ``rescue.seen_at``; no save time recorded);
- ``hf trainer``: ``OmniLearnTrainer`` (tests/faults/hf_rescue_script.py: a float64 1-layer GPT-2, 2 workers)
  under ``torchrun --standalone --max-restarts 1``, rank 0 killed at the end of step K: rank 1 saves the
  Trainer folder (its restart counts from the kill; its first step from the process start);
- ``lightning``: ``OmniLearnStrategy`` (tests/faults/lightning_rescue_script.py: a float64 MLP, 3 workers,
  ``accumulate_grad_batches=2``) under ``torchrun --standalone --max-restarts 1``, rank 0 killed at the end of
  step K: a survivor writes the ``OnExceptionCheckpoint`` file, ``fit(ckpt_path="last")`` resumes it (times as
  for the Trainer).

The parts (unix times from the run's own records): detection = the kill to a survivor seeing its collective
fail (the rescue checkpoint's ``meta.rescue.seen_at``); save = that to the manifest's ``saved_at``; restart =
that to the new attempt's processes starting (the launcher or agent notices, stops the survivors, spawns;
for two agents the c10d round too); start-up = imports and joining the group; load = reading the checkpoint
into the model; first step = the first step after it. ``omnilearn train`` records no process start, so its
restart includes the start-up. Prints a Markdown table; ``--out`` keeps the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "faults" / "rescue_script.py"
HF_SCRIPT = ROOT / "tests" / "faults" / "hf_rescue_script.py"
LIGHTNING_SCRIPT = ROOT / "tests" / "faults" / "lightning_rescue_script.py"
sys.path.insert(0, str(ROOT / "tests" / "faults"))
KILL = 7  # the step in flight when the worker dies (the script's and the CLI's)


def rescue_meta(ckpt: Path) -> dict:
    found = [json.loads(p.read_text()) for p in ckpt.glob("step-*.json")]
    rescued = [m for m in found if "rescue" in m.get("meta", {})]
    if not rescued:
        raise SystemExit(f"crash_cost: no survivor's checkpoint in {ckpt}")
    m = max(rescued, key=lambda m: m["step"])
    return {"step": m["step"], "seen_at": m["meta"]["rescue"]["seen_at"], "saved_at": m["saved_at"]}


def launched(out: Path, what: str, *flags: str) -> tuple[list[dict], float]:
    """``omnilearn train`` (2 workers, ``flags`` more) with worker 1 killed after step KILL - 1 and one restart:
    the run's events and the kill's time."""
    stamp = out / "killed-at.txt"
    env = {**os.environ, "OMNILEARN_FAULT_KILL_AT": f"1:{KILL}", "OMNILEARN_FAULT_STAMP": str(stamp)}
    cmd = [sys.executable, "-m", "omnilearn", "train", "--out", str(out / "run"), "--workers", "2", "--speeds", "2,1",
           "--max-steps", "30", "--control-interval", "5", "--checkpoint-every", "1000", "--max-restarts", "1",
           "--no-plots", *flags]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"crash_cost: {what} failed:\n{done.stderr[-3000:]}")
    events = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return events, float(stamp.read_text())


def resumed(events: list[dict]) -> tuple[dict, float]:
    """The restart's ``resume`` event and its checkpoint's load time."""
    return (next(e for e in events if e.get("event") == "resume"),
            next(e["load_s"] for e in events if e.get("event") == "checkpoint_loaded"))


def cli(out: Path) -> dict:
    events, killed = launched(out, "omnilearn train")
    resume, load_s = resumed(events)
    meta = rescue_meta(out / "run" / "checkpoints")
    return {"lost": KILL - resume["step"], "detection": meta["seen_at"] - killed,
            "save": meta["saved_at"] - meta["seen_at"], "restart": resume["at"] - load_s - meta["saved_at"],
            "start-up": None, "load": load_s, "first step": None, "total": resume["at"] - killed}


def tensorflow(out: Path) -> dict:
    """``omnilearn train --framework tensorflow``: the survivor's ``session.json`` records when it saw the error."""
    events, killed = launched(out, "omnilearn train --framework tensorflow", "--framework", "tensorflow")
    resume, load_s = resumed(events)
    state = max((out / "run" / "checkpoints").glob("step-*/session.json"))
    seen = json.loads(state.read_text())["rescue"]["seen_at"]
    return {"lost": KILL - resume["step"], "detection": seen - killed, "save": None,
            "restart": resume["at"] - load_s - seen, "start-up": None, "load": load_s, "first step": None,
            "total": resume["at"] - killed}


def script_parts(out: Path) -> dict:
    kill = json.loads((out / "kill-0.json").read_text())
    again = json.loads((out / "attempt-1.json").read_text())
    meta = rescue_meta(out / "ckpt")
    return {"lost": kill["step"] - again["start"], "detection": meta["seen_at"] - kill["at"],
            "save": meta["saved_at"] - meta["seen_at"], "restart": again["t0"] - meta["saved_at"],
            "start-up": again["setup"] - again["t0"], "load": again["loaded"] - again["setup"],
            "first step": again["first_step"] - again["loaded"], "total": again["first_step"] - kill["at"],
            "workers": again["world"]}


def torchrun(out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "--max-restarts",
           "1", str(SCRIPT), str(out), f"2:{KILL}"]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"crash_cost: torchrun failed:\n{done.stderr[-3000:]}")
    return script_parts(out)


def two_agents(out: Path) -> dict:
    from test_rescue_torchrun import free_port, two_nodes  # the test's nodes: namespaces where possible

    with two_nodes() as (nodes, procs):
        port = free_port()
        procs.append(nodes.agent(0, port, 2, out))
        procs.append(nodes.agent(1, port, 1, out, f"L0:{KILL}:agent"))
        if procs[0].wait(timeout=300) != 0:
            raise SystemExit(f"crash_cost: two agents failed:\n{(out / 'agent-A.log').read_text()[-3000:]}")
        where = "namespaces" if nodes.isolated else "loopback"
    return {**script_parts(out), "nodes": where}


def hf(out: Path) -> dict:
    """OmniLearnTrainer (tests/faults/hf_rescue_script.py), 2 workers, rank 0 killed at the end of step KILL."""
    return framework_door(out, HF_SCRIPT, 2, "the Trainer run")


def lightning(out: Path) -> dict:
    """OmniLearnStrategy (tests/faults/lightning_rescue_script.py), 3 workers, rank 0 killed at the end of step
    KILL."""
    return framework_door(out, LIGHTNING_SCRIPT, 3, "the Lightning run")


def framework_door(out: Path, script: Path, workers: int, what: str) -> dict:
    """A framework's script under torchrun, rank 0 killed at the end of step KILL. Its rescue file holds no times:
    restart counts from the kill (detection and save in it), start-up to the first step (imports, the framework,
    the load)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
           "--max-restarts", "1", str(script), str(out), f"0:{KILL}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"crash_cost: {what} failed:\n{done.stderr[-3000:]}")
    kill = json.loads((out / "kill-0.json").read_text())
    again = json.loads((out / "attempt-1.json").read_text())
    return {"lost": kill["step"] - again["start"], "detection": None, "save": None, "restart": again["t0"] - kill["at"],
            "start-up": None, "load": None, "first step": again["first_step"] - again["t0"],
            "total": again["first_step"] - kill["at"], "workers": again["world"]}


DOORS = {"cli": cli, "tensorflow": tensorflow, "torchrun": torchrun, "two agents": two_agents, "hf trainer": hf,
         "lightning": lightning}
PARTS = ("detection", "save", "restart", "start-up", "load", "first step", "total")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1, help="runs per door (medians reported)")
    p.add_argument("--doors", default=",".join(DOORS), help=f"which, comma-separated (default {','.join(DOORS)})")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args(argv)
    doors = [d.strip() for d in args.doors.split(",")]
    unknown = [d for d in doors if d not in DOORS]
    if unknown or args.repeats < 1:
        p.error(f"--doors {','.join(unknown)}: choose among {', '.join(DOORS)}" if unknown else "--repeats >= 1")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="crash-cost-"))
    results: dict[str, list[dict]] = {}
    for door in doors:
        for i in range(args.repeats):
            out = base / f"{door.replace(' ', '-')}-{i}"
            out.mkdir(parents=True, exist_ok=False)
            start = time.perf_counter()
            results.setdefault(door, []).append(DOORS[door](out))
            print(f"crash_cost: {door} #{i + 1} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    (base / "crash_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| door | steps lost | " + " | ".join(f"{part} s" for part in PARTS) + " |")
    print("|---" * (len(PARTS) + 2) + "|")
    for door, runs in results.items():
        cells = []
        for part in PARTS:
            values = [r[part] for r in runs if r.get(part) is not None]
            cells.append(f"{statistics.median(values):.2f}" if values else "-")
        lost = max(r["lost"] for r in runs)
        note = f" ({runs[0]['nodes']})" if "nodes" in runs[0] else ""
        print(f"| {door}{note} | {lost} | " + " | ".join(cells) + " |")
    print(f"crash_cost: {base / 'crash_cost.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
