"""The config as a new user meets it on the command line: presets of their own, typos, --help."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from jobtools import bookkeeping, read_output, read_report, run_cli, write_table

QUESTIONS = ["What is a cat?", "Why is the sky blue?", "Name a prime."]


def write_presets(root: Path, presets: dict[str, str]) -> Path:
    """`{"data/mine": "path: ..."}` -> root/data/mine.yaml; returns root, for --config-dir."""
    for name, text in presets.items():
        path = root / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def assert_refused(done, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = done.stderr.strip()
    assert error.startswith("error: ") and "\n" not in error, error
    for word in words:
        assert word in error


def test_presets_holding_only_the_keys_they_change_work_for_every_group(tmp_path: Path, model_dir: str) -> None:
    data = write_table(tmp_path / "q.parquet", {"question": QUESTIONS, "source": ["a", "b", "c"]})
    conf = write_presets(
        tmp_path / "conf",
        {
            "model/mine": f"path: {model_dir}\n",
            "data/mine": f"path: {data}\nprompt_column: question\n",
            "engine/mine": "name: hf\nmax_batch_size: 2\n",
            "output/mine": "commit_every_rows: 2\n",
        },
    )
    out = tmp_path / "out"
    done = run_cli(
        "model=mine", "data=mine", "engine=mine", "output=mine", f"output.dir={out}", flags=("--config-dir", str(conf))
    )
    assert done.returncode == 0, done.stderr
    table = read_output(out)
    assert table.column("row_id").to_pylist() == [0, 1, 2]
    assert table.column("error").null_count == 3
    assert table.column("source").to_pylist() == ["a", "b", "c"]  # data.passthrough_columns from the defaults
    assert read_report(out)["engine"]["name"] == "hf"
    assert len(list(out.glob("part-*.parquet"))) == 2  # output.commit_every_rows=2 over 3 rows
    assert json.loads((bookkeeping(out) / "_job.json").read_text())["model"]["path"] == model_dir


def test_cfg_job_shows_a_partial_preset_over_the_defaults(tmp_path: Path) -> None:
    conf = write_presets(tmp_path / "conf", {"data/mine": "prompt_column: question\n"})
    shown = run_cli("data=mine", flags=("--config-dir", str(conf), "--cfg", "job"))
    assert shown.returncode == 0, shown.stderr
    assert "prompt_column: question" in shown.stdout
    assert "passthrough_columns: null" in shown.stdout
    assert "batch_rows: 1024" in shown.stdout


@pytest.mark.parametrize(
    ("override", "closest"),
    [
        ("+data.prompt_colum=question", "data.prompt_column"),
        ("+output.dirr=elsewhere", "output.dir"),
        ("+resum=false", "resume"),
        ("sampling.max_new_token=8", "sampling.max_new_tokens"),  # Hydra's own hint would be to add `+`
        ("engine.max_batch_siz=8", "engine.max_batch_size"),
        ("+engine.max_batch_siz=8", "engine.max_batch_size"),
    ],
)
def test_an_unknown_key_is_refused_naming_the_closest_valid_one(tmp_path: Path, override: str, closest: str) -> None:
    done = run_cli(f"output.dir={tmp_path / 'out'}", override)
    assert_refused(done, override.lstrip("+").split("=")[0], f"did you mean {closest}?")
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


def test_an_unknown_key_in_a_preset_file_is_refused(tmp_path: Path) -> None:
    conf = write_presets(tmp_path / "conf", {"data/typo": "prompt_colum: question\n"})
    done = run_cli("data=typo", f"output.dir={tmp_path / 'out'}", flags=("--config-dir", str(conf)))
    assert_refused(done, "unknown key data.prompt_colum", "did you mean data.prompt_column?")


def test_an_option_a_partial_engine_preset_leaves_out_is_set_with_a_plus(tmp_path: Path) -> None:
    conf = write_presets(tmp_path / "conf", {"engine/small": "name: hf\nmax_batch_size: 2\n"})
    done = run_cli("engine=small", "engine.lookahead=2", flags=("--config-dir", str(conf)))
    assert_refused(done, "engine.lookahead is not in this engine preset", "+engine.lookahead=VALUE")
    shown = run_cli("engine=small", "+engine.lookahead=2", flags=("--config-dir", str(conf), "--cfg", "job"))
    assert shown.returncode == 0, shown.stderr
    assert "lookahead: 2" in shown.stdout


def test_an_engine_option_of_another_backend_is_refused(tmp_path: Path) -> None:
    done = run_cli(f"output.dir={tmp_path / 'out'}", "+engine.max_num_seqs=8")  # a native option, engine=hf
    assert_refused(done, "unknown hf engine option(s) engine.max_num_seqs")


def test_an_unknown_preset_lists_the_available_ones(tmp_path: Path) -> None:
    done = run_cli(f"output.dir={tmp_path / 'out'}", "model=nosuch")
    assert_refused(done, "model=nosuch: no such preset", "qwen2.5-0.5b-instruct, tiny", "--config-dir")


def test_a_value_of_the_wrong_type_names_the_key(tmp_path: Path) -> None:
    done = run_cli(f"output.dir={tmp_path / 'out'}", "sampling.max_new_tokens=abc")
    assert_refused(done, "sampling.max_new_tokens='abc': must be an integer")
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("override", "value"),
    [
        ("sampling.regex=[a-z]+-\\d{2}", "[a-z]+-\\d{2}"),
        ('sampling.json_schema={"type":"object"}', '{"type":"object"}'),
    ],
    ids=["regex", "inline JSON"],
)
def test_a_value_hydra_cannot_read_is_refused_with_the_quoting_that_works(tmp_path: Path, override: str, value: str):
    done = run_cli(f"output.dir={tmp_path / 'out'}", override)
    assert_refused(done, "Hydra cannot read this value", "quote it for Hydra inside the shell's quotes")
    # The quoting the message gives, as the shell hands it over, yields the value.
    quoted = re.search(r"inside the shell's quotes, (\S+)", done.stderr).group(1).rstrip(",")
    argument = shlex.split(quoted)[0]
    shown = run_cli(f"output.dir={tmp_path / 'out'}", argument, flags=("--cfg", "job"))
    assert shown.returncode == 0, shown.stderr
    key = override.partition("=")[0].rpartition(".")[2]
    assert yaml.safe_load(shown.stdout)["sampling"][key] == value


def test_a_decimal_comma_is_refused_naming_the_decimal_point_and_the_list(tmp_path: Path) -> None:
    done = run_cli(f"output.dir={tmp_path / 'out'}", "sampling.temperature=0,7")
    assert_refused(done, "sampling.temperature=0,7:", "sampling.temperature=0.7", "sampling.temperature=[0,7]")
    assert not (tmp_path / "out").exists()


def help_lines(*overrides: str) -> dict[str, str]:
    shown = run_cli(*overrides, flags=("--help",))
    assert shown.returncode == 0, shown.stderr
    keys = re.findall(r"^  ([\w.]+)=(\S*) *(.*)$", shown.stdout, flags=re.MULTILINE)
    return {key: meaning for key, _, meaning in keys}


@pytest.mark.parametrize("engine", ["auto", "native", "hf"])
def test_help_lists_every_key_with_what_it_means(engine: str) -> None:
    described = help_lines(f"engine={engine}")
    for key in ("model.path", "data.prompt_column", "sampling.max_new_tokens", "output.dir", "resume", "engine.dtype"):
        assert key in described
    assert not [key for key, meaning in described.items() if not meaning]
    assert ("engine.max_num_seqs" in described) == (engine != "hf")
    assert ("engine.hf.max_batch_size" in described) == (engine == "auto")
