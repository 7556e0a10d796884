"""Running steps on one device: the model runner with its three CUDA streams ordered by events, the two IO slots
and the packed step they carry (`io_slot.py`, `packed_step.py`), how a step is laid out to a graph bucket
(`step_layout.py`), the CUDA graphs of both slots in one memory pool (`graphs.py`), the KV cache's sizing
(`kv_cache.py`), warm-up (`warmup.py`), the device side of start-up in order (`device_start.py`), host-released
stream gates (`host_gate.py`), GPU-busy accounting (`busy_clock.py`) and the BLAS choice per step (`blas.py`).

May import `loading/`, `models/`, `sampling/`, `layers/`, `kernels/`, `scheduling/` (a step's plan) and the
engine's options; never the executor or the loop above it.
"""
