"""One job's life: checks before and beside the engine's start-up (`checks.py`), the wiring from config to
output (`run.py`), one shard's generation loop (`shard_loop.py`), the job record's fingerprint
(`fingerprint.py`), each process's saved config and log (`run_files.py`), stop signals (`signals.py`), a stderr
that may lose its reader (`stderr.py`), progress (`progress.py`), start-up timing (`startup.py`) and the embedded
default model (`tiny_model.py`).

Above the engine and the IO layer, which it wires together; neither imports anything from here. Keep this file
free of imports: `python -m batchjob` imports `job.startup` before anything else.
"""
