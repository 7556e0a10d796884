"""A model's tokenizer loads as transformers' AutoTokenizer loads it; once the class AutoTokenizer chose is kept,
a later load imports that class alone (not transformers' config and auto classes) and gives the same tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from batchjob.engine.transformers_import import KIND, load_tokenizer
from batchjob.job.tiny_model import make_tiny_model

TEXTS = ["Hello world", "  leading spaces and ünïcödé ✓", '{"a": [1, 2]}\n\ttab']
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / KIND


def _model(tmp_path: Path, arch: str, tokenizer_class: str | None) -> Path:
    model = make_tiny_model(tmp_path / f"{arch}-{tokenizer_class}", arch=arch)
    if tokenizer_class is not None:
        config_path = model / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    return model


def _same(a, b) -> None:
    assert type(a) is type(b)
    for special in (True, False):
        assert a(TEXTS, add_special_tokens=special)["input_ids"] == b(TEXTS, add_special_tokens=special)["input_ids"]
    ids = a(TEXTS[1])["input_ids"]
    assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert a.decode(ids) == b.decode(ids)
    assert a.all_special_tokens == b.all_special_tokens
    assert a.chat_template == b.chat_template
    render = dict(tokenize=False, add_generation_prompt=True)
    assert a.apply_chat_template(CHAT, **render) == b.apply_chat_template(CHAT, **render)


@pytest.mark.parametrize(
    ("arch", "tokenizer_class"),
    [("llama", None), ("qwen2", "Qwen2Tokenizer"), ("llama", "PreTrainedTokenizerFast"), ("gemma3", None)],
)
def test_a_kept_choice_loads_the_tokenizer_autotokenizer_loads(
    arch: str, tokenizer_class: str | None, entries: Path, tmp_path: Path
) -> None:
    model = _model(tmp_path, arch, tokenizer_class)
    reference = AutoTokenizer.from_pretrained(model)
    first = load_tokenizer(model)  # chooses through AutoTokenizer and keeps the choice
    assert len(list(entries.iterdir())) == 1
    kept = load_tokenizer(model)
    _same(first, reference)
    _same(kept, reference)


def test_a_kept_choice_imports_no_auto_classes(entries: Path, tmp_path: Path) -> None:
    model = _model(tmp_path, "llama", None)
    load_tokenizer(model)
    probe = (
        "import sys\n"
        "from batchjob.engine.transformers_import import load_tokenizer\n"
        f"tok = load_tokenizer({str(model)!r})\n"
        "print(type(tok).__name__, 'transformers.models.auto.tokenization_auto' in sys.modules, "
        "'transformers.generation' in sys.modules)\n"
    )
    env = {**os.environ, "BATCHJOB_CACHE": str(entries.parent)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == [type(AutoTokenizer.from_pretrained(model)).__name__, "False", "False"]


def test_a_changed_tokenizer_config_chooses_again(entries: Path, tmp_path: Path) -> None:
    model = _model(tmp_path, "qwen2", None)
    load_tokenizer(model)
    config_path = model / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(model)) is type(AutoTokenizer.from_pretrained(model))
    assert len(list(entries.iterdir())) == 2


@pytest.mark.parametrize(
    "entry",
    [
        "{broken",
        json.dumps({"module": "os", "name": "system"}),  # only transformers' own classes are ever imported
        json.dumps({"module": "transformers.no_such_module", "name": "X"}),
        json.dumps({"module": "transformers", "name": "NoSuchTokenizer"}),
        json.dumps(["transformers"]),
    ],
)
def test_an_unusable_entry_chooses_through_autotokenizer(entry: str, entries: Path, tmp_path: Path) -> None:
    model = _model(tmp_path, "llama", None)
    load_tokenizer(model)
    (path,) = entries.iterdir()
    path.write_text(entry)
    _same(load_tokenizer(model), AutoTokenizer.from_pretrained(model))
    assert json.loads(path.read_text())["module"].startswith("transformers.")  # chosen again and kept


def _distribution(site: Path, name: str, top_level: str) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(top_level + "\n")


def test_the_distributions_mapping_is_kept_until_a_distribution_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from importlib import metadata

    from batchjob.engine import transformers_import

    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    _distribution(site, "first_dist", "first_pkg")
    monkeypatch.syspath_prepend(str(site))
    computed = transformers_import._computed_packages_distributions
    first = transformers_import.kept_packages_distributions()
    assert first == computed() and first["first_pkg"] == ["first_dist"]
    entries = list((tmp_path / "cache" / transformers_import.PACKAGES_KIND).iterdir())
    assert len(entries) == 1

    def not_again() -> dict:
        raise AssertionError("computed again for an unchanged environment")

    monkeypatch.setattr(transformers_import, "_computed_packages_distributions", not_again)
    assert transformers_import.kept_packages_distributions() == first
    # Installing a distribution adds a folder to a sys.path folder: a new key, computed again.
    os.utime(site, ns=(1, 1))
    _distribution(site, "second_dist", "second_pkg")
    monkeypatch.setattr(transformers_import, "_computed_packages_distributions", computed)
    second = transformers_import.kept_packages_distributions()
    assert second["second_pkg"] == ["second_dist"] and second == metadata.packages_distributions()


def test_a_later_process_reads_the_kept_mapping_once_it_imports_transformers(entries: Path, tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        "from importlib import metadata\n"
        "if sys.argv[1] == 'later':\n"
        "    def listed():\n"
        "        raise SystemExit('the distributions were listed again')\n"
        "    metadata.packages_distributions = listed\n"
        "from batchjob.engine import transformers_import\n"
        "transformers_import.from_transformers('PreTrainedTokenizerFast')\n"
        "print(len(metadata.packages_distributions()['transformers']))\n"
    )
    env = {**os.environ, "BATCHJOB_CACHE": str(entries.parent)}
    work = tmp_path / "work"  # the probe's sys.path[0]: a folder nothing writes into, so the key stays
    work.mkdir()
    for run in ("first", "later"):
        done = subprocess.run(
            [sys.executable, "-c", probe, run], env=env, cwd=work, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["1"]
