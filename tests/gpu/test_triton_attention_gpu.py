"""The compiled Triton paged-attention kernels on a GPU at real sizes: bf16 within ~1e-2 of a float64 dense
reference, fp32 tight, and a captured decode graph that replays correctly with other lengths."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Importing the kernels here, uninterpreted, would leave them unusable for the CPU interpreter tests.
    pytest.skip("needs CUDA", allow_module_level=True)

import dataclasses  # noqa: E402
import functools  # noqa: E402

from attention_cases import random_paged_step  # noqa: E402
from attention_cases import reference_attention as reference  # noqa: E402

from batchjob.engine.native.kernels.decode_attention import DEFAULT_DECODE_CONFIG  # noqa: E402
from batchjob.engine.native.layers.attention import AttentionMetadata  # noqa: E402
from batchjob.engine.native.layers.triton_attention import TritonPagedAttention, store_kv  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
random_step = functools.partial(random_paged_step, device=DEVICE)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).norm() / expected.norm()).item()


LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize(("num_seqs", "context"), [(64, 1024), (32, 1152)])
def test_bf16_decode_at_llama_8b_shape_matches_reference(num_seqs, context):
    gen = torch.Generator().manual_seed(num_seqs)
    seq_lens = (context - torch.randint(0, 300, (num_seqs,), generator=gen)).tolist()
    step = random_step([1] * num_seqs, seq_lens, 16, dtype=torch.bfloat16, **LLAMA_8B)
    out = TritonPagedAttention().forward(*step, scale=128**-0.5)
    assert relative_error(out, reference(*step, scale=128**-0.5)) < 1e-2


@pytest.mark.parametrize("programs", [66, 132])
def test_bf16_decode_on_a_persistent_grid_matches_the_grid_of_a_program_per_head(programs):
    gen = torch.Generator().manual_seed(programs)
    seq_lens = (1024 - torch.randint(0, 300, (96,), generator=gen)).tolist()
    step = random_step([1] * 96, seq_lens, 16, dtype=torch.bfloat16, **LLAMA_8B)
    persistent = dataclasses.replace(DEFAULT_DECODE_CONFIG, programs=programs)
    out = TritonPagedAttention(1, persistent).forward(*step, scale=128**-0.5)
    expected = TritonPagedAttention(1, DEFAULT_DECODE_CONFIG).forward(*step, scale=128**-0.5)
    assert torch.equal(out, expected)
    assert relative_error(out, reference(*step, scale=128**-0.5)) < 1e-2


def test_bf16_decode_on_a_grid_of_heads_first_matches_the_usual_grid():
    gen = torch.Generator().manual_seed(7)
    seq_lens = (1024 - torch.randint(0, 300, (96,), generator=gen)).tolist()
    step = random_step([1] * 96, seq_lens, 16, dtype=torch.bfloat16, **LLAMA_8B)
    heads_first = dataclasses.replace(DEFAULT_DECODE_CONFIG, heads_first=True)
    out = TritonPagedAttention(1, heads_first).forward(*step, scale=128**-0.5)
    assert torch.equal(out, TritonPagedAttention(1, DEFAULT_DECODE_CONFIG).forward(*step, scale=128**-0.5))


def test_bf16_decode_taking_the_longest_sequences_first_writes_what_batch_order_writes():
    gen = torch.Generator().manual_seed(11)
    seq_lens = torch.randint(128, 3073, (300,), generator=gen).tolist()
    step = random_step([1] * 300, seq_lens, 16, dtype=torch.bfloat16, **LLAMA_8B)
    meta = step[-1]
    # The step's metadata lists its sequences longest first, as the engine's does; the same step in batch order:
    longest_first = torch.argsort(meta.seq_lens, descending=True, stable=True).to(torch.int32)
    assert torch.equal(meta.decode_order, longest_first)
    in_batch_order = step[:-1] + (dataclasses.replace(meta, decode_order=None),)
    assert TritonPagedAttention().decode_splits(300, 8, DEVICE) == 1
    out = TritonPagedAttention().forward(*step, scale=128**-0.5)
    assert torch.equal(out, TritonPagedAttention().forward(*in_batch_order, scale=128**-0.5))


@pytest.mark.parametrize("block_size", [16, 1, 256])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (16, 8, 64), (8, 8, 128)])
def test_bf16_mixed_prefill_and_decode_batch_matches_reference(block_size, num_heads, num_kv_heads, head_dim):
    query_lens = [1, 1, 37, 513, 1000, 1, 250]
    seq_lens = [1, 777, 37, 1300, 1000, 2049, 251]
    step = random_step(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, torch.bfloat16)
    scale = head_dim**-0.5
    out = TritonPagedAttention().forward(*step, scale=scale)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference(*step, scale=scale)) < 1e-2


def test_fp32_prefill_and_decode_match_reference_tightly():
    # The fp32 engine is compared token for token with transformers: no TF32 anywhere.
    prefill = random_step([5, 300, 1], [5, 700, 90], 16, dtype=torch.float32, **LLAMA_8B)
    decode = random_step([1] * 8, [3, 64, 65, 500, 1025, 7, 9, 2000], 16, dtype=torch.float32, **LLAMA_8B)
    # 40 sequences x 8 KV heads fill the GPU without splitting: one split, no reduce.
    wide = random_step([1] * 40, [17 * i + 1 for i in range(40)], 16, dtype=torch.float32, **LLAMA_8B)
    assert TritonPagedAttention().decode_splits(40, 8, torch.device("cuda")) == 1
    for step in (prefill, decode, wide):
        out = TritonPagedAttention().forward(*step, scale=0.088)
        torch.testing.assert_close(out.double(), reference(*step, scale=0.088), atol=2e-5, rtol=2e-5)


def test_store_writes_every_token_at_its_slot():
    q, k, v, k_cache, v_cache, meta = random_step([100, 1, 33], [300, 20, 33], 16, dtype=torch.bfloat16, **LLAMA_8B)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], k)
    assert torch.equal(v_cache.flatten(0, 1)[meta.slot_mapping], v)


def test_captured_decode_graph_replays_with_other_seq_lens():
    num_seqs, max_blocks, block_size, scale = 16, 160, 16, 128**-0.5
    backend = TritonPagedAttention()
    # Static inputs the graph reads; each replay rewrites them in place, as the engine's IO slots do.
    first = random_step(
        [1] * num_seqs, [5 + 3 * i for i in range(num_seqs)], block_size, dtype=torch.bfloat16, **LLAMA_8B
    )
    q, k, v = (t.clone() for t in first[:3])
    num_blocks = num_seqs * max_blocks + 1
    k_cache = torch.zeros(num_blocks, block_size, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    meta = AttentionMetadata(
        cu_query_lens=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=DEVICE),
        max_query_len=1,
        max_seq_len=1,
    )

    def load(step) -> None:
        """Copy a random step into the static buffers: its context into the big cache, lengths and tables."""
        sq, sk, sv, sk_cache, sv_cache, smeta = step
        for dst, src in ((q, sq), (k, sk), (v, sv)):
            dst.copy_(src)
        k_cache[: sk_cache.shape[0]].copy_(sk_cache.nan_to_num())
        v_cache[: sv_cache.shape[0]].copy_(sv_cache.nan_to_num())
        meta.seq_lens.copy_(smeta.seq_lens)
        meta.block_tables.zero_()
        meta.block_tables[:, : smeta.block_tables.shape[1]].copy_(smeta.block_tables)
        meta.slot_mapping.copy_(smeta.slot_mapping)

    load(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)

    gen = torch.Generator().manual_seed(7)
    for seed, longest in ((1, 40), (2, 2500), (3, 700)):
        # Contexts far longer (and shorter) than at capture: more tiles, more live splits, same launch.
        lens = torch.randint(1, longest, (num_seqs,), generator=gen).tolist()
        step = random_step([1] * num_seqs, lens, block_size, dtype=torch.bfloat16, seed=seed, **LLAMA_8B)
        load(step)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, reference(*step, scale=scale)) < 1e-2
        assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], k)


def test_the_decode_attention_profiler_times_the_engines_launch_beside_the_configs_asked_for():
    """scripts/dev/decode_attention_shapes.py at a 1B's decode steps: every launch tried computes what the engine's
    does, and none beats the floor of reading the cache once by 2x."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "decode_attention_shapes.py"
    args = ["--rows", "8,256", "--context", "64-1024", "--block-n", "32,64", "--warps", "4", "--stages", "3"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0] in ("8", "256")]
    assert [r[0] for r in rows] == ["8", "256"]
    for row in rows:
        floor, engine, best = (float(cell) for cell in row[2:5])
        assert min(engine, best) >= 0.5 * floor, row
        assert not row[5].endswith("!"), row
    assert done.stdout.count("every launch") == 2 and "!" not in done.stdout.split("every launch")[-1]


