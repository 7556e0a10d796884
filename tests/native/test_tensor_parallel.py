"""engine.tensor_parallel on CPU (two rank processes joined by gloo), in fp32: every family's greedy output is
the single-device engine's, with the asynchronous and the synchronous loop, through chunked prefill and
preemption, and with dummy weights."""

from __future__ import annotations

import pytest
from engine_cases import CASES, mixed_requests, open_ended, with_stops

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.job.tiny_model import make_tiny_model

BASE = dict(dtype="float32", num_kv_blocks=160, block_size=8, max_model_len=128)
# Chunked prompts and preemptions: 29 usable blocks of 4 tokens, 24-token steps.
TIGHT = dict(dtype="float32", num_kv_blocks=30, block_size=4, max_model_len=80, max_num_batched_tokens=24)
# Every family, plus a Llama with one KV head, which both ranks then hold (replicated).
TP_CASES = {**CASES, "llama_one_kv_head": ("llama", {"num_key_value_heads": 1})}


def tokens(model_dir, requests: list[Request], engine: str = "native", **options) -> dict:
    eng = create_engine(engine, str(model_dir), {**BASE, **options})
    try:
        return {c.id: c.token_ids for c in eng.generate(requests)}
    finally:
        eng.close()


def single_device_case(model_dir, max_new: int = 12, **options) -> tuple[list[Request], dict]:
    """Requests (a third of them stopping on a token mid-way) and what the single-device engine makes of them."""
    base = mixed_requests(16, seed=5, max_prompt=40, max_new=max_new)
    return with_stops(base, tokens(model_dir, base, **options))


@pytest.fixture(scope="module", params=TP_CASES)
def tp_case(request, tmp_path_factory):
    arch, overrides = TP_CASES[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / request.param, arch=arch, **overrides)
    requests, expected = single_device_case(model_dir)
    return model_dir, requests, expected


def test_tensor_parallel_2_greedy_output_equals_one_device(tp_case):
    model_dir, requests, expected = tp_case
    assert tokens(model_dir, requests, tensor_parallel=2) == expected


@pytest.mark.parametrize("arch", ["llama_one_kv_head", "qwen3_moe", "olmo2"])
def test_tensor_parallel_2_sync_loop_with_chunked_prefill_and_preemption_equals_one_device(arch, tmp_path, monkeypatch):
    family, overrides = TP_CASES[arch]
    model_dir = make_tiny_model(tmp_path / arch, arch=family, **overrides)
    # Outputs that outgrow the room the scheduler keeps free for each running sequence: some are preempted.
    open_ended(monkeypatch)
    requests, expected = single_device_case(model_dir, max_new=60, **TIGHT)
    # Poisoned host buffers on the ranks: a field the job process's message leaves out would corrupt a step.
    options = {**TIGHT, "tensor_parallel": 2, "debug_poison_slots": True}
    eng = create_engine("native_sync", str(model_dir), options)
    try:
        got = {c.id: c.token_ids for c in eng.generate(requests)}
        stats = eng.stats()
    finally:
        eng.close()
    assert got == expected
    assert stats["preemptions"] > 0 and stats["tensor_parallel"] == 2


def test_dummy_weights_are_the_same_model_whatever_the_tensor_parallel(tmp_path):
    model_dir = make_tiny_model(tmp_path / "qwen3", arch="qwen3")
    requests = mixed_requests(6, seed=8, max_new=8)
    assert tokens(model_dir, requests, load_format="dummy", tensor_parallel=2) == tokens(
        model_dir, requests, load_format="dummy"
    )


def test_seeded_sampling_draws_the_same_tokens_on_two_ranks_as_on_one_device(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    requests = [
        Request(i, r.prompt_ids, SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=i))
        for i, r in enumerate(mixed_requests(8, seed=9))
    ]
    assert tokens(model_dir, requests, tensor_parallel=2) == tokens(model_dir, requests)


