"""The config as a new user meets it on the command line: presets of their own, typos, --help."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from jobtools import bookkeeping, read_output, read_report, run_cli, write_table

import batchjob
from batchjob.errors import ConfigError

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
    assert json.loads((bookkeeping(out) / "_job.json").read_text())["provenance"]["model_path"] == model_dir


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


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (("engine=hf", "engine.quantization=fp8"), "it is an option of engine=native"),
        (("engine=native", "engine.enforce_eager=true"), "it goes with engine=vllm as +engine.enforce_eager=VALUE"),
    ],
    ids=["native option with hf", "vLLM argument with native"],
)
def test_an_option_the_chosen_backend_does_not_have_names_the_backend_that_does(
    tmp_path: Path, overrides: tuple[str, ...], fix: str
) -> None:
    done = run_cli(f"output.dir={tmp_path / 'out'}", *overrides)
    key = overrides[1].split("=")[0]
    assert_refused(done, f"unknown key {key}: {overrides[0]} has no such option", fix)
    assert "add it with +" not in done.stderr  # the backend would refuse it then


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


@dataclass(frozen=True)
class Broken:
    """A config or model directory that cannot run, and the words its one-line refusal must hold (MODEL: the
    model directory's path)."""

    words: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    preset: str | None = None  # the text of a preset data/mine.yaml in a search-path folder, run with data=mine
    model_file: tuple[str, bytes] | None = None  # a copy of the tiny model with this file holding these bytes


TRUNCATED_CONFIG = b'{\n  "architectures": ["LlamaForCausalLM"],\n  "hidden_size": '
BROKEN = {
    "an interpolation of no key": Broken(
        ("data.path=${nope}", "no key nope to refer to", "give the value itself"), overrides=("data.path=${nope}",)
    ),
    "an interpolation of no resolver": Broken(
        ("data.path=${nope:x}", "no resolver named nope"), overrides=("data.path=${nope:x}",)
    ),
    "an unset environment variable": Broken(
        ("BATCHJOB_UNSET_VARIABLE", "cannot be resolved", "give the value itself"),
        overrides=("data.path=${oc.env:BATCHJOB_UNSET_VARIABLE}",),
    ),
    "an interpolation of a key inside the config": Broken(
        ("sampling.seed=${data.nothere}", "no key data.nothere"), overrides=("sampling.seed=${data.nothere}",)
    ),
    "a value left unset": Broken(("data.path is not set (???)", "set data.path=VALUE"), overrides=("data.path=???",)),
    "a preset that is not YAML": Broken(
        ("mine.yaml is not valid YAML (line 2, column 4", "fix the file"), preset="path: [unclosed\n  x: : y\n"
    ),
    "a preset indented with a tab": Broken(
        ("mine.yaml is not valid YAML (line 2, column 1", "'\\t'"), preset="path: x\n\tprompt_column: y\n"
    ),
    "a preset holding a list": Broken(("data/mine.yaml holds a list", "`key: value` lines"), preset="- a\n- b\n"),
    "a preset with an unclosed interpolation": Broken(
        ("${...} that cannot be parsed", "escape a literal $ as \\$"), preset="path: a${b\n"
    ),
    "a truncated config.json": Broken(
        ("model.path=MODEL: MODEL/config.json is not valid JSON (line 3, column 18", "download it again"),
        model_file=("config.json", TRUNCATED_CONFIG),
    ),
    "an empty config.json": Broken(
        ("MODEL/config.json is empty", "download it again"), model_file=("config.json", b"")
    ),
    "a config.json holding a list": Broken(
        ("MODEL/config.json holds an array, not a JSON object",), model_file=("config.json", b"[1, 2]")
    ),
    "a config.json that is not text": Broken(
        ("MODEL/config.json is not UTF-8 text",), model_file=("config.json", b'{"a": "\xff\xfe"}')
    ),
    "a broken tokenizer_config.json": Broken(
        ("MODEL/tokenizer_config.json is not valid JSON (line 1, column 2",),
        model_file=("tokenizer_config.json", b"{tokenizer_class: x}"),
    ),
    "a broken generation_config.json": Broken(
        ("MODEL/generation_config.json is not valid JSON",), model_file=("generation_config.json", b'{"eos": 2,}')
    ),
    "a broken weight index": Broken(
        ("MODEL/model.safetensors.index.json is not valid JSON",),
        model_file=("model.safetensors.index.json", b'{"weight_map": {'),
    ),
}


def broken_setup(case: Broken, tmp_path: Path, model_dir: str) -> tuple[list[str], tuple[str, ...]]:
    """The overrides that run `case` (beside a fresh output.dir), and its words with MODEL filled in."""
    overrides = [*case.overrides, f"output.dir={tmp_path / 'out'}"]
    words = case.words
    if case.preset is not None:
        conf = write_presets(tmp_path / "conf", {"data/mine": case.preset})
        overrides += [f"hydra.searchpath=[file://{conf}]", "data=mine"]
    if case.model_file is not None:
        model = tmp_path / "model"
        shutil.copytree(model_dir, model)
        name, content = case.model_file
        (model / name).write_bytes(content)
        overrides.append(f"model.path={model}")
        words = tuple(word.replace("MODEL", str(model)) for word in words)
    return overrides, words


@pytest.mark.parametrize("case", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_config_or_model_file_is_refused_in_one_line_naming_it(
    tmp_path: Path, model_dir: str, case: Broken
) -> None:
    overrides, words = broken_setup(case, tmp_path, model_dir)
    done = run_cli(*overrides)
    assert_refused(done, *words)
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


@pytest.mark.parametrize("case", BROKEN.values(), ids=BROKEN.keys())
def test_the_python_api_raises_a_config_error_with_the_same_line(tmp_path: Path, model_dir: str, case: Broken) -> None:
    overrides, words = broken_setup(case, tmp_path, model_dir)
    with pytest.raises(ConfigError) as refused:
        batchjob.run(*overrides, "engine=hf")
    assert all(word in str(refused.value) for word in words), str(refused.value)
    assert "\n" not in str(refused.value)


def test_help_gives_each_key_its_own_comment_and_not_the_heading_below_it() -> None:
    described = help_lines()
    assert described["sampling.logprobs"].endswith("(chosen token log-probabilities)")
    assert described["output.dir"].endswith("go beside it, in <output.dir>.batchjob/")  # a comment's second line
