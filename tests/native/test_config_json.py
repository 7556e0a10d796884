"""config.json read without transformers (`models/config_json.py`) gives the spec transformers' reading gives, for
every family: the tiny test configs (written by transformers 5, so in its `rope_parameters` layout and holding only
what differs from the defaults), configs in their makers' published layout (the older `rope_scaling` one), the
benchmark models' and variants that move windows and ropes. And a start-up that read natively checks it against
transformers' reading beside before it generates: a difference stops it with a setup error, after which the spec
cache holds transformers' reading."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import transformers
from test_published_configs import (
    GEMMA2_2B,
    GEMMA3_1B,
    LLAMA31_8B,
    MISTRAL_7B_V03,
    PHI35_MINI,
    QWEN3_8B,
    QWEN25_7B,
    SMOLLM3_3B,
)

from batchjob.engine.native.models import config_json, spec_check
from batchjob.engine.native.models.registry import architecture_of, spec_from_config, transformers_spec
from batchjob.engine.native.models.spec_check import comparable
from batchjob.job.tiny_model import TINY_CONFIGS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_lib.models import model_config  # noqa: E402
from bench_lib.workloads import ARCHITECTURES as BENCH_ARCHITECTURES  # noqa: E402

SMALL = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024,
)  # fmt: skip
# The architecture each config class's model type runs as.
ARCHITECTURE_OF = {model_type: name for name, (model_type, *_) in config_json.FAMILIES.items()}


def _saved(tmp_path: Path, config_class: str, **fields) -> Path:
    config = getattr(transformers, config_class)(**fields)
    config.architectures = [ARCHITECTURE_OF[config.model_type]]
    config.save_pretrained(tmp_path)
    return tmp_path


def _written(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _native(model_dir: Path) -> dict:
    architecture = architecture_of(model_dir)
    config = config_json.native_config(model_dir, architecture.name)
    assert config is not None, "the native reading gave up"
    return comparable(spec_from_config(config, architecture, str(model_dir), {}, "auto", None))


def _transformers(model_dir: Path) -> dict:
    return comparable(transformers_spec(model_dir))


VARIANTS = {
    "qwen2 windowed from layer 2": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
    ),
    "qwen3 windowed": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)),
    "mistral windowed": ("MistralConfig", dict(sliding_window=64)),
    "llama yarn": (
        "LlamaConfig",
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
    ),
    "llama linear, partial rotary": ("LlamaConfig", dict(rope_scaling={"type": "linear", "factor": 2.0})),
    "llama dynamic": ("LlamaConfig", dict(rope_scaling={"type": "dynamic", "factor": 2.0})),
    "gemma2 default layers": ("Gemma2Config", dict(head_dim=16)),
    "gemma3 pattern of 2, linear global rope": (
        "Gemma3TextConfig",
        dict(head_dim=16, sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    ),
    "smollm3 windowed": ("SmolLM3Config", dict(use_sliding_window=True, sliding_window=8, no_rope_layer_interval=2)),
    "mixtral eight experts": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen3-moe dense every other layer": ("Qwen3MoeConfig", dict(decoder_sparse_step=2, head_dim=16)),
}


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_every_tiny_config_reads_as_transformers_reads_it(arch, tmp_path):
    config_class, family = TINY_CONFIGS[arch]
    model_dir = _saved(tmp_path, config_class, **{**SMALL, **family})
    assert _native(model_dir) == _transformers(model_dir)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_windows_ropes_and_experts_read_as_transformers_reads_them(name, tmp_path):
    config_class, fields = VARIANTS[name]
    model_dir = _saved(tmp_path, config_class, **{**SMALL, **fields})
    assert _native(model_dir) == _transformers(model_dir)


PUBLISHED = {
    "llama-3.1": LLAMA31_8B, "qwen2.5": QWEN25_7B, "qwen3": QWEN3_8B, "mistral-v0.3": MISTRAL_7B_V03,
    "gemma-2": GEMMA2_2B, "gemma-3": GEMMA3_1B, "smollm3": SMOLLM3_3B, "phi-3.5": PHI35_MINI,
}  # fmt: skip


@pytest.mark.parametrize("config", list(PUBLISHED.values()), ids=list(PUBLISHED))
def test_published_configs_read_as_transformers_reads_them(config, tmp_path):
    model_dir = _written(tmp_path, config)
    assert _native(model_dir) == _transformers(model_dir)


@pytest.mark.parametrize("name", sorted(BENCH_ARCHITECTURES))
def test_the_benchmark_models_read_as_transformers_reads_them(name, tmp_path):
    config = model_config(name)
    config.save_pretrained(tmp_path)
    assert _native(tmp_path) == _transformers(tmp_path)


def test_what_the_native_reading_cannot_tell_is_left_to_transformers(tmp_path):
    custom = _written(tmp_path / "custom", {**LLAMA31_8B, "auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    other_type = _written(tmp_path / "other", {**LLAMA31_8B, "model_type": "llama4_text"})
    nested = _written(
        tmp_path / "nested",
        {**LLAMA31_8B, "rope_scaling": None, "rope_parameters": {"full_attention": {"rope_type": "default"}}},
    )
    for model_dir in (custom, other_type, nested):
        assert config_json.native_config(model_dir, "LlamaForCausalLM") is None, model_dir


QUANTIZATION = {
    "block fp8 (DeepSeek / Qwen3 layout)": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "mlp.gate"],
    },
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "compressed-tensors FP8_DYNAMIC": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
                "input_activations": {
                    "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True,
                },
            }
        },
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(QUANTIZATION))
def test_fp8_quantization_configs_read_as_transformers_reads_them(name, tmp_path):
    model_dir = _written(tmp_path, {**LLAMA31_8B, "quantization_config": QUANTIZATION[name]})
    assert _native(model_dir)["quantization"] is not None
    assert _native(model_dir) == _transformers(model_dir)


def _engine(model_dir: Path):
    from batchjob.engine import create_engine

    return create_engine("native", str(model_dir), {"device": "cpu", "dtype": "float32", "detokenize": False})


def _requests(count: int = 3):
    from batchjob.engine import Request, SamplingParams

    return [Request(i, (5 + i, 6, 7), SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(count)]


def test_a_start_up_reads_natively_and_leaves_transformers_reading_in_the_cache(tmp_path, monkeypatch):
    from batchjob.engine.native.models.spec_cache import load_spec
    from batchjob.engine.native.models.spec_key import spec_key
    from batchjob.job.tiny_model import make_tiny_model

    monkeypatch.setattr(spec_check, "NATIVE_READING_DEVICES", frozenset({"cuda", "cpu"}))  # as a GPU's start-up
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    model_dir = make_tiny_model(tmp_path / "gemma3", arch="gemma3")
    read, checks = [], []
    monkeypatch.setattr(spec_check, "begin", lambda *args, begin=spec_check.begin: read.append(args) or begin(*args))
    monkeypatch.setattr(spec_check, "take", lambda take=spec_check.take: checks.extend(taken := take()) or taken)
    engine = _engine(model_dir)
    assert len(read) == 1 and len(checks) == 1  # read without transformers, and checked
    completions = engine.generate(_requests())
    next(completions)
    assert checks[0].process.poll() is not None, "a completion was handed on before transformers' reading ended"
    assert len(list(completions)) == 2
    stats = engine.stats()
    assert stats["spec_check_s"] > 0 and 0 <= stats["spec_check_wait_s"] <= stats["spec_check_s"]
    engine.close()
    kept = load_spec(spec_key(model_dir), model_dir)
    assert kept is not None and comparable(kept) == comparable(read[0][2])
    _engine(model_dir).close()
    assert len(read) == 1  # the next start-up reads the cache


def test_the_check_begins_before_the_engines_imports_and_the_native_reading_joins_it(tmp_path, monkeypatch):
    """`create_engine` starts transformers' reading before it imports the engine (torch), from modules that import
    no torch; the native reading is then checked against that process rather than a second one. A check begun
    early that no native reading joins is stopped; none begins for a kept spec, a CPU start-up or a hub id."""
    import subprocess

    from batchjob.engine.native.engine import NativeEngine
    from batchjob.job.tiny_model import make_tiny_model

    monkeypatch.setattr(spec_check, "NATIVE_READING_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    probe = (
        "import sys\n"
        "from batchjob.engine import _begin_early\n"
        "from batchjob.engine.native.models import spec_check\n"
        "spec_check.NATIVE_READING_DEVICES = frozenset({'cpu'})\n"
        "_begin_early('native', sys.argv[1], {'device': 'cpu'})\n"
        "(check,) = spec_check._pending.values()\n"
        "assert check.native is None and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "assert spec_check.take() == [] and check.process.returncode is not None  # no native reading joined it\n"
    )
    env = {**os.environ, "BATCHJOB_CACHE": str(tmp_path / "cache-probe")}
    done = subprocess.run([sys.executable, "-c", probe, str(model_dir)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

    workers = []
    monkeypatch.setattr(spec_check, "_worker", lambda *a, worker=spec_check._worker: workers.append(a) or worker(*a))
    checks = []
    monkeypatch.setattr(spec_check, "take", lambda take=spec_check.take: checks.extend(taken := take()) or taken)
    engine = _engine(model_dir)
    assert len(workers) == 1 and len(checks) == 1 and checks[0].native is not None
    assert len(list(engine.generate(_requests()))) == 3
    engine.close()
    for path, device in [(model_dir, "cpu"), (tmp_path / "llama", "cuda"), ("org/model", "cuda")]:
        spec_check.begin_early(str(path), device)  # kept spec (twice), and a hub id
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache-2"))
    with pytest.raises(ValueError, match="max_model_len"):  # a model check that fails stops the check it began
        NativeEngine.check_model(str(model_dir), {"device": "cpu", "max_model_len": 10**6})
    assert len(workers) == 2 and spec_check._pending == {}
    monkeypatch.setattr(spec_check, "NATIVE_READING_DEVICES", frozenset({"cuda"}))
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache-3"))
    spec_check.begin_early(str(model_dir), "cpu")
    monkeypatch.setattr(spec_check, "NVIDIA_DRIVER", tmp_path / "no-driver")
    spec_check.begin_early(str(model_dir), "auto")
    assert len(workers) == 2 and spec_check.take() == []
    monkeypatch.setattr(spec_check, "NVIDIA_DRIVER", tmp_path)  # a GPU node, its GPUs hidden, then not
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec_check.begin_early(str(model_dir), "auto")
    assert len(workers) == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    spec_check.begin_early(str(model_dir), "auto")
    assert len(workers) == 3 and spec_check.take() == []  # no native reading joined it: stopped


def test_an_engine_that_generates_nothing_settles_its_check_or_stops_it_at_close(tmp_path, monkeypatch):
    """`settle` (what `batchjob.warmup` calls) waits for the check, which leaves transformers' reading in the spec
    cache; an engine closed without it stops the check."""
    from batchjob.engine.native.models.spec_cache import load_spec
    from batchjob.engine.native.models.spec_key import spec_key
    from batchjob.job.tiny_model import make_tiny_model

    monkeypatch.setattr(spec_check, "NATIVE_READING_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    checks = []
    monkeypatch.setattr(spec_check, "take", lambda take=spec_check.take: checks.extend(taken := take()) or taken)
    _engine(model_dir).close()
    assert len(checks) == 1 and checks[0].process.poll() is not None
    engine = _engine(model_dir)
    engine.settle()
    engine.close()
    assert len(checks) == 2 and checks[1].process.returncode == 0
    assert load_spec(spec_key(model_dir), model_dir) is not None


def test_a_native_reading_that_differs_from_transformers_stops_the_first_results_and_the_rerun_reads_theirs(
    tmp_path, monkeypatch
):
    """The engine starts and generates beside the check; the difference is raised in place of the first result,
    none of which is handed on."""
    from batchjob.engine.api import EngineSetupError
    from batchjob.job.tiny_model import make_tiny_model

    monkeypatch.setattr(spec_check, "NATIVE_READING_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    model_dir = make_tiny_model(tmp_path / "qwen2", arch="qwen2")
    qwen2 = config_json.FAMILIES["Qwen2ForCausalLM"]
    wrong = (qwen2[0], qwen2[1], lambda c: (qwen2[2](c), c.update(rms_norm_eps=0.5)), qwen2[3])
    monkeypatch.setitem(config_json.FAMILIES, "Qwen2ForCausalLM", wrong)
    engine = _engine(model_dir)
    handed = []
    with pytest.raises(EngineSetupError, match=r"otherwise than transformers does \(rms_norm_eps: 0.5 against 1e-05\)"):
        handed.extend(engine.generate(_requests()))
    assert handed == []
    engine.close()
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache-2"))  # the same, settled without generating
    engine = _engine(model_dir)
    with pytest.raises(EngineSetupError, match=r"rms_norm_eps: 0.5 against 1e-05"):
        engine.settle()
    engine.close()
    engine = _engine(model_dir)  # transformers' reading, from the cache
    assert len(list(engine.generate(_requests()))) == 3
    engine.close()


def test_a_cpu_start_up_reads_through_transformers(tmp_path, monkeypatch):
    from batchjob.job.tiny_model import make_tiny_model

    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    monkeypatch.setattr(spec_check, "begin", lambda *args: pytest.fail("a CPU start-up began a check"))
    _engine(model_dir).close()


def test_held_items_wait_for_a_slow_check_only_so_long_then_for_the_check_itself(tmp_path):
    """Items produced while a check runs are held; past the hold, producing stops until the check has ended, so a
    check that hangs holds a bounded number of items (here, with no hold at all, the first one)."""
    import subprocess

    from batchjob.job.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    spec = transformers_spec(model_dir)
    worker = [sys.executable, "-m", "batchjob.engine.native.models.spec_check_worker", str(model_dir)]
    (tmp_path / "theirs.json").write_text(subprocess.run(worker, capture_output=True, text=True, check=True).stdout)
    reading = f"import time; time.sleep(1.5); print(open({str(tmp_path / 'theirs.json')!r}).read())"  # a slow worker
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    process = subprocess.Popen([sys.executable, "-c", reading], **pipes)
    check = spec_check.SpecCheck(model_dir, spec, process, transformers_spec)
    produced = []

    def items():
        for i in range(4):
            produced.append(process.poll() is not None)  # had the check ended when this item was made?
            yield i

    assert list(spec_check.held_until_verified([check], items(), hold_s=0.0)) == [0, 1, 2, 3]
    assert produced == [False, True, True, True]
    timings = spec_check.timings([check])  # the engine's stats: how long the check ran, how long it was waited for
    assert timings["spec_check_s"] >= 1.5 and 0.5 < timings["spec_check_wait_s"] <= timings["spec_check_s"]


def test_a_transformers_reading_the_engine_cannot_run_is_a_setup_error_where_the_native_one_ran(tmp_path):
    """What transformers' config object presents builds the spec in the engine's process: where that spec is refused
    (here an activation other than SiLU) but the native one was not, the check fails as a difference does."""
    import subprocess

    from batchjob.job.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    spec = transformers_spec(model_dir)
    worker = [sys.executable, "-m", "batchjob.engine.native.models.spec_check_worker", str(model_dir)]
    fields = json.loads(subprocess.run(worker, capture_output=True, text=True, check=True).stdout)
    (tmp_path / "theirs.json").write_text(json.dumps({**fields, "hidden_act": "relu"}))
    reading = f"print(open({str(tmp_path / 'theirs.json')!r}).read())"
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    process = subprocess.Popen([sys.executable, "-c", reading], **pipes)
    with pytest.raises(spec_check.SpecCheckError, match="not one batchjob runs natively.*hidden_act 'relu'"):
        spec_check.SpecCheck(model_dir, spec, process, transformers_spec).result()


def test_the_checks_worker_reads_the_config_without_torch_or_the_packages_transformers_need_not_import(tmp_path):
    """torch, and the vision and scikit-learn packages that transformers imports where installed (seconds on a GPU
    host), are hidden from the worker: installed here as packages that fail on import, the worker still reads the
    config, and the spec built from what it printed is the one transformers' config object gives with torch."""
    import subprocess

    from batchjob.engine.native.models.spec_check_worker import HIDDEN
    from batchjob.job.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    for name in HIDDEN:
        (tmp_path / "site" / name).mkdir(parents=True)
        (tmp_path / "site" / name / "__init__.py").write_text(f"raise RuntimeError('{name} was imported')\n")
    probe = (
        "import importlib.util, sys\n"
        "from batchjob.engine.native.models import spec_check_worker as worker\n"
        "assert all(importlib.util.find_spec(name) is not None for name in worker.HIDDEN)  # installed\n"
        "worker.main(sys.argv[1:])\n"
        "assert all(importlib.util.find_spec(name) is None for name in worker.HIDDEN)\n"
    )
    env = {**os.environ, "BATCHJOB_CACHE": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", probe, str(model_dir)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    fields = json.loads(done.stdout.strip().splitlines()[-1])
    assert fields["dtype"] == "float32"  # read without torch: a name, not a torch.dtype
    assert comparable(transformers_spec(model_dir, fields)) == comparable(transformers_spec(model_dir))


def test_the_workers_reading_without_torch_gives_every_configs_spec_as_transformers_reading_with_it(tmp_path):
    """Every config of this file (the tiny ones, the variants, the published and benchmark models', FP8 ones), read
    by one worker without torch: the spec built from what it printed equals transformers' reading with torch, in
    this process."""
    import subprocess

    dirs = []
    for arch in sorted(TINY_CONFIGS):
        config_class, family = TINY_CONFIGS[arch]
        dirs.append(_saved(tmp_path / f"tiny-{arch}", config_class, **{**SMALL, **family}))
    for i, name in enumerate(sorted(VARIANTS)):
        config_class, fields = VARIANTS[name]
        dirs.append(_saved(tmp_path / f"variant-{i}", config_class, **{**SMALL, **fields}))
    dirs += [_written(tmp_path / f"published-{name}", config) for name, config in PUBLISHED.items()]
    for name in sorted(BENCH_ARCHITECTURES):
        model_config(name).save_pretrained(tmp_path / f"bench-{name}")
        dirs.append(tmp_path / f"bench-{name}")
    for name in sorted(QUANTIZATION):
        dirs.append(_written(tmp_path / f"fp8-{name}", {**LLAMA31_8B, "quantization_config": QUANTIZATION[name]}))
    command = [sys.executable, "-m", "batchjob.engine.native.models.spec_check_worker", *map(str, dirs)]
    env = {**os.environ, "BATCHJOB_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(dirs)
    for model_dir, line in zip(dirs, lines, strict=True):
        assert comparable(transformers_spec(model_dir, json.loads(line))) == _transformers(model_dir), model_dir
