"""Signal handlers that raise as Python's do, except where raising would tear a lock's state."""

import os
import threading


def interrupting(raise_it):
    """A SIGINT or SIGTERM handler that raises as `raise_it` does, except where it landed
    between a lock's taking and the code that gives it back (torn): raised there, the lock
    would stay held (a thread pool's worker then waits on it for ever, and so does the exit) or
    be given back twice; or in a __del__, where Python prints the exception as ignored (a
    traceback on stderr) and drops it. There the signal is sent again a few ms later, when it
    lands elsewhere."""

    def handler(signum, frame):
        if frame is not None and (torn(frame) or frame.f_code.co_name == "__del__"):
            again = threading.Timer(0.005, os.kill, (os.getpid(), signum))
            again.daemon = True  # (an exit meanwhile does not wait for it)
            again.start()
            return
        raise_it(signum, frame)

    return handler


_WAIT = threading.Condition.wait.__code__


def torn(frame) -> bool:
    """Whether `frame` stands where an exception would tear a lock's state: a context manager's
    __enter__ (its lock taken, its with-block not begun) or __exit__ (not given back yet:
    Condition's, or concurrent.futures.wait's over its futures' conditions, which a pool's
    worker then waits on for ever), or Condition.wait from giving its lock up to the try that
    takes it back (marked by its local `gotit`, set just before that try)."""
    code = frame.f_code
    if code.co_name in ("__enter__", "__exit__", "_release_save"):
        return True
    return code is _WAIT and "gotit" in code.co_varnames and "gotit" not in frame.f_locals
