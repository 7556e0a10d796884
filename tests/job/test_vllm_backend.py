"""`engine=vllm`: every job option maps onto vLLM's own `SamplingParams`, `StructuredOutputsParams` and
`EngineArgs` (checked against the real classes where vLLM is importable; vLLM imports on a CPU-only machine, it
only cannot run), options are checked before anything starts, and a machine without vLLM is told how to get it.
The generation itself needs a GPU: tests/gpu/test_vllm_gpu.py.
"""

from __future__ import annotations

import importlib.util

import pytest
from jobtools import run_cli

from batchjob.engine import SamplingParams, check_engine_options
from batchjob.engine.vllm_options import OPTION_DEFAULTS, engine_kwargs, sampling_kwargs

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'batchjob[vllm]')")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_job_refuses_before_loading_anything_and_says_how_to_install_it(tmp_path):
    refused = run_cli("engine=vllm", "data.limit=2", f"output.dir={tmp_path / 'out'}")
    assert refused.returncode == 2
    assert "vLLM is not installed here: pip install 'batchjob[vllm]'" in refused.stderr
    assert "Traceback" not in refused.stderr


@needs_vllm
def test_where_vllm_finds_no_gpu_the_job_refuses_before_loading_anything(tmp_path):
    from batchjob.engine.vllm_options import vllm_device

    if vllm_device():
        pytest.skip("vLLM finds a device here")
    refused = run_cli("engine=vllm", "data.limit=2", f"output.dir={tmp_path / 'out'}")
    assert refused.returncode == 2
    assert "vLLM finds no device to run on here" in refused.stderr and "engine=native or engine=hf" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "out").exists()


def test_sampling_settings_map_onto_vllms_names():
    sampling = SamplingParams(
        max_new_tokens=7, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=11, stop=("END",),
        stop_token_ids=(2,), n=3, logprobs=2, ignore_eos=True,
    )  # fmt: skip
    assert sampling_kwargs(sampling) == {
        "n": 3, "max_tokens": 7, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 11,
        "stop": ["END"], "stop_token_ids": [2], "ignore_eos": True, "logprobs": 2,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        ({"json_schema": {"type": "object"}}, {"json": '{"type":"object"}', "disable_any_whitespace": True}),
        (
            {"json_schema": {"type": "object"}, "json_whitespace": True},
            {"json": '{"type":"object"}', "disable_any_whitespace": False},
        ),
        ({"regex": "[a-z]+"}, {"regex": "[a-z]+"}),
        ({"choice": ("yes", "no")}, {"choice": ["yes", "no"]}),
        ({"grammar": 'start: "a"+'}, {"grammar": 'start: "a"+'}),
    ],
    ids=["json schema", "json with whitespace", "regex", "choice", "grammar"],
)
def test_a_constraint_maps_onto_vllms_structured_outputs_and_drops_stop_strings(constraint, expected):
    kwargs = sampling_kwargs(SamplingParams(stop=("x",), **constraint))
    assert kwargs["structured_outputs"] == expected
    assert kwargs["stop"] == [] and kwargs["stop_token_ids"] == []


def test_engine_options_map_onto_engine_args_names_and_leave_the_checkpoints_own_to_vllm():
    kwargs = engine_kwargs("/models/m", {**OPTION_DEFAULTS, "tensor_parallel": 2, "enforce_eager": True})
    assert kwargs["model"] == kwargs["tokenizer"] == "/models/m"
    assert kwargs["tensor_parallel_size"] == 2 and "tensor_parallel" not in kwargs
    assert kwargs["enforce_eager"] is True
    assert "quantization" not in kwargs and "max_model_len" not in kwargs and "deterministic" not in kwargs


@needs_vllm
def test_every_mapped_sampling_setting_builds_vllms_real_sampling_params():
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sampling = SamplingParams(
        max_new_tokens=7, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=11, stop=("END",),
        stop_token_ids=(2,), n=3, logprobs=2, ignore_eos=True,
    )  # fmt: skip
    built = VllmSamplingParams(**sampling_kwargs(sampling))
    assert (built.n, built.max_tokens, built.temperature, built.top_p, built.top_k, built.min_p) == (
        3, 7, 0.8, 0.9, 20, 0.05,
    )  # fmt: skip
    assert (built.seed, built.stop, built.stop_token_ids, built.ignore_eos, built.logprobs) == (
        11, ["END"], [2], True, 2,
    )  # fmt: skip
    assert not built.include_stop_str_in_output  # the text ends before the stop string, as every backend's
    for constraint in ({"json_schema": {"type": "object"}}, {"regex": "[0-9]+"}, {"choice": ("a", "b")}):
        kwargs = sampling_kwargs(SamplingParams(**constraint))
        structured = StructuredOutputsParams(**kwargs.pop("structured_outputs"))
        VllmSamplingParams(**kwargs, structured_outputs=structured)
    assert structured.choice == ["a", "b"]  # the last one built


@needs_vllm
def test_engine_options_build_vllms_real_engine_args():
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(**engine_kwargs("/models/m", {**OPTION_DEFAULTS, "tensor_parallel": 2, "enforce_eager": True}))
    assert (args.model, args.tensor_parallel_size, args.enforce_eager, args.seed) == ("/models/m", 2, True, 0)
    assert (args.gpu_memory_utilization, args.load_format, args.dtype) == (0.9, "auto", "auto")


@needs_vllm
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"enforce_eagr": True}, "engine.enforce_eagr (did you mean engine.enforce_eager?)"),
        ({"model": "x"}, "engine.model (batchjob sets it from model.path)"),
        ({"tensor_parallel_size": 2}, "engine.tensor_parallel_size (batchjob sets it from engine.tensor_parallel)"),
        ({"tensor_parallel": 0}, "engine.tensor_parallel must be an integer >= 1"),
        ({"deterministic": "yes"}, "engine.deterministic must be true or false"),
    ],
)
def test_bad_options_are_refused_naming_the_fix(options, message):
    with pytest.raises(ValueError) as refused:
        check_engine_options("vllm", options)
    assert message in str(refused.value)


@needs_vllm
def test_vllms_own_engine_args_pass_through():
    check_engine_options("vllm", {"enforce_eager": True, "max_num_seqs": 64, "enable_prefix_caching": False})
