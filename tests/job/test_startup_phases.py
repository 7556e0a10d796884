"""Start-up by phase: one log line at "ready to generate" and the same seconds in the report; the checks that run
beside the engine (tokenizer, duplicate-id scan, output lock and record) still stop the job with exit 2."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from jobtools import (
    REPO,
    bookkeeping,
    cli_env,
    read_report,
    run_cli,
    run_in_process,
    unloadable_copy,
    write_prompts,
    write_table,
)
from startup_probe import FIRST_RUN_ONLY, TOKENIZER_MODULE, modules_a_job_imports

from batchjob.job.startup import CRITICAL_PHASES, StartupClock
from batchjob.job.tiny_model import default_tiny_model


def test_phases_beside_the_engine_add_nothing_to_the_total() -> None:
    clock = StartupClock()
    clock.lap("imports_s")
    with clock.timed("tokenizer_s", beside_engine=True):
        time.sleep(0.05)
    before_last_lap = time.perf_counter()
    clock.lap("engine_s")
    summary = clock.summary({"load_s": 0.01, "steps": 3})
    after_summary = time.perf_counter()
    assert summary["tokenizer_s"] >= 0.05
    assert summary["engine_load_s"] == 0.01 and "engine_steps" not in summary
    # The laps cover the start to the last lap; the total runs on to the summary, which is all that may lie
    # between them (bounded by this test's own clock, as a loaded machine may pause anywhere in between).
    critical = summary["imports_s"] + summary["engine_s"]
    assert 0 <= summary["total_s"] - critical <= after_summary - before_last_lap
    line = clock.ready_line(summary)
    assert line.startswith(f"ready to generate {summary['total_s']:.1f} s after start: imports ")
    assert f"engine {summary['engine_s']:.2f} s (weights 0.01 s)" in line
    assert line.endswith(f"; beside the engine: tokenizer {summary['tokenizer_s']:.2f} s")


def test_a_repeated_lap_adds_to_its_phase() -> None:
    clock = StartupClock()
    clock.lap("imports_s")
    first = clock.phases["imports_s"]
    clock.lap("config_s")
    clock.lap("imports_s")
    assert clock.phases["imports_s"] >= first
    assert sum(clock.phases.values()) == pytest.approx(clock.summary()["total_s"], abs=0.01)


def test_a_clock_sent_to_another_process_starts_afresh_there() -> None:
    """submitit pickles the Hydra task, the clock with it, for every Slurm task it submits."""
    import pickle

    clock = StartupClock()
    clock.lap("imports_s")
    copy = pickle.loads(pickle.dumps(clock))
    assert copy.phases == {} and copy.started > clock.started
    copy.lap("imports_s")  # and works there


def test_the_command_logs_and_reports_every_start_up_phase(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli(f"output.dir={out}", "data.limit=4")
    assert done.returncode == 0, done.stderr
    startup = read_report(out)["startup_s"]
    assert set(CRITICAL_PHASES) <= set(startup)
    assert "tokenizer_s" in startup and "ids_s" not in startup  # no id column: nothing to scan
    assert all(seconds >= 0 for seconds in startup.values())
    # The critical path adds up to the wall time from process start (Hydra's own start-up is in it too), but for
    # the moment between the last lap and the summary: a few calls, which a machine busy with other work may
    # stretch, hence ten times the 0.05 s an idle one needs. A phase left out of the sum still shows if it is one
    # of the long ones (imports, config and model files, engine: 0.4-2 s each on an idle machine).
    critical = sum(startup[key] for key in CRITICAL_PHASES)
    assert critical <= startup["total_s"] <= critical + 0.5
    assert startup["imports_s"] > 0.5  # torch and transformers are imported in this phase, not in a check
    [line] = [line for line in done.stderr.splitlines() if "ready to generate" in line]
    assert f"ready to generate {startup['total_s']:.1f} s after start: imports {startup['imports_s']:.2f} s" in line
    assert f"beside the engine: tokenizer {startup['tokenizer_s']:.2f} s" in line


def test_a_first_run_with_an_id_column_scans_the_ids_beside_the_engine(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.parquet", 4, uid=[10, 11, 12, 13])
    out = tmp_path / "o"
    assert run_in_process(f"data.path={path}", "data.id_column=uid", f"output.dir={out}") == 0
    startup = read_report(out)["startup_s"]
    assert {"ids_s", "output_s", "tokenizer_s", "wait_s"} <= set(startup)
    assert (bookkeeping(out) / "_job.json").exists()


def test_duplicate_ids_found_beside_a_failing_engine_are_the_error_reported(
    tmp_path: Path, model_dir: str, capsys
) -> None:
    broken = unloadable_copy(model_dir, tmp_path / "broken-model")
    path = write_table(tmp_path / "p.parquet", {"uid": [7, 8, 7], "prompt": ["a", "b", "c"]})
    code = run_in_process(f"model.path={broken}", f"data.path={path}", "data.id_column=uid", f"output.dir={tmp_path}/o")
    assert code == 2
    assert "data.id_column='uid' repeats values (7)" in capsys.readouterr().err
    assert not (bookkeeping(tmp_path / "o") / "_job.json").exists()


def test_a_chat_pipeline_without_a_chat_template_is_refused_after_the_engine_loads(
    tmp_path: Path, model_dir: str, capsys
) -> None:
    plain = tmp_path / "no-template"
    shutil.copytree(model_dir, plain)
    (plain / "chat_template.jinja").unlink()
    path = write_prompts(tmp_path / "p.parquet", 2)
    code = run_in_process(f"model.path={plain}", f"data.path={path}", "pipeline.kind=chat", f"output.dir={tmp_path}/o")
    assert code == 2
    assert "pipeline.kind=chat but the model's tokenizer has no chat template" in capsys.readouterr().err


def test_a_later_job_on_a_model_imports_no_config_classes(tmp_path: Path) -> None:
    """transformers' config and auto classes, and the sympy they (and torch's meta tensors) import, are seconds
    of a start-up on a GPU node: only a job's first run on a model imports them; later runs read the model's
    spec and its tokenizer's class from the cache, and still load the tokenizer."""
    env = {**cli_env(), "BATCHJOB_CACHE": str(tmp_path / "cache")}
    watched = [*FIRST_RUN_ONLY, TOKENIZER_MODULE]

    def imported(run: str) -> set[str]:
        overrides = ["engine=native", f"model.path={default_tiny_model()}", f"output.dir={tmp_path / run}"]
        return modules_a_job_imports([*overrides, "data.limit=2", "sampling.max_new_tokens=4"], env, REPO, watched)

    assert imported("first") == set(watched)
    assert imported("later") == {TOKENIZER_MODULE}


