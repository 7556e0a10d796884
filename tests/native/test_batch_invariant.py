"""The batch-invariant arithmetic of `engine.deterministic`, on CPU: the projections' rows (plain torch, and the
GPU's Triton matmul through the interpreter) and the attention of a token (the per-token torch path, and the
Triton varlen kernel with every tile masked) are the same bits whatever else the step holds; and the rest of
the engine leaves a row alone: tensor-parallel sums in rank order.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_deterministic_gpu.py runs the compiled kernels", allow_module_level=True)

import importlib  # noqa: E402

from attention_cases import random_paged_step  # noqa: E402
from interpreted_attention import TritonPagedAttention  # noqa: E402

from batchjob.engine.native.kernels import invariant_matmul  # noqa: E402
from batchjob.engine.native.layers import batch_invariant  # noqa: E402
from batchjob.engine.native.layers.attention import TorchPagedAttention, make_metadata  # noqa: E402

if not isinstance(
    invariant_matmul._parts_kernel, importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    invariant_matmul = importlib.reload(invariant_matmul)


@pytest.mark.parametrize(("n", "k"), [(64, 64), (96, 128), (48, 320)])
def test_a_projection_row_is_the_same_bits_at_every_row_count_on_cpu(n, k):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(70, k, generator=generator)
    whole = batch_invariant.matmul(x, weight)
    for rows in (1, 2, 7, 33, 64):
        assert torch.equal(batch_invariant.matmul(x[:rows], weight), whole[:rows]), rows
    assert torch.allclose(whole, x @ weight.t(), atol=1e-4)


def test_the_gpu_matmul_splits_k_by_the_weight_alone_and_adds_its_parts_in_order():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 320, generator=generator)
    x = torch.randn(140, 320, generator=generator)
    bias = torch.randn(64, generator=generator)
    parts = invariant_matmul.partial_products(x, weight)
    assert parts.shape == (invariant_matmul.num_parts(weight), 140, 64)
    assert torch.equal(invariant_matmul.partial_products(x[:3], weight), parts[:, :3])
    whole = invariant_matmul.matmul(x, weight, bias)
    for rows in (1, 5, 129):
        assert torch.equal(invariant_matmul.matmul(x[:rows], weight, bias), whole[:rows]), rows
    assert torch.allclose(whole, x @ weight.t() + bias, atol=1e-4)


def test_rows_that_fill_the_gpu_take_every_part_in_one_program_with_the_same_bits(monkeypatch):
    """Where a step's rows make a wave of programs (`serial`), each program adds its tile's parts itself, in the
    order `reduce_parts` adds them: the same bits as the split launch, on either side of the threshold. K = 320 is
    two parts of 192 and 128: the last part's loop takes a step past K, which adds zeros."""
    monkeypatch.setattr(invariant_matmul, "_sm_count", lambda device: 2)  # a GPU of two multiprocessors,
    monkeypatch.setattr(invariant_matmul, "SERIAL_WAVES", 1)  # serial from one wave of programs: 2 row tiles
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 320, generator=generator)
    x = torch.randn(200, 320, generator=generator)
    bias = torch.randn(64, generator=generator)
    assert invariant_matmul.num_parts(weight) == 2
    assert not invariant_matmul.serial(128, weight) and invariant_matmul.serial(129, weight)
    whole = invariant_matmul.matmul(x, weight, bias)  # 200 rows: one program a tile, both parts in it
    split = invariant_matmul.reduce_parts(invariant_matmul.partial_products(x, weight), bias, x.dtype)
    assert torch.equal(whole, split)
    for rows in (1, 5, 128, 129, 200):
        assert torch.equal(invariant_matmul.matmul(x[:rows], weight, bias), whole[:rows]), rows
    assert torch.allclose(whole, x @ weight.t() + bias, atol=1e-4)


def test_a_step_of_more_than_one_row_tile_serializes_from_half_a_wave_with_the_same_bits(monkeypatch):
    """One row tile splits K across programs until a whole wave (`SERIAL_WAVES`); from two row tiles, half a
    wave of programs serializes (`MULTI_TILE_SERIAL_WAVES`): the same bits on either side."""
    monkeypatch.setattr(invariant_matmul, "_sm_count", lambda device: 4)
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(64, 320, generator=generator)  # one column tile: a program a row tile
    x = torch.randn(300, 320, generator=generator)
    assert invariant_matmul.num_parts(weight) > 1
    assert not invariant_matmul.serial(128, weight)  # 1 program of 4 multiprocessors
    assert invariant_matmul.serial(129, weight)  # 2 programs: half a wave
    whole = invariant_matmul.matmul(x, weight)
    split = invariant_matmul.reduce_parts(invariant_matmul.partial_products(x, weight), None, x.dtype)
    assert torch.equal(whole, split)
    for rows in (1, 128, 129, 256, 257):
        assert torch.equal(invariant_matmul.matmul(x[:rows], weight), whole[:rows]), rows
    monkeypatch.setattr(invariant_matmul, "MULTI_TILE_SERIAL_WAVES", 1)
    assert not invariant_matmul.serial(384, weight) and invariant_matmul.serial(385, weight)


