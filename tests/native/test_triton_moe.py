"""The fused MoE kernel computes what a float64 per-expert loop says, on CPU through the Triton interpreter:
one token, an odd count and more tokens than a block, with experts that get no token and tokens that pick the
same expert twice; every tile config the tuner may write into the table; the expert alignment it rests on; and
the config table's lookup."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_moe_gpu.py runs these checks compiled", allow_module_level=True)

# Kernels are built as interpreted or compiled when their module is imported, so this must come first.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from batchjob.engine.native.kernels import (
    fused_moe,  # noqa: E402
    moe_align,  # noqa: E402
    moe_configs,  # noqa: E402
)
from batchjob.engine.native.kernels.moe_configs import GemmTile, MoEConfig, MoEConfigTable  # noqa: E402

if not isinstance(fused_moe._grouped_gemm_kernel, InterpretedFunction):
    # Imported compiled by another module: CPU needs interpreted, the alignment first as the GEMMs import it.
    moe_align = importlib.reload(moe_align)
    fused_moe = importlib.reload(fused_moe)

E, K, H, INTER = 8, 2, 64, 32
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def reference_moe(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float64, one token and one choice at a time."""
    x, w13, w2 = hidden.double(), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w13[e] @ x[t]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, k]) * (w2[e] @ act)
    return out


def routing(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts drawn from 0..E-3 only (the last two get no token); every third token picks one expert twice."""
    ids = torch.randint(0, E - 2, (num_tokens, K), generator=gen)
    ids[::3, 1] = ids[::3, 0]
    weights = torch.rand(num_tokens, K, generator=gen)
    return weights / weights.sum(dim=1, keepdim=True), ids


def random_moe(num_tokens: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=gen) / INTER**0.5).to(dtype)
    return (hidden, w13, w2, *routing(num_tokens, gen))


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_fused_moe_equals_the_float64_reference(num_tokens):
    args = random_moe(num_tokens)
    got = fused_moe.fused_moe(*args)
    assert got.shape == args[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference_moe(*args), rtol=1e-5, atol=1e-5)


def tuner_candidates() -> list[MoEConfig]:
    """One config per tile the tuner may choose: every block_m with each projection's candidate tiles."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from tune_moe import CANDIDATE_BLOCK_M, DOWN_TILES, GATE_UP_TILES
    finally:
        sys.path.remove(str(SCRIPTS))
    gate_up = sorted({tile for tiles in GATE_UP_TILES.values() for tile in tiles}, key=str)
    down = sorted({tile for tiles in DOWN_TILES.values() for tile in tiles}, key=str)
    block_ms = sorted({m for ms in CANDIDATE_BLOCK_M.values() for m in ms})
    # Pair the lists up cyclically: each tile and each block_m runs at least once without a full product.
    count = max(len(gate_up), len(down), len(block_ms))
    return [
        MoEConfig(block_ms[i % len(block_ms)], gate_up[i % len(gate_up)], down[i % len(down)]) for i in range(count)
    ]


@pytest.mark.parametrize(
    "config",
    [moe_configs._MEDIUM, moe_configs._PREFILL, MoEConfig(16, GemmTile(32, 32, 4, 2), GemmTile(16, 16, 4, 2))],
    ids=["medium", "prefill", "whole-depth-tiles"],
)
def test_every_tile_config_gives_the_same_result(config):
    # Tiles wider than the expert (64-row blocks of 3-row experts, 128 columns of 32) exercise the wrap-around
    # columns and padding rows, and depth tiles wider than the depth the masked loads; the last config's depth
    # tiles divide both projections' depths (the unmasked loads).
    args = random_moe(33)
    got = fused_moe.fused_moe(*args, config=config)
    torch.testing.assert_close(got.double(), reference_moe(*args), rtol=1e-5, atol=1e-5)


def test_every_config_the_tuner_can_choose_computes_the_same_result():
    args = random_moe(9)
    want = reference_moe(*args)
    for config in tuner_candidates():
        got = fused_moe.fused_moe(*args, config=config)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m, c=config: f"{c}: {m}")


def test_half_precision_gives_outputs_in_its_dtype_within_its_rounding():
    # bf16 is checked on the GPU only: the interpreter's tl.dot multiplies bf16 bit patterns as integers.
    args = random_moe(5, torch.float16)
    got = fused_moe.fused_moe(*args)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), reference_moe(*args), rtol=1e-2, atol=1e-2)


