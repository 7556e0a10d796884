"""Benchmark batchjob's engine against vLLM, transformers and the GPU's roofline, every run in a fresh process.

    python scripts/bench.py --workloads W1,W2 --out bench-results          # on one GPU
    python scripts/bench.py --tiny --out /tmp/bench-tiny                   # CPU smoke run on a tiny model
    python scripts/bench.py --workloads W2 --constrained --out bench-json   # structured outputs vs none
    python scripts/bench.py --workloads W1 --systems native --against ../base --repeat 3   # this checkout vs another

Each workload's model has its architecture's real config and seeded random weights; every system runs identical
requests (EOS ignored), "cold" (empty compile and start-up caches, a first job) then "warm" (the caches its cold
run filled). Writes OUT/runs.jsonl as each run finishes, then OUT/bench.json and OUT/bench.png, and prints a
table; exits 1 if any run failed. `--against DIR` runs every native system a second time in each round from the
checkout at DIR (its `batchjob`, this harness) as `SYSTEM@against`, and gives each run's throughput against it:
machines of one kind differ by more than a small change gains. Method and flags: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_lib.hardware import HardwareRates
from bench_lib.isolation import ChildFailed, model_dir, run_cache_env, run_child
from bench_lib.models import BENCH_SPECIAL_IDS, DEFAULT_CACHE, TINY_SPECIAL_IDS, text_tokens
from bench_lib.report import AGAINST, WorkloadReport, plot, provenance, result_from_json, table, write_json
from bench_lib.roofline import model_shape, roofline
from bench_lib.systems import (
    CONSTRAINED_SYSTEMS,
    NATIVE_ENGINES,
    NATIVE_SYSTEMS,
    SYSTEMS,
    VLLM_SYSTEMS,
    RunSettings,
    run_label,
)
from bench_lib.workloads import ARCHITECTURES, TINY_WORKLOAD, WORKLOADS, WorkloadSpec, draw_requests, workload

REPO = Path(__file__).resolve().parents[1]
TINY_SYSTEMS = ("hf_generate", "hf_batch_sync", "native", "native_sync")
RUNS = ("cold", "warm")
# A run's own time limit covers its generation; this much more is allowed for its start-up (an 8B model's
# load and a cold compile) before the process is stopped.
CHILD_STARTUP_S = 900.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W1,W2", help=f"comma-separated, from {','.join(WORKLOADS)}")
    parser.add_argument("--systems", default=None, help=f"comma-separated, from {','.join(SYSTEMS)} (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="where bench.json and bench.png go")
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE, help="random-weight models, reused")
    parser.add_argument("--time-limit-s", type=float, default=120.0, help="per system and workload")
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to the native engines (repeatable); VALUE is a Python literal or a string",
    )
    parser.add_argument("--hf-batch", type=int, default=32, help="static batch size of hf_generate")
    parser.add_argument("--hf-max-batch-tokens", type=int, default=8192, help="tokens per hf_batch_* step")
    parser.add_argument("--hf-attn-implementation", default=None, help="transformers attn_implementation")
    parser.add_argument(
        "--kv-budget-fraction", type=float, default=0.9, help="share of GPU memory less the weights for the KV cache"
    )
    parser.add_argument(
        "--runs",
        default="cold,warm",
        help="cold (empty compile and start-up caches), warm (the caches the cold run filled, or without one the "
        "usual ones), or both",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every system; the table adds medians")
    parser.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default=None,
        help="dummy: no weight files (default: the workload's)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile each run into OUT/profile-*.txt (slower)")
    parser.add_argument(
        "--kernel-profile",
        action="store_true",
        help="each engine run's generation under torch's profiler: its kernels by device time in OUT/kernels-*.txt",
    )
    parser.add_argument(
        "--against", type=Path, default=None, metavar="DIR", help="also run the native systems from the checkout at DIR"
    )
    parser.add_argument("--greedy", action="store_true", help="decode every workload greedily (W5: the sampler's cost)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny llama, tiny workload, no roofline")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="run each workload's model with its first N decoder layers only (its steps' kernels on a smaller GPU)",
    )
    parser.add_argument(
        "--constrained",
        action="store_true",
        help=f"structured outputs: a BPE tokenizer, and systems {','.join(CONSTRAINED_SYSTEMS)} by default",
    )
    parser.add_argument(
        "--tokenizer",
        choices=("bpe", "cl100k"),
        default="bpe",
        help="with --constrained: a generated 128k BPE, or tiktoken's cl100k_base (needs tiktoken and its download)",
    )
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: a model needs at least one layer")
    return args


def unavailable_reason(system: str) -> str | None:
    """Why a system cannot run here (a native one's module does not import; no vLLM, or no GPU), or None."""
    if system in VLLM_SYSTEMS:
        if importlib.util.find_spec("vllm") is None:
            return "not available: vLLM is not installed (pip install 'batchjob[vllm]')"
        return None if importlib.import_module("torch").cuda.is_available() else "not available: vLLM needs a GPU"
    if system not in NATIVE_SYSTEMS:
        return None
    from batchjob.engine import BACKENDS

    module = BACKENDS[NATIVE_ENGINES[system][0]][0].split(":")[0]
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"not available: {error}"
    return None


def run_workload(
    spec: WorkloadSpec, systems: list[str], runs: list[str], settings: RunSettings, args: argparse.Namespace, hardware
) -> WorkloadReport:
    dummy = (args.load_format or spec.load_format) == "dummy"
    options = dict(settings.engine_options)
    if spec.tensor_parallel != 1:
        options.setdefault("tensor_parallel", spec.tensor_parallel)
    if dummy:
        options["load_format"] = "dummy"
    settings = dataclasses.replace(settings, engine_options=options)
    gpus = int(options.get("tensor_parallel", 1))
    if args.tiny:
        model = model_dir(None, args.model_cache)  # with dummy weights its weight file is simply not read
        vocab, special_ids = int(json.loads((model / "config.json").read_text())["vocab_size"]), TINY_SPECIAL_IDS
        requests = draw_requests(spec, vocab, special_ids)
        floor = None
    else:
        tokenizer = args.tokenizer if args.constrained else None
        model = model_dir(spec.architecture, args.model_cache, dummy, tokenizer)
        shape = model_shape(
            ARCHITECTURES[spec.architecture],
            str(options.get("quantization", "auto")),
            str(options.get("kv_cache_dtype", "auto")),
        )
        # A BPE's special ids follow its ordinary tokens: prompts are then ordinary text below them.
        vocab = text_tokens(spec.architecture, args.tokenizer) + 1 if args.constrained else shape.vocab
        special_ids = BENCH_SPECIAL_IDS
        requests = draw_requests(spec, vocab, special_ids)
        # A tensor-parallel engine reads its weights and cache with every GPU's bandwidth and keeps its cache in
        # every GPU's memory: the floor is that of one GPU `gpus` times as large (GPUs of one kind assumed).
        kv_budget = int(args.kv_budget_fraction * hardware["total_memory"]) * gpus
        if kv_budget <= shape.weight_bytes:
            reason = (
                f"its weights ({shape.weight_bytes / 1e9:.1f} GB) leave no room for a KV cache in "
                f"{args.kv_budget_fraction:.0%} of {gpus} x {hardware['total_memory'] / 2**30:.1f} GiB: "
                "it needs a larger GPU"
            )
            print(f"{spec.name}: skipped, {reason}", flush=True)
            return WorkloadReport(requests, str(model), None, (), dict.fromkeys(systems, reason), {})
        floor = roofline(
            shape,
            requests,
            hardware["copy_bytes_per_s"] * gpus,
            hardware["matmul_flops_per_s"] * gpus,
            kv_budget - shape.weight_bytes,
            (hardware.get("fp8_matmul_flops_per_s") or 0) * gpus or None,
        )
        print(
            f"{spec.name}: roofline {floor.total_s:.2f} s = {floor.tok_per_s:,.0f} tok/s"
            + (f" ({spec.architecture})" if args.layers else "")
            + (f" ({gpus} GPUs' bandwidth)" if gpus > 1 else ""),
            flush=True,
        )
    results = []
    skipped, errors = {}, {}
    runnable = []
    for system in systems:
        reason = unavailable_reason(system)
        if reason is None and system not in NATIVE_SYSTEMS and system not in VLLM_SYSTEMS and gpus > 1:
            reason = "runs on one GPU only (this workload: tensor_parallel > 1)"
        if reason is None and system in NATIVE_ENGINES and NATIVE_ENGINES[system][1] and gpus > 1:
            reason = "structured outputs run on one GPU only (this workload: tensor_parallel > 1)"
        if reason:
            skipped[system] = reason
            print(f"{spec.name} {system}: skipped, {reason}", flush=True)
        else:
            runnable.append(system)
    sources = [pair for system in runnable for pair in _sources(system, args.against)]
    for repeat, (system, repo) in ((r, pair) for r in range(args.repeat) for pair in sources):
        name = system if repo is None else f"{system}{AGAINST}"
        # One cache directory per system and round: its cold run starts it empty, its warm run finds it filled.
        with tempfile.TemporaryDirectory(prefix=f"bench-caches-{spec.name}-{system}-") as caches:
            for run in runs:
                task = {
                    "kind": "system",
                    "system": system,
                    "workload": spec.name,
                    "greedy": args.greedy,
                    "model_dir": str(model),
                    "vocab": vocab,
                    "special_ids": special_ids,
                    "settings": dataclasses.asdict(settings),
                    "run": run,
                }
                label = run_label(run, repeat)
                tag = f"{spec.name}-{name}-{label.replace(' ', '-')}"
                if args.profile:
                    task["profile"] = str(args.out / f"profile-{tag}.txt")
                if args.kernel_profile:
                    task["settings"] = {**task["settings"], "kernel_profile": str(args.out / f"kernels-{tag}.txt")}
                env = run_cache_env(Path(caches)) if run == "cold" or "cold" in runs else {}
                try:
                    timeout_s = args.time_limit_s + CHILD_STARTUP_S
                    result = result_from_json(run_child(task, env, timeout_s=timeout_s, repo=repo))
                except ChildFailed as error:  # one broken run must not lose the others' measurements
                    errors[f"{name} {label}"] = str(error)
                    print(f"{spec.name} {name} {label}: failed, {error}", flush=True)
                    continue
                result = dataclasses.replace(result, system=name, repeat=repeat)
                results.append(result)
                # One line per finished run, written at once: a command stopped later keeps what it measured.
                with open(args.out / "runs.jsonl", "a") as log:
                    log.write(
                        json.dumps({"workload": spec.name, "greedy": args.greedy, **dataclasses.asdict(result)}) + "\n"
                    )
                print(
                    f"{spec.name} {name} {label}: {result.wall_s:.2f} s, {result.output_tokens} tokens, "
                    f"{result.tok_per_s:,.0f} tok/s, start-up {result.startup_s:.1f} s"
                    + (" (cut)" if result.cut else ""),
                    flush=True,
                )
    return WorkloadReport(
        requests=requests, model=str(model), floor=floor, results=tuple(results), skipped=skipped, errors=errors
    )


def engine_options(pairs: list[str]) -> dict[str, Any]:
    """`--engine-option KEY=VALUE` pairs: VALUE a Python literal, `true`/`false`/`null` in any case, or a string."""
    options = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-option {pair!r}: expected KEY=VALUE, e.g. --engine-option max_num_seqs=256")
        try:
            options[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            options[key] = {"true": True, "false": False, "null": None}.get(raw.lower(), raw)
    return options


def _sources(system: str, against: Path | None) -> list[tuple[str, Path | None]]:
    """Where each round runs `system` from: this checkout, then (a native system, with `--against`) the other."""
    return [(system, None)] + ([(system, against)] if against is not None and system in NATIVE_SYSTEMS else [])


def _select(raw: str, known: dict | tuple, flag: str) -> list[str]:
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {unknown or 'empty'}; choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be 1 or more, got {args.repeat}")
    if args.against is not None:
        args.against = args.against.resolve()
        if not (args.against / "batchjob" / "engine").is_dir():
            raise SystemExit(f"--against {args.against}: no batchjob/engine there; give the root of another checkout")
    # The checkout's batchjob is what is measured, whether or not (and wherever) it is pip-installed.
    sys.path.insert(1, str(REPO))
    import torch

    from batchjob.engine import check_engine_options

    default = CONSTRAINED_SYSTEMS if args.constrained else TINY_SYSTEMS if args.tiny else SYSTEMS
    systems = _select(args.systems or ",".join(default), SYSTEMS, "--systems")
    runs = [run for run in RUNS if run in _select(args.runs, RUNS, "--runs")]  # cold first: it fills the caches
    options = engine_options(args.engine_option)
    if args.tiny:
        specs = [TINY_WORKLOAD]
        settings = RunSettings("cpu", "float32", args.time_limit_s, args.hf_batch, args.hf_max_batch_tokens)
        hardware = rates = None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the benchmark needs a CUDA GPU; use --tiny for the CPU smoke run")
        try:
            names = _select(args.workloads, WORKLOADS, "--workloads")
            specs = [workload(name, args.greedy, args.layers) for name in names]
        except KeyError as error:
            raise SystemExit(f"--layers {args.layers}: {error.args[0]}") from None
        settings = RunSettings(
            "cuda", "bfloat16", args.time_limit_s, args.hf_batch, args.hf_max_batch_tokens, args.hf_attn_implementation
        )
        hardware = run_child({"kind": "hardware"})
        rates = HardwareRates(**{field.name: hardware[field.name] for field in dataclasses.fields(HardwareRates)})
        print(rates.summary(), flush=True)
    settings = dataclasses.replace(settings, engine_options=options)
    for system in systems:
        if system in NATIVE_SYSTEMS and unavailable_reason(system) is None:
            # A bad --engine-option fails here, before minutes of model building and peer runs.
            try:
                check_engine_options(
                    NATIVE_ENGINES[system][0], {"dtype": settings.dtype, "detokenize": False, **options}
                )
            except ValueError as error:
                raise SystemExit(f"--engine-option: {error}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    reports = [run_workload(spec, systems, runs, settings, args, hardware) for spec in specs]
    run = {
        **provenance(sys.argv[1:] if argv is None else argv),
        "device": rates.device if rates else "cpu",
        "time_limit_s": args.time_limit_s,
        "runs": runs,
        "repeat": args.repeat,
        "against": None if args.against is None else str(args.against),
        "engine_options": options,
        "load_format": args.load_format,
        "greedy": args.greedy,
        "layers": args.layers,
        "hf_batch": args.hf_batch,
    }
    write_json(args.out / "bench.json", reports, rates, run)
    plot(args.out / "bench.png", reports)
    print(table(reports, rates))
    return 1 if any(report.errors for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
