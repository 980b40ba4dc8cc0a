"""With lagging_gloo_worker.so preloaded (LD_PRELOAD): an exit handler, registered before any other so that it runs
last, just before the interpreter finalizes, lets the held-back gloo workers go (lagging_gloo_worker.c says why).
Imported first by the entry file that tests/megatron/exits.py writes for a run with the injection."""
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


atexit.register(_let_workers_go)
