"""Shard defaults from Slurm's variables, and the local data-parallel split (no cluster needed)."""

import signal

import pytest

from batchjob.cluster.data_parallel import ChildShard, child_command, plan_children
from batchjob.cluster.slurm import SlurmShard, requeue_after_preemption, shard_from_env, slurm_task_id
from batchjob.errors import ConfigError


def array_env(task: int, lowest: int = 0, highest: int = 3, count: int = 4) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "107",
        "SLURM_ARRAY_JOB_ID": "100",
        "SLURM_ARRAY_TASK_ID": str(task),
        "SLURM_ARRAY_TASK_MIN": str(lowest),
        "SLURM_ARRAY_TASK_MAX": str(highest),
        "SLURM_ARRAY_TASK_COUNT": str(count),
    }


def step_env(procid: int, tasks: int) -> dict[str, str]:
    return {"SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(tasks)}


def test_outside_slurm_is_the_whole_input() -> None:
    assert shard_from_env({}) == SlurmShard(0, 1)


def test_array_task_id_is_the_shard_index_and_array_size_the_count() -> None:
    assert [shard_from_env(array_env(t)) for t in range(4)] == [SlurmShard(t, 4) for t in range(4)]


def test_single_job_tasks_split_by_procid() -> None:
    assert [shard_from_env(step_env(p, 8)) for p in range(8)] == [SlurmShard(p, 8) for p in range(8)]


def test_array_times_tasks_covers_every_shard_once() -> None:
    shards = [shard_from_env({**array_env(t), **step_env(p, 2)}) for t in range(4) for p in range(2)]
    assert sorted(s.index for s in shards) == list(range(8))
    assert {s.count for s in shards} == {8}


def test_batch_script_is_one_process_even_with_many_tasks() -> None:
    # The batch shell sees SLURM_NTASKS but is not a step task: it must not claim 1/ntasks of the input.
    env = {**array_env(1), "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}
    assert shard_from_env(env) == SlurmShard(1, 4)


def test_array_not_starting_at_zero_needs_an_explicit_count() -> None:
    with pytest.raises(ConfigError, match="shard.count=<N>"):
        shard_from_env(array_env(2, lowest=2, highest=2, count=1))


def test_array_with_gaps_needs_an_explicit_count() -> None:
    with pytest.raises(ConfigError, match="not 0..N-1"):
        shard_from_env(array_env(0, lowest=0, highest=5, count=3))


def test_requeue_id_names_the_array_task() -> None:
    assert slurm_task_id(array_env(3)) == "100_3"
    assert slurm_task_id({"SLURM_JOB_ID": "42"}) == "42"
    assert slurm_task_id({}) is None


def test_requeue_after_preemption_does_nothing_outside_slurm() -> None:
    assert requeue_after_preemption(signal.SIGUSR1, env={}) is None
    assert requeue_after_preemption(signal.SIGTERM, env={}) is None


def test_requeue_after_ctrl_c_does_nothing_even_under_slurm() -> None:
    assert requeue_after_preemption(signal.SIGINT, env=array_env(1)) is None


def test_data_parallel_children_split_the_parent_shard_on_visible_gpus() -> None:
    children = plan_children(2, shard_index=1, shard_count=4, env={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert children == [ChildShard("4", 2, 8), ChildShard("5", 3, 8)]


def test_data_parallel_without_enough_gpus_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="only 1 GPU"):
        plan_children(2, 0, 1, env={"CUDA_VISIBLE_DEVICES": "0"})


def test_child_command_replaces_shard_and_data_parallel_overrides() -> None:
    cmd = child_command(["data.path=x", "shard.index=1", "+engine.data_parallel=2"], ChildShard("0", 2, 8), "py")
    assert cmd == ["py", "-m", "batchjob", "data.path=x", "shard.index=2", "shard.count=8", "++engine.data_parallel=1"]
