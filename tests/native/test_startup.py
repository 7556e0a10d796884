"""Start-up work the native engine must not do: import torch's compiler (torch._dynamo, seconds before any
GPU work) just to build, on the meta device, a model it then fills from its checkpoint."""

from __future__ import annotations

import subprocess
import sys

from batchjob.job.tiny_model import make_tiny_model


def test_creating_an_engine_does_not_import_torch_dynamo(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    code = (
        "import sys; from batchjob.engine import create_engine; "
        f"engine = create_engine('native', {str(model_dir)!r}, {{'num_kv_blocks': 128}}); "
        "print('torch._dynamo' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "False"
