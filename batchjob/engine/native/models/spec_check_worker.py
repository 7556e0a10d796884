"""`spec_check.py`'s worker: `python -m batchjob.engine.native.models.spec_check_worker MODEL_DIR` reads the model's
config through transformers, keeps the spec in the spec cache and prints it (as `spec_check.comparable` does)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from batchjob.engine.native.models.registry import transformers_spec
from batchjob.engine.native.models.spec_check import comparable

# Packages that transformers imports whenever they are installed and that reading a config never uses: hidden
# from it here (a module set to None is one `importlib.util.find_spec` reports missing). On a 16-core GPU host
# torchvision took 4.2 s of this worker's 12.5 s, and scikit-learn (which transformers 5.17 imports with its
# generation utilities) 1.4 s, while the start-up beside it needs those cores.
UNUSED = ("torchvision", "torchaudio", "sklearn")


def main(model_dir: str) -> None:
    for name in UNUSED:
        sys.modules.setdefault(name, None)
    print(json.dumps(comparable(transformers_spec(Path(model_dir)))))


if __name__ == "__main__":
    main(sys.argv[1])
