"""Where a decode step's GPU time goes: the whole step (eager and CUDA graph) next to its matmuls alone and
its attention alone, against the bytes it must read and the FLOPs it must do; plus the top kernels of an eager
step. `--prefill L,P` adds P sequences prefilling L prompt tokens each to the step (a mixed step, as when
finished sequences are replaced), after `--prefill-past` tokens already cached (an earlier chunk).

    python scripts/dev/profile_decode.py --arch llama-3.1-8b --batch 32 --context 640 [--out profile.json]
    python scripts/dev/profile_decode.py --arch llama-3.1-8b --batch 256 --context 1300 --prefill 1024,4
    python scripts/dev/profile_decode.py --arch llama-3.1-8b --batch 8,32,128 --split-k off,4096:4096:2/4096:14336:2
    python scripts/dev/profile_decode.py --arch llama-3.1-8b --batch 32 --blas engine,cublas,cublaslt

Several batch sizes, split-K tables (`split_k.py`: "N:K:parts/..." for weights of N rows and K columns split into
that many parts at up to `--split-rows` rows, "off" for none, "default" for the engine's)
and BLAS libraries run in one process, each printed as its own block; by default the matmuls go to the library
the engine picks for the step's rows (`blas.py`). Random bf16 weights built in memory (no checkpoint on disk);
needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_lib.hardware import graph_ms, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402
from bench_lib.models import model_config  # noqa: E402

from batchjob.engine.native.layers import split_k  # noqa: E402
from batchjob.engine.native.layers.attention import make_metadata  # noqa: E402
from batchjob.engine.native.layers.triton_attention import TritonPagedAttention  # noqa: E402
from batchjob.engine.native.loading.model_loader import read_model_spec  # noqa: E402
from batchjob.engine.native.models import CausalLM  # noqa: E402
from batchjob.engine.native.runtime import blas  # noqa: E402
from batchjob.engine.native.runtime.kv_cache import allocate_kv_cache  # noqa: E402
from batchjob.engine.native.sampling.sampler import greedy_tokens  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama-3.1-8b")
    parser.add_argument("--batch", default="32", help="decoding sequences, or a comma-separated list")
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--prefill", default="0,0", help="L,P: P sequences prefilling L tokens each")
    parser.add_argument("--prefill-past", type=int, default=0, help="tokens the prefilling sequences had cached")
    parser.add_argument("--split-k", default="default", help="comma-separated split-K tables to compare")
    parser.add_argument("--split-rows", type=int, default=256, help="most rows a step splits (a table's)")
    parser.add_argument("--blas", default="engine", help="comma-separated: engine (blas.py's pick), cublas, cublaslt")
    parser.add_argument("--out")
    args = parser.parse_args()
    model, spec = build_model(args)
    results = []
    rows = range(1, args.split_rows + 1)
    tables = {
        table: split_k.SPLITS if table == "default" else parse_splits(table, rows) for table in args.split_k.split(",")
    }
    for batch in (int(b) for b in args.batch.split(",")):
        for table in tables.values():
            for library in args.blas.split(","):
                split_k.SPLITS = table
                results.append(profile(model, spec, args, batch, library))
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def parse_splits(table: str, rows: range) -> dict:
    """ "4096:4096:2/4096:14336:4" -> {(4096, 4096): (2, rows), (4096, 14336): (4, rows)}; "off" -> {}."""
    if table == "off":
        return {}
    entries = (tuple(int(v) for v in item.split(":")) for item in table.split("/"))
    return {(n, k): (parts, rows) for n, k, parts in entries}


def build_model(args: argparse.Namespace) -> tuple[CausalLM, object]:
    chunk = int(args.prefill.split(",")[0])
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        model_config(args.arch).save_pretrained(tmp)
        spec = read_model_spec(tmp, "bfloat16", max_model_len=max(args.context, args.prefill_past + chunk) + 64)
    attn = TritonPagedAttention()
    with torch.device("meta"):
        model = CausalLM(spec, attn).to(spec.dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    model.reset_tables()
    return model, spec


@contextmanager
def blas_library(library: str, rows: int, dtype: torch.dtype) -> Iterator[None]:
    """The engine's BLAS pick for `rows` (library "engine"), or `library` throughout."""
    if library == "engine":
        with blas.for_rows(rows, torch.device("cuda"), dtype):
            yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def profile(model: CausalLM, spec, args: argparse.Namespace, b: int, library: str) -> dict:
    """Time one decode step of `b` sequences (with the prefill chunks `args` asks for) and print its block."""
    device = torch.device("cuda")
    attn = model.layers[0].self_attn.attn
    chunk, prompts = (int(x) for x in args.prefill.split(","))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ctx, bs = args.context, 16
    prefill_len = args.prefill_past + chunk
    query_lens = [1] * b + [chunk] * prompts
    seq_lens = [ctx] * b + [prefill_len] * prompts
    tokens = sum(query_lens)
    per_seq = -(-max(ctx, prefill_len) // bs)
    caches = allocate_kv_cache(spec, 1 + len(query_lens) * per_seq, bs, device)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(query_lens))]
    meta = make_metadata(query_lens, seq_lens, tables, bs, device=device)
    ids = torch.randint(0, spec.vocab_size, (tokens,), device=device)
    positions = torch.tensor(
        [ctx - 1] * b + [p for _ in range(prompts) for p in range(args.prefill_past, prefill_len)], device=device
    )
    kv_bytes = 2 * spec.num_layers * (b * ctx + prompts * prefill_len) * spec.num_kv_heads * spec.head_dim * 2
    matmul_rate = measure_matmul_rate()
    layer_params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    # As the roofline measures it (eagerly): a copy replayed from a CUDA graph moved 2.7 TB/s on an H200 against
    # 4.3 TB/s, less than the decode kernel itself reads, which made the floor longer than the step.
    bandwidth = measure_copy_bandwidth(gib=1.0)

    last_rows = torch.tensor([i for i in range(b)] + [b + (i + 1) * chunk - 1 for i in range(prompts)], device=device)

    def step():
        with torch.no_grad(), blas_library(library, tokens, spec.dtype):
            h = model(ids, positions, meta, caches)
            greedy_tokens(model.compute_logits(h[last_rows], float32=False))

    # The layers' linears run on every token, the output head (tied or not) on the sampled rows only.
    linears = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    lm_weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    x_in = {w.shape[1]: torch.randn(tokens, w.shape[1], device=device, dtype=spec.dtype) for w, _ in linears}

    def matmuls():
        with blas_library(library, tokens, spec.dtype):
            for w, bias in linears:
                F.linear(x_in[w.shape[1]], w, bias)
            F.linear(x_in[spec.hidden_size][: len(last_rows)], lm_weight)

    q = torch.randn(tokens, spec.num_heads, spec.head_dim, device=device, dtype=spec.dtype)
    kv = torch.randn(tokens, spec.num_kv_heads, spec.head_dim, device=device, dtype=spec.dtype)

    def attention():
        for k_cache, v_cache in caches:
            attn.forward(q, kv, kv, k_cache, v_cache, meta, spec.head_dim**-0.5)

    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    torch.cuda.synchronize()
    result = {
        "split_k": "/".join(f"{n}:{k}:{p}" for (n, k), (p, rows) in split_k.SPLITS.items() if tokens in rows) or "off",
        "blas": library,
        "arch": args.arch,
        "batch": b,
        "context": ctx,
        "prefill": f"{prompts} x {chunk} after {args.prefill_past}",
        "tokens": tokens,
        "matmul_tflops": matmul_rate / 1e12,
        "copy_tb_s": bandwidth / 1e12,
        "weight_gb": weight_bytes / 1e9,
        "kv_gb": kv_bytes / 1e9,
        "floor_ms": (weight_bytes + kv_bytes) / bandwidth * 1000,
        "eager_ms": start.elapsed_time(end) / 5,
        "graph_ms": graph_ms(step),
        "matmuls_graph_ms": graph_ms(matmuls),
        "matmul_floor_ms": weight_bytes / bandwidth * 1000,
        "matmul_flops_floor_ms": 2
        * (layer_params * tokens + spec.vocab_size * spec.hidden_size * len(last_rows))
        / matmul_rate
        * 1000,
        "attention_graph_ms": graph_ms(attention),
        "attention_floor_ms": kv_bytes / bandwidth * 1000,
    }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
    for key, value in result.items():
        print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
    print(table, flush=True)
    return result


if __name__ == "__main__":
    main()
