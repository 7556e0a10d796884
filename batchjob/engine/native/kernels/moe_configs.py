"""Launch configs of the fused MoE kernel: a table of measured winners per GPU and expert shape, and a default.

The table (`moe_configs.json`, written by scripts/tune_moe.py on the GPU it describes) maps
device name -> shape key (experts, intermediate size, hidden size, top-k, dtype) -> token count -> config.
A step's config is the entry whose token count is nearest to the step's in ratio, so a decode bucket between
two tuned counts takes the closer one (tuned counts are powers of two: the engine's warm-up, sweeping step
sizes by doubling, then meets every config a run can choose and compiles it before the run). The choice reads
host integers and a cached device name only: no synchronisation, and a CUDA graph captured for a batch bucket
replays with the config it was captured with.

The two grouped GEMMs (gate/up with SiLU-and-mul, down with the routing weight) share `block_m`, which is also
the alignment of each expert's rows, so one alignment serves both; their column and depth tiles, warps and
pipeline stages are chosen apart, as their shapes differ ([2I, H] against [H, I] per expert).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("moe_configs.json")


@dataclass(frozen=True)
class GemmTile:
    """Tile of one grouped GEMM: output columns and depth per step, warps, software-pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoEConfig:
    """`block_m` rows per block (and per-expert alignment), then each projection's tile."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, entry: dict) -> MoEConfig:
        return cls(entry["block_m"], GemmTile(**entry["gate_up"]), GemmTile(**entry["down"]))


def _same_tile(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> MoEConfig:
    tile = GemmTile(block_n, block_k, num_warps, num_stages)
    return MoEConfig(block_m, tile, tile)


# Untuned shapes choose by the average number of rows each expert gets (T*K/E): a decode batch gives most
# experts a handful of rows (a 16-row block wastes the least padding and the step is bound by reading the
# experts' weights), a prefill gives each expert hundreds (wider tiles reuse each weight tile over more rows).
_DECODE = _same_tile(16, 64, 128, 4, 4)
_MEDIUM = _same_tile(32, 64, 128, 4, 4)
_PREFILL = _same_tile(64, 128, 64, 8, 4)


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 24:
        return _DECODE
    if rows_per_expert <= 96:
        return _MEDIUM
    return _PREFILL


def shape_key(num_experts: int, intermediate: int, hidden: int, top_k: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},I={intermediate},H={hidden},top_k={top_k},dtype={str(dtype).removeprefix('torch.')}"


@dataclass(frozen=True, eq=False)  # hashed by identity: moe_config's cache takes it as an argument
class MoEConfigTable:
    """device name -> shape key -> {token count: config}."""

    entries: dict[str, dict[str, dict[int, MoEConfig]]]

    @classmethod
    def load(cls, path: Path) -> MoEConfigTable:
        if not path.exists():
            return cls({})
        raw = json.loads(path.read_text())
        return cls(
            {
                device: {
                    shape: {int(tokens): MoEConfig.from_json(entry) for tokens, entry in by_tokens.items()}
                    for shape, by_tokens in shapes.items()
                }
                for device, shapes in raw.items()
            }
        )

    def to_json(self) -> dict:
        return {
            device: {
                shape: {str(tokens): config.to_json() for tokens, config in sorted(by_tokens.items())}
                for shape, by_tokens in sorted(shapes.items())
            }
            for device, shapes in sorted(self.entries.items())
        }

    def lookup(self, device: str, shape: str, num_tokens: int) -> MoEConfig | None:
        by_tokens = self.entries.get(device, {}).get(shape)
        if not by_tokens:
            return None
        # Nearest in ratio; a tie goes to the smaller count (its smaller blocks waste less padding).
        nearest = min(by_tokens, key=lambda tuned: (abs(math.log(tuned / max(num_tokens, 1))), tuned))
        return by_tokens[nearest]


@functools.cache
def package_table() -> MoEConfigTable:
    return MoEConfigTable.load(TABLE_PATH)


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


# Eager steps (prefills) ask once per layer: the answer for a step size is kept.
@functools.lru_cache(maxsize=4096)
def moe_config(
    num_tokens: int,
    num_experts: int,
    intermediate: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
    table: MoEConfigTable | None = None,
) -> MoEConfig:
    """The tuned config for this step's shape on this device, else the default for its rows per expert."""
    table = table if table is not None else package_table()
    key = shape_key(num_experts, intermediate, hidden, top_k, dtype)
    tuned = table.lookup(device_name(device), key, num_tokens)
    return tuned if tuned is not None else default_config(num_tokens, top_k, num_experts)
