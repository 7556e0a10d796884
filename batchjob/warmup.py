"""`python -m batchjob.warmup [key=value ...]`: fill the caches a job's start-up fills, then exit.

Give it the job's own overrides (`model.path`, `engine.*`, `sampling.*`, `data.format`: they decide which kernels
and graphs the engine needs). It starts the engine as the job would (the model's spec, its tokenizer, the GPU
kernels compiled by the start-up's warm-up) and stops it, without reading the input or touching `output.dir`.
Everything lands in `$BATCHJOB_CACHE` (compiled kernels, model specs, tokenizer classes, the package listing, kept
bytecode): run it once per GPU kind and software version on a node of that kind, with `BATCHJOB_CACHE` on storage
the array's tasks share, and every task starts warm.

`data.limit` is ignored: a job of fewer rows than `engine.max_num_seqs` lowers it to the row count, so a short
job compiles only its small steps' kernels and a real job's larger steps would compile cold.
`engine.data_parallel` is ignored too (every GPU of one kind uses the same kernels). Exit status: 0 once warm,
2 for a bad config or a model that cannot start here.
"""

from __future__ import annotations

import logging
import sys

from batchjob.job.startup import StartupClock, keep_bytecode

_STARTUP = StartupClock()
keep_bytecode()  # as `python -m batchjob`: bytecode an environment cannot keep goes to the cache too

import hydra  # noqa: E402
from omegaconf import DictConfig, open_dict  # noqa: E402

from batchjob.__main__ import cli, composed  # noqa: E402  (its import registers the conf's resolvers)
from batchjob.errors import EXIT_USAGE, ConfigError  # noqa: E402

log = logging.getLogger("batchjob")
# The engine options that decide which kernels and graphs a start-up compiles, named in the log line.
KERNEL_OPTIONS = (
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "quantization",
    "kv_cache_dtype",
    "tensor_parallel",
    "deterministic",
    "graph_sampling",
    "graph_constrained",
)


def warm(cfg: DictConfig, startup: StartupClock | None = None) -> int:
    """Start and stop the engine `cfg`'s job would run; returns the exit status."""
    from batchjob.caches import cache_root
    from batchjob.config.settings import load_settings
    from batchjob.engine import EngineSetupError, create_engine
    from batchjob.job.checks import choose_engine, load_tokenizer
    from batchjob.job.fingerprint import resolve_model_path
    from batchjob.job.run import import_libraries, quiet_libraries

    startup = startup or StartupClock()
    quiet_libraries()
    with open_dict(cfg):
        cfg.data.limit = None
        cfg.engine.data_parallel = 1
    try:
        settings = load_settings(cfg)
        model_path = resolve_model_path(settings.model_path)
        startup.lap("config_s")
        import_libraries()  # torch, before the engine's choice imports it: the phases read as the job's do
        startup.lap("imports_s")
        settings = choose_engine(settings, model_path)
        startup.lap("config_s")
        with startup.timed("tokenizer_s"):
            load_tokenizer(model_path)  # the tokenizer class transformers picks is kept too
        engine = create_engine(settings.engine_name, model_path, settings.engine_options, settings.engine_asked)
    except (ConfigError, EngineSetupError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        engine.settle()  # a config.json read without transformers is checked, and the reading kept, before the end
        startup.lap("engine_s")
        summary = startup.summary(engine.stats())
    except EngineSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        engine.close()
    shaping = {key: settings.engine_options[key] for key in KERNEL_OPTIONS if key in settings.engine_options}
    log.info(
        "warm: engine=%s for %s (%s), %s; caches in %s",
        settings.engine_name,
        model_path,
        ", ".join(f"engine.{key}={value}" for key, value in shaping.items()),
        startup.ready_line(summary, moment="started and stopped"),
        cache_root(),
    )
    return 0


@hydra.main(config_path="pkg://batchjob.conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    composed()
    status = warm(cfg, _STARTUP)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    from batchjob.job.stderr import drop_stderr_when_unread

    drop_stderr_when_unread()  # as the job: a reader gone before the warm-up is must not turn "warm" into a failure
    cli(main)
