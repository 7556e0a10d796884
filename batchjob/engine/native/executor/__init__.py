"""Tensor parallelism across processes: the job process's side (`rank_group.py`: starts the ranks, sends each
step's packed inputs, receives rank 0's tokens; `rank_links.py`: the rank processes, their connections and the
watchdog on every wait) and each rank's (`rank_process.py`: a model runner on one GPU, serving those messages),
meeting only through `messages.py`. A rank builds a runner, never an engine: the
scheduler, tokenizer and output processing run once, in the job process.

May import `runtime/` and below; never `engine.py`.
"""
