"""The engine's start-up on the device side: its steps' seconds, and the interpreter's switch interval, cut while
threads beside the start-up (the tokenizer's imports, weight readers, Triton's key) compete for the lock and
restored once the engine is ready."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from batchjob.engine import create_engine
from batchjob.engine.native.runtime import device_start
from batchjob.job.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama")


def test_start_up_cuts_the_switch_interval_and_restores_it(model_dir, monkeypatch):
    seen = []
    start_runner = device_start.start_runner

    def spy(*args, **kwargs):
        seen.append(sys.getswitchinterval())
        return start_runner(*args, **kwargs)

    monkeypatch.setattr("batchjob.engine.native.engine_start.start_runner", spy)
    before = sys.getswitchinterval()
    engine = create_engine("native", str(model_dir), {"dtype": "float32", "warmup": True})
    try:
        assert seen == [pytest.approx(device_start.STARTUP_SWITCH_INTERVAL_S)]
        assert sys.getswitchinterval() == before
        stats = engine.stats()
        assert stats["load_s"] > 0 and stats["kv_sizing_s"] >= 0 and stats["warmup_s"] > 0
        assert stats["startup_s"] >= stats["load_s"] + stats["kv_sizing_s"]
    finally:
        engine.close()


def test_a_shorter_interval_lets_a_waiting_thread_back_sooner_beside_a_busy_one():
    """What the cut buys: 100 waits without the lock, each followed by a little Python, beside a thread that only
    runs Python. At Python's default interval each return waits for the busy thread for up to 5 ms."""

    def waits_beside_a_busy_thread() -> float:
        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                sum(range(100))

        thread = threading.Thread(target=busy)
        thread.start()
        started = time.perf_counter()
        for _ in range(100):
            time.sleep(0.0005)
            sum(range(1000))
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join()
        return elapsed

    before = sys.getswitchinterval()
    default = waits_beside_a_busy_thread()
    with device_start.short_thread_switches():
        short = waits_beside_a_busy_thread()
    assert sys.getswitchinterval() == before
    assert short < default


def test_listing_the_kernel_variants_runs_every_start_up_step_and_leaves_the_model_as_it_was(model_dir):
    """The listing pass (runtime/precompile.py) runs the graphs' work uncaptured and the warm-up on a scratch
    runner; on CPU it lists nothing (no Triton kernel runs compiled there), but every step goes through, and the
    weights, torch's allocators and Triton's hooks are as before it."""
    import torch
    from triton import knobs

    from batchjob.engine.native.options import NativeOptions

    opts = NativeOptions(
        device="cpu", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, cuda_graphs=True, warmup=True
    )
    model, spec = device_start.load_on_device(model_dir, opts, torch.device("cpu"))
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    hooks = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    assert device_start.list_start_variants(model, spec, opts, torch.device("cpu")) == []
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == hooks
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == empty
