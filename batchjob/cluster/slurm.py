"""Slurm integration: shard defaults from Slurm's variables, and requeue after preemption.

Shards. An array task's id *is* its shard number (so resubmitting `--array=2` redoes shard 2), and every
task of an `srun` step splits its array task's shard further by `SLURM_PROCID`:

    shard.index = array_task_id * step_tasks + procid        shard.count = array_size * step_tasks

The conf uses `${slurm_shard_index:}` / `${slurm_shard_count:}` as defaults; outside Slurm they are 0 / 1.
Only an array whose ids are exactly 0..N-1 gives `shard.count` on its own: for any other set (a subset
resubmitted, an offset range) the count is ambiguous and must be given.

Preemption. The job's signal handler commits finished rows, then calls `requeue_after_preemption`, which
puts this task back in the queue; the requeued task resumes from its manifest. The same `scontrol requeue`
serves the Hydra submitit launcher: its checkpoint protocol resubmits the same callable with the same
arguments, which is exactly the pickle already on disk, so only the requeue and a `SystemExit` (not an
exception, which submitit would record as the task's failed result) are needed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from omegaconf import OmegaConf

from batchjob.errors import ConfigError

log = logging.getLogger(__name__)

INDEX_RESOLVER = "slurm_shard_index"
COUNT_RESOLVER = "slurm_shard_count"
# Slurm's job state/reason after SIGTERM when nothing else will restart the task: a time limit hit
# without (or despite) the USR1 margin, or a preemption that cancels instead of requeueing.
_REQUEUE_AFTER_TERM = {"TimeLimit", "TIMEOUT", "PREEMPTED"}


@dataclass(frozen=True)
class SlurmShard:
    index: int
    count: int


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    return int(value) if value not in (None, "") else None


def _step_tasks(env: Mapping[str, str]) -> tuple[int, int]:
    """(procid, tasks) of this process's `srun` step, or (0, 1) in a batch script or outside Slurm."""
    # The batch script itself sees SLURM_NTASKS too, but it is one process: only a step's tasks
    # (SLURM_STEP_ID set) are the parallel processes that each need their own shard.
    if _int(env, "SLURM_STEP_ID") is None:
        return 0, 1
    tasks = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS") or 1
    return _int(env, "SLURM_PROCID") or 0, tasks


def _array_count(env: Mapping[str, str]) -> int:
    task_count = _int(env, "SLURM_ARRAY_TASK_COUNT")
    if task_count is None:
        return 1
    lowest, highest = _int(env, "SLURM_ARRAY_TASK_MIN"), _int(env, "SLURM_ARRAY_TASK_MAX")
    if lowest != 0 or highest != task_count - 1:
        raise ConfigError(
            f"this Slurm array has {task_count} task(s) with ids {lowest}..{highest}, not 0..N-1, so the "
            "shard count is ambiguous: array task ids are shard indices. Submit --array=0-<N-1>, or (to "
            "rerun some shards of an N-shard job) pass shard.count=<N> explicitly"
        )
    return task_count


def shard_from_env(env: Mapping[str, str] | None = None) -> SlurmShard:
    """This process's shard from Slurm's array and step variables; SlurmShard(0, 1) outside Slurm."""
    env = os.environ if env is None else env
    procid, tasks = _step_tasks(env)
    array_task = _int(env, "SLURM_ARRAY_TASK_ID") or 0
    return SlurmShard(index=array_task * tasks + procid, count=_array_count(env) * tasks)


def _shard_index() -> int:
    env = os.environ
    procid, tasks = _step_tasks(env)
    # Computed without the array size, so `shard.count=N` given explicitly makes a subset array valid.
    return (_int(env, "SLURM_ARRAY_TASK_ID") or 0) * tasks + procid


def register_resolvers() -> None:
    """Make `${slurm_shard_index:}` and `${slurm_shard_count:}` available to the conf."""
    if not OmegaConf.has_resolver(INDEX_RESOLVER):
        OmegaConf.register_new_resolver(INDEX_RESOLVER, _shard_index)
    if not OmegaConf.has_resolver(COUNT_RESOLVER):
        OmegaConf.register_new_resolver(COUNT_RESOLVER, lambda: shard_from_env().count)


def slurm_task_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id `scontrol requeue` needs for this task (`<array job>_<task>` in an array), or None."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def _slurm_command(*args: str, timeout_s: float) -> subprocess.CompletedProcess | None:
    """Run a Slurm client command; None when it cannot run. The rows are already committed when this is
    called, so a missing client or a hung controller must cost a log line, not the exit status."""
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("%s failed: %s", args[0], err)
        return None


def _state_and_reason(task_id: str) -> set[str]:
    done = _slurm_command("squeue", "-h", "-j", task_id, "-o", "%T %r", timeout_s=30)
    return set(done.stdout.split()) if done is not None and done.returncode == 0 else set()


def requeue_after_preemption(signum: int, env: Mapping[str, str] | None = None) -> str | None:
    """After the runner committed on `signum`, put this Slurm task back in the queue.

    USR1 is the sbatch template's (and submitit's) warning before the time limit, or a deliberate
    `scancel --signal=USR1`: always requeue. SIGTERM also comes from `scancel` (the user wants the task
    gone) and from `scontrol requeue` or a requeueing preemption (Slurm restarts it anyway), which look
    alike from inside; only a time limit or a cancelling preemption, visible in the job's state, is
    requeued. Returns the requeued task id, or None when nothing was requeued (or not under Slurm).
    """
    env = os.environ if env is None else env
    task_id = slurm_task_id(env)
    if task_id is None or signum not in (signal.SIGUSR1, signal.SIGTERM):
        return None
    if signum == signal.SIGTERM and not _state_and_reason(task_id) & _REQUEUE_AFTER_TERM:
        log.info("SIGTERM from Slurm: left to Slurm whether task %s runs again (scancel or requeue)", task_id)
        return None
    done = _slurm_command("scontrol", "requeue", task_id, timeout_s=60)
    if done is None:
        return None
    if done.returncode != 0:
        # Another task of the same job (or Slurm itself) may have requeued it first: not an error.
        log.warning("scontrol requeue %s failed: %s", task_id, done.stderr.strip() or done.stdout.strip())
        return None
    log.warning("requeued Slurm task %s: it resumes from its manifest when it restarts", task_id)
    return task_id
