"""The model's building blocks: paged attention (its per-step metadata, the plain-torch backend and float64
reference, and the Triton backend over `kernels/`), RMSNorm and the gated MLP activations (`elementwise.py`),
rotary embeddings (`rope.py`), the split-K projections that feed a residual (`split_k.py`), FP8 projections
(`fp8_linear.py`), the batch-invariant projections of `engine.deterministic` (`batch_invariant.py`), and the
collectives of tensor parallelism (`parallel.py`).

May import `kernels/` and nothing above it (no models, loading, runtime or engine).
"""