def test_a_serial_step_too_small_for_its_own_tiles_takes_narrow_ones_with_the_same_bits(monkeypatch):
    """Rows that make a wave of the split launch's programs but not of the serial launch's wider tiles
    (`NARROW_BELOW_WAVES`) run serial in the split launch's column tiles: the same bits either way."""
    monkeypatch.setattr(invariant_matmul, "_sm_count", lambda device: 5)
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(192, 320, generator=generator)  # 3 column tiles of 64, 2 of 128; K in 2 parts
    x = torch.randn(300, 320, generator=generator)
    assert invariant_matmul.num_parts(weight) == 2 and invariant_matmul.serial(200, weight)
    whole = invariant_matmul.matmul(x, weight)  # 3 row tiles x 2 wide column tiles: a wave, wide tiles
    for rows in (100, 129, 200):  # split; then serial in narrow tiles (2 x 2 wide tiles would be 4 of 5)
        assert torch.equal(invariant_matmul.matmul(x[:rows], weight), whole[:rows]), rows
    monkeypatch.setattr(invariant_matmul, "NARROW_BELOW_WAVES", 0)
    assert torch.equal(invariant_matmul.matmul(x[:200], weight), whole[:200])


def test_a_weight_of_one_part_takes_the_row_tile_that_pads_least_with_the_same_bits(monkeypatch):
    """A one-part weight's serial launch takes 256-row tiles where they pad the rows no further than 128-row ones
    (129-256, 385-512, ...) and 128-row tiles otherwise (257-384: three of 128, not two of 256): a row's bits are
    the same in either."""
    rows = (100, 128, 129, 256, 257, 300, 384, 385, 512, 513, 640, 768, 8192)
    tiles = [invariant_matmul.one_part_block_m(r) for r in rows]
    assert tiles == [128, 128, 256, 256, 128, 128, 128, 256, 256, 128, 128, 256, 256]
    monkeypatch.setattr(invariant_matmul, "_sm_count", lambda device: 1)  # one part, serial at every row count
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 128, generator=generator)
    x = torch.randn(520, 128, generator=generator)
    assert invariant_matmul.num_parts(weight) == 1 and invariant_matmul.serial(1, weight)
    whole = invariant_matmul.matmul(x, weight)  # 520 rows: five tiles of 128
    for count in (129, 256, 300, 384, 385, 512):
        assert torch.equal(invariant_matmul.matmul(x[:count], weight), whole[:count]), count
    assert torch.allclose(whole, x @ weight.t(), atol=1e-4)


@pytest.mark.parametrize("sms", [1, 64], ids=["serial", "split"])
def test_a_last_row_tile_from_the_steps_last_rows_stores_each_row_once_with_the_same_bits(sms, monkeypatch):
    """A step whose rows end inside a row tile computes that tile from its last `BLOCK_M` rows, some of which the
    tile before also computes, and stores only its own (`SHIFT_LAST_ROW_TILE`): every row is written, with the bits
    of a launch whose last tile reads past the input's end, in a serial launch and in a split one."""
    monkeypatch.setattr(invariant_matmul, "_sm_count", lambda device: sms)
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 320, generator=generator)
    x = torch.randn(300, 320, generator=generator)
    assert invariant_matmul.serial(300, weight) == (sms == 1)
    reference = x @ weight.t()
    for rows in (129, 200, 300):
        monkeypatch.setattr(invariant_matmul, "SHIFT_LAST_ROW_TILE", True)
        shifted = invariant_matmul.matmul(x[:rows], weight)
        monkeypatch.setattr(invariant_matmul, "SHIFT_LAST_ROW_TILE", False)
        assert torch.equal(shifted, invariant_matmul.matmul(x[:rows], weight)), rows
        assert torch.allclose(shifted, reference[:rows], atol=1e-4), rows


@pytest.mark.parametrize("group_m", [1, 2, 8])
def test_every_tile_is_computed_once_in_any_program_order(group_m, monkeypatch):
    """Row tiles walk down each column tile in groups (`GROUP_M`): a last group of fewer row tiles, and groups
    across several column tiles, still compute every tile once, with the bits of any other order."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 64, generator=generator)  # 4 column tiles
    x = torch.randn(300, 64, generator=generator)  # 3 row tiles
    monkeypatch.setattr(invariant_matmul, "GROUP_M", 1)
    reference = invariant_matmul.matmul(x, weight)
    monkeypatch.setattr(invariant_matmul, "GROUP_M", group_m)
    assert torch.equal(invariant_matmul.matmul(x, weight), reference)
    assert torch.allclose(reference, x @ weight.t(), atol=1e-4)


@pytest.mark.parametrize(
    "backend",
    [TorchPagedAttention(deterministic=True), TritonPagedAttention(deterministic=True)],
    ids=["torch", "triton"],
)
def test_a_tokens_attention_is_the_same_bits_in_a_chunk_as_a_decode_alone_or_beside_others(backend):
    # Sequence 0 is a 40-token chunk over 60 cached tokens (its tokens at positions 60..99), beside a decode and
    # a 6-token prompt. Its token at position 80 is computed again as the last of a shorter chunk, and its last
    # token as a one-token decode alone and beside another sequence's decode.
    q, k, v, k_cache, v_cache, meta = random_paged_step(
        [40, 1, 6], [100, 19, 6], 16, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, device="cpu"
    )
    scale = 32**-0.5
    full = backend.forward(q, k, v, k_cache, v_cache, meta, scale)  # stores the step's keys and values
    tables = [meta.block_tables[b].tolist() for b in range(3)]

    def again(rows: list[int], query_lens: list[int], seq_lens: list[int], sequences: list[int]) -> torch.Tensor:
        step = make_metadata(query_lens, seq_lens, [tables[b] for b in sequences], 16)
        return backend.forward(q[rows], k[rows], v[rows], k_cache, v_cache, step, scale, kv_stored=True)

    assert torch.equal(again(list(range(21)), [21], [81], [0])[20], full[20])
    assert torch.equal(again([39], [1], [100], [0])[0], full[39])
    assert torch.equal(again([39, 40], [1, 1], [100, 19], [0, 1])[0], full[39])
