"""What the engine says when the GPU has no room for a KV cache."""

from __future__ import annotations

from batchjob.engine.native.runtime.kv_cache import no_room_for_kv_cache

GIB = 2**30


def test_memory_held_by_another_process_is_named() -> None:
    message = no_room_for_kv_cache(peak=int(0.2 * GIB), outside=120 * GIB, total=140 * GIB, utilization=0.9)
    assert "120.0 GiB of it is held outside this engine" in message and "nvidia-smi" in message
    assert "126.0 GiB of 140.0 GiB" in message and "0.2 GiB" in message


def test_a_model_too_large_for_the_budget_names_the_knobs_only() -> None:
    message = no_room_for_kv_cache(peak=70 * GIB, outside=GIB // 2, total=80 * GIB, utilization=0.5)
    assert "held outside" not in message
    assert "engine.gpu_memory_utilization=0.5" in message and "engine.max_num_batched_tokens" in message
