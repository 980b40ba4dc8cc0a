"""With lagging_gloo_worker.so preloaded (LD_PRELOAD): the exit handler that runs last, just before the interpreter
finalizes, lets the held-back gloo workers go (lagging_gloo_worker.c says why). On PYTHONPATH for the ranks only."""
import atexit
import ctypes
import os

HOLD_MS = int(os.environ.get("LAGGING_GLOO_WORKER_HOLD_MS", "20"))


def _let_workers_go() -> None:
    try:
        release = ctypes.PyDLL(None).lagging_gloo_worker_exit  # PyDLL: the call keeps the GIL
    except AttributeError:  # the library is not preloaded in this process
        return
    release.argtypes = [ctypes.c_long]
    release(HOLD_MS)


atexit.register(_let_workers_go)  # registered first, so it runs last
