#!/usr/bin/env python3
"""Operator trials for issue 20 (run through run_trials.sh, which sets ROOT/PYTHONPATH/LABEL).

Each trial starts `python -m omnilearn ...` in ROOT, does to it what an operator (or a failure) would, and records
what came out: exit code, last lines, leftovers (processes carrying this trial's marker in their environment,
listening sockets of those processes, the launcher's temp store under a private TMPDIR, half-written files), and
for a resume: the step it resumed at and the step it ended at. Results: $OUT/results.json and $OUT/results.md
(an automatic verdict per row; the hand-written table is in docs/failures.md, "Operator trials"). Trials run one at a time.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ["ROOT"])
LABEL = os.environ.get("LABEL", "before")
OUT = Path(os.environ.get("TRIALS", "/tmp/trials")) / LABEL
ONLY = {s for s in os.environ.get("ONLY", "").split(",") if s}
SEED = int(os.environ.get("SEED", "20"))
PY = sys.executable
rng = random.Random(SEED)

# the default MNIST-1D workload, kept short; static controller so a resumed run can be compared bitwise
BASE = ["--workers", "2", "--speeds", "2,1", "--global-batch", "64", "--control-interval", "5",
        "--checkpoint-every", "5", "--no-plots", "--controller", "static"]
RESULTS: list[dict] = []


# ----------------------------------------------------------------------------- helpers
def omni(*args: str) -> list[str]:
    return [PY, "-m", "omnilearn", *args]


def env_for(mark: str, **extra: str) -> dict:
    tmp = OUT / "tmp" / mark
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), TRIAL_MARK=mark, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def start(cmd: list[str], mark: str, log: Path, **extra: str) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "wb")
    f.write(("$ " + " ".join(cmd) + "\n").encode())
    f.flush()
    return subprocess.Popen(cmd, cwd=ROOT, env=env_for(mark, **extra), stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def marked(mark: str) -> list[int]:
    """Live processes (not zombies) whose environment carries TRIAL_MARK=<mark>."""
    key, pids = f"TRIAL_MARK={mark}".encode(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if key in (d / "environ").read_bytes().split(b"\0"):
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(d.name))
        except OSError:
            pass
    return sorted(pids)


def env_of(pid: int) -> dict:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def listening(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return [line.split()[3] + " " + line.split()[-1] for line in out.splitlines()
            if any(f"pid={p}," in line for p in pids)]


def kill_marked(mark: str) -> list[int]:
    """SIGKILL (one by one, by pid) whatever of this trial is still running; the pids."""
    pids = marked(mark)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def wait(p: subprocess.Popen, timeout: float) -> int | None:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def tail(log: Path, n: int = 4) -> str:
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()]
    return " / ".join(lines[-n:])


def grep(log: Path, pattern: str) -> list[str]:
    return [l for l in log.read_text(errors="replace").splitlines() if re.search(pattern, l)]


def leftovers(mark: str, run: Path | None, pids: set[int] | None = None, settle: float = 3.0) -> dict:
    """What a trial left: processes, their listening ports, the temp store, half-written files."""
    deadline = time.time() + settle
    while marked(mark) and time.time() < deadline:
        time.sleep(0.2)
    procs = marked(mark)
    tmp = OUT / "tmp" / mark
    left = {
        "procs": [f"{p} {cmdline(p)}" for p in procs],
        "ports": listening(set(procs) | (pids or set())),
        # torch's own compile cache (torchinductor_<user>) and torchrun's log dir (torchelastic_*) are torch's,
        # not the run's: the run's store is omnilearn-store-* (anything else is listed too)
        "store": sorted(p.name for p in tmp.iterdir() if not p.name.startswith(("torchinductor_", "torchelastic_")))
        if tmp.is_dir() else [],
        "partial": sorted(str(p.relative_to(run)) for p in run.rglob(".*.tmp")) if run and run.is_dir() else [],
    }
    if procs:
        left["killed_by_harness"] = kill_marked(mark)
    return left


def clean(left: dict) -> bool:
    return not (left["procs"] or left["ports"] or left["store"])


def worker_pids(run: Path, timeout: float = 60) -> dict[int, int]:
    f, deadline = run / "workers.pid", time.time() + timeout
    while time.time() < deadline:
        try:
            pids = {int(r): int(p) for r, p in (l.split() for l in f.read_text().splitlines() if l.strip())}
            if pids:
                return pids
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {}


def rank_pids(mark: str, timeout: float = 60) -> dict[int, int]:
    """torchrun: the rank processes of this trial (RANK in their environment, running omnilearn)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = {}
        for p in marked(mark):
            e = env_of(p)
            if "RANK" in e and "omnilearn" in cmdline(p) and "torchrun" not in cmdline(p):
                found[int(e["RANK"])] = p
        if len(found) >= 2:
            return found
        time.sleep(0.2)
    return {}


