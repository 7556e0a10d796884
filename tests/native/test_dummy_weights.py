"""engine.load_format=dummy: seeded random weights from config.json alone, for every family, reproducible."""

from __future__ import annotations

import pytest
import torch
from engine_cases import mixed_requests

from batchjob.engine import create_engine
from batchjob.engine.native.layers.elementwise import RMSNorm
from batchjob.engine.native.loading.dummy_weights import STD
from batchjob.job.tiny_model import ARCHITECTURES, make_tiny_model

OPTIONS = {
    "dtype": "float32",
    "load_format": "dummy",
    "detokenize": False,
    "max_model_len": 128,
    "num_kv_blocks": 64,
    "block_size": 8,
}


def config_only(model_dir):
    """The model directory without its weights (and, as in a benchmark, without its tokenizer)."""
    for path in model_dir.iterdir():
        if path.suffix == ".safetensors" or path.name.startswith("tokenizer"):
            path.unlink()
    return model_dir


@pytest.fixture(scope="module", params=ARCHITECTURES)
def config_dir(request, tmp_path_factory):
    return config_only(make_tiny_model(tmp_path_factory.mktemp("m") / request.param, arch=request.param))


def _tokens(model_dir) -> dict:
    engine = create_engine("native", str(model_dir), OPTIONS)
    try:
        return {c.id: c.token_ids for c in engine.generate(mixed_requests(6, seed=3, max_new=8))}
    finally:
        engine.close()


def test_dummy_engine_runs_every_family_without_weight_files_and_reproduces(config_dir):
    first = _tokens(config_dir)
    assert sorted(first) == list(range(6)) and all(first.values())
    assert _tokens(config_dir) == first


def test_dummy_weights_are_small_normals_and_identity_norms(config_dir):
    engine = create_engine("native", str(config_dir), OPTIONS)
    try:
        model = engine.model
        for name, module in model.named_modules():
            if isinstance(module, RMSNorm):
                assert torch.all(module.weight == 1.0 - module.offset), name
        weight = model.layers[0].self_attn.qkv_proj.weight
        assert abs(weight.std().item() - STD) < 0.2 * STD
        assert abs(weight.mean().item()) < 0.2 * STD
    finally:
        engine.close()


def test_auto_load_format_still_needs_the_weights(config_dir):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        create_engine("native", str(config_dir), {**OPTIONS, "load_format": "auto"})


def test_unknown_load_format_is_refused_before_loading(config_dir):
    with pytest.raises(ValueError, match="engine.load_format='random': choose auto"):
        create_engine("native", str(config_dir), {**OPTIONS, "load_format": "random"})
