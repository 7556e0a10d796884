"""Suite-wide: the tests share two CPU cores, where torch's default of one OpenMP thread per core makes
small models many times slower. Set before torch is imported here, and inherited by every job the tests
start (subprocesses, Slurm tasks)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
