"""Kernels compiled ahead by worker processes for this GPU, from an empty Triton cache: each variant goes to the
workers as the listing finds it, and the process's own launches then compile nothing, not even a kernel's launcher
(a C module the system's compiler builds per kernel signature, on Triton versions that have one).

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu/test_compile_pool_gpu.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]

SCENARIO = r"""
import json

import torch
from triton.backends.nvidia import driver as nvidia
from triton.runtime import build
from triton.runtime.driver import driver

from batchjob.engine.native.kernels import fused_ops
from batchjob.engine.native.runtime.compile_pool import CompilePool
from batchjob.engine.native.runtime.kernel_variants import skipping_launches, zeroed_allocations

g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(37, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
w = torch.randn(2048, device="cuda", dtype=torch.bfloat16, generator=g)
residual = torch.randn(37, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
gate_up = torch.randn(5, 2 * 1408, device="cuda", dtype=torch.bfloat16, generator=g)
steps = [
    lambda: fused_ops.rms_norm(x, w, 1e-5),
    lambda: fused_ops.rms_norm(x, w, 1e-5, residual=residual.clone())[0],
    lambda: fused_ops.silu_and_mul(gate_up),
]
target = driver.active.get_current_target()
pool = CompilePool(2, (target.backend, target.arch, target.warp_size))
handed = []
with zeroed_allocations(), skipping_launches(lambda v: (handed.append(v.qualname), pool.submit([v]))) as found:
    for step in steps:
        step()
report = pool.wait(300)

builds = []
real_build = build._build
build._build = lambda name, *rest: (builds.append(name), real_build(name, *rest))[1]
outputs = [step().float() for step in steps]
torch.cuda.synchronize()

def norm(v):
    v = v.float()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

gate, up = gate_up.float().chunk(2, dim=-1)
expected = [norm(x), norm(x.float() + residual.float()), torch.nn.functional.silu(gate) * up]
print(json.dumps({
    "handed": handed,
    "found": [v.qualname for v in found],
    "compiled": len(report.compiled),
    "failed": [why for _, why in report.failed],
    "per_kernel_launchers": hasattr(nvidia, "make_launcher"),
    "builds": builds,
    "max_error": max(float((o - e).abs().max() / e.abs().max()) for o, e in zip(outputs, expected)),
}))
"""


def test_workers_compile_each_variant_as_listed_and_its_launcher_too(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    assert report["handed"] == report["found"] == ["_rms_norm_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel"]
    assert report["compiled"] == 3 and report["failed"] == []
    assert report["builds"] == [], "the launches built a launcher the workers should have built"
    assert report["max_error"] < 1e-2, "relative to the largest output"
