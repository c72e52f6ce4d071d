"""The Triton Python-backend models (each repository ``model.py`` imports one of them).

Importing this package first makes a model's stub process print the Python stack of every
thread to its stderr (the server's log) on SIGUSR1 (``TritonServer`` sends it to the stubs of a
server that is not ready in time, so the log says where a model load hangs) and on a fatal
signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL: the supervisor logs the server log's tail when
it finds a stub dead, so the log says where it died)."""

import faulthandler
import signal

faulthandler.enable(all_threads=True)
faulthandler.register(signal.SIGUSR1, all_threads=True)
