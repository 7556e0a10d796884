"""More than one process: shard defaults from Slurm's variables and requeue after preemption (`slurm.py`), and one
node's GPUs as child processes, one shard each (`data_parallel.py`, `engine.data_parallel=N`)."""
