"""What the device sampler costs per decode step, by mode, and which kernels the sampling path spends it in.

    python scripts/profile_sampler.py --rows 256 --vocab 128256 [--out sampler.json]

Times `sample()` on random float32 logits [rows, vocab], replayed as a CUDA graph (as the engine runs it) for
each graph mode: greedy, temperature-only sampling and filtered sampling (top_p=0.95), and the threshold search
and a full sort alone (what the filter used to cost); then lists the top kernels of one filtering call from the
torch profiler. Needs CUDA.
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

from batchjob.engine.native.sampler import SamplerMode, SamplingTensors, sample  # noqa: E402
from batchjob.engine.native.triton_filter import filter_thresholds  # noqa: E402


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
    plain = SamplingTensors(**{**vars(params), "top_p": torch.ones(rows, device=device)})
    filtering = SamplerMode(sampling=True, filtering=True)
    timed = {
        "greedy": lambda: sample(logits, params, SamplerMode()),
        "temperature only": lambda: sample(logits, plain, SamplerMode(sampling=True)),
        "top_p=0.95": lambda: sample(logits, params, filtering),
        "threshold search alone": lambda: filter_thresholds(
            logits, params.temperature, params.top_k, params.top_p, params.min_p
        ),
        "a full sort alone": lambda: logits.sort(dim=-1, descending=True),
    }
    result: dict[str, object] = {"rows": rows, "vocab": vocab}
    result["graph_ms"] = {name: graph_ms(fn, reps=50) for name, fn in timed.items()}
    for name, ms in result["graph_ms"].items():
        print(f"{ms:8.3f} ms  {name}")

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
