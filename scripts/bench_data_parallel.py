"""Multi-GPU scaling on one node: the whole `python -m batchjob engine.data_parallel=D engine.tensor_parallel=T`
job, per layout D x T.

    python scripts/bench_data_parallel.py --gpus 1,2 --out bench-dp        # on a 2-GPU machine
    python scripts/bench_data_parallel.py --tiny --gpus 1,2 --rows 24 --max-new-tokens 8 --out /tmp/dp   # CPU
    python scripts/bench_data_parallel.py --layouts 1x1,1x2,2x1 --architecture llama-3.1-8b --load-format dummy \
        --out bench-tp     # one 8B GPU vs the model split over two vs two copies (tok/s per GPU)

One model (W2's Llama-3.2-1B by default; --tiny: the tiny llama on CPU) and --rows seeded prompts of about
U(--prompt-tokens) tokens; each layout runs the same job from scratch, timed as a whole command. Prints a table
of the layouts, then each layout's slowest shard's start-up by phase as its job logged it (the engine's own phases
among them: weights, kernel listing and compiles, KV sizing, CUDA graphs, warm-up). Writes OUT/data_parallel.json;
exits 1 if a run failed or lost or repeated a row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_lib.isolation import model_dir
from bench_lib.models import DEFAULT_CACHE
from bench_lib.report import provenance
from bench_lib.workloads import ARCHITECTURES, SEED, WORKLOADS

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = WORKLOADS["W2"].architecture


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,2", help="comma-separated values of engine.data_parallel")
    parser.add_argument("--layouts", default=None, help="comma-separated DxT, e.g. 1x1,1x2,2x1 (replaces --gpus)")
    parser.add_argument("--architecture", default=ARCHITECTURE, help=f"one of {', '.join(ARCHITECTURES)}")
    parser.add_argument(
        "--load-format", choices=("auto", "dummy"), default="auto", help="dummy: the engine makes random weights"
    )
    parser.add_argument("--rows", type=int, default=8192, help="prompts in the input file")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per row (EOS ignored)")
    parser.add_argument("--prompt-tokens", default="64,512", help="LOW,HIGH: prompt lengths drawn uniformly")
    parser.add_argument("--max-model-len", type=int, default=None, help="engine.max_model_len (2048; --tiny 1024)")
    parser.add_argument("--engine", default="native", help="engine preset (conf/engine)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="override (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="data_parallel.json, inputs, runs")
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE, help="random-weight models, reused")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per run: a stuck run leaves the others")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on batchjob's tiny llama")
    return parser.parse_args(argv)


def single_token_words(tokenizer: Any, rng: np.random.Generator, candidates: int = 4096) -> list[str]:
    """Words of one token after a space, from a seeded sample of the vocabulary: L of them make about L tokens."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    picked = rng.choice(ids, size=min(candidates, len(ids)), replace=False)
    words = []
    for token_id in picked.tolist():
        word = tokenizer.decode([token_id]).strip()
        if word.isalnum() and len(tokenizer(" " + word, add_special_tokens=False).input_ids) == 1:
            words.append(word)
    if len(words) < 16:
        raise SystemExit(f"the tokenizer has only {len(words)} single-token words in its sample: cannot make prompts")
    return sorted(set(words))


