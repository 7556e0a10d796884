"""The Python API: `batchjob.run` (a whole job, through the command line's code path, `job.py`) and
`batchjob.LLM` (an engine in this process, `llm.py`). `batchjob/__init__.py` exports both lazily."""
