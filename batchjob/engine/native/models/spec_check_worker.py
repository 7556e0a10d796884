"""`spec_check.py`'s worker: `python -m batchjob.engine.native.models.spec_check_worker MODEL_DIR` reads the model's
config through transformers, keeps the spec in the spec cache and prints it (as `spec_check.comparable` does)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from batchjob.engine.native.models.registry import transformers_spec
from batchjob.engine.native.models.spec_check import comparable

if __name__ == "__main__":
    print(json.dumps(comparable(transformers_spec(Path(sys.argv[1])))))
