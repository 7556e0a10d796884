"""`engine.device` as a torch device, shared by the native and hf backends.

Both backends' `check_model` call it, so a device this machine does not have (`engine.device=cuda` on a machine
without CUDA, `cuda:3` where two GPUs are visible) is refused as the job checks its engine, before the output is
locked or a weight is read, instead of failing inside the model load.
"""

from __future__ import annotations

import os

import torch


def device_kind(name: str) -> str:
    """The kind of device `engine.device` names ("cpu", "cuda"), unchecked: `torch_device` checks it."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name.split(":")[0]


def torch_device(name: str) -> torch.device:
    """`auto` (the first GPU where CUDA is available, else the CPU), `cpu`, `cuda` or `cuda:N`; raises `ValueError`
    naming the fix for a GPU this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"engine.device={name} but CUDA is not available here: use engine.device=cpu (or auto)")
    visible = torch.cuda.device_count()
    if device.index is not None and device.index >= visible:
        raise ValueError(
            f"engine.device={name} but {visible} GPU{'s are' if visible != 1 else ' is'} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): use engine.device=cuda:0 to "
            f"cuda:{visible - 1}, or cuda"
        )
    return device
