"""What the device sampler costs per decode step, by mode, and which kernels the sampling path spends it in.

    python scripts/profile_sampler.py --rows 256 --vocab 128256 [--out sampler.json]

Times `sample()` on random float32 logits [rows, vocab], replayed as a CUDA graph (as the engine runs it) for
each graph mode: greedy, temperature-only sampling, and filtered sampling with top_p=0.95, top_k=50, min_p=0.05
and top_k=50 with top_p=0.95; the share of rows the race's checks settle (the rest take the exact search), and
the exact search and a full sort alone (what the filter used to cost); then lists the top kernels of one
top_p call from the torch profiler. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.hardware import graph_ms  # noqa: E402

from batchjob.engine.native.kernels import sampling_race  # noqa: E402
from batchjob.engine.native.kernels.sampling_filter import filter_thresholds  # noqa: E402
from batchjob.engine.native.sampling.sampler import SamplerMode, SamplingTensors, noise_keys, sample  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows, vocab = args.rows, args.vocab
    logits = torch.randn(rows, vocab, device=device, generator=torch.Generator(device).manual_seed(0)) * 3
    params = SamplingTensors(
        temperature=torch.full((rows,), 0.8, device=device),
        top_k=torch.zeros(rows, dtype=torch.int64, device=device),
        top_p=torch.full((rows,), 0.95, device=device),
        min_p=torch.zeros(rows, device=device),
        seeds=torch.arange(rows, dtype=torch.int64, device=device),
        positions=torch.full((rows,), 7, dtype=torch.int64, device=device),
    )

    def with_filters(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> SamplingTensors:
        return SamplingTensors(
            **{
                **vars(params),
                "top_k": torch.full((rows,), top_k, dtype=torch.int64, device=device),
                "top_p": torch.full((rows,), top_p, device=device),
                "min_p": torch.full((rows,), min_p, device=device),
            }
        )

    filtering = SamplerMode(sampling=True, filtering=True)
    runs = {
        "greedy": (params, SamplerMode()),
        "temperature only": (with_filters(), SamplerMode(sampling=True)),
        "top_p=0.95": (params, filtering),
        "top_k=50": (with_filters(top_k=50), filtering),
        "min_p=0.05": (with_filters(min_p=0.05), filtering),
        "top_k=50 top_p=0.95": (with_filters(top_k=50, top_p=0.95), filtering),
    }
    timed = {name: (lambda p=p, m=m: sample(logits, p, m)) for name, (p, m) in runs.items()}
    timed["exact search alone, every row"] = lambda: filter_thresholds(
        logits, params.temperature, params.top_k, params.top_p, params.min_p
    )
    timed["a full sort alone"] = lambda: logits.sort(dim=-1, descending=True)
    result: dict[str, object] = {"rows": rows, "vocab": vocab}
    result["graph_ms"] = {name: graph_ms(fn, reps=50) for name, fn in timed.items()}
    for name, ms in result["graph_ms"].items():
        print(f"{ms:8.3f} ms  {name}")
    keys = noise_keys(params.seeds, params.positions)
    settled = {}
    for name, (p, mode) in runs.items():
        if mode.filtering:
            _, state = sampling_race.settle(logits, p.temperature, keys, (p.top_k, p.top_p, p.min_p))
            settled[name] = (state == 0).float().mean().item()
            print(f"{settled[name]:8.1%} of rows settled by the race's checks: {name}")
    result["settled_share"] = settled

    sample(logits, params, filtering)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sample(logits, params, filtering)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    print(table)
    result["top_kernels"] = table
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
