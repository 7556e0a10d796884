"""Which of some modules a whole `python -m batchjob` job imports (every thread's imports), run in a probe
process: the start-up tests check that a later job on a model skips transformers' config and auto classes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# Imported by a job's first run on a model (reading its config and choosing its tokenizer through transformers),
# never by later runs: seconds of a start-up on a GPU node.
FIRST_RUN_ONLY = ("transformers.models.auto.auto_factory", "transformers.generation", "sympy")
TOKENIZER_MODULE = "transformers.tokenization_utils_tokenizers"


def modules_a_job_imports(
    overrides: Sequence[str], env: Mapping[str, str], cwd: Path, watched: Sequence[str], timeout: float = 300
) -> set[str]:
    probe = (
        "import json, runpy, sys\n"
        # The command ends its process once the job is done (quick_exit.py): here it returns, to be asked.
        "from batchjob import quick_exit\n"
        "quick_exit.exit_now = sys.exit\n"
        f"sys.argv = {['batchjob', *overrides]!r}\n"
        "try:\n    runpy.run_module('batchjob', run_name='__main__')\nexcept SystemExit as end:\n"
        "    assert not end.code, end.code\n"
        f"print(json.dumps([m for m in {list(watched)!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.splitlines()[-1]))
