"""Reads asked of the kernel that run while the decode thread goes on building: POSIX AIO as
glibc implements it (64-bit Linux), whose reads run on glibc's own threads, outside Python.
A Python IO thread needs the GIL to start a read and again to end it, and the decode thread
holds it while it builds: on 2 cores an 8 KB O_DIRECT read handed to one ended 550-890 us
later against 200 alone, while through AIO the builder found it done after 200 us of
building (bench/RESULTS.md). Elsewhere `AIO` is None and callers read at once.
"""

import ctypes
import ctypes.util
import errno
import platform
import sys


class _SigEvent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("_rest", ctypes.c_byte * 48)]  # (struct sigevent: 64 bytes on Linux)


class _Request(ctypes.Structure):
    """glibc's struct aiocb on a 64-bit target (off_t of 64 bits: no padding after aio_offset)."""
    _fields_ = [("fildes", ctypes.c_int), ("lio_opcode", ctypes.c_int), ("reqprio", ctypes.c_int),
                ("buf", ctypes.c_void_p), ("nbytes", ctypes.c_size_t), ("sigevent", _SigEvent),
                ("_next_prio", ctypes.c_void_p), ("_abs_prio", ctypes.c_int), ("_policy", ctypes.c_int),
                ("_error_code", ctypes.c_int), ("_return_value", ctypes.c_ssize_t),
                ("offset", ctypes.c_int64), ("_reserved", ctypes.c_char * 32)]


SIGEV_NONE = 1


class Aio:
    """aio_read, and the wait for one read's end, by ctypes (which lets go of the GIL in each call)."""

    def __init__(self, lib) -> None:
        self.lib = lib
        for name in ("aio_read", "aio_error", "aio_return", "aio_suspend"):
            getattr(lib, name).argtypes = [ctypes.c_void_p] if name != "aio_suspend" else \
                [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.aio_return.restype = ctypes.c_ssize_t

    def read(self, fd: int, address: int, nbytes: int, offset: int, request: _Request | None = None) -> _Request:
        """Ask for `nbytes` of `fd` at `offset` into memory at `address` (in `request`, one
        that ended, where given); the request, which must stay alive (and the memory with it)
        until wait() returned. Raises OSError."""
        if request is None:
            request = _Request()
            request.sigevent.notify = SIGEV_NONE
        request.fildes, request.buf, request.nbytes, request.offset = fd, address, nbytes, offset
        if self.lib.aio_read(ctypes.addressof(request)) != 0:
            raise OSError(ctypes.get_errno(), "aio_read")
        return request

    def wait(self, request: _Request) -> int:
        """The bytes `request` read, once it ended; raises its OSError."""
        at = ctypes.addressof(request)
        if (error := self.lib.aio_error(at)) == errno.EINPROGRESS:
            one = (ctypes.c_void_p * 1)(at)
            while (error := self.lib.aio_error(at)) == errno.EINPROGRESS:
                self.lib.aio_suspend(one, 1, None)  # (EINTR: asked again)
        n = self.lib.aio_return(at)
        if error:
            raise OSError(error, "aio_read")
        return n


def load() -> Aio | None:
    if not (sys.platform == "linux" and sys.maxsize > 2 ** 32 and platform.libc_ver()[0] == "glibc"):
        return None
    try:
        return Aio(ctypes.CDLL(ctypes.util.find_library("rt") or "libc.so.6", use_errno=True))
    except (OSError, AttributeError):
        return None


AIO = load()