def test_alignment_groups_pairs_by_expert_in_whole_blocks():
    gen = torch.Generator().manual_seed(0)
    _, ids = routing(33, gen)
    block_m = 16
    sorted_pairs, block_experts, padded_rows = moe_align.moe_align_block_size(ids, E, block_m)
    pairs = ids.numel()
    counts = torch.bincount(ids.flatten(), minlength=E)
    end = int(padded_rows)
    assert end == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_pairs.numel() >= end and sorted_pairs.numel() % block_m == 0
    # Every pair exactly once, only padding after the used blocks, each block one expert's.
    real = sorted_pairs[sorted_pairs < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    assert (sorted_pairs[end:] == pairs).all()
    for block in range(end // block_m):
        rows = sorted_pairs[block * block_m : (block + 1) * block_m]
        rows = rows[rows < pairs].long()
        assert len(rows) > 0 and (ids.flatten()[rows] == block_experts[block]).all()
        assert rows.tolist() == sorted(rows.tolist())


def stable_sort_alignment(ids: torch.Tensor, block_m: int) -> list[int]:
    """The sorted buffer's used rows by hand: each expert's pairs in order, padded with T*K to whole blocks."""
    pairs = ids.numel()
    rows = []
    for expert in range(E):
        mine = [p for p, e in enumerate(ids.flatten().tolist()) if e == expert]
        rows += mine + [pairs] * (-len(mine) % block_m)
    return rows


@pytest.mark.parametrize("num_tokens", [1, 33, 1100])
def test_alignment_equals_a_stable_sort_by_expert(num_tokens):
    # 1100 tokens of top-2 are more pairs than one step of the kernel's loops takes.
    _, ids = routing(num_tokens, torch.Generator().manual_seed(num_tokens))
    sorted_pairs, _, padded_rows = moe_align.moe_align_block_size(ids, E, 16)
    want = stable_sort_alignment(ids, 16)
    assert int(padded_rows) == len(want)
    assert sorted_pairs[: len(want)].tolist() == want


def test_the_table_entry_nearest_in_ratio_is_chosen_and_untuned_shapes_take_the_default(tmp_path):
    small = MoEConfig(16, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3))
    large = MoEConfig(64, GemmTile(128, 64, 8, 4), GemmTile(256, 64, 8, 4))
    key = moe_configs.shape_key(E, INTER, H, K, torch.float32)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(MoEConfigTable({"cpu": {key: {16: small, 256: large}}}).to_json()))
    table = MoEConfigTable.load(path)

    def pick(num_tokens: int, num_experts: int = E) -> MoEConfig:
        return moe_configs.moe_config(
            num_tokens, num_experts, INTER, H, K, torch.float32, torch.device("cpu"), table=table
        )

    # 64 is 4x from both: the tie goes to the smaller count; asking twice gives the same answer.
    assert [pick(n) for n in (1, 16, 63, 64, 65, 256, 10_000)] == [small] * 4 + [large] * 3
    assert pick(64) == pick(64)
    assert pick(16, num_experts=4) == moe_configs.default_config(16, K, 4)


def test_the_packaged_table_loads():
    table = MoEConfigTable.load(moe_configs.TABLE_PATH)
    for shapes in table.entries.values():
        for by_tokens in shapes.values():
            assert all(isinstance(config, MoEConfig) for config in by_tokens.values())


@pytest.mark.parametrize(("block", "group"), [(None, False), ((16, 16), True)], ids=["per-row", "blocks"])
def test_fp8_experts_through_the_kernel_compute_their_float32_arithmetic(block, group, monkeypatch):
    from batchjob.engine.native.layers.fp8_linear import quantize_weight
    from batchjob.engine.native.models.moe import Fp8Experts

    hidden, w13, w2, topk_weights, topk_ids = random_moe(21)
    experts = Fp8Experts(E, H, INTER, block, group, None)
    for name, weight in (("gate_up_proj", w13), ("down_proj", w2)):
        q, scales = zip(*(quantize_weight(w, block) for w in weight), strict=True)
        getattr(experts, name).data = torch.stack([w.view(torch.uint8) for w in q]).view(torch.float8_e4m3fn)
        getattr(experts, name + "_scale").data = torch.stack(scales)
    # The interpreter's e4m3 rounding does not carry a mantissa overflow into the exponent (1.97 -> 1.0; compiled
    # kernels round right, and tests/gpu checks the quantizer bit for bit): the inputs are quantized in torch here.
    monkeypatch.setattr(fused_moe.fp8, "quantize", fused_moe.fp8.plain_quantize)
    scheme = fused_moe.Fp8ExpertWeights(experts.gate_up_proj_scale, experts.down_proj_scale, block, experts.group)
    got = fused_moe.fused_moe(
        hidden, experts.gate_up_proj, experts.down_proj, topk_weights, topk_ids, fp8_experts=scheme
    )
    expected = experts._torch_forward(hidden, topk_weights, topk_ids)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
