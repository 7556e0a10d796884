"""Choosing tokens on the device: the sampler (greedy, temperature, top-k, top-p, min-p, per-request seeds from a
counter-based hash) and the structured-outputs token mask.

May import `kernels/` (the CUDA paths) and nothing above it.
"""
