"""From a model directory to weights on the device: reading the config files into a `ModelSpec`, building the
model on the meta device and materialising it (`model_loader.py`), mapping checkpoint tensors onto parameters
(`checkpoint.py`), streaming safetensors at the page cache's speed (`weight_stream.py`), seeded dummy weights for
benchmarks (`dummy_weights.py`), and which slice of each weight a tensor-parallel rank holds (`sharding.py`).

May import `models/`, `layers/` and `kernels/`; never the runtime or the engine.
"""