def test_an_engine_serves_a_second_generate_after_the_first_was_abandoned(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    requests = mixed_requests(12, seed=10, max_new=16)
    expected = tokens(model_dir, requests)
    eng = create_engine("native", str(model_dir), {**BASE, "tensor_parallel": 2})
    try:
        stream = eng.generate(requests)
        next(stream)
        stream.close()  # steps in flight are dropped, as when a job is interrupted
        assert {c.id: c.token_ids for c in eng.generate(requests)} == expected
    finally:
        eng.close()


def test_a_tensor_parallel_that_does_not_divide_the_heads_is_refused_from_the_config(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")  # 4 heads, 2 KV heads
    from batchjob.engine.native.engine import NativeEngine

    with pytest.raises(ValueError, match="engine.tensor_parallel=3 does not divide its 4 attention heads"):
        NativeEngine.check_model(str(model_dir), {"tensor_parallel": 3})


def test_a_ranks_start_up_error_reaches_the_job_when_nobody_reads_stderr(tmp_path):
    """`... 2>&1 | tee log` with the tee gone: the ranks inherit a stderr whose writes fail; the job must still
    be told why a rank could not start (not "rank 0 exited with status 1", which reads as worth a rerun)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    script = (
        "import sys\n"
        "from batchjob.job.stderr import drop_stderr_when_unread\n"
        "drop_stderr_when_unread()\n"
        "from batchjob.engine import create_engine\n"
        "try:\n"
        "    create_engine('native', sys.argv[1], {'device': 'cpu', 'tensor_parallel': 2, 'num_kv_blocks': 2,\n"
        "                  'max_model_len': 256, 'dtype': 'float32'})\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, err)\n"
    )
    reader, writer = os.pipe()
    os.close(reader)
    try:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [sys.executable, "-c", script, str(model_dir)], stdout=subprocess.PIPE, stderr=writer, text=True,
            env=env, timeout=300,
        )  # fmt: skip
    finally:
        os.close(writer)
    assert done.returncode == 0
    assert "tensor-parallel rank 0 failed: batchjob.engine.api.EngineSetupError: the KV cache holds 1" in done.stdout


def test_a_constrained_request_fails_alone_on_a_tensor_parallel_engine(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    plain = mixed_requests(4, seed=11, max_new=6)
    constrained = Request("json", (5, 6, 7), SamplingParams(max_new_tokens=6, regex="[a-z]+"))
    eng = create_engine("native", str(model_dir), {**BASE, "tensor_parallel": 2})
    try:
        done = {c.id: c for c in eng.generate([*plain, constrained])}
    finally:
        eng.close()
    assert "not supported with engine.tensor_parallel=2" in done["json"].error
    assert {r.id: done[r.id].token_ids for r in plain} == tokens(model_dir, plain)


def test_a_ranks_own_device_passes_its_options_but_a_job_naming_one_gpu_is_refused(tmp_path):
    """Each rank runs its engine on `cuda:r` with the job's options; only the job may not pin one GPU."""
    from batchjob.engine.native.engine import NativeEngine
    from batchjob.engine.native.options import NativeOptions

    NativeOptions.from_mapping({"tensor_parallel": 2, "device": "cuda:1"})
    with pytest.raises(ValueError, match="engine.device=cuda:0 with engine.tensor_parallel=2: use engine.device=cuda"):
        NativeEngine.check_model(str(make_tiny_model(tmp_path / "m")), {"tensor_parallel": 2, "device": "cuda:0"})


def test_ranks_warm_up_through_the_same_layers_and_then_generate_as_one_device(tmp_path):
    # Six layers of two kinds: the warm-up runs three of them on each rank, and each layer all-reduces, so the
    # ranks meet in every collective only if they choose the same ones.
    model_dir = make_tiny_model(
        tmp_path / "gemma3", arch="gemma3", num_hidden_layers=6, sliding_window_pattern=3, layer_types=None
    )
    requests = mixed_requests(8, seed=3, max_prompt=30, max_new=8)
    small = dict(max_num_seqs=8, max_num_batched_tokens=64)
    warmed = tokens(model_dir, requests, tensor_parallel=2, warmup=True, **small)
    assert warmed == tokens(model_dir, requests, **small)