def test_the_decode_attention_profiler_times_the_deterministic_launches_beside_the_default_decode():
    """The same profiler with --deterministic: the varlen kernel's launches at a decode step, each within bf16's
    tolerance of the deterministic engine's, timed beside the default engine's decode launch; the engine's launch
    with its programs taking the sequences longest first computes every bit alike."""
    import subprocess
    import sys
    from pathlib import Path

    from batchjob.engine.native.layers.triton_attention import DETERMINISTIC_PREFILL_CONFIG as ENGINE

    script = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "decode_attention_shapes.py"
    args = ["--deterministic", "--rows", "8,256", "--context", "64-1024", "--block-m", f"{ENGINE.block_m},64"]
    args += ["--block-n", str(ENGINE.block_n), "--warps", str(ENGINE.num_warps), "--stages", str(ENGINE.num_stages)]
    args += ["--longest-first", "0,1"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0] in ("8", "256")]
    assert [r[0] for r in rows] == ["8", "256"]
    for row in rows:
        floor, default, engine, best = (float(cell) for cell in row[2:6])
        assert min(default, engine, best) >= 0.5 * floor, row
        assert not row[6].endswith("!"), row
    assert done.stdout.count("every launch") == 2 and "!" not in done.stdout.split("every launch")[-1]
    ordered = f"{ENGINE.block_m}/{ENGINE.block_n}/{ENGINE.num_warps}/{ENGINE.num_stages}/1 "
    for listed in done.stdout.split("every launch")[1:]:
        assert listed.split(ordered)[1].split(",")[0].strip().endswith("="), listed


