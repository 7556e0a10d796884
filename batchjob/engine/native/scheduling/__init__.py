"""What runs next, as plain host bookkeeping: the continuous-batching scheduler (`scheduler.py`) and the step plans
it makes (`plan.py`), whether the KV cache holds sequences of known length to their ends (`growth.py`), the paged KV
cache's blocks with prefix sharing (`block_manager.py`), sequences and their pending tokens (`sequence.py`), and
the offline admission order (`admission.py`).

No torch here (numpy only): a step's plan is data that the runtime turns into device inputs. May import
`batchjob.engine.api` and nothing else of the engine.
"""