def write_prompts(path: Path, model: Path, rows: int, lengths: tuple[int, int]) -> dict[str, Any]:
    """The seeded input file (columns id, prompt); returns its prompt token statistics as the tokenizer sees them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(SEED)
    words = np.array(single_token_words(tokenizer, rng))
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=rows)
    prompts = [" ".join(rng.choice(words, size=int(n)).tolist()) for n in sizes]
    tokens = np.array([len(ids) for ids in tokenizer(prompts).input_ids])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": np.arange(rows, dtype=np.int64), "prompt": prompts}), path)
    return {"rows": rows, "min": int(tokens.min()), "mean": float(tokens.mean()), "max": int(tokens.max())}


def job_command(
    args: argparse.Namespace, model: Path, data: Path, out_dir: Path, data_parallel: int, tensor_parallel: int
) -> list[str]:
    max_model_len = args.max_model_len or (1024 if args.tiny else 2048)
    return [
        sys.executable,
        "-m",
        "batchjob",
        f"model.path={model}",
        f"data.path={data}",
        f"output.dir={out_dir}",
        f"engine={args.engine}",
        f"engine.data_parallel={data_parallel}",
        *([f"engine.tensor_parallel={tensor_parallel}"] if tensor_parallel > 1 else []),
        *(["engine.load_format=dummy"] if args.load_format == "dummy" else []),
        f"engine.max_model_len={max_model_len}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        "sampling.ignore_eos=true",
        *(["engine.device=cpu"] if args.tiny else []),
        *args.override,
    ]


def run_one(
    args: argparse.Namespace, model: Path, data: Path, data_parallel: int, tensor_parallel: int
) -> dict[str, Any]:
    """One whole job of the layout, from scratch, timed end to end and then checked."""
    gpus = data_parallel * tensor_parallel
    name = f"dp{data_parallel}" + (f"tp{tensor_parallel}" if tensor_parallel > 1 else "")
    from batchjob.io.inputs import InputSpec
    from batchjob.io.job_status import job_status
    from batchjob.io.layout import bookkeeping_dir

    out_dir = args.out / "runs" / name
    # A leftover output (and its bookkeeping beside it) would be resumed, not measured.
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(bookkeeping_dir(str(out_dir)), ignore_errors=True)
    out_dir.mkdir(parents=True)
    command = job_command(args, model, data, out_dir, data_parallel, tensor_parallel)
    # Data-parallel children share nothing; tensor-parallel ranks all-reduce through NCCL, with NVLink multicast
    # (NVLS) off: the benchmark machines forbid it.
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    log = args.out / "runs" / f"{name}.log"
    print(f"{name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    with log.open("w") as log_file:
        # Its own process group, so a run past --timeout-s is stopped with every GPU child it started.
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = 124
    wall_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "gpus": gpus,
        "data_parallel": data_parallel,
        "tensor_parallel": tensor_parallel,
        "returncode": returncode,
        "wall_s": wall_s,
        "log": str(log),
    }
    if returncode != 0:
        print(f"{name}: exited {returncode}; last lines of {log}:", file=sys.stderr)
        print("\n".join(log.read_text().splitlines()[-30:]), file=sys.stderr)
    try:
        job = job_status(str(out_dir), InputSpec(path=str(data)))
    except ValueError as error:  # no job record: the command failed before writing anything
        result.update(exactly_once=False, complete=False, completion_tokens=0, tok_per_s=0.0, error=str(error))
        import pyarrow.parquet as pq

        result.update(rows_committed=0, rows_expected=pq.ParquetFile(data).metadata.num_rows)
        return result
    reports = [json.loads(p.read_text()) for p in sorted(Path(bookkeeping_dir(str(out_dir))).glob("_report-*.json"))]
    tokens = sum(s.completion_tokens for s in job.shards)
    v = job.validation
    result.update(
        rows_expected=v.rows_expected,
        rows_committed=v.rows_committed,
        duplicates=v.duplicates.count,
        missing=v.missing.count,
        exactly_once=v.exactly_once and v.ids_checked and v.rows_committed == v.rows_expected,
        complete=job.complete,
        completion_tokens=tokens,
        tok_per_s=tokens / wall_s,
        tok_per_s_per_gpu=tokens / wall_s / gpus,
        shards=[
            {
                "shard": r["shard"]["index"],
                "wall_s": r["wall_s"],
                "completion_tokens": r["completion_tokens"],
                "engine_startup_s": r["engine"].get("startup_s"),
                # process start to first generate (imports, checks, engine), from batchjob's report
                "process_startup_s": r.get("startup_s", {}).get("total_s"),
                "startup_phases": r.get("startup_s", {}),
                # every GPU of the shard's engine (rank 0's is gpu_busy_fraction)
                **{k: v for k, v in r["engine"].items() if k.startswith("gpu_busy_fraction")},
            }
            for r in reports
        ],
    )
    if reports:
        # The slowest shard decides the job; the rest of the command's time is process and model start-up.
        slowest = max(r["wall_s"] for r in reports)
        result["shard_wall_s_max"] = slowest
        for key in ("engine_startup_s", "process_startup_s"):
            result[f"{key}_max"] = max((s[key] for s in result["shards"] if s[key] is not None), default=None)
        result["outside_shard_loop_s"] = wall_s - slowest
        # Start-up excluded: what N GPUs give once every shard is generating.
        generation = tokens / slowest if slowest else None
        result["generation_tok_per_s"] = generation
        result["generation_tok_per_s_per_gpu"] = generation / gpus if generation else None
    return result


def add_efficiency(results: list[dict[str, Any]]) -> None:
    """efficiency(N) = tok/s(N) / (N x tok/s(1)): 1.0 is perfect scaling."""
    base = next((r for r in results if r["gpus"] == 1 and r["returncode"] == 0), None)
    for r in results:
        ok = base is not None and r["returncode"] == 0
        r["scaling_efficiency"] = r["tok_per_s"] / (r["gpus"] * base["tok_per_s"]) if ok else None
        gen, gen1 = r.get("generation_tok_per_s"), base.get("generation_tok_per_s") if base else None
        r["generation_scaling_efficiency"] = gen / (r["gpus"] * gen1) if ok and gen and gen1 else None


def table(results: list[dict[str, Any]]) -> str:
    """tok/s and eff are of the whole command; gen tok/s, per GPU and gen eff of the slowest shard's generation
    loop; startup s is the slowest shard's process start to first generate."""
    header = (
        f"{'N':>3} {'DxT':>5} {'wall s':>8} {'startup s':>9} {'tokens':>10} {'tok/s':>10} {'eff':>5} "
        f"{'gen tok/s':>10} {'per GPU':>9} {'gen eff':>7}  rows"
    )
    lines = [header]

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in results:
        rows = "exactly once" if r["exactly_once"] else f"{r['rows_committed']}/{r['rows_expected']} NOT exactly once"
        if r["returncode"]:
            rows += f" (exit {r['returncode']})"
        lines.append(
            f"{r['gpus']:>3} {r['data_parallel']:>3}x{r['tensor_parallel']} {r['wall_s']:>8.1f} "
            f"{num(r.get('process_startup_s_max'), '.1f'):>9} "
            f"{r['completion_tokens']:>10} {r['tok_per_s']:>10,.0f} {num(r['scaling_efficiency'], '.2f'):>5} "
            f"{num(r.get('generation_tok_per_s'), ',.0f'):>10} "
            f"{num(r.get('generation_tok_per_s_per_gpu'), ',.0f'):>9} "
            f"{num(r.get('generation_scaling_efficiency'), '.2f'):>7}  {rows}"
        )
    return "\n".join(lines)


