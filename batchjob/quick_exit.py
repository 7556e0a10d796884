"""A process's exit without the interpreter's teardown: the command's, and a tensor-parallel rank's.

After a job's last commit and report, a normal exit still destroys every module and object the process holds and
unloads torch's libraries: 0.56 s with torch imported, 0.72 s with torch and transformers, on a 2-core machine
(the job's own exit there, from its "done" line to the process's end: 0.93 s), plus the CUDA context's teardown
on a GPU. Nothing of the job's depends on that teardown: its outputs are committed and synced by then. A
tensor-parallel rank's exit is waited for by the job process (`RankGroup.close`), after the last step; its
teardown would add torch's, the process group's and the CUDA context's to the job's end.
`exit_now` does what `sys.exit` does before the teardown, in the interpreter's own order: wait for the threads
that are not daemons (and run the thread pools' exit hooks), run the `atexit` handlers (logging's flush,
multiprocessing's children, weakref finalizers), flush stdout and stderr; then it ends the process with the status.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


def exit_now(code: object) -> None:
    """End the process as `sys.exit(code)` would, skipping the interpreter's teardown. Falls back to `sys.exit`
    where this Python lacks the steps it runs (`threading._shutdown`, `atexit._run_exitfuncs`), off the main thread,
    and under a profiler or debugger (`python -m cProfile -m batchjob` writes its output after the command
    returns)."""
    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    watched = sys.getprofile() is not None or sys.gettrace() is not None  # a profiler writes its results at exit
    off_main = threading.current_thread() is not threading.main_thread()
    if shutdown is None or run_exitfuncs is None or watched or off_main:
        sys.exit(code)
    status = _status(code)
    shutdown()
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, or a stream closed: nothing left to say
            stream.flush()
    os._exit(status)


def _status(code: object) -> int:
    """The exit status `sys.exit(code)` gives: 0 for None, the int itself, else 1 with `code` printed to stderr."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
