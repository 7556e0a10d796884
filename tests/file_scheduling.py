"""How `pytest -n N` hands tests to its workers (pytest-xdist's scheduler hook, in tests/conftest.py).

A test file is one unit of work, run whole on one worker, so its module fixtures (tiny models, reference runs)
are made once; all of tests/gpu is one unit, so GPU tests run one at a time, as they share the GPU. Units go
out in collection order, where tests/conftest.py puts the Slurm jobs first.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

GPU_TESTS = "tests/gpu/"


class FileScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return GPU_TESTS if path.startswith(GPU_TESTS) else path
