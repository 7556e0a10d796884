"""Nothing a run varies from step to step selects a compiled variant of the attention kernels: batch size,
lengths, split count, block-table width, buffer offsets, window and soft-cap values. Only a layer kind
(window on or off, soft-cap on or off) does, and for the decode kernel whether it runs one split (which writes
the output itself) or several.

The interpreter compiles nothing, so this reads what a compiled launch would be keyed on: each launch's
arguments (through a pre-run hook) given to Triton's own specialisation binder, which is what the JIT cache
key is made of. tests/gpu/test_triton_attention_gpu.py counts real compiled variants on a GPU.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_triton_attention_gpu.py counts compiled variants", allow_module_level=True)

from attention_cases import packed_metadata  # noqa: E402
from interpreted_attention import (  # noqa: E402
    TritonPagedAttention,
    decode_attention,
    prefill_attention,
    random_step,
    split_decode_attention,
    triton_attention,
)
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

KERNELS = {
    "store": triton_attention._store_kv_kernel,
    "decode": split_decode_attention._decode_split_kernel,
    "one_split": decode_attention._decode_one_split_kernel,
    "reduce": split_decode_attention._decode_reduce_kernel,
    "prefill": prefill_attention._prefill_kernel,
}
# (query lens, seq lens, decode splits, buffer offset, block-table width). Triton specialises an integer
# equal to 1 or divisible by 16 and a pointer aligned to 16 bytes: split counts 1, 16 and others, prefill
# batches of 1, 2 and 16 sequences, offsets of every alignment, tables from one column (a stride of 1) to 20.
DECODE_STEPS = [
    ([1], [1], 1, 0, 1),
    ([1], [9], 16, 1, 3),
    ([1, 1, 1], [4, 17, 33], 2, 2, 16),
    ([1, 1], [70, 5], 5, 3, 20),
    ([1, 1, 1], [3, 20, 41], 1, 5, 12),
]
PREFILL_STEPS = [
    ([16], [16], None, 1, 4),
    ([3, 1], [19, 6], None, 2, 16),
    ([2] + [1] * 15, list(range(20, 36)), None, 3, 11),
]


def specialisations(kernel, launches: list) -> set[str]:
    """The JIT cache keys (signature, specialised values, constexprs) of `launches` of `kernel`."""
    jit = JITFunction(
        kernel.fn,
        do_not_specialize=kernel.kwargs["do_not_specialize"],
        do_not_specialize_on_alignment=kernel.kwargs["do_not_specialize_on_alignment"],
    )
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    return {str(binder(*args, **kwargs)[1]) for args, kwargs in launches}


@pytest.fixture
def launches():
    """Every launch of each attention kernel while the test runs, by kernel name."""
    recorded = {name: [] for name in KERNELS}
    hooks = {name: lambda *args, _name=name, **kwargs: recorded[_name].append((args, kwargs)) for name in KERNELS}
    for name, kernel in KERNELS.items():
        kernel.add_pre_run_hook(hooks[name])
    yield recorded
    for name, kernel in KERNELS.items():
        kernel.pre_run_hooks.remove(hooks[name])


def run_steps(steps, windows=(0,), softcaps=(0.0,)) -> None:
    for i, (query_lens, seq_lens, splits, offset, width) in enumerate(steps):
        q, k, v, k_cache, v_cache, meta = random_step(query_lens, seq_lens, 4, 2, head_dim=16, seed=i)
        meta = packed_metadata(meta, offset, width)
        window, softcap = windows[i % len(windows)], softcaps[i % len(softcaps)]
        out = TritonPagedAttention(splits).forward(q, k, v, k_cache, v_cache, meta, 0.25, window, softcap)
        assert not out.isnan().any()


def assert_one_variant_each(launches, ran=tuple(KERNELS)) -> None:
    """One variant per kernel (the one-split decode kernel: one per launch shape, reading the block table a
    tile ahead or not); each kernel named in `ran` must have run."""
    for name, kernel in KERNELS.items():
        assert launches[name] or name not in ran, f"{name} never ran"
        by_shape: dict[bool, list] = {}
        for args, kwargs in launches[name]:
            by_shape.setdefault(bool(kwargs.get("PREFETCH_TABLE", False)), []).append((args, kwargs))
        for group in by_shape.values():
            keys = specialisations(kernel, group)
            assert len(keys) == 1, f"{name} would compile {len(keys)} variants:\n" + "\n".join(sorted(keys))


def test_batch_sizes_lengths_splits_offsets_and_table_widths_share_one_variant(launches):
    run_steps(DECODE_STEPS + PREFILL_STEPS)
    assert_one_variant_each(launches)


@pytest.mark.parametrize(("windows", "softcaps"), [((3, 8, 1), (0.0,)), ((0,), (2.5, 30.0)), ((4, 100), (2.5, 30.0))])
def test_window_and_soft_cap_values_share_one_variant_per_layer_kind(launches, windows, softcaps):
    run_steps(DECODE_STEPS[:2] + PREFILL_STEPS[:2], windows, softcaps)
    # Only layers without a window take the one-split kernel (the first step is the one-split one).
    assert_one_variant_each(launches, [name for name in KERNELS if name != "one_split" or windows[0] == 0])
