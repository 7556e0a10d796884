"""Where each run of a bench `runs.jsonl` left the GPU idle, and the loop thread's host time a step:
python scripts/dev/timeline_gaps.py OUT/runs.jsonl [...].

A step with constrained rows records two spans on the GPU timeline, its forward and its masked sampler (a span
under 0.3 ms after a longer one); the gaps are split by what the GPU waited for: the masks (before a sampler),
the loop's next forward (after a sampler), or the loop's next step (between two forwards). "outside" is the
run's wall time not covered by the timeline (admission before the first step, the last completions)."""

import json
import sys

HOST = ("admit", "schedule", "process", "collect_wait", "prep")


def gaps(timeline: list) -> tuple[float, float, float]:
    sampler = [i > 0 and b - a < 3e-4 <= timeline[i - 1][1] - timeline[i - 1][0] for i, (a, b) in enumerate(timeline)]
    before_sampler = after_sampler = between_forwards = 0.0
    for i in range(1, len(timeline)):
        gap = timeline[i][0] - timeline[i - 1][1]
        if sampler[i]:
            before_sampler += gap
        elif sampler[i - 1]:
            after_sampler += gap
        else:
            between_forwards += gap
    return before_sampler, after_sampler, between_forwards


runs = []
for path in sys.argv[1:]:
    with open(path) as f:
        runs += [json.loads(line) for line in f]
for run in runs:
    timeline, stats = run.get("busy_timeline") or [], run.get("engine_stats") or {}
    if not timeline:
        continue
    busy = sum(b - a for a, b in timeline)
    outside = run["wall_s"] - (timeline[-1][1] - timeline[0][0])
    masks, forward, step = gaps(timeline)
    host = " ".join(f"{k} {stats.get(k + '_ms_per_step', float('nan')):.2f}" for k in HOST)
    print(
        f"{run['system']} {run.get('run', '')}: wall {run['wall_s']:.3f} s, busy {busy:.3f}, outside {outside:.3f}; "
        f"GPU waited for masks {masks:.3f}, for the next forward {forward:.3f}, between forwards {step:.3f}; "
        f"host ms a step: {host}"
    )
