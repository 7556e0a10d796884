"""Print the engine statistics of a bench JSON's first workload: python scripts/dev/bench_stats.py FILE LABEL."""

import json
import sys

with open(sys.argv[1]) as f:
    d = json.load(f)
for name, s in d["workloads"][0]["systems"].items():
    st = s.get("engine_stats") or {}
    keep = (
        "steps",
        "graph_steps",
        "mixed_graph_steps",
        "eager_steps",
        "prep_ms_per_step",
        "fill_ms_per_step",
        "graph_launch_ms_per_step",
        "eager_launch_ms_per_step",
        "gpu_busy_fraction",
    )
    print(sys.argv[2], name, round(s["wall_s"], 2), {k: round(st[k], 3) for k in keep if k in st})
