"""Launching a kernel in the pipeline stages the GPU's shared memory holds.

A kernel's tiles and stages are chosen for the GPU they were measured on (Hopper: 227 KB of shared memory a block);
a GPU of about 100 KB (an L4, an L40S, an A10, an RTX 4090) cannot hold as many stages of the same tiles, and
Triton refuses such a launch before it runs anything. `launch_in_stages_that_fit` then tries a stage fewer, and
remembers what fitted, so a GPU where the first launch fits pays one dictionary lookup a launch.
"""

from __future__ import annotations

from collections.abc import Callable

from triton.runtime.errors import OutOfResources

# The stages a launch of each key (device, dtypes, the variant's tiles) went with.
_stages_that_fit: dict[tuple, int] = {}


def launch_in_stages_that_fit(launch: Callable[[int], None], key: tuple, stages: int) -> None:
    """`launch(stages)`, with a stage fewer each time the GPU's shared memory cannot hold them; `key` names what
    fixes the launch's shared memory besides its stages."""
    stages = _stages_that_fit.get(key, stages)
    while True:
        try:
            launch(stages)
        except OutOfResources as exc:
            if exc.name != "shared memory" or stages <= 1:
                raise
            stages -= 1
            continue
        _stages_that_fit[key] = stages
        return
