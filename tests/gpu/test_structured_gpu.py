"""Structured outputs on a GPU: the Triton mask kernel equals the torch mask at a 128k vocabulary, as does the
masked greedy argmax of bf16 logits (and is faster than masking a float32 copy), and a constrained run with CUDA
graphs (split decode and mixed steps: forward graph, then masked-sampler graph) gives the same tokens as eager and
as the synchronous loop, every `stop` row valid, in float32 and in bf16.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from structured_cases import CHOICES, PET_SCHEMA, POINT_SCHEMA, valid_json  # noqa: E402

from batchjob.engine import Request, SamplingParams, create_engine  # noqa: E402
from batchjob.engine.native.kernels.sampling_race import greedy_tokens  # noqa: E402
from batchjob.engine.native.kernels.token_mask import apply_token_bitmask  # noqa: E402
from batchjob.engine.native.sampling.token_mask import torch_apply_token_bitmask_  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_mask_kernel_equals_the_torch_mask_at_a_128k_vocabulary():
    vocab, rows = 128256, 48
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", generator=g)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, device="cuda", generator=g
    )
    mask_rows = torch.arange(rows, device="cuda").flip(0)
    mask_rows[::3] = -1  # unconstrained rows stay untouched
    want = torch_apply_token_bitmask_(logits.clone(), bitmask, mask_rows)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, mask_rows)
    assert torch.equal(got, want)


def _requests(top_p: float = 1.0) -> list[Request]:
    kinds = (
        {"json_schema": json.dumps(PET_SCHEMA)},
        {"json_schema": json.dumps(POINT_SCHEMA)},
        {"choice": CHOICES},
        {},
    )
    return [
        Request(
            i,
            (6 + i, 30, 41 + i % 7),
            SamplingParams(
                120,
                temperature=0.8 if i % 2 else 0.0,
                top_p=top_p,
                seed=i,
                ignore_eos=not kinds[i % 4],
                **kinds[i % 4],
            ),
        )
        for i in range(40)
    ]


def _run(model_dir, top_p, engine="native", **options):
    eng = create_engine(engine, str(model_dir), {"dtype": "float32", "max_num_seqs": 64, **options})
    try:
        done = {c.id: c for c in eng.generate(_requests(top_p))}
        return done, eng.stats(), len(eng.runner.graphs.mixed_masked)
    finally:
        eng.close()


# top_p 1: the temperature-only graph mode's masked sampler; top_p 0.9: the filtering mode's (mask, then filter).
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_constrained_run_with_graphs_equals_eager_and_sync_and_stops_valid(tmp_path, top_p):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    graphed, stats, mixed_masked_graphs = _run(model_dir, top_p)
    assert mixed_masked_graphs > 0 and stats["constrained_steps"] > 0
    # Jump-forward chunks make constrained steps mixed: they replay the split mixed graphs, none runs eagerly.
    assert stats["eager_steps"] == 0 and stats["mixed_graph_steps"] > 0
    # Masked samplers waited on the GPU behind gates that the mask worker opened.
    assert 0 < stats["constrained_steps_gated"] <= stats["constrained_steps"]
    tokens = {i: c.token_ids for i, c in graphed.items()}
    for options in (
        {"cuda_graphs": False},
        {"graph_constrained": False},
        {"debug_poison_slots": True},
        {"constrained_lag": True},
        {"gate_masked_sampler": False},
        {"mask_chunk_rows": 8},
        {"mask_chunk_rows": 8, "debug_poison_slots": True},
    ):
        assert {i: c.token_ids for i, c in _run(model_dir, top_p, **options)[0].items()} == tokens, options
    assert {i: c.token_ids for i, c in _run(model_dir, top_p, "native_sync")[0].items()} == tokens
    for r in _requests(top_p):
        c = graphed[r.id]
        if c.finish_reason == "stop" and r.sampling.json_schema:
            assert valid_json(c.text, json.loads(r.sampling.json_schema)), c.text
        elif c.finish_reason == "stop" and r.sampling.choice:
            assert c.text in CHOICES


def test_masked_greedy_reads_the_bitmask_beside_bf16_logits_and_beats_masking_a_float32_copy(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_lib.hardware import graph_ms

    vocab, rows = 128256, 256
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(rows, vocab, device="cuda", generator=g).to(torch.bfloat16)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, device="cuda", generator=g
    )
    bitmask[6] = 0  # a row that allows nothing takes its first token (logits row 249, constrained)
    mask_rows = torch.arange(rows, device="cuda").flip(0)
    mask_rows[::2] = -1
    before = logits.clone()
    got = greedy_tokens(logits, (bitmask, mask_rows))
    assert torch.equal(logits, before)
    want = torch_apply_token_bitmask_(logits.float(), bitmask, mask_rows).argmax(dim=-1)
    assert torch.equal(got, want)
    assert got[rows - 1 - 6].item() == 0
    buffer = torch.empty(rows, vocab, device="cuda")

    def copy_mask_argmax():
        apply_token_bitmask(buffer.copy_(logits), bitmask, mask_rows)
        greedy_tokens(buffer)

    fused = graph_ms(lambda: greedy_tokens(logits, (bitmask, mask_rows)), reps=50)
    before_ms = graph_ms(copy_mask_argmax, reps=50)
    print(f"{rows} rows, half constrained: masked greedy {fused * 1e3:.1f} us, ", end="")
    print(f"float32 copy + mask + argmax {before_ms * 1e3:.1f} us")
    assert fused < before_ms


def test_bf16_constrained_run_takes_its_greedy_rows_from_the_models_own_logits(tmp_path):
    # The split steps' forwards leave bf16 logits: greedy rows take the masked argmax of those, sampled rows a
    # float32 copy; graphed, eager and synchronous runs agree and every stopped row is valid.
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    eng = create_engine("native", str(model_dir), {"dtype": "bfloat16", "max_num_seqs": 64})
    try:
        assert eng.runner.split_logits.dtype == torch.bfloat16
        graphed = {c.id: c for c in eng.generate(_requests())}
        assert eng.stats()["constrained_steps"] > 0 and eng.stats()["eager_steps"] == 0
    finally:
        eng.close()
    tokens = {i: c.token_ids for i, c in graphed.items()}
    for engine, options in (("native", {"cuda_graphs": False}), ("native_sync", {})):
        assert {
            i: c.token_ids for i, c in _run(model_dir, 1.0, engine, dtype="bfloat16", **options)[0].items()
        } == tokens
    for r in _requests():
        c = graphed[r.id]
        if c.finish_reason == "stop" and r.sampling.json_schema:
            assert valid_json(c.text, json.loads(r.sampling.json_schema)), c.text
        elif c.finish_reason == "stop" and r.sampling.choice:
            assert c.text in CHOICES


# A run stopped at its first completion: the mask worker may still hold the next step's gate closed (the default
# starts the masks before the step's completions are handed out; jump-forward after them).
@pytest.mark.parametrize("options", [{}, {"jump_forward": True}])
def test_a_run_stopped_while_samplers_wait_behind_gates_drains_and_serves_the_next(tmp_path, options):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    eng = create_engine("native", str(model_dir), {"dtype": "float32", "max_num_seqs": 64, **options})
    try:
        run = eng.generate(_requests())
        next(run)
        run.close()  # the worker opens what it holds, the loop every other gate, before waiting for the device
        assert eng.runner.gates.pending() == 0
        again = {c.id: c.token_ids for c in eng.generate(_requests())}
        assert eng.stats()["constrained_steps_gated"] > 0
    finally:
        eng.close()
    assert again == {i: c.token_ids for i, c in _run(model_dir, 1.0, **options)[0].items()}
