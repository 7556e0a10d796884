"""What each rank of a tensor-parallel engine holds: together the ranks hold every full weight, each row once
(KV heads: once per rank that reads them), and each rank's shard fits the model its spec builds."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from batchjob.engine.native.layers.attention import TorchPagedAttention
from batchjob.engine.native.layers.parallel import TensorParallel
from batchjob.engine.native.loading.model_loader import read_model_spec
from batchjob.engine.native.loading.sharding import check_tensor_parallel, param_shard, rank_spec
from batchjob.engine.native.models.decoder import CausalLM
from batchjob.job.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def moe_spec(tmp_path_factory):
    return read_model_spec(make_tiny_model(tmp_path_factory.mktemp("m") / "moe", arch="qwen3_moe"), "float32")


def held_rows(spec, name: str, size: int) -> Counter:
    """How many ranks hold each index of the full parameter `name` along its shard dimension."""
    held = Counter()
    for rank in range(size):
        shard = param_shard(name, spec, TensorParallel(rank, size))
        for seg in shard.segments:
            held.update(range(seg.full, seg.full + seg.length))
    return held


@pytest.mark.parametrize(("kv_heads", "size"), [(2, 2), (4, 2), (1, 2), (2, 4)])
def test_ranks_hold_every_qkv_row_and_replicate_only_kv_heads_fewer_than_ranks(moe_spec, kv_heads, size):
    spec = dataclasses.replace(moe_spec, num_heads=8, num_kv_heads=kv_heads)
    d = spec.head_dim
    held = held_rows(spec, "layers.0.self_attn.qkv_proj.weight", size)
    q_rows, kv_rows = 8 * d, kv_heads * d
    replication = max(size // kv_heads, 1)
    assert sorted(held) == list(range(q_rows + 2 * kv_rows))
    assert {held[i] for i in range(q_rows)} == {1}
    assert {held[i] for i in range(q_rows, q_rows + 2 * kv_rows)} == {replication}


def test_vocabulary_rows_are_split_with_padding_on_the_last_rank(moe_spec):
    spec = dataclasses.replace(moe_spec, vocab_size=511)
    held = held_rows(spec, "embed_tokens.weight", 2)
    assert sorted(held) == list(range(511)) and set(held.values()) == {1}
    last = param_shard("embed_tokens.weight", spec, TensorParallel(1, 2))
    assert last.segments[0].length == 255  # of 256 local rows: one padding row


def test_experts_are_split_along_their_intermediate_dimension_and_the_router_replicated(moe_spec):
    width = moe_spec.moe.intermediate_size
    held = held_rows(moe_spec, "layers.0.mlp.experts.gate_up_proj", 2)
    assert sorted(held) == list(range(2 * width)) and set(held.values()) == {1}
    assert param_shard("layers.0.mlp.experts.down_proj", moe_spec, TensorParallel(1, 2)).dim == 2
    assert param_shard("layers.0.mlp.gate.weight", moe_spec, TensorParallel(1, 2)) is None


def test_each_ranks_shard_has_the_shape_of_its_parameter_in_the_rank_model(moe_spec):
    tp = TensorParallel(1, 2)
    with torch.device("meta"):
        full = dict(CausalLM(moe_spec, TorchPagedAttention()).named_parameters())
        local = dict(CausalLM(rank_spec(moe_spec, tp), TorchPagedAttention(), tp).named_parameters())
    assert full.keys() == local.keys()
    for name, param in local.items():
        shard = param_shard(name, moe_spec, tp)
        if shard is None:
            assert param.shape == full[name].shape, name
        elif not shard.first_rank_only:
            assert shard.full_shape(tuple(param.shape)) == tuple(full[name].shape), name


def test_a_split_that_does_not_divide_names_every_dimension_it_fails(moe_spec):
    with pytest.raises(ValueError, match=r"does not divide its 4 attention heads or its 2 KV heads .* or its"):
        check_tensor_parallel(moe_spec, 3)
    check_tensor_parallel(moe_spec, 2)
