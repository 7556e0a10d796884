"""Tensor parallelism inside one engine: which rank of how many this process is, and the collectives the
model runs.

An engine with `tensor_parallel=N` is N rank processes (`rank_process.py`), one per GPU, joined in one
`torch.distributed` group: NCCL on GPUs, gloo on CPU. A rank process calls `join` once, before it builds its
engine; the loader, the model and the KV sizing then read `current()`. Every other process (the job process,
a single-device engine) is `SINGLE`, on which every collective is the identity.

The collectives are plain `torch.distributed` calls on the current stream, so a CUDA graph captured on a rank
records them like any kernel: the graphs of all ranks replay the same collectives in the same order because
every rank runs the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    # engine.deterministic: sums over ranks are gathered and added in rank order on every rank, whatever the
    # message size (NCCL picks its reduction algorithm, and so its order of additions, by size)
    ordered_sums: bool = False

    @property
    def active(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x`, in place (row-parallel layers: each rank holds a partial sum)."""
        if not self.active:
            return x
        if not self.ordered_sums:
            dist.all_reduce(x)
            return x
        parts = self._gather(x)
        x.copy_(parts[0])
        for part in parts[1:]:
            x += part
        return x

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        if x.is_cuda:
            gathered = x.new_empty((self.size, *x.shape))
            dist.all_gather_into_tensor(gathered, x)
            return list(gathered.unbind(0))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return parts

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank r's columns at r * n (vocab-parallel logits)."""
        if not self.active:
            return x
        return torch.cat(self._gather(x), dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest `value` of all ranks (sizes every rank must agree on, such as the KV cache's)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def vocab_per_rank(vocab_size: int, size: int) -> int:
    """Embedding and lm_head rows of one rank: the vocabulary padded to a multiple of `size`, split evenly."""
    return -(-vocab_size // size)


SINGLE = TensorParallel(rank=0, size=1)
_current = SINGLE


def current() -> TensorParallel:
    """This process's place in its engine's tensor-parallel group (`SINGLE` outside a rank process)."""
    return _current


def join(
    rank: int, size: int, store_path: str, device: torch.device, timeout_s: float, ordered_sums: bool = False
) -> TensorParallel:
    """Join the group of `size` ranks that meet at the file store `store_path`; called once per rank process.
    Collectives that wait longer than `timeout_s` for a peer fail instead of hanging."""
    global _current
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
    _current = TensorParallel(rank=rank, size=size, ordered_sums=ordered_sums)
    return _current
