"""A model's spec is read through transformers once per config, then taken from the cache: the same spec, for
any dtype and length a job asks, with no transformers import; an edited config, a broken entry or a read-only
cache fall back to reading the config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchjob.engine.native.loading.model_loader import read_model_spec
from batchjob.engine.native.models.spec_cache import spec_from_json, spec_to_json
from batchjob.engine.native.models.spec_key import spec_key
from batchjob.job.tiny_model import make_tiny_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "model-specs"


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3", "qwen3_moe", "smollm3"])
def test_a_kept_spec_is_the_spec_read_from_the_config(arch: str, cache: Path, tmp_path: Path) -> None:
    """Per-layer ropes and windows (Gemma 3), LongRoPE's factor lists (Phi-3), experts (Qwen3-MoE), layers
    without rope (SmolLM3): all survive the round trip through the cache."""
    model = make_tiny_model(tmp_path / arch, arch=arch)
    read = read_model_spec(model)
    assert list(cache.iterdir()) == [cache / f"{spec_key(model)}.json"]
    assert spec_from_json(json.loads(json.dumps(spec_to_json(read)))) == read
    kept = read_model_spec(model)
    assert kept == read
    assert read_model_spec(model, "float16", 64) == read_model_spec(model, "float16", 64)
    assert read_model_spec(model, "bfloat16", 64).dtype == torch.bfloat16
    assert read_model_spec(model, "auto", 64).max_model_len == 64


def test_a_job_reading_a_kept_spec_imports_no_transformers(cache: Path, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "llama")
    expected = read_model_spec(model, "auto", 128)
    probe = (
        "import sys, json\n"
        "from batchjob.engine.native.loading.model_loader import read_model_spec\n"
        "from batchjob.engine.native.models.spec_cache import spec_to_json\n"
        f"spec = read_model_spec({str(model)!r}, 'auto', 128)\n"
        "print(json.dumps({'transformers': 'transformers' in sys.modules, 'spec': spec_to_json(spec)}))\n"
    )
    env = {**os.environ, "BATCHJOB_CACHE": str(cache.parent)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["transformers"] is False
    assert spec_from_json(result["spec"]) == expected


def test_a_copied_model_keeps_its_own_directory(cache: Path, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "llama")
    read_model_spec(model)
    copy = Path(shutil.copytree(model, tmp_path / "copy"))
    assert read_model_spec(copy).model_dir == str(copy)
    assert len(list(cache.iterdir())) == 1  # the same config files: one entry


def test_an_edited_config_is_read_again(cache: Path, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "llama")
    assert read_model_spec(model).max_model_len == 1024
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    assert read_model_spec(model).max_model_len == 512
    (model / "generation_config.json").unlink()
    assert read_model_spec(model).eos_token_ids == (config["eos_token_id"],)
    assert len(list(cache.iterdir())) == 3


def test_a_broken_entry_is_read_again_and_replaced(cache: Path, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "llama")
    read = read_model_spec(model)
    entry = cache / f"{spec_key(model)}.json"
    for broken in ('{"architecture": "LlamaForCausalLM"}', "{not json", ""):
        entry.write_text(broken)
        assert read_model_spec(model) == read
        assert spec_from_json(json.loads(entry.read_text())) == read


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("BATCHJOB_CACHE", str(blocked / "cache"))  # under a file: no directory can be made
    model = make_tiny_model(tmp_path / "llama")
    assert read_model_spec(model).architecture == "LlamaForCausalLM"
    assert read_model_spec(model).architecture == "LlamaForCausalLM"


def test_a_kept_spec_still_refuses_a_length_beyond_the_model(cache: Path, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "llama")
    read_model_spec(model)
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds what .* supports \\(1024\\)"):
        read_model_spec(model, "auto", 4096)
    with pytest.raises(ValueError, match="unsupported dtype 'fp8'"):
        read_model_spec(model, "fp8")