def test_a_package_without_bytecode_that_python_may_not_write_is_reported_with_its_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import shlex
    import subprocess
    import sys

    from batchjob.job.startup import compiled_afresh

    package = tmp_path / "site" / "uncompiled_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # what PYTHONDONTWRITEBYTECODE=1 sets
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    module = importlib.import_module("uncompiled_pkg")
    assert not (package / "__pycache__").exists()
    message = compiled_afresh(module)
    assert message is not None and "PYTHONDONTWRITEBYTECODE is set" in message
    fix = shlex.split(message.split(": ", 1)[1])
    assert fix[:2] == ["python", "-m"] and fix[-1] == str(tmp_path / "site")
    subprocess.run([sys.executable, *fix[1:]], check=True)
    assert compiled_afresh(module) is None
    assert compiled_afresh(sys) is None  # a built-in module has no sources to compile


KEEP_AND_IMPORT = """
import importlib._bootstrap_external as external, json, os, subprocess, sys
compiled = []
to_code = external.SourceLoader.source_to_code
external.SourceLoader.source_to_code = lambda self, data, path, *a, **k: compiled.append(path) or to_code(
    self, data, path, *a, **k)
from batchjob.job.startup import keep_bytecode
prefix = keep_bytecode("uncompiled_pkg")
import uncompiled_pkg.inner
child = subprocess.run([sys.executable, "-c", "import sys; print(sys.pycache_prefix, sys.dont_write_bytecode)"],
                       capture_output=True, text=True, check=True).stdout.split()
mine = [os.path.basename(p) for p in compiled if os.path.basename(os.path.dirname(p)) == "uncompiled_pkg"]
print(json.dumps({"prefix": prefix and str(prefix), "compiled": mine,
                  "cached": uncompiled_pkg.inner.__spec__.cached, "child": child}))
"""


def _uncompiled_package(site: Path) -> Path:
    package = site / "uncompiled_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    (package / "inner.py").write_text("from uncompiled_pkg import VALUE\nDOUBLE = 2 * VALUE\n")
    return package


def test_a_job_keeps_bytecode_in_its_cache_where_the_environment_cannot(tmp_path: Path) -> None:
    # An environment without bytecode whose Python may not write it (PYTHONDONTWRITEBYTECODE): the first
    # process compiles into the cache, its children inherit the place, the next process compiles nothing.
    import json
    import os
    import subprocess
    import sys

    package = _uncompiled_package(tmp_path / "site")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPYCACHEPREFIX"}
    env |= {
        "PYTHONDONTWRITEBYTECODE": "1",
        "BATCHJOB_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
    }

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", KEEP_AND_IMPORT], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    first, later = run(), run()
    prefix = str(tmp_path / "cache" / "pycache")
    assert first["prefix"] == prefix and first["child"] == [prefix, "False"]
    assert first["compiled"] == ["__init__.py", "inner.py"]
    assert first["cached"].startswith(prefix) and Path(first["cached"]).is_file()
    assert not (package / "__pycache__").exists()  # nothing written beside the sources
    assert later["prefix"] == prefix and later["compiled"] == []


def test_an_environment_that_keeps_its_own_bytecode_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import compileall
    import sys

    from batchjob.job.startup import keep_bytecode

    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    _uncompiled_package(tmp_path / "site")
    # Python may write it beside the sources: the first import will.
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert keep_bytecode("uncompiled_pkg") is None
    # The user chose where bytecode goes.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "theirs"))
    assert keep_bytecode("uncompiled_pkg") is None
    # Compiled beside the sources (as pip installs), writing not allowed: read from there as before.
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert compileall.compile_dir(str(tmp_path / "site"), quiet=1)
    assert keep_bytecode("uncompiled_pkg") is None
    assert keep_bytecode("a_package_not_installed") is None
    assert not (tmp_path / "cache").exists() and sys.pycache_prefix is None
