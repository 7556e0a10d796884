"""output.dir holds batchjob's parts and nothing else: a folder with anything else in it is refused before
anything is written, while a job's own output (parts of any shard, what a crash left) is accepted."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest
from conftest import bookkeeping
from fsspec.implementations.memory import MemoryFileSystem

from batchjob.io import OutputDataset, OutputDirError

JOB = {"model": "tiny", "sampling": {"max_new_tokens": 4}}


def rows(ids: list[int]) -> pa.Table:
    return pa.table({"row_id": pa.array(ids, pa.int64())})


def strangers_folder(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "important.txt").write_text("keep me")
    return out


def test_a_folder_holding_other_files_is_refused_naming_them_and_the_fix(tmp_path: Path) -> None:
    out = strangers_folder(tmp_path)
    with pytest.raises(OutputDirError) as refused:
        OutputDataset(str(out)).open(JOB)
    message = str(refused.value)
    assert f"output.dir={out} holds files batchjob did not write (important.txt, sub/)" in message
    assert "set output.dir to an empty or new folder" in message
    assert sorted(os.listdir(out)) == ["important.txt", "sub"] and not bookkeeping(out).exists()


def test_a_folder_holding_other_files_is_refused_even_with_overwrite(tmp_path: Path) -> None:
    out = strangers_folder(tmp_path)
    with pytest.raises(OutputDirError, match="important.txt"):
        OutputDataset(str(out)).open(JOB, resume=False, overwrite=True)
    assert (out / "important.txt").read_text() == "keep me"


def test_a_folder_holding_hidden_files_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".DS_Store").write_bytes(b"\0")
    with pytest.raises(OutputDirError, match=r"\(\.DS_Store\)"):
        OutputDataset(str(out)).open(JOB)


def test_a_jobs_output_with_a_file_added_is_refused_with_the_fix_that_resumes_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with OutputDataset(str(out)) as dataset:
        dataset.open(JOB)
        dataset.commit(rows([0]))
    (out / ".ipynb_checkpoints").mkdir()
    fix = r"\(\.ipynb_checkpoints/\); .*: delete them \(or move them out\) to resume"
    with pytest.raises(OutputDirError, match=fix):
        OutputDataset(str(out)).open(JOB)
    (out / ".ipynb_checkpoints").rmdir()
    with OutputDataset(str(out)) as dataset:
        dataset.open(JOB)
        assert dataset.committed_row_ids().tolist() == [0]


def test_a_long_list_of_other_files_is_cut_short_with_a_count(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for i in range(12):
        (out / f"photo{i:02d}.jpg").write_bytes(b"")
    with pytest.raises(OutputDirError, match=r"\(photo00.jpg, photo01.jpg, .*photo04.jpg and 7 more\)"):
        OutputDataset(str(out)).open(JOB)


def test_an_empty_or_new_folder_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new"):
        with OutputDataset(str(out)) as dataset:
            dataset.open(JOB)
            dataset.commit(rows([0]))
        assert os.listdir(out) == ["part-s00000-000000.parquet"]


def test_a_jobs_own_output_resumes_with_other_shards_parts_and_a_crashs_leftovers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for index in (0, 1):
        with OutputDataset(str(out), index, 2) as shard:
            shard.open(JOB)
            shard.commit(rows([index]))
    # What a kill -9 can leave inside output.dir: a part of shard 1 staged there (a mounted output.dir), and
    # an NFS client's name for a part deleted while a reader held it open.
    (out / ".part-s00001-000001.parquet.tmp").write_bytes(b"PAR1")
    (out / ".nfs00000000012f4a2b00000001").write_bytes(b"PAR1")
    with OutputDataset(str(out), 0, 2) as shard:
        shard.open(JOB)
        assert shard.committed_row_ids().tolist() == [0]
    with OutputDataset(str(out), 1, 2) as shard:
        shard.open(JOB)
        assert shard.committed_row_ids().tolist() == [1]
    assert not (out / ".part-s00001-000001.parquet.tmp").exists(), "its shard's next open deleted it"


def test_an_output_dir_inside_another_jobs_output_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    first = tmp_path / "run1"
    with OutputDataset(str(first)) as dataset:
        dataset.open(JOB)
        dataset.commit(rows([0, 1]))
    for inside in (first / "retry", first / "a" / "b"):
        with pytest.raises(OutputDirError) as refused:
            OutputDataset(str(inside)).open(JOB)
        assert str(refused.value) == (
            f"output.dir={inside} is inside {first}, another job's output.dir; every reader of that folder reads all "
            "of it, so this job's files would show up there as extra or duplicate rows: set output.dir to a folder "
            f"outside {first}"
        )
    assert os.listdir(first) == ["part-s00000-000000.parquet"]


def test_a_jobs_bookkeeping_folder_or_a_folder_inside_it_is_refused_as_output_dir(tmp_path: Path) -> None:
    run1 = tmp_path / "run1"
    with OutputDataset(str(run1)) as dataset:
        dataset.open(JOB)
    folder = bookkeeping(run1)
    for out, inside in ((folder, ""), (folder / "manifests", "inside "), (folder / "new", "inside ")):
        with pytest.raises(OutputDirError) as refused:
            OutputDataset(str(out)).open(JOB)
        assert str(refused.value) == (
            f"output.dir={out} is {inside}{folder}, where batchjob keeps the record, manifests and locks of the "
            f"output {run1}: set output.dir={run1} to resume that job, or a folder outside {folder}"
        )
    assert not (folder / "new").exists()


class PrefixPolicyStore(MemoryFileSystem):
    """An object store whose policy grants this user one prefix: asked whether anything else exists, it answers
    403, which s3fs raises as PermissionError."""

    protocol = "policy"
    granted = "/bucket/team/me/"

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.removeprefix("policy://"))

    def exists(self, path: str, **kwargs: object) -> bool:
        if not self._strip_protocol(path).startswith(self.granted):
            raise PermissionError(f"403 Forbidden: HEAD {path}")
        return super().exists(path, **kwargs)


def test_folders_above_output_dir_that_this_user_may_not_read_are_not_taken_for_another_jobs() -> None:
    fsspec.register_implementation("policy", PrefixPolicyStore, clobber=True)
    out = f"policy:/{PrefixPolicyStore.granted}run-{uuid.uuid4().hex}"
    with OutputDataset(out) as dataset:
        dataset.open(JOB)
        dataset.commit(rows([0]))
    with pytest.raises(PermissionError):
        PrefixPolicyStore().exists("/bucket/team.batchjob/_job.json")


def test_a_sibling_of_a_jobs_output_is_accepted(tmp_path: Path) -> None:
    for name in ("run1", "run2"):
        with OutputDataset(str(tmp_path / name)) as dataset:
            dataset.open(JOB)
            dataset.commit(rows([0]))


def test_the_check_alone_writes_nothing(tmp_path: Path) -> None:
    out = strangers_folder(tmp_path)
    with pytest.raises(OutputDirError):
        OutputDataset(str(out)).check_dir()
    OutputDataset(str(tmp_path / "new")).check_dir()
    assert not (tmp_path / "new").exists() and not bookkeeping(out).exists()


def test_a_prefix_holding_other_objects_is_refused_on_an_s3_server(s3_output_dir: str) -> None:
    fs, path = fsspec.core.url_to_fs(s3_output_dir, use_listings_cache=False)
    fs.pipe_file(f"{path}/notes.csv", b"a,b\n")
    with pytest.raises(OutputDirError, match=r"holds files batchjob did not write \(notes.csv\)"):
        OutputDataset(s3_output_dir).open(JOB)
    assert not fs.exists(path + ".batchjob")


def test_a_prefix_inside_another_jobs_output_is_refused_on_an_s3_server(s3_output_dir: str) -> None:
    with OutputDataset(s3_output_dir) as dataset:
        dataset.open(JOB)
    with pytest.raises(OutputDirError, match=rf"is inside {s3_output_dir}, another job's output.dir"):
        OutputDataset(f"{s3_output_dir}/retry").open(JOB)


def test_an_output_dir_inside_a_deleted_jobs_output_names_the_record_left_behind(tmp_path: Path) -> None:
    first = tmp_path / "run1"
    with OutputDataset(str(first)) as dataset:
        dataset.open(JOB)
        dataset.commit(rows([0, 1]))
    shutil.rmtree(first)  # the user deleted the output by hand, not its bookkeeping folder beside it
    inside = first / "retry"
    with pytest.raises(OutputDirError) as refused:
        OutputDataset(str(inside)).open(JOB)
    record = bookkeeping(first)
    assert str(refused.value) == (
        f"output.dir={inside} is inside {first}, the output.dir of the job recorded in {record}, whose committed parts "
        f"are no longer in {first}: if that output was deleted, delete {record} as well (it holds only that job's "
        f"record, manifests and locks); else set output.dir to a folder outside {first}"
    )
    assert not first.exists()
    shutil.rmtree(record)  # as the message says
    with OutputDataset(str(inside)) as dataset:
        dataset.open(JOB)
        dataset.commit(rows([0]))
    assert os.listdir(inside) == ["part-s00000-000000.parquet"]


def test_a_prefix_inside_a_deleted_jobs_output_names_the_record_left_behind_on_an_s3_server(
    s3_output_dir: str,
) -> None:
    fs, path = fsspec.core.url_to_fs(s3_output_dir, use_listings_cache=False)
    with OutputDataset(s3_output_dir) as dataset:
        dataset.open(JOB)
        dataset.commit(rows([0, 1]))
    fs.rm(path, recursive=True)
    with pytest.raises(OutputDirError, match=rf"whose committed parts are no longer in {s3_output_dir}: if that "):
        OutputDataset(f"{s3_output_dir}/retry").open(JOB)
