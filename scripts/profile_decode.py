"""Where a decode step's GPU time goes: the whole step (eager and CUDA graph) next to its matmuls alone and
its attention alone, against the bytes it must read; plus the top kernels of an eager step.

    python scripts/profile_decode.py --arch llama-3.1-8b --batch 32 --context 640 [--out profile.json]

Random bf16 weights built in memory (no checkpoint on disk); needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.hardware import graph_ms  # noqa: E402
from bench_lib.models import _config  # noqa: E402

from batchjob.engine.native.attention import make_metadata  # noqa: E402
from batchjob.engine.native.kv_cache import allocate_kv_cache  # noqa: E402
from batchjob.engine.native.loader import read_model_spec  # noqa: E402
from batchjob.engine.native.models import CausalLM  # noqa: E402
from batchjob.engine.native.triton_attention import TritonPagedAttention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(args.arch)
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.save_pretrained(tmp)
        spec = read_model_spec(tmp, "bfloat16", max_model_len=args.context + 64)
    attn = TritonPagedAttention()
    with torch.device("meta"):
        model = CausalLM(spec, attn).to(spec.dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    model.reset_tables()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    b, ctx, bs = args.batch, args.context, 16
    per_seq = -(-ctx // bs)
    caches = allocate_kv_cache(spec, 1 + b * per_seq, bs, device)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(b)]
    meta = make_metadata([1] * b, [ctx] * b, tables, bs, device=device)
    ids = torch.randint(0, spec.vocab_size, (b,), device=device)
    positions = torch.full((b,), ctx - 1, device=device)
    kv_bytes = 2 * spec.num_layers * b * ctx * spec.num_kv_heads * spec.head_dim * 2
    copy_src = torch.empty(2**30, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = graph_ms(lambda: copy_dst.copy_(copy_src))
    bandwidth = 2 * copy_src.numel() / (copy_ms / 1000)

    def step():
        with torch.no_grad():
            h = model(ids, positions, meta, caches)
            model.compute_logits(h).argmax(-1)

    linears = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    lm_weight = model.embed_tokens.weight if model.lm_head is None else None
    x_in = {w.shape[1]: torch.randn(b, w.shape[1], device=device, dtype=spec.dtype) for w, _ in linears}

    def matmuls():
        for w, bias in linears:
            F.linear(x_in[w.shape[1]], w, bias)
        if lm_weight is not None:
            F.linear(x_in[spec.hidden_size], lm_weight)

    q = torch.randn(b, spec.num_heads, spec.head_dim, device=device, dtype=spec.dtype)
    kv = torch.randn(b, spec.num_kv_heads, spec.head_dim, device=device, dtype=spec.dtype)

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
        "arch": args.arch,
        "batch": b,
        "context": ctx,
        "copy_tb_s": bandwidth / 1e12,
        "weight_gb": weight_bytes / 1e9,
        "kv_gb": kv_bytes / 1e9,
        "floor_ms": (weight_bytes + kv_bytes) / bandwidth * 1000,
        "eager_ms": start.elapsed_time(end) / 5,
        "graph_ms": graph_ms(step),
        "matmuls_graph_ms": graph_ms(matmuls),
        "matmul_floor_ms": weight_bytes / bandwidth * 1000,
        "attention_graph_ms": graph_ms(attention),
        "attention_floor_ms": kv_bytes / bandwidth * 1000,
    }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
    for key, value in result.items():
        print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
