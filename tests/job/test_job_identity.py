"""One output directory, one job: reruns never mix job records, ids are unique and may be strings, and the
input is recognised by its content."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
from jobtools import (
    bookkeeping,
    read_output,
    run_cli,
    run_in_process,
    unloadable_copy,
    write_prompts,
    write_table,
)

from batchjob.io import InputSpec
from batchjob.io.job_status import job_status
from batchjob.job.tiny_model import default_tiny_model


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file a run may commit or mark: the parts, and the bookkeeping beside them (logs, temps and
    locks aside)."""
    files = {}
    for root in (out, bookkeeping(out)):
        for p in root.rglob("*"):
            if p.is_file() and p.relative_to(root).parts[0] not in ("_hydra", "tmp", "locks"):
                files[str(p.relative_to(out.parent))] = p.read_bytes()
    return files


def two_finished_shards(prompts: Path, out: Path, *extra: str) -> tuple[str, ...]:
    base = (f"data.path={prompts}", f"output.dir={out}", "data.limit=6", "shard.count=2", *extra)
    for index in (0, 1):
        assert run_in_process(*base, f"shard.index={index}") == 0
    return base


def test_resume_false_on_one_shard_with_other_settings_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = two_finished_shards(write_prompts(tmp_path / "p.parquet", 6), out)
    before = snapshot(out)
    refused = run_cli(*base, "shard.index=0", "resume=false", "sampling.max_new_tokens=3")
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr
    [message] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "sampling.max_new_tokens: 4 -> 3" in message and "shard 1 (3 committed rows)" in message
    assert "new output.dir" in message and "output.overwrite=true" in message
    assert snapshot(out) == before