def complete_steps(run: Path) -> list[int]:
    d = run / "checkpoints"
    return sorted(int(m.group(1)) for p in d.glob("step-*.json") if (m := re.match(r"step-(\d+)\.json", p.name))) \
        if d.is_dir() else []


def wait_for(cond, timeout: float, every: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(every)
    return False


def summary(run: Path) -> dict:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def resumed_step(log: Path) -> str:
    m = grep(log, r"resumes at step|training starts:")
    if not m:
        return "none"
    r = re.search(r"resumes at step (\d+)", m[-1])
    return r.group(1) if r else "0 (fresh start)"


def same_weights(a: Path, b: Path) -> str:
    """'bitwise' / max relative difference / 'missing' between two model.pt files."""
    try:
        import torch
        x = torch.load(a, map_location="cpu", weights_only=True)
        y = torch.load(b, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        return f"missing ({type(e).__name__})"
    x = x.get("model", x) if isinstance(x, dict) else x
    y = y.get("model", y) if isinstance(y, dict) else y
    worst = 0.0
    for k in x:
        if not torch.is_tensor(x[k]) or not x[k].is_floating_point():
            continue
        d = (x[k] - y[k]).abs().max().item() / max(y[k].abs().max().item(), 1e-30)
        worst = max(worst, d)
    return "bitwise" if worst == 0.0 else f"rel diff {worst:.2e}"


def record(tid: str, trial: str, promise: str, observed: str, verdict: str, **raw) -> None:
    for key, path in raw.items():  # the exit abort of issue item 6, wherever it shows
        if key.endswith("log") and Path(str(path)).is_file():
            text = Path(str(path)).read_text(errors="replace")
            if "terminate called" in text or "SIGABRT" in text:
                observed += f" [EXIT ABORT in {Path(str(path)).name}: 'terminate called without an active exception']"
    row = {"id": tid, "trial": trial, "promise": promise, "observed": observed, "verdict": verdict, **raw}
    RESULTS.append(row)
    print(f"[{tid}] {verdict}: {observed}", flush=True)
    (OUT / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def resume(run: Path, mark: str, log: Path, *flags: str, timeout: float = 240) -> tuple[int | None, str, dict]:
    p = start(omni("train", "--out", str(run), "--resume", *flags), mark, log)
    rc = wait(p, timeout)
    left = leftovers(mark, run)
    return rc, resumed_step(log), left


def want(tid: str) -> bool:
    return not ONLY or any(tid == o or tid.split(".")[0] == o or (tid.startswith(o) and tid[len(o):].isalpha())
                           for o in ONLY)


# ----------------------------------------------------------------------------- reference runs
def reference(max_steps: int, name: str) -> Path:
    run = OUT / "runs" / name
    if (run / "model.pt").exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    log = OUT / "logs" / f"{name}.log"
    p = start(omni("train", *BASE, "--max-steps", str(max_steps), "--out", str(run)), name, log)
    rc = wait(p, 300)
    leftovers(name, run)
    print(f"[ref] {name}: rc {rc}, {tail(log, 1)}", flush=True)
    return run


# ----------------------------------------------------------------------------- 1. kill -9 during a checkpoint write
PHASES = ["pt-tmp", "pt-no-json", "json-tmp", "pt-tmp+delay", "random"]


def catch(ck: Path, phase: str, after: int, timeout: float) -> tuple[bool, str]:
    """Poll the checkpoint dir tightly until the wanted moment of a write of a step > after; True if caught."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            names = os.listdir(ck)
        except OSError:
            names = []
        for n in names:
            m = re.match(r"\.step-(\d+)\.(pt|json)\..*\.tmp$", n)
            if m and int(m.group(1)) > after:
                if phase in ("pt-tmp", "pt-tmp+delay") and m.group(2) == "pt":
                    return True, n
                if phase == "json-tmp" and m.group(2) == "json":
                    return True, n
            m = re.match(r"step-(\d+)\.pt$", n)
            if phase == "pt-no-json" and m and int(m.group(1)) > after and f"step-{m.group(1)}.json" not in names:
                return True, n
    return False, ""


def trial1(ref: Path) -> None:
    promise = ("A kill -9 mid-write leaves no half checkpoint that counts (atomic .pt then .json); the launcher "
               "names the dead rank; --resume continues from the newest complete checkpoint; same split: bitwise the "
               "weights of a run never stopped")
    for i, phase in enumerate(PHASES):
        tid, mark = f"1.{i + 1}", f"t1-{i + 1}"
        if not want(tid):
            continue
        run, log = OUT / "runs" / mark, OUT / "logs" / f"{mark}.log"
        shutil.rmtree(run, ignore_errors=True)
        victim = i % 2  # rank 0 writes the file; rank 1 is in the gather
        p = start(omni("train", *BASE, "--max-steps", "300", "--out", str(run)), mark, log)
        pids = worker_pids(run)
        ck = run / "checkpoints"
        wait_for(lambda: len(complete_steps(run)) >= 1, 90)
        target_after = complete_steps(run)[-1] + 5 * rng.randint(1, 6) if complete_steps(run) else 0
        wait_for(lambda: bool(complete_steps(run)) and complete_steps(run)[-1] >= target_after - 5, 60, 0.002)
        if phase == "random":
            time.sleep(rng.uniform(0, 0.3))
            caught, what = False, "random moment"
        else:
            caught, what = catch(ck, phase, target_after - 5, 20)
            if phase == "pt-tmp+delay":
                time.sleep(rng.uniform(0, 0.004))
        ckpt_state = sorted(os.listdir(ck)) if ck.is_dir() else []
        os.kill(pids[victim], signal.SIGKILL)
        t_kill = time.time()
        rc = wait(p, 120)
        took = time.time() - t_kill
        left = leftovers(mark, run, set(pids.values()))
        newest = complete_steps(run)[-1] if complete_steps(run) else 0
        kill_line = (grep(log, r"omnilearn: error") or [tail(log, 1)])[-1]
        # resume
        rlog = OUT / "logs" / f"{mark}-resume.log"
        rrc, at, rleft = resume(run, mark + "r", rlog)
        s = summary(run)
        w = same_weights(run / "model.pt", ref / "model.pt")
        obs = (f"victim rank {victim}, moment {phase} ({'caught: ' + what if caught else 'NOT caught, killed anyway'}; "
               f"ckpt dir at kill: {' '.join(ckpt_state[-4:])}); launcher rc {rc} in {took:.1f}s: {kill_line[:160]}; "
               f"leftovers {left}; newest complete ckpt {newest}; resume rc {rrc}, resumed at {at}, ended at step "
               f"{s.get('steps')}, weights vs unstopped: {w}; resume leftovers {rleft}")
        ok = (rc not in (0, None) and clean(left) and rrc == 0 and at == str(newest) and s.get("steps") == 300
              and w == "bitwise" and clean(rleft))
        verdict = "FAIL" if not ok else "FAIL (minor: the cut write's .tmp is never removed)" if rleft["partial"] \
            else "PASS"
        record(tid, f"kill -9 rank {victim} during checkpoint write ({phase})", promise, obs, verdict, rc=rc, resume_rc=rrc, log=str(log), resume_log=str(rlog))


# ----------------------------------------------------------------------------- 2. corrupt the newest checkpoint
def corrupt_base() -> Path:
    """A run killed (OMNILEARN_FAULT_KILL_AT) at step 52: checkpoints at 40, 45, 50 (keep 3)."""
    run = OUT / "runs" / "t2-base"
    if complete_steps(run):
        return run
    shutil.rmtree(run, ignore_errors=True)
    log = OUT / "logs" / "t2-base.log"
    p = start(omni("train", *BASE, "--max-steps", "120", "--out", str(run)), "t2-base", log,
              OMNILEARN_FAULT_KILL_AT="1:52")
    rc = wait(p, 120)
    leftovers("t2-base", run)
    print(f"[2-base] rc {rc}, checkpoints {complete_steps(run)}: {tail(log, 1)}", flush=True)
    return run


def trial2(ref: Path) -> None:
    base = corrupt_base()
    steps = complete_steps(base)
    newest, previous = steps[-1], steps[-2]
    ways = {
        "truncate": lambda pt, js: os.truncate(pt, pt.stat().st_size // 2),
        "flip bytes": lambda pt, js: flip(pt),
        "delete .json manifest": lambda pt, js: js.unlink(),
        "all checkpoints damaged (extra)": None,
        "pickle bytes flipped, manifest checksum updated (extra: passes the checksum, fails to deserialise)": None,
    }
    for i, (way, fn) in enumerate(ways.items()):
        tid, mark = f"2.{i + 1}", f"t2-{i + 1}"
        if not want(tid):
            continue
        run = OUT / "runs" / mark
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(base, run)
        pt = run / "checkpoints" / f"step-{newest:09d}.pt"
        js = pt.with_suffix(".json")
        expect = str(previous)
        if fn is not None:
            fn(pt, js)
        elif way.startswith("all"):
            for s in steps:
                os.truncate(run / "checkpoints" / f"step-{s:09d}.pt", 1000)
            expect = "error (no usable checkpoint; never a silent fresh start)"
        else:
            flip(pt, offset=0x40)  # the start of archive/data.pkl: the pickle stream itself
            import hashlib
            m = json.loads(js.read_text())
            m["sha256"] = hashlib.sha256(pt.read_bytes()).hexdigest()
            js.write_text(json.dumps(m))
            expect = "one-line error naming the file (or the previous checkpoint, loudly)"
        log = OUT / "logs" / f"{mark}-resume.log"
        rc, at, left = resume(run, mark, log)
        s = summary(run)
        warn = grep(log, r"(?i)warn|damaged|skipp|fall|cannot|checkpoint")
        warn = [w for w in warn if "checkpoints every" not in w][:3]
        w = same_weights(run / "model.pt", ref / "model.pt") if rc == 0 else "n/a"
        obs = (f"newest {newest} {way}; resume rc {rc}, resumed at {at}, ended at step {s.get('steps')}, "
               f"weights vs unstopped {w}; messages: {' | '.join(x.strip()[:200] for x in warn) or 'none'}; "
               f"last: {tail(log, 1)[:200]}; leftovers {left}")
        if way.startswith("all"):
            ok = rc not in (0, None) and at != "0 (fresh start)" and clean(left)
        elif way.startswith("pickle bytes flipped"):
            ok = rc is not None and (rc != 0 or at == str(previous)) and at != "0 (fresh start)" and \
                any("step-%09d" % newest in x for x in warn) and clean(left)
        else:
            ok = rc == 0 and at == expect and s.get("steps") == 120 and clean(left) and w == "bitwise" and (
                way.startswith("delete") or any(f"step-{newest:09d}" in x for x in warn))
        record(tid, f"corrupt newest checkpoint: {way}", "A damaged newest checkpoint is skipped with a warning "
               "naming it, for the one before (SHA-256 in the manifest); a checkpoint without its manifest does not "
               "count; a resume never quietly becomes a fresh start", obs, "PASS" if ok else "FAIL",
               rc=rc, expected=expect, log=str(log))


def flip(path: Path, at: float = 0.5, n: int = 16, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    k = int(len(data) * at) if offset is None else offset
    for j in range(k, min(k + n, len(data))):
        data[j] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- 3. SIGSTOP a worker, short heartbeat
def trial3() -> None:
    tid, mark = "3", "t3"
    if not want(tid):
        return
    run, log = OUT / "runs" / mark, OUT / "logs" / f"{mark}.log"
    shutil.rmtree(run, ignore_errors=True)
    hb = 5
    p = start(omni("train", *BASE, "--max-steps", "300", "--heartbeat-s", str(hb), "--out", str(run)), mark, log)
    pids = worker_pids(run)
    wait_for(lambda: len(complete_steps(run)) >= 2, 90)
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.time()
    rc = wait(p, 120)
    took = time.time() - t0
    left = leftovers(mark, run, set(pids.values()))
    line = (grep(log, r"omnilearn: error") or [tail(log, 1)])[-1]
    newest = complete_steps(run)[-1] if complete_steps(run) else 0
    rlog = OUT / "logs" / f"{mark}-resume.log"
    rrc, at, rleft = resume(run, mark + "r", rlog)
    obs = (f"SIGSTOP rank 1 (pid {pids.get(1)}), --heartbeat-s {hb}: launcher rc {rc} after {took:.1f}s: "
           f"{line[:220]}; leftovers {left}; --resume: rc {rrc}, resumed at {at} (newest {newest}), ended at "
           f"{summary(run).get('steps')}, leftovers {rleft}")
    ok = rc not in (0, None) and took <= hb + 10 and "rank 1" in line and clean(left) and rrc == 0 and \
        at == str(newest) and clean(rleft)
    record(tid, f"SIGSTOP a worker, --heartbeat-s {hb}", "A hung (stopped) worker is named within --heartbeat-s "
           "and the run stops (no process left); --resume continues", obs, "PASS" if ok else "FAIL",
           rc=rc, log=str(log), resume_log=str(rlog))


# ----------------------------------------------------------------------------- 4. SIGKILL the launcher
def trial4() -> None:
    for i, when in enumerate(["training", "starting"]):
        tid, mark = f"4.{i + 1}", f"t4-{i + 1}"
        if not want(tid):
            continue
        run, log = OUT / "runs" / mark, OUT / "logs" / f"{mark}.log"
        shutil.rmtree(run, ignore_errors=True)
        p = start(omni("train", *BASE, "--max-steps", "3000", "--out", str(run)), mark, log)
        if when == "training":
            pids = worker_pids(run)
            wait_for(lambda: len(complete_steps(run)) >= 1, 90)
        else:  # while the workers start up and join
            pids = worker_pids(run)
            time.sleep(0.5)
        before = {pp: cmdline(pp)[:60] for pp in marked(mark)}
        os.kill(p.pid, signal.SIGKILL)
        rc = wait(p, 10)
        time.sleep(1)
        left = leftovers(mark, run, set(pids.values()) | {p.pid}, settle=5)
        obs = (f"SIGKILL launcher pid {p.pid} while {when} (marked processes before: {len(before)}): rc {rc}; "
               f"after 5 s: leftovers {left}; workers.pid left: {(run / 'workers.pid').exists()}")
        record(tid, f"SIGKILL the launcher ({when})", "Workers die with a killed launcher; no process, no temp "
               "store, no listening port left", obs, "PASS" if clean(left) else "FAIL", rc=rc, log=str(log))


# ----------------------------------------------------------------------------- 5. small tmpfs as --out
def mount(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["umount", str(path)], capture_output=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def trial5() -> None:
    small = Path(os.environ.get("SMALL", str(OUT.parent / "small")))
    if want("5.1"):
        mark = "t5-1"
        mount(small, "600k")
        run, log = small / "run", OUT / "logs" / f"{mark}.log"
        p = start(omni("train", *BASE, "--max-steps", "200", "--out", str(run)), mark, log)
        rc = wait(p, 120)
        left = leftovers(mark, run)
        files = sorted(str(x.relative_to(small)) for x in small.rglob("*"))
        obs = f"--out on a 600 KB tmpfs: rc {rc}: {tail(log, 2)[:300]}; files on the tmpfs: {files[:8]}; leftovers {left}"
        fl = grep(log, r"error")
        if rc == 2 and not files:
            verdict = "PASS (refused up front)"
        elif rc not in (0, None) and fl and clean(left):
            verdict = "see 5.2"
        else:
            verdict = "FAIL"
        record("5.1", "--out on a 600 KB tmpfs, checkpoints on", "An --out without room is refused before any "
               "worker starts (exit 2, nothing written), or a full disk is one line naming the file and the space",
               obs, verdict, rc=rc, log=str(log))
        # then: resume after freeing space (make it bigger)
        if rc not in (0, None) and complete_steps(run):
            subprocess.run(["mount", "-o", "remount,size=20m", str(small)], check=True)
            rlog = OUT / "logs" / f"{mark}-resume.log"
            rrc, at, rleft = resume(run, mark + "r", rlog)
            record("5.1r", "... resume after freeing space", "continues from the newest complete checkpoint",
                   f"rc {rrc}, resumed at {at}, ended at {summary(run).get('steps')}; {rleft}",
                   "PASS" if rrc == 0 and at == str(complete_steps(run)[-1]) else "FAIL")
        subprocess.run(["umount", str(small)], capture_output=True)
    if want("5.2"):
        # the preflight wants 10 MB free, so: a 12 MB tmpfs, filled after the start to leave ~450 KB
        mark = "t5-2"
        mount(small, "12m")
        run, log = small / "run", OUT / "logs" / f"{mark}.log"
        p = start(omni("train", *BASE, "--max-steps", "300", "--checkpoint-every", "10", "--out", str(run)),
                  mark, log)
        pids = worker_pids(run)
        wait_for(lambda: len(complete_steps(run)) >= 1, 90, 0.005)
        free = shutil.disk_usage(small).free
        filler = small / "filler.bin"
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free - 450_000))
        fill_at = complete_steps(run)
        rc = wait(p, 120)
        left = leftovers(mark, run, set(pids.values()))
        err = grep(log, r"omnilearn: error")
        lines = [l for l in log.read_text(errors="replace").splitlines() if "Traceback" in l]
        done = complete_steps(run)
        partial = sorted(str(x.relative_to(small)) for x in small.rglob("*.tmp"))
        obs = (f"12 MB tmpfs, filled to ~450 KB free after checkpoint {fill_at}: launcher rc {rc}: "
               f"{(err or [tail(log, 1)])[-1][:300]}; error lines {len(err)}, tracebacks in output {len(lines)}; "
               f"complete checkpoints {done}; temp files {partial}; leftovers {left}")
        ok = rc not in (0, None) and len(err) == 1 and "DiskFull" in err[0] and not lines and clean(left)
        record("5.2", "full disk mid-run (tmpfs filled), checkpoints on", "A full disk is one `omnilearn: error:` "
               "line naming the file, the space needed and free; every rank stops; nothing half-written",
               obs, "PASS" if ok else "FAIL", rc=rc, log=str(log))
        filler.unlink(missing_ok=True)
        rlog = OUT / "logs" / f"{mark}-resume.log"
        newest = done[-1] if done else 0
        rrc, at, rleft = resume(run, mark + "r", rlog)
        obs = (f"filler deleted; --resume: rc {rrc}, resumed at {at} (newest complete "
               f"{newest}), ended at {summary(run).get('steps')}; {tail(rlog, 1)[:200]}; leftovers {rleft}")
        ok = rrc == 0 and at == str(newest) and summary(run).get("steps") == 300 and clean(rleft)
        record("5.3", "... then --resume after freeing space", "continues from the newest complete checkpoint",
               obs, "PASS" if ok else "FAIL", rc=rrc, log=str(rlog))
        shutil.copytree(small, OUT / "runs" / "t5-2-copy", dirs_exist_ok=True)  # kept for reading after the umount
        subprocess.run(["umount", str(small)], capture_output=True)


# ----------------------------------------------------------------------------- 6. ASP
ASP = ["--mode", "asp", "--workers", "3", "--speeds", "2,1,1", "--global-batch", "96", "--no-plots",
       "--checkpoint-every", "20"]


def trial6() -> None:
    cases = [("6.1", "kill -9 a worker (rank 2)", 2, signal.SIGKILL, []),
             ("6.2", "kill -9 the server (rank 0)", 0, signal.SIGKILL, [])]
    # SIGSTOP lands at a random point of a worker's cycle (in an exchange with the server or not): repeat it
    cases += [(f"6.3{c}", "SIGSTOP a worker (rank 2), --heartbeat-s 5", 2, signal.SIGSTOP, ["--heartbeat-s", "5"])
              for c in "abcdefgh"]
    promises = {
        "6.1": "The server drops the dead worker (one line, a drop event), deals its samples to the others (no "
               "sample repeated) and goes on; exit 0 with a warning line per lost worker",
        "6.2": "A dead server ends the run naming 'the parameter server (rank 0)'; workers do not hang; --resume "
               "(or --max-restarts) resumes the server from its checkpoint",
    }
    promises.update({f"6.3{c}": "The server drops a worker silent for --heartbeat-s and goes on; the hung one is "
                     "SIGKILLed after the server finishes; exit 0 with a warning" for c in "abcdefgh"})
    for tid, what, victim, sig, extra in cases:
        if not want(tid):
            continue
        mark = "t" + tid.replace(".", "-")
        run, log = OUT / "runs" / mark, OUT / "logs" / f"{mark}.log"
        shutil.rmtree(run, ignore_errors=True)
        steps = "1500" if sig == signal.SIGSTOP else "300"  # long enough to see the others go on after the drop
        p = start(omni("train", *ASP, "--max-steps", steps, "--out", str(run), *extra), mark, log)
        pids = worker_pids(run)
        wait_for(lambda: len(complete_steps(run)) >= 1, 90)
        if sig == signal.SIGSTOP:
            time.sleep(rng.uniform(0, 1.0))
        os.kill(pids[victim], sig)
        t0 = time.time()
        rc = wait(p, 150)
        took = time.time() - t0
        left = leftovers(mark, run, set(pids.values()))
        s = summary(run)
        msgs = [l.strip()[:200] for l in grep(log, r"(?i)drop|lost|warning|error|parameter server")][:4]
        obs = (f"{what}: launcher rc {rc} {took:.1f}s after; messages: {' | '.join(msgs) or 'none'}; last: "
               f"{tail(log, 1)[:160]}; summary: steps {s.get('steps')}, updates {s.get('updates')}, repeated "
               f"{s.get('repeated_samples')}; leftovers {left}")
        if tid == "6.2":
            newest = complete_steps(run)[-1] if complete_steps(run) else 0
            rlog = OUT / "logs" / f"{mark}-resume.log"
            rrc, at, rleft = resume(run, mark + "r", rlog)
            rs = summary(run)
            rl = [l.strip()[:160] for l in grep(rlog, r"(?i)resum")][:2]
            obs += (f"; --resume: rc {rrc}, {' | '.join(rl)}, newest ckpt {newest}, ended: steps {rs.get('steps')}, "
                    f"updates {rs.get('updates')}, resumed_at_version {rs.get('resumed_at_version')}, repeated "
                    f"{rs.get('repeated_samples')}; leftovers {rleft}")
            ok = (rc not in (0, None) and any("parameter server" in m for m in msgs) and clean(left) and rrc == 0
                  and clean(rleft) and rs.get("resumed_at_version") not in (None, 0))
        else:
            ok = rc == 0 and s.get("repeated_samples") == 0 and clean(left) and any("rank 2" in m for m in msgs)
        extra_logs = {"resume_log": str(OUT / "logs" / f"{mark}-resume.log")} if tid == "6.2" else {}
        record(tid, f"ASP: {what}", promises[tid], obs, "PASS" if ok else "FAIL", rc=rc, log=str(log), **extra_logs)


# ----------------------------------------------------------------------------- 7. torchrun --max-restarts 1
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial7(ref: Path) -> None:
    variants = [("7.1", "static rendezvous (--nnodes 1 --master-port P)",
                 lambda: ["--nnodes", "1", "--master-port", str(free_port())]),
                ("7.2", "c10d rendezvous (--standalone)", lambda: ["--standalone"])]
    for tid, what, rdzv in variants:
        if not want(tid):
            continue
        mark = "t" + tid.replace(".", "-")
        run, log = OUT / "runs" / mark, OUT / "logs" / f"{mark}.log"
        shutil.rmtree(run, ignore_errors=True)
        cmd = ["torchrun", *rdzv(), "--nproc-per-node", "2", "--max-restarts", "1", "-m", "omnilearn", "train",
               *[a for a in BASE if a not in ("--workers", "2")], "--max-steps", "300", "--out", str(run)]
        p = start(cmd, mark, log)
        ranks = rank_pids(mark)
        wait_for(lambda: len(complete_steps(run)) >= 2, 120)
        newest_at_kill = complete_steps(run)[-1] if complete_steps(run) else None
        if 1 in ranks:
            os.kill(ranks[1], signal.SIGKILL)
        rc = wait(p, 400)
        left = leftovers(mark, run, set(ranks.values()) | {p.pid})
        s = summary(run)
        at = resumed_step(log)
        w = same_weights(run / "model.pt", ref / "model.pt")
        rs = [l.strip()[:120] for l in grep(log, r"resumes at step|Connection refused|connectFullMesh|restart")][:3]
        obs = (f"torchrun {what}, kill -9 rank 1 (pid {ranks.get(1)}) with newest ckpt {newest_at_kill}: rc {rc}; "
               f"{' | '.join(rs) or 'no resume line'}; ended at step {s.get('steps')}, weights vs unstopped {w}; "
               f"last: {tail(log, 1)[:160]}; leftovers {left}")
        ok = rc == 0 and at not in ("none", "0 (fresh start)") and s.get("steps") == 300 and clean(left)
        record(tid, f"torchrun --max-restarts 1, rank killed: {what}", "A restarted rank resumes the run in --out "
               "from the newest checkpoint and the job completes", obs, "PASS" if ok else "FAIL", rc=rc, log=str(log))


# ----------------------------------------------------------------------------- 8. malformed invocations
def trial8() -> None:
    bad = OUT / "bad"
    bad.mkdir(parents=True, exist_ok=True)
    (bad / "bad.toml").write_text("[train\nworkers = = 2\n")
    (bad / "unknown-key.toml").write_text("[train]\nworkerz = 2\n")
    (bad / "wrong-type.toml").write_text('[train]\nworkers = "two"\n')
    (bad / "a-file").write_text("not a directory\n")
    existing = reference_small(bad / "existing-run")
    T = ["--max-steps", "5", "--no-plots"]
    cases = [
        ("zero global batch", ["--global-batch", "0"]),
        ("negative global batch", ["--global-batch", "-64"]),
        ("zero workers", ["--workers", "0"]),
        ("negative workers", ["--workers", "-2"]),
        ("negative max-steps", ["--max-steps", "-5"]),
        ("zero epochs", ["--epochs", "0"]),
        ("min-batch above the even share", ["--workers", "2", "--global-batch", "64", "--min-batch", "100"]),
        ("max-batch too small for the global batch", ["--workers", "2", "--global-batch", "64", "--max-batch", "10"]),
        ("min-batch above max-batch", ["--workers", "2", "--min-batch", "40", "--max-batch", "20"]),
        ("max-batch list of the wrong length", ["--workers", "4", "--max-batch", "256,64"]),
        ("unknown model", ["--model", "nosuchnet"]),
        ("unknown dataset", ["--dataset", "nosuchdata"]),
        ("unknown controller", ["--controller", "nosuch"]),
        ("unknown preset", ["--preset", "nosuch-preset"]),
        ("speeds not matching --workers", ["--workers", "2", "--speeds", "4,2,1"]),
        ("speeds not numbers", ["--speeds", "fast,slow"]),
        ("unknown speed level", ["--speeds", "HL3"]),
        ("zero speed", ["--speeds", "2,0"]),
        ("missing --config file", ["--config", str(bad / "nope.toml")]),
        ("bad TOML syntax", ["--config", str(bad / "bad.toml")]),
        ("unknown key in TOML", ["--config", str(bad / "unknown-key.toml")]),
        ("wrong type in TOML", ["--config", str(bad / "wrong-type.toml")]),
        ("unknown flag", ["--nosuch-flag", "1"]),
        ("missing data dir", ["--dataset", "cifar10", "--data-dir", str(bad / "nope-data")]),
        ("missing speed schedule", ["--speed-schedule", str(bad / "nope-schedule.toml")]),
        ("zero control interval", ["--control-interval", "0"]),
        ("negative checkpoint-every", ["--checkpoint-every", "-1"]),
        ("zero keep-checkpoints", ["--keep-checkpoints", "0"]),
        ("zero heartbeat", ["--heartbeat-s", "0"]),
        ("lr not a number", ["--lr", "abc"]),
        ("docker emulator without containers", ["--emulator", "docker"]),
        ("too many processes per core", ["--workers", "40"]),
        ("--resume with nothing to resume", ["--resume"]),
        ("global batch smaller than the workers", ["--workers", "4", "--global-batch", "2"]),
        ("zero max-batch", ["--max-batch", "0"]),
        ("ASP-only flag in BSP", ["--staleness-lr"]),
        ("--resume changing a learned setting (--lr)", None),
        ("--out is a file", None),
        ("--out holds a run (no --overwrite)", None),
        ("unknown subcommand", None),
    ]
    for k, (what, args) in enumerate(cases, 1):
        tid = f"8.{k}"
        if not want(tid) and not want("8"):
            continue
        out = bad / f"out-{k}"
        shutil.rmtree(out, ignore_errors=True)
        if what == "--out is a file":
            cmd, watch = omni("train", *T, "--out", str(bad / "a-file")), bad / "a-file"
        elif what.startswith("--out holds"):
            cmd, watch = omni("train", *T, "--out", str(existing)), existing
        elif what.startswith("--resume changing"):
            cmd, watch = omni("train", "--out", str(existing), "--resume", "--lr", "0.2"), existing
        elif what == "unknown subcommand":
            cmd, watch = omni("trian", "--out", str(out)), out
        else:
            cmd, watch = omni("train", *T, *args, "--out", str(out)), out
        snap = snapshot(watch) if watch.exists() else None
        runs_before = sorted(os.listdir(ROOT / "runs")) if (ROOT / "runs").is_dir() else []
        t0 = time.time()
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env_for(f"t8-{k}"), capture_output=True, text=True, timeout=120)
            rc, so, se = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, so, se = None, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
            kill_marked(f"t8-{k}")
        took = time.time() - t0
        text = (so + se)
        lines = [l for l in text.splitlines() if l.strip()]
        runs_after = sorted(os.listdir(ROOT / "runs")) if (ROOT / "runs").is_dir() else []
        if snap is not None:
            written = snapshot(watch) != snap
        else:
            written = watch.exists()
        written = written or runs_after != runs_before
        tb = "Traceback" in text
        ok = rc == 2 and len(lines) == 1 and not tb and not written
        obs = (f"rc {rc}, {len(lines)} line(s){', TRACEBACK' if tb else ''}{', WROTE ' + str(watch) if written else ''}"
               f" ({took:.1f}s): " + " / ".join(l[:200] for l in lines[-2:]))
        record(tid, what, "one `omnilearn: error:` line, exit 2, no traceback, nothing written", obs,
               "PASS" if ok else "FAIL", rc=rc, cmd=" ".join(cmd[1:]), lines=len(lines))


def snapshot(path: Path) -> list:
    if path.is_file():
        return [(str(path), path.stat().st_mtime_ns, path.stat().st_size)]
    return sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in path.rglob("*"))


def reference_small(run: Path) -> Path:
    if (run / "summary.json").exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    log = OUT / "logs" / "t8-existing.log"
    p = start(omni("train", *BASE, "--max-steps", "10", "--out", str(run)), "t8-existing", log)
    wait(p, 120)
    leftovers("t8-existing", run)
    return run


# ----------------------------------------------------------------------------- main
def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    global RESULTS
    rf = OUT / "results.json"
    if ONLY and rf.exists():  # a partial rerun replaces only its own rows
        RESULTS = [r for r in json.loads(rf.read_text()) if not want(r["id"])]
    import omnilearn
    print(f"omnilearn from {omnilearn.__file__} (ROOT={ROOT}, LABEL={LABEL})", flush=True)
    if not Path(omnilearn.__file__).resolve().is_relative_to(ROOT.resolve()):
        sys.exit(f"omnilearn is imported from {omnilearn.__file__}, not from ROOT={ROOT}: set PYTHONPATH")
    def trial_wanted(n: str) -> bool:
        return not ONLY or any(o.split(".")[0] == n for o in ONLY)
    if ONLY == {"report"}:  # ONLY=report: render results.md from results.json, run nothing
        RESULTS = json.loads(rf.read_text())
    ref300 = None if ONLY == {"report"} else reference(300, "ref-300") if trial_wanted("1") or trial_wanted("7") else None
    ref120 = reference(120, "ref-120") if trial_wanted("2") and ONLY != {"report"} else None
    steps = [("1", lambda: trial1(ref300)), ("2", lambda: trial2(ref120)), ("3", trial3), ("4", trial4),
             ("5", trial5), ("6", trial6), ("7", lambda: trial7(ref300)), ("8", trial8)]
    for tid, fn in steps:
        if ONLY and not any(o.split(".")[0] == tid for o in ONLY):
            continue
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a harness error is a row, not the end of the trials
            import traceback
            traceback.print_exc()
            record(tid, f"trial {tid}", "", f"HARNESS ERROR {type(e).__name__}: {e}", "ERROR")
        finally:
            for m in list((OUT / "tmp").glob("*")) if (OUT / "tmp").is_dir() else []:
                if marked(m.name):
                    print(f"[{tid}] still running under {m.name}: {kill_marked(m.name)} killed", flush=True)
        print(f"== trial {tid} took {time.time() - t0:.0f}s", flush=True)
    RESULTS.sort(key=lambda r: [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in re.findall(r"\d+|\D+", r["id"])])
    rf.write_text(json.dumps(RESULTS, indent=1, default=str))
    md = ["| # | trial | observed | verdict |", "|---|---|---|---|"]
    for r in RESULTS:
        md.append(f"| {r['id']} | {r['trial']} | {str(r['observed']).replace('|', '/')} | {r['verdict']} |")
    (OUT / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