def startup_lines(results: list[dict[str, Any]]) -> list[str]:
    """Each layout's slowest shard's start-up by phase, as its job logged it (imports, config, checks, the engine's
    own phases, the checks beside it)."""
    from batchjob.job.startup import phases_line

    lines = []
    for r in results:
        shards = [s for s in r.get("shards", []) if s.get("startup_phases", {}).get("total_s") is not None]
        if shards:
            slowest = max(shards, key=lambda s: s["startup_phases"]["total_s"])
            layout = f"{r['data_parallel']}x{r['tensor_parallel']}"
            lines.append(f"{layout} shard {slowest['shard']}: {phases_line(slowest['startup_phases'])}")
    return lines


def _device_names() -> list[str]:
    """GPU names from nvidia-smi (not torch: this process must not create a CUDA context)."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return query.stdout.strip().splitlines() if query.returncode == 0 else []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The checkout's batchjob is what is measured, whether or not (and wherever) it is pip-installed.
    sys.path.insert(1, str(REPO))
    try:
        if args.layouts:
            layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",") if item.strip()]
        else:
            layouts = [(n, 1) for n in sorted({int(n) for n in args.gpus.split(",") if n.strip()})]
        low, high = (int(x) for x in args.prompt_tokens.split(","))
    except ValueError:
        raise SystemExit(
            "--gpus takes integers like 1,2, --layouts DxT pairs like 1x1,1x2,2x1 and --prompt-tokens LOW,HIGH "
            "like 64,512"
        ) from None
    if not layouts or any(len(lay) != 2 or min(lay) < 1 for lay in layouts) or not 1 <= low <= high:
        raise SystemExit("--gpus / --layouts need values >= 1 and --prompt-tokens 1 <= LOW <= HIGH")
    if args.architecture not in ARCHITECTURES:
        raise SystemExit(f"--architecture: choose one of {', '.join(ARCHITECTURES)}")
    args.out = args.out.resolve()
    architecture = None if args.tiny else args.architecture
    model = model_dir(architecture, args.model_cache, args.load_format == "dummy")
    data = args.out / "prompts.parquet"
    prompt_tokens = write_prompts(data, model, args.rows, (low, high))
    print(f"{args.rows} prompts, {prompt_tokens['min']}-{prompt_tokens['max']} tokens; model {model}", flush=True)
    results: list[dict[str, Any]] = []
    report = {
        **provenance(sys.argv[1:] if argv is None else argv),
        "devices": _device_names(),
        "model": str(model),
        "architecture": "tiny-llama" if args.tiny else args.architecture,
        "load_format": args.load_format,
        "engine": args.engine,
        "overrides": args.override,
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": prompt_tokens,
        "results": results,
    }
    for data_parallel, tensor_parallel in layouts:
        results.append(run_one(args, model, data, data_parallel, tensor_parallel))
        add_efficiency(results)
        # Written after every layout, so a run stopped by a time limit still leaves what it measured.
        (args.out / "data_parallel.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    for line in startup_lines(results):
        print(line)
    return 0 if all(r["returncode"] == 0 and r["exactly_once"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
