"""`engine=auto` (the default) runs the native engine where it supports the model's architecture and hf
otherwise, saying which and why; an explicit `engine=native` on an architecture it cannot run is a config error
(exit 2, no traceback) found before the output is locked."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from jobtools import CONF_DIR, REPO, bookkeeping, cli_env, job_config, read_output, read_report, write_prompts

from batchjob.cluster.slurm import register_resolvers
from batchjob.engine import choose_backend
from batchjob.engine.vllm_options import vllm_device
from batchjob.job.run import run_job
from batchjob.job.tiny_model import train_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# vLLM installed with a device to run on: there engine=auto falls back to vllm rather than hf
VLLM_RUNS = HAS_VLLM and bool(vllm_device())


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """A tiny GPT-2: an architecture only the hf engine runs."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    tokenizer = train_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=256,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gpt2")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run(*overrides: str) -> int:
    """The job in this process with the packaged defaults (engine=auto) and 4 new tokens per row."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=["sampling.max_new_tokens=4", *overrides])
    return run_job(cfg)


def test_auto_runs_the_native_engine_on_a_supported_architecture_and_says_why(
    tmp_path: Path, model_dir: str, caplog
) -> None:
    data = write_prompts(tmp_path / "p.parquet", 3)
    with caplog.at_level(logging.INFO, logger="batchjob"):
        code = run(f"model.path={model_dir}", f"data.path={data}", f"output.dir={tmp_path / 'o'}")

    assert code == 0
    assert "engine=auto: running native, since the native engine supports LlamaForCausalLM" in caplog.text
    assert read_report(tmp_path / "o")["engine"]["name"] == "native"
    assert read_output(tmp_path / "o").num_rows == 3


@pytest.mark.skipif(VLLM_RUNS, reason="vLLM runs here: engine=auto falls back to vllm")
def test_auto_falls_back_to_hf_on_an_unsupported_architecture_and_says_why(
    tmp_path: Path, gpt2_dir: Path, caplog
) -> None:
    data = write_prompts(tmp_path / "p.parquet", 3)
    with caplog.at_level(logging.INFO, logger="batchjob"):
        code = run(f"model.path={gpt2_dir}", f"data.path={data}", f"output.dir={tmp_path / 'o'}")

    assert code == 0
    assert "engine=auto: running hf, since the native engine cannot run it" in caplog.text
    assert "architecture GPT2LMHeadModel is not supported" in caplog.text
    assert read_report(tmp_path / "o")["engine"]["name"] == "hf"
    assert read_output(tmp_path / "o").num_rows == 3


@pytest.mark.skipif(not VLLM_RUNS, reason="needs vLLM (pip install 'batchjob[vllm]') and a GPU it runs on")
def test_auto_falls_back_to_vllm_where_it_is_installed_and_says_why(gpt2_dir: Path) -> None:
    choice = choose_backend("auto", str(gpt2_dir), {"dtype": "bfloat16", "max_num_seqs": 64, "tensor_parallel": 1})
    assert choice.name == "vllm"
    assert choice.options == {"dtype": "bfloat16", "tensor_parallel": 1}  # max_num_seqs is the native engine's
    assert "architecture GPT2LMHeadModel is not supported" in choice.reason and "vLLM 0." in choice.reason


@pytest.mark.skipif(VLLM_RUNS, reason="vLLM runs here: engine=auto falls back to vllm")
def test_the_hf_fallback_takes_its_options_from_engine_hf(tmp_path: Path, gpt2_dir: Path, capsys) -> None:
    data = write_prompts(tmp_path / "p.parquet", 3)

    code = run(f"model.path={gpt2_dir}", f"data.path={data}", f"output.dir={tmp_path / 'o'}", "engine.hf.lookahead=0")

    assert code == 2
    assert "engine.hf.lookahead must be a positive integer" in capsys.readouterr().err


@pytest.mark.skipif(VLLM_RUNS, reason="engine=auto falls back to vllm here")
def test_an_attention_the_hf_fallback_cannot_load_is_named_as_engine_auto_spells_it(
    tmp_path: Path, gpt2_dir: Path, capsys
) -> None:
    data = write_prompts(tmp_path / "p.parquet", 3)
    overrides = (f"model.path={gpt2_dir}", f"data.path={data}", f"output.dir={tmp_path / 'o'}")

    code = run(*overrides, "engine.hf.attn_implementation=flash_attention_2", "engine.device=cpu")

    assert code == 2
    err = capsys.readouterr().err
    assert "engine.hf.attn_implementation=flash_attention_2 cannot run this model here" in err
    assert "use engine.hf.attn_implementation=sdpa or eager" in err


def test_explicit_native_engine_on_an_unsupported_architecture_exits_2_before_locking_the_output(
    tmp_path: Path, gpt2_dir: Path
) -> None:
    data = write_prompts(tmp_path / "p.parquet", 3)
    out = tmp_path / "o"
    command = [sys.executable, "-m", "batchjob", "engine=native", f"model.path={gpt2_dir}", f"data.path={data}"]
    done = subprocess.run(
        [*command, f"output.dir={out}"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120
    )

    assert done.returncode == 2
    assert "architecture GPT2LMHeadModel is not supported by the native engine" in done.stderr
    assert "run it with engine=hf" in done.stderr
    assert "Traceback" not in done.stderr
    # A refused run writes nothing: no output dataset, no lock, not even Hydra's files.
    assert not out.exists() and not bookkeeping(out).exists()


def test_a_job_auto_ran_natively_resumes_under_an_explicit_engine_native(tmp_path: Path, model_dir: str) -> None:
    data = write_prompts(tmp_path / "p.parquet", 3)
    args = (f"model.path={model_dir}", f"data.path={data}", f"output.dir={tmp_path / 'o'}")
    assert run(*args) == 0

    assert run(*args, "engine=native") == 0
    assert read_output(tmp_path / "o").num_rows == 3


@pytest.mark.parametrize(
    ("overrides", "captured"),
    [
        ((), False),
        (('sampling.choice=["yes","no"]',), True),
        (("data.json_schema_column=schema",), True),
        (("data.format=openai_batch",), True),
    ],
)
def test_split_step_graphs_are_captured_only_for_jobs_whose_rows_can_carry_a_constraint(
    tmp_path: Path, overrides: tuple[str, ...], captured: bool
) -> None:
    from batchjob.config.settings import load_settings

    cfg = job_config("engine=native", f"output.dir={tmp_path / 'out'}", *overrides)
    assert load_settings(cfg).engine_options["graph_constrained"] is captured


@pytest.mark.parametrize(
    ("overrides", "captured"),
    [
        ((), "greedy"),
        (("sampling.temperature=0.7",), "temperature"),
        (("sampling.temperature=0.7", "sampling.top_p=0.95"), "filtering"),
        (("sampling.temperature=0.7", "sampling.top_k=50"), "filtering"),
        (("sampling.temperature=0.7", "sampling.min_p=0.05"), "filtering"),
        (("data.format=openai_batch",), "all"),
        (("sampling.temperature=0.7", "engine.graph_sampling=greedy"), "greedy"),
    ],
)
def test_a_job_whose_rows_all_sample_alike_captures_graphs_of_that_sampler_mode_only(
    tmp_path: Path, overrides: tuple[str, ...], captured: str
) -> None:
    from batchjob.config.settings import load_settings

    cfg = job_config("engine=native", f"output.dir={tmp_path / 'out'}", *overrides)
    assert load_settings(cfg).engine_options["graph_sampling"] == captured


def test_an_openai_batch_file_read_under_format_auto_keeps_every_sampler_graph(tmp_path: Path) -> None:
    """Its lines set their own temperature, n and response format: under data.format=auto the graphs are not
    narrowed to the job's sampling (they were, before the format was recognised, leaving per-line temperatures and
    schemas to eager steps), nor its sequences to its rows; a plain .jsonl of prompts still is."""
    import json

    from batchjob.config.settings import for_shard_rows, load_settings

    batch = tmp_path / "requests.jsonl"
    request = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hi"}}
    batch.write_text(json.dumps(request) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = f"output.dir={tmp_path / 'out'}"
    settings = for_shard_rows(load_settings(job_config("engine=native", out, f"data.path={batch}")), 20)
    options = settings.engine_options
    assert (options["graph_sampling"], options["graph_constrained"], options["max_num_seqs"]) == ("all", True, 512)
    settings = for_shard_rows(load_settings(job_config("engine=native", out, f"data.path={prompts}")), 20)
    options = settings.engine_options
    assert (options["graph_sampling"], options["graph_constrained"], options["max_num_seqs"]) == ("greedy", False, 20)


@pytest.mark.parametrize(
    ("overrides", "rows", "seqs"),
    [
        ((), None, 512),  # a stream: rows unknown
        ((), 20, 20),
        (("sampling.n=3", "sampling.temperature=0.7"), 20, 60),
        ((), 100000, 512),
        (("engine.max_num_seqs=8",), 20, 8),
        ((), 0, 512),  # an empty shard
        (("data.format=openai_batch",), 20, 512),  # a line may ask for several samples
    ],
)
def test_a_shard_of_a_few_rows_runs_no_more_sequences_than_they_make(
    tmp_path: Path, overrides: tuple[str, ...], rows: int | None, seqs: int
) -> None:
    from batchjob.config.settings import for_shard_rows, load_settings

    settings = load_settings(job_config("engine=native", f"output.dir={tmp_path / 'out'}", *overrides))
    configured = 8 if "engine.max_num_seqs=8" in overrides else 512
    assert settings.engine_options["max_num_seqs"] == configured, (
        "the config alone lowers nothing: a warm-up's is whole"
    )
    assert for_shard_rows(settings, rows).engine_options["max_num_seqs"] == seqs


@pytest.mark.parametrize(
    ("overrides", "seqs"),
    [
        ((), 12),  # the input's rows, without data.limit
        (("data.limit=5",), 5),
        (("shard.count=2", "shard.index=1"), 6),  # this shard's rows
        (("sampling.n=2", "sampling.temperature=0.7"), 24),
    ],
)
def test_a_job_runs_its_engine_with_no_more_sequences_than_its_shard_has(
    tmp_path: Path, overrides: tuple[str, ...], seqs: int
) -> None:
    data = write_prompts(tmp_path / "prompts.parquet", 12)
    out = tmp_path / "out"
    assert run_job(job_config("engine=native", f"data.path={data}", f"output.dir={out}", *overrides)) == 0
    report = read_report(out) if "shard.count=2" not in overrides else _shard_report(out, 1)
    assert report["engine"]["max_num_seqs"] == seqs


def _shard_report(out: Path, shard: int) -> dict:
    import json

    return json.loads(next(bookkeeping(out).glob(f"_report-s{shard:05d}*.json")).read_text())


def test_graph_sampling_takes_a_mode_name_or_a_boolean_and_names_its_choices() -> None:
    from batchjob.engine.native.options import NativeOptions

    assert NativeOptions.from_mapping({"graph_sampling": True}).graph_sampling == "all"
    assert NativeOptions.from_mapping({"graph_sampling": False}).graph_sampling == "greedy"
    assert NativeOptions.from_mapping({"graph_sampling": "filtering"}).graph_sampling == "filtering"
    with pytest.raises(ValueError, match="graph_sampling='top_p': choose one of all, greedy, temperature, filtering"):
        NativeOptions.from_mapping({"graph_sampling": "top_p"})


@pytest.mark.skipif(not HAS_VLLM or VLLM_RUNS, reason="needs vLLM installed where it finds no GPU")
def test_auto_falls_back_to_hf_where_vllm_finds_no_gpu_and_says_so(gpt2_dir: Path) -> None:
    choice = choose_backend("auto", str(gpt2_dir), {"dtype": "float32", "tensor_parallel": 1})
    assert choice.name == "hf"
    assert "finds no GPU here" in choice.reason
