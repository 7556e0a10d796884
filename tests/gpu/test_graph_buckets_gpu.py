"""Decode buckets chosen by replay time on a GPU: every captured decode graph is timed, the buckets steps pad to
are the ones no larger bucket beats, and steps whose own bucket was dropped replay a larger graph with the
output an eager engine gives.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu/test_graph_buckets_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine import Request, SamplingParams, create_engine  # noqa: E402
from batchjob.engine.native.runtime import graphs  # noqa: E402
from batchjob.engine.native.runtime.step_layout import decode_buckets, fastest_buckets  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu
OPTIONS = {"dtype": "float32", "max_num_seqs": 64, "num_kv_blocks": 512}


def _generate(engine, rows: int) -> dict:
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)
    return {c.id: c.token_ids for c in engine.generate([Request(i, (7 + i, 20, 30), params) for i in range(rows)])}


def test_every_decode_graph_is_timed_and_the_buckets_kept_are_the_fastest(tmp_path):
    engine = create_engine("native", str(make_tiny_model(tmp_path / "llama", arch="llama")), OPTIONS)
    try:
        timed = engine.runner.graphs.decode_seconds
        assert sorted(timed) == decode_buckets(64) and all(t > 0 for t in timed.values())
        kept = engine.runner.graph_buckets.decode
        assert kept == fastest_buckets(timed) and kept[-1] == 64
        assert engine.stats()["decode_buckets"] == len(kept)
    finally:
        engine.close()


def test_steps_of_a_dropped_bucket_pad_to_a_larger_graph_and_generate_what_eager_steps_do(tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    monkeypatch.setattr(graphs, "fastest_buckets", lambda seconds: tuple(b for b in seconds if b not in (16, 48)))
    graphed = create_engine("native", str(model_dir), OPTIONS)
    eager = create_engine("native", str(model_dir), {**OPTIONS, "cuda_graphs": False})
    try:
        assert 16 not in graphed.runner.graph_buckets.decode and 32 in graphed.runner.graph_buckets.decode
        for rows in (9, 16, 40, 48):  # into 32 and 64 in place of 16 and 48
            assert _generate(graphed, rows) == _generate(eager, rows), rows
        assert graphed.stats()["eager_steps"] == 0
    finally:
        graphed.close()
        eager.close()
