"""Reading safetensors files in chunks (`weight_stream`): the same tensors as safetensors reads, however the file
is cut into chunks and row blocks, at offsets safetensors' own writer never produces, and a file with a dtype the
reader does not know is read through safetensors instead."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from batchjob.engine.native.layers.attention import TorchPagedAttention
from batchjob.engine.native.loading import weight_stream
from batchjob.engine.native.loading.model_loader import load_model
from batchjob.engine.native.loading.weight_stream import WeightReader, chunks, pieces, read_entries
from batchjob.job.tiny_model import make_tiny_model


def _write(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file written by hand, tensors in the given order with no padding between them."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _read_all(path) -> dict[str, torch.Tensor]:
    got: dict[str, list[torch.Tensor]] = {}
    with WeightReader(torch.device("cpu")) as reader:
        reader.read(
            path, read_entries(path), lambda piece, rows: got.setdefault(piece.entry.name, []).append(rows.clone())
        )
    return {name: torch.cat(parts) if parts[0].dim() else parts[0] for name, parts in got.items()}


def test_tensors_at_offsets_that_are_not_a_multiple_of_their_element_size_read_exactly(tmp_path):
    flags = torch.tensor([True, False, True])
    weights = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7
    half = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    scalar = torch.tensor(3, dtype=torch.int64)
    _write(
        tmp_path / "odd.safetensors",
        {
            "flags": ("BOOL", [3], flags.numpy().tobytes()),
            "weights": ("F32", [2, 3], weights.numpy().tobytes()),
            "half": ("BF16", [2], half.view(torch.int16).numpy().tobytes()),
            "scalar": ("I64", [], scalar.numpy().tobytes()),
        },
    )
    got = _read_all(tmp_path / "odd.safetensors")
    assert torch.equal(got["flags"], flags) and torch.equal(got["weights"], weights)
    assert torch.equal(got["half"], half) and torch.equal(got["scalar"], scalar)


def test_a_tensor_larger_than_a_chunk_is_read_in_blocks_of_whole_rows(tmp_path, monkeypatch):
    big = torch.randn(10, 6)
    small = torch.randn(3)
    _write(
        tmp_path / "big.safetensors",
        {"small": ("F32", [3], small.numpy().tobytes()), "big": ("F32", [10, 6], big.numpy().tobytes())},
    )
    entries = read_entries(tmp_path / "big.safetensors")
    cut = pieces(entries, chunk_bytes=3 * 6 * 4)  # three rows of `big`
    assert [(p.entry.name, p.row, p.rows) for p in cut] == [("small", 0, 3)] + [
        ("big", r, min(3, 10 - r)) for r in (0, 3, 6, 9)
    ]
    assert all(sum(p.end - p.begin for p in group) <= 72 for group in chunks(cut, 72))
    monkeypatch.setattr(weight_stream, "CHUNK_BYTES", 72)
    monkeypatch.setattr(weight_stream, "READERS", 3)
    got = _read_all(tmp_path / "big.safetensors")
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)


def test_a_file_with_a_dtype_the_reader_does_not_know_is_left_to_safetensors(tmp_path):
    _write(tmp_path / "new.safetensors", {"scales": ("F8_E8M0", [2], b"\x7f\x80")})
    assert read_entries(tmp_path / "new.safetensors") is None


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_model_loads_the_same_through_chunks_of_any_size(tmp_path, monkeypatch, arch):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch)
    reference = load_file(model_dir / "model.safetensors")

    def load():
        model, _ = load_model(model_dir, "float32", "cpu", TorchPagedAttention())
        return {name: p.clone() for name, p in model.named_parameters()}

    whole = load()
    monkeypatch.setattr(weight_stream, "CHUNK_BYTES", 4096)  # many chunks; embeddings and MLPs in row blocks
    monkeypatch.setattr(weight_stream, "READERS", 3)
    assert all(torch.equal(whole[name], p) for name, p in load().items())
    # q/k/v land in their rows of the fused projection, as the checkpoint has them
    q = reference["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(whole["layers.0.self_attn.qkv_proj.weight"][: q.shape[0]], q)
