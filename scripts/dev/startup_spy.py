"""Where a job's start-up thread spent its time, from py-spy's samples of the job:

    py-spy record -f speedscope -r 200 --threads [--native --idle | --gil] -o SPY.json -- python -m batchjob ...
    python scripts/dev/startup_spy.py SPY.json [--top 12]

Each sample of the job's main thread is put in the start-up phase of the innermost frame that names one (the
phases of the "ready to generate" line) and, with `--native --idle`, in what the thread was doing: running
Python or C code, waiting for the interpreter lock, or waiting in the CUDA driver. With `--gil`, py-spy keeps
only the samples of the thread holding the lock, so a phase's seconds there are its seconds of holding it, and
every other thread's seconds show who held it meanwhile. The other threads are summed by name.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

# Innermost first: a frame of a later phase can sit below an earlier phase's frame (imports inside the engine).
PHASES = (
    ("warm_up", "warm-up"),
    ("_capture_graphs", "CUDA graphs"),
    ("decide_num_blocks", "KV sizing"),
    ("start_runner", "runner"),
    ("load_on_device", "weights"),
    ("create_engine", "engine (other)"),
    ("import_libraries", "imports"),
    ("compose_config", "config"),
    ("ShardRun.run", "generation"),
    ("NativeEngine.generate", "generation"),
)


def phase_of(names: list[str]) -> str:
    for marker, phase in PHASES:
        if any(name == marker or name.endswith("." + marker) for name in names):
            return phase
    return "other"


def state_of(names: list[str], native: bool) -> str:
    """What the innermost native frames say the thread was doing. Python's lock wait (`take_gil`) is a static
    function, often shown by address only: a condition wait called from an unnamed frame is taken for it."""
    if not native:
        return "holding the lock"
    leaf = names[-3:]
    if any("take_gil" in name for name in leaf):
        return "waiting for the interpreter lock"
    if names[-1].startswith("pthread_cond") and len(names) > 1 and names[-2].startswith("0x"):
        return "waiting for the interpreter lock"
    if any(name.startswith("PyThread_acquire_lock") for name in leaf):
        return "waiting for another thread"
    if any(name.startswith("cu") and name[2:3].isupper() or "libcuda" in name for name in names[-6:]):
        return "in the CUDA driver"
    return "running"


def summarise(path: Path, top: int) -> str:
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    native = any("::" in f["name"] or f["name"].startswith("0x") for f in frames)
    lines = []
    others: dict[str, float] = defaultdict(float)
    for profile in data["profiles"]:
        name = profile["name"]
        weights = profile["weights"]
        if '""' not in name and "MainThread" not in name:
            others[name.split('"')[1] if '"' in name else name] += sum(weights)
            continue
        by_phase: dict[str, Counter] = defaultdict(Counter)
        leaves: dict[str, Counter] = defaultdict(Counter)
        for stack, weight in zip(profile["samples"], weights, strict=True):
            names = [frames[i]["name"] for i in stack]
            phase, state = phase_of(names), state_of(names, native)
            by_phase[phase][state] += weight
            python = [n for n in names if not n.startswith("0x") and "::" not in n]
            leaves[phase][python[-1] if python else names[-1]] += weight
        lines.append(f"main thread ({sum(weights):.2f} s sampled)")
        for phase, states in sorted(by_phase.items(), key=lambda item: -sum(item[1].values())):
            detail = ", ".join(f"{state} {seconds:.2f}" for state, seconds in states.most_common())
            lines.append(f"  {phase:<16} {sum(states.values()):6.2f} s: {detail}")
            for leaf, seconds in leaves[phase].most_common(top):
                lines.append(f"      {seconds:6.2f} s  {leaf}")
    lines.append("other threads (s sampled)")
    for name, seconds in sorted(others.items(), key=lambda item: -item[1]):
        lines.append(f"  {name or '?':<32} {seconds:6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spy", type=Path, help="py-spy's speedscope JSON of one job")
    parser.add_argument("--top", type=int, default=8, help="innermost Python frames shown per phase")
    args = parser.parse_args(argv)
    print(summarise(args.spy, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
