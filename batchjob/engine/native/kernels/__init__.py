"""Every Triton kernel of the native engine, with its launch rules and tuned tables: paged decode attention
(one split per program, and split-K for small batches and sliding windows), varlen prefill attention and the
online-softmax tile they share, the fused elementwise ops (residual-add + RMSNorm, rotary-and-store, SiLU-and-mul),
the fused mixture-of-experts GEMMs with their expert sort and per-GPU configs (`moe_configs.json`, written by
scripts/tune_moe.py), the sampler's race, draw and filter, the structured-outputs mask, the FP8 quantizer and
scaled matmul, and the batch-invariant matmul of `engine.deterministic`.

The bottom layer: a kernel module imports torch, Triton and other kernel modules, nothing else of batchjob (the
import-linter contract in pyproject.toml checks it). What a kernel computes is tested against plain torch under
Triton's interpreter on CPU (tests/native) and compiled on a GPU (tests/gpu); that each compiles for an H100 and
fits its shared memory is checked without a GPU too (tests/native/test_kernels_compile.py).
"""
