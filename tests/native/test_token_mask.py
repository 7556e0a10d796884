"""The structured-outputs mask: the Triton kernel (through the interpreter on CPU) and the torch path forbid
exactly the tokens whose bit is clear, only in constrained rows, and the sampler never picks a forbidden token
while its log-probabilities stay the model's own."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from batchjob.engine.native.sampling.sampler import SamplerMode, SamplingTensors, sample
from batchjob.engine.native.sampling.token_mask import TokenMask, one_hot_bitmask_, torch_apply_token_bitmask_

VOCAB = 1000  # not a multiple of 32 or of the kernel's block: partial last word and block


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (VOCAB + 31) // 32), dtype=torch.int32, generator=g)
    one_hot_bitmask_(bitmask[2], 991)
    rows = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int64)
    return torch.randn(5, VOCAB, generator=g), bitmask, rows


def _allowed(bitmask: torch.Tensor, row: int) -> torch.Tensor:
    return torch.tensor([bool((int(bitmask[row, v // 32]) >> (v % 32)) & 1) for v in range(VOCAB)])


def test_torch_mask_forbids_exactly_the_clear_bits_of_constrained_rows():
    logits, bitmask, rows = _case()
    masked = torch_apply_token_bitmask_(logits.clone(), bitmask, rows)
    for r, m in enumerate(rows.tolist()):
        want = torch.ones(VOCAB, dtype=torch.bool) if m < 0 else _allowed(bitmask, m)
        assert torch.equal(torch.isfinite(masked[r]), want)
        assert torch.equal(masked[r][want], logits[r][want])
    assert torch.isfinite(masked[0]).sum() == 1 and masked[0].argmax() == 991  # one-hot, bit 31 of its word


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, tests/gpu/test_structured_gpu.py checks the kernel")
def test_triton_mask_kernel_equals_the_torch_mask():
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    from batchjob.engine.native.kernels import token_mask

    if not isinstance(token_mask._apply_token_bitmask_kernel, InterpretedFunction):
        token_mask = importlib.reload(token_mask)
    logits, bitmask, rows = _case(1)
    want = torch_apply_token_bitmask_(logits.clone(), bitmask, rows)
    got = logits.clone()
    token_mask.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "mode", [SamplerMode(), SamplerMode(sampling=True), SamplerMode(sampling=True, filtering=True, logprobs=2)]
)
def test_sampler_never_picks_a_forbidden_token_and_keeps_raw_logprobs(mode):
    logits, bitmask, rows = _case(2)
    params = SamplingTensors(
        temperature=torch.full((5,), 1.0 if mode.sampling else 0.0),
        top_k=torch.zeros(5, dtype=torch.int64),
        top_p=torch.full((5,), 0.9),
        min_p=torch.zeros(5),
        seeds=torch.arange(5, dtype=torch.int64),
        positions=torch.zeros(5, dtype=torch.int64),
    )
    out = sample(logits.clone(), params, mode, TokenMask(bitmask, rows))
    for r, m in enumerate(rows.tolist()):
        if m >= 0:
            assert _allowed(bitmask, m)[out.tokens[r]]
    if mode.logprobs is not None:
        raw = logits.log_softmax(-1)
        torch.testing.assert_close(out.logprobs, raw.gather(1, out.tokens[:, None])[:, 0])