def test_overwrite_starts_the_whole_job_over_under_the_new_record(tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = two_finished_shards(write_prompts(tmp_path / "p.parquet", 6), out)
    assert run_in_process(*base, "shard.index=0", "output.overwrite=true", "sampling.max_new_tokens=2") == 0
    assert not list(out.glob("part-s00001-*")) and not (bookkeeping(out) / "_SUCCESS-s00001").exists()
    assert not job_status(str(out)).complete
    # Every task of the array may carry the option: the record is the new one now, so shard 1 just runs.
    assert run_in_process(*base, "shard.index=1", "output.overwrite=true", "sampling.max_new_tokens=2") == 0
    assert job_status(str(out)).complete
    assert max(read_output(out).column("completion_tokens").to_pylist()) <= 2


def test_resume_false_with_the_same_record_restarts_only_this_shard(tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = two_finished_shards(write_prompts(tmp_path / "p.parquet", 6), out)
    other_shard = {k: v for k, v in snapshot(out).items() if "s00001" in k}
    assert run_in_process(*base, "shard.index=0", "resume=false") == 0
    assert {k: v for k, v in snapshot(out).items() if "s00001" in k} == other_shard
    assert job_status(str(out)).complete


def test_duplicate_ids_are_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    path = write_table(tmp_path / "p.parquet", {"uid": [7, 8, 7, 9], "prompt": ["a", "b", "c", "d"]})
    assert run_in_process(f"data.path={path}", "data.id_column=uid", f"output.dir={tmp_path / 'o'}") == 2
    assert "data.id_column='uid' repeats values (7)" in capsys.readouterr().err
    assert not (bookkeeping(tmp_path / "o") / "_job.json").exists()


def test_string_ids_reach_the_output_and_status_checks_them(tmp_path: Path) -> None:
    ids = [f"req-{i:03d}" for i in (5, 1, 9, 3)]
    path = write_prompts(tmp_path / "p.parquet", 4, custom_id=ids)
    out = tmp_path / "o"
    args = (f"data.path={path}", "data.id_column=custom_id", f"output.dir={out}", "shard.count=2")
    for index in (0, 1):
        assert run_in_process(*args, f"shard.index={index}") == 0
    table = read_output(out)
    assert table.column("row_id").to_pylist() == [0, 1, 2, 3]
    assert table.column("custom_id").to_pylist() == ids
    assert job_status(str(out)).complete
    assert job_status(str(out), InputSpec(str(path), id_column="custom_id")).validation.ids_checked
    assert run_in_process(*args, "shard.index=1") == 0  # complete: nothing recomputed, nothing added
    assert read_output(out).num_rows == 4


def test_streaming_duplicates_become_error_rows_or_are_dropped(tmp_path: Path) -> None:
    rows = [("a", 1, "One"), ("b", 2, "Two"), ("a", 1, "Three"), ("c", 3, "Four")]
    lines = [json.dumps({"sid": s, "iid": i, "prompt": p}) for s, i, p in rows]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    stream = ("data.path=json", f"data.data_files={tmp_path / 'p.jsonl'}", "data.streaming=true")
    assert run_in_process(*stream, "data.id_column=sid", f"output.dir={tmp_path / 's'}") == 0
    by_string = read_output(tmp_path / "s")
    assert by_string.column("sid").to_pylist() == ["a", "b", None, "c"]
    assert by_string.column("finish_reason").to_pylist()[2] == "error"
    assert "duplicate id" in by_string.column("error").to_pylist()[2]
    # An integer id is the row_id itself: the later row cannot have one of its own, so it is dropped.
    assert run_in_process(*stream, "data.id_column=iid", f"output.dir={tmp_path / 'i'}") == 0
    assert read_output(tmp_path / "i").column("row_id").to_pylist() == [1, 2, 3]


def test_a_fresh_copy_of_the_input_elsewhere_resumes(tmp_path: Path) -> None:
    original = write_prompts(tmp_path / "a" / "p.parquet", 4)
    out = tmp_path / "o"
    assert run_in_process(f"data.path={original}", f"output.dir={out}", "shard.count=2", "shard.index=0") == 0
    staged = tmp_path / "scratch" / "p.parquet"
    staged.parent.mkdir()
    shutil.copyfile(original, staged)  # new inode and mtime, as cp without -p or staging to scratch gives
    assert run_in_process(f"data.path={staged}", f"output.dir={out}", "shard.count=2", "shard.index=1") == 0
    assert job_status(str(out)).complete


def test_a_copy_of_the_model_staged_elsewhere_resumes(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.parquet", 4)
    out = tmp_path / "o"
    shared = shutil.copytree(default_tiny_model(), tmp_path / "shared" / "tiny")
    assert run_in_process(f"model.path={shared}", f"data.path={prompts}", f"output.dir={out}", "shard.count=2",
                          "shard.index=0") == 0  # fmt: skip
    staged = shutil.copytree(shared, tmp_path / "node-local" / "job-7" / "model")  # another node's scratch
    assert run_in_process(f"model.path={staged}", f"data.path={prompts}", f"output.dir={out}", "shard.count=2",
                          "shard.index=1") == 0  # fmt: skip
    assert job_status(str(out)).complete
    record = json.loads((bookkeeping(out) / "_job.json").read_text())
    assert record["provenance"] == {"model_path": str(shared)}  # where the job first read it


def test_another_checkpoint_of_the_same_shape_in_the_same_folder_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    prompts = write_prompts(tmp_path / "p.parquet", 4)
    out = tmp_path / "o"
    model = shutil.copytree(default_tiny_model(), tmp_path / "checkpoint")
    base = (f"model.path={model}", f"data.path={prompts}", f"output.dir={out}", "shard.count=2")
    assert run_in_process(*base, "shard.index=0") == 0
    [weights] = model.glob("*.safetensors")
    before = weights.stat().st_size
    tensors = load_file(weights)
    save_file({name: t + 0.01 for name, t in tensors.items()}, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == before  # same names, shapes and size: a later step of the same training
    refused = run_cli(*base, "shard.index=1")
    assert refused.returncode == 2, refused.stderr
    assert "another job (model.weights.model.safetensors.sampled_sha256: " in refused.stderr


def test_a_start_that_failed_before_committing_does_not_block_the_fixed_rerun(tmp_path: Path) -> None:
    broken = unloadable_copy(default_tiny_model(), tmp_path / "broken-model")
    path = write_prompts(tmp_path / "p.parquet", 3)
    try:
        failed = run_in_process(f"model.path={broken}", f"data.path={path}", f"output.dir={tmp_path / 'o'}")
    except Exception:  # the weights fail to load: an error, whatever its exit path
        failed = 1
    assert failed != 0
    assert run_in_process(f"data.path={path}", f"output.dir={tmp_path / 'o'}") == 0
    assert read_output(tmp_path / "o").num_rows == 3


def test_overwrite_must_be_a_boolean(tmp_path: Path, capsys) -> None:
    path = write_table(tmp_path / "p.parquet", {"prompt": pa.array(["a"])})
    assert run_in_process(f"data.path={path}", f"output.dir={tmp_path / 'o'}", "output.overwrite=yes please") == 2
    assert "output.overwrite='yes please': must be true or false" in capsys.readouterr().err
