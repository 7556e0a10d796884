"""load_tokenizer: what AutoTokenizer gives, without importing transformers' model registry when the
checkpoint names the generic fast tokenizer class."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from batchjob.engine.tokenizer import load_tokenizer
from batchjob.tiny_model import make_tiny_model

TEXTS = ["Hello world, a plain prompt.", "  spaces\tand\nnewlines  ", "ünïcödé ✓ 123"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama")


def _same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert [ours.encode(t) for t in TEXTS] == [theirs.encode(t) for t in TEXTS]
    assert ours.all_special_ids == theirs.all_special_ids
    messages = [{"role": "user", "content": TEXTS[0]}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == theirs.apply_chat_template(
        messages, add_generation_prompt=True
    )


def test_a_generic_fast_tokenizer_loads_as_auto_tokenizer_would(model_dir):
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    _same_tokenizer(load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir))


def test_a_model_specific_tokenizer_class_goes_through_auto_tokenizer(model_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    _same_tokenizer(load_tokenizer(other), AutoTokenizer.from_pretrained(other))


def test_the_generic_path_skips_the_model_registry(model_dir):
    code = (
        "import sys; from batchjob.engine.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(model_dir)!r}); print('transformers.models.auto' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"