@pytest.mark.parametrize("row_sums", [[], ["--row-sum-dot"]], ids=["row sums across threads", "row sums by a dot"])
def test_the_decode_attention_profiler_times_a_deterministic_prefill_chunk_and_checks_its_bits(row_sums):
    """The profiler with --deterministic --prefill: a chunk of whole prompts through the varlen kernel's launches,
    the default engine's prefill launch beside; the deterministic engine's own launch, tried again, is marked as
    computing every bit alike (the mark a launch needs before it may serve some steps in that mode), with the
    softmax's row sums added across threads or on the tensor cores."""
    import subprocess
    import sys
    from pathlib import Path

    from batchjob.engine.native.layers.triton_attention import DETERMINISTIC_PREFILL_CONFIG as ENGINE

    script = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "decode_attention_shapes.py"
    args = ["--deterministic", "--prefill", "2048", "--context", "64-1024", "--block-m", f"{ENGINE.block_m},64"]
    args += ["--block-n", str(ENGINE.block_n), "--warps", str(ENGINE.num_warps), "--stages", str(ENGINE.num_stages)]
    done = subprocess.run([sys.executable, str(script), *args, *row_sums], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"row_sum_dot={bool(row_sums)}" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0] == "2048"]
    assert len(rows) == 1
    floor, default, engine, best = (float(cell) for cell in rows[0][2:6])
    assert min(default, engine, best) >= 0.5 * floor, rows[0]
    own = f"{ENGINE.block_m}/{ENGINE.block_n}/{ENGINE.num_warps}/{ENGINE.num_stages} "
    listed = done.stdout.split("every launch")[-1]
    assert own in listed and listed.split(own)[1].split(",")[0].strip().endswith("="), listed
    assert "!" not in listed
