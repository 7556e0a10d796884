"""A run that cannot go ahead says why in one line and exits 2 before any model load, changing nothing."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jobtools import REPO, bookkeeping, cli_env, read_only, read_output, run_cli, tree_bytes, write_prompts


def assert_refused(done, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = done.stderr[done.stderr.index("error: ") :]
    for word in words:
        assert word in error


@pytest.fixture
def finished_job(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A complete job's output directory and the overrides that made it; its folder holds nothing else but
    the job's bookkeeping beside it."""
    out = tmp_path / "job" / "out"
    args = (f"data.path={write_prompts(tmp_path / 'p.parquet', 3)}", f"output.dir={out}")
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    return out, args


def test_a_corrupt_parquet_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "prompts.parquet"
    bad.write_bytes(b"this is not parquet")
    done = run_cli(f"data.path={bad}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, str(bad), "is not a readable Parquet file", "replace it")
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


def test_a_parquet_file_with_two_columns_of_one_name_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["Hi"]), pa.array(["Hello"])], names=["prompt", "prompt"]), bad)
    done = run_cli(f"data.path={bad}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, str(bad), "more than one column named 'prompt'", "rename them")
    assert not (tmp_path / "out").exists()


def test_parquet_files_typing_a_column_differently_are_named_before_the_model_loads(tmp_path: Path) -> None:
    write_prompts(tmp_path / "data" / "a.parquet", 2, n=[1, 2])
    write_prompts(tmp_path / "data" / "b.parquet", 2, n=["x", "y"])
    done = run_cli(f"data.path={tmp_path / 'data'}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, "column 'n' is int64 in", "but string in", "write it with one type in every file")
    assert not (tmp_path / "out").exists()


def test_a_json_lines_file_with_a_broken_line_is_one_line_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "Hello"}\n{"prompt": "unterminated\n{"prompt": "World"}\n')
    done = run_cli(f"data.path={bad}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, str(bad), "line 2 is not JSON", "fix or delete that line")
    assert done.stderr.count("\n") == 1, done.stderr  # no log lines of the datasets builder around it
    assert not (tmp_path / "out").exists()


def test_pickle_only_weights_are_refused_by_the_native_engine_before_loading(tmp_path: Path, model_dir: str) -> None:
    import torch
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled-model"
    shutil.copytree(model_dir, pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    done = run_cli("engine=native", f"model.path={pickled}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, "pickle weights", "Convert it once", "save_pretrained")
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_a_truncated_copy_of_the_weights_is_refused_before_loading(tmp_path: Path, model_dir: str, engine: str) -> None:
    cut = tmp_path / "cut-model"
    shutil.copytree(model_dir, cut)
    weights = cut / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 1000)  # a copy that stopped early
    done = run_cli(f"engine={engine}", f"model.path={cut}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, str(weights), f"{size - 1000:,} bytes", f"{size:,}", "truncated", "copy or download it again")
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


@pytest.mark.parametrize("engine", ["hf", "native", "native_sync"])
def test_a_gpu_this_machine_does_not_have_is_refused_before_loading(tmp_path: Path, engine: str) -> None:
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last visible GPU; without CUDA, any GPU
    done = run_cli(f"engine={engine}", f"engine.device={missing}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, f"engine.device={missing} but ", "use engine.device=")
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


def test_a_flash_attention_that_cannot_run_here_is_refused_as_the_engine_starts(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("FlashAttention 2 may run here")
    done = run_cli("engine.attn_implementation=flash_attention_2", f"output.dir={tmp_path / 'out'}")
    assert_refused(
        done, "engine.attn_implementation=flash_attention_2 cannot run this model here (", "attn_implementation=sdpa"
    )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_model_without_tokenizer_files_says_so(tmp_path: Path, model_dir: str) -> None:
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(model_dir, bare)
    for file in bare.glob("tokenizer*"):
        file.unlink()
    done = run_cli(f"model.path={bare}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, f"model.path={bare} has no tokenizer files", "tokenizer.json")
    assert "sentencepiece" not in done.stderr


def test_a_tokenizer_json_cut_short_is_named(tmp_path: Path, model_dir: str) -> None:
    cut = tmp_path / "cut-tokenizer"
    shutil.copytree(model_dir, cut)
    tokenizer = cut / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:500])  # a download that stopped early
    done = run_cli(f"model.path={cut}", f"output.dir={tmp_path / 'out'}")
    assert_refused(done, f"model.path={cut}: {tokenizer} is not valid JSON (line ", "download it again")


def test_an_output_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "results"
    file.write_text("not a directory")
    done = run_cli(f"output.dir={file}")
    assert_refused(done, f"output.dir={file} is a file")
    assert file.read_text() == "not a directory"


def test_an_output_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    done = run_cli(f"output.dir={tmp_path / 'file' / 'out'}")
    assert_refused(done, "cannot be written", "set output.dir to a writable directory")


def test_an_output_dir_on_a_read_only_mount_is_refused(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    mount.mkdir()
    with read_only(mount) as prefix:
        done = run_cli(f"output.dir={mount / 'out'}", prefix=prefix)
    assert_refused(done, "cannot be written", "set output.dir to a writable directory")
    assert not (mount / "out").exists()


def test_rerunning_a_finished_job_in_a_read_only_directory_reports_it_complete(finished_job) -> None:
    out, args = finished_job
    before = tree_bytes(out.parent)
    with read_only(out.parent) as prefix:
        done = run_cli(*args, prefix=prefix)
    assert done.returncode == 0, done.stderr
    assert "already complete" in done.stderr
    assert tree_bytes(out.parent) == before


def test_a_refused_rerun_keeps_the_saved_config_and_log_of_the_job_it_refused(finished_job) -> None:
    out, args = finished_job
    saved = bookkeeping(out) / "_hydra" / "shard-0-of-1"
    assert "max_new_tokens: 4" in (saved / ".hydra" / "config.yaml").read_text()
    assert "done: 3 rows" in (saved / "batchjob.log").read_text()
    before = tree_bytes(out.parent)
    done = run_cli(*args, "sampling.max_new_tokens=5")
    assert_refused(done, "records a different job")
    assert tree_bytes(out.parent) == before


def test_a_multirun_over_output_dirs_leaves_no_folder_named_after_the_default(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.parquet", 2)
    done = run_cli(f"data.path={prompts}", f"output.dir={tmp_path / 'a'},{tmp_path / 'b'}", flags=("-m",), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for out in (tmp_path / "a", tmp_path / "b"):
        assert (bookkeeping(out) / "_SUCCESS").exists()
        assert (bookkeeping(out) / "_hydra" / "shard-0-of-1" / ".hydra" / "config.yaml").exists()
    assert not (tmp_path / "outputs").exists()
    # Hydra's record of the sweep as a whole goes where Hydra puts it when there is no single output.dir.
    assert len(list((tmp_path / "multirun").glob("*/multirun.yaml"))) == 1


# What a refusal of a bad input, config or model file must not wait for: seconds of imports on a busy machine.
HEAVY_MODULES = re.compile(r"^(torch|transformers|datasets|batchjob\.engine\.(native\.engine|hf))(\.|$)")


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("data.path=/nonexistent/prompts.parquet", "no such file or directory: /nonexistent/prompts.parquet"),
        ("data.prompt_column=question", "no column 'question'"),
        ("engine.max_num_seqs=0", "engine.max_num_seqs=0: must be >= 1"),
        ("data.path=${nope}", "data.path=${nope}: the config has no key nope"),
        ("model.path=BROKEN", "BROKEN/config.json is not valid JSON"),
    ],
    ids=[
        "missing data file",
        "missing column",
        "bad engine option",
        "unresolvable interpolation",
        "broken config.json",
    ],
)
def test_a_bad_input_config_or_model_file_is_refused_before_torch_is_imported(
    tmp_path: Path, model_dir: str, override: str, words: str
) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(model_dir, broken)
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    override, words = (text.replace("BROKEN", str(broken)) for text in (override, words))
    # `-X importtime` lists every module the process imports, on stderr, as it imports it.
    command = [sys.executable, "-X", "importtime", "-m", "batchjob", override, f"output.dir={tmp_path / 'out'}"]
    done = subprocess.run(command, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    imported = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2, done.stderr
    assert len(said) == 1 and said[0].startswith("error: ") and words in said[0], said  # no "running <engine>" line
    assert "batchjob.job.checks" in imported  # the list is the job's, through its checks
    assert not [name for name in imported if HEAVY_MODULES.match(name)]


# A GPU job's start-up as it runs on a CPU: config.json read without transformers, the engine's first results held
# until transformers' reading (in a process beside) has been compared; here the native reading is made wrong.
WRONG_NATIVE_READING = """
import runpy, sys
from batchjob.engine.native.models import config_json, spec_check
spec_check.NATIVE_READING_DEVICES = frozenset({"cuda", "cpu"})
family = config_json.FAMILIES["Qwen2ForCausalLM"]
derive = lambda config: (family[2](config), config.update(rms_norm_eps=0.5))
config_json.FAMILIES["Qwen2ForCausalLM"] = (family[0], family[1], derive, family[3])
sys.argv = ["batchjob", *sys.argv[1:]]
runpy.run_module("batchjob", run_name="__main__")
"""


def test_a_native_config_reading_that_transformers_contradicts_commits_nothing_and_the_rerun_runs(
    tmp_path: Path,
) -> None:
    from batchjob.job.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "qwen2", arch="qwen2")
    out = tmp_path / "out"
    job = ["engine=native", f"model.path={model}", f"data.path={write_prompts(tmp_path / 'p.parquet', 5)}"]
    env = {**cli_env(), "BATCHJOB_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-c", WRONG_NATIVE_READING, *job, f"output.dir={out}", "sampling.max_new_tokens=4"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert_refused(done, "otherwise than transformers does (rms_norm_eps: 0.5 against 1e-05)", "run the command again")
    assert not list(out.glob("**/*.parquet")), "no row of a wrongly read model is committed"
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr  # transformers' reading, kept in the spec cache
    assert read_output(out).column("row_id").to_pylist() == list(range(5))
