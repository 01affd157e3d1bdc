"""How the shards are opened and read: the three IO modes (store.py's docstring), each
file opened once, O_DIRECT's alignment probed per file, a per-thread bounce buffer.
`ShardReader.read_run(run)` reads one run (store.runs: a file, a span, the destinations in
it) and returns the bytes asked of the kernel.
"""

import mmap
import os
import sys
import threading
import warnings

import numpy as np

from ..errors import MlxmoeError
from .aio import AIO
from .shards import ALIGN, Range

IO_MODES = ("mmap", "pread", "direct")
BYPASSES = ("o_direct", "f_nocache", "fadvise")

# What io="auto" means per platform: direct, because the modes read at the same speed
# within noise (bench/RESULTS.md, IO) and only direct keeps the page cache from holding a
# second copy of every expert read, which would compete with the budget. On macOS direct
# is F_NOCACHE.
DEFAULT_IO = {"linux": "direct", "darwin": "direct"}

# O_DIRECT needs file offsets, lengths and buffer addresses aligned to the device's
# logical block size (512 or 4096; probed per file when it is opened). Bounce buffers
# are page aligned (ALIGN), and runs of ranges are grouped by page.

BOUNCE = 4 << 20  # per-thread bounce buffer (a multiple of ALIGN): O_DIRECT reads of at most this
# bytes of LaterRuns' buffers in use at once (each read has one, of whole MBs): 8 experts of BOUNCE
# bytes, more of smaller ones (a miss's layer call and its guesses asked together: a read past
# the cap goes to the IO threads, which need the GIL the decode thread holds while it builds)
LATER_BYTES = 8 * BOUNCE
LATER_UNIT = 1 << 20


def default_io(platform=sys.platform):
    return DEFAULT_IO.get(platform, "pread")


def resolve_io(io):
    """The IO mode `io` stands for ("auto" or None: this platform's default)."""
    if io in (None, "auto"):
        return default_io()
    if io not in IO_MODES:
        raise MlxmoeError(f"unknown io mode {io!r}; choose auto, {', '.join(IO_MODES)}")
    return io


def align_down(x, a=ALIGN):
    return x - x % a


def align_up(x, a=ALIGN):
    return -(-x // a) * a


def runs(ranges, dests, align=1):
    """Group one expert's (range, destination) pairs into runs that one read can cover:
    same file, and back to back (align=1) or touching once widened to `align`.

    Returns [(file, start, end, [(offset, dest)])]. In a stacked checkpoint each
    tensor's range is its own run (the experts of a tensor lie between them); a
    per-expert or bundled checkpoint gives one run per expert.
    """
    out = []
    for r, d in sorted(zip(ranges, dests), key=lambda rd: (str(rd[0].file), rd[0].offset)):
        if out and out[-1][0] == r.file and align_down(r.offset, align) <= align_up(out[-1][2], align):
            f, start, end, pieces = out[-1]
            out[-1] = (f, start, max(end, r.offset + r.nbytes), pieces + [(r.offset, d)])
        else:
            out.append((r.file, r.offset, r.offset + r.nbytes, [(r.offset, d)]))
    return out


def preadv_all(fd, bufs, offset, file, align=1):
    """preadv into `bufs` (uint8 arrays) from `offset` until they are full or the file
    ends; returns the bytes read. With align > 1 (O_DIRECT) a short read ends it, as
    the next read would start unaligned."""
    done, want = 0, sum(b.nbytes for b in bufs)
    while True:
        try:
            n = os.preadv(fd, bufs, offset + done)
        except OSError as e:
            raise MlxmoeError(f"reading {file} at offset {offset + done}: {e}") from None
        done += n
        if n == want or n == 0 or n % align:  # all of it (the usual case), the file's end, a short O_DIRECT read
            return done
        want -= n
        bufs = [memoryview(b) for b in bufs]
        while n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        bufs[0] = bufs[0][n:]


def truncated(file, end):
    return MlxmoeError(f"truncated shard: {file} ends before offset {end}")


class ShardReader:
    """The shards' open files and the reads of one IO mode (`io`; `bypass`: how "direct"
    goes around the page cache, None for the platform's). Reads may run from several
    threads at once."""

    def __init__(self, io="auto", bypass=None):
        self._fds = {}  # file -> fd
        self._how = {}  # file -> "mmap", "pread", or the bypass used for "direct"
        self._maps = {}  # file -> (mmap, uint8 array over it), io="mmap"
        self._align = {}  # file -> O_DIRECT alignment
        self._open_lock = threading.Lock()
        self._local = threading.local()  # per-thread O_DIRECT bounce buffer
        self.later = LaterRuns(self)
        self.fallback = None  # why "direct" could not use O_DIRECT, when it could not
        self.io, self.bypass = resolve_io(io), self._check_bypass(bypass)
        # what puts a read's bytes in place (backend.DeviceCopy on CUDA), or None: the host's
        # stores, and reads straight into the slots where they can
        self.land = None

    def set_io(self, io="auto", bypass=None):
        """Switch the IO mode; the shards are reopened."""
        io, bypass = resolve_io(io), self._check_bypass(bypass)
        if (io, bypass) == (self.io, self.bypass):
            return
        files = list(self._fds)
        self.close()
        self.io, self.bypass, self.fallback = io, bypass, None
        for f in files:
            self._fd(f)

    @staticmethod
    def _check_bypass(bypass):
        if bypass is not None and bypass not in BYPASSES:
            raise MlxmoeError(f"unknown page-cache bypass {bypass!r}; choose {', '.join(BYPASSES)}")
        return bypass

    @property
    def method(self):
        """How the shards are read: the mode, or for "direct" the bypass(es) in use."""
        return "+".join(sorted(set(self._how.values()))) or self.io

    def _fd(self, file):
        if file not in self._how:  # set last: a file in _how is fully open
            with self._open_lock:
                if file not in self._how:
                    try:
                        fd, how = self._open(file)
                    except OSError as e:
                        raise MlxmoeError(f"cannot open {file}: {e}") from None
                    self._fds[file] = fd
                    self._how[file] = how
        return self._fds[file]

    def _open(self, file):
        if self.io != "direct":
            fd = os.open(file, os.O_RDONLY)
            if self.io == "pread" and hasattr(os, "posix_fadvise"):
                # No readahead: around a random range it reads ~20 % more than asked (bench_io).
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            if self.io == "mmap":
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                if hasattr(mmap, "MADV_RANDOM"):  # no readahead around each fault: we ask for each range
                    mm.madvise(mmap.MADV_RANDOM)
                self._maps[file] = (mm, np.frombuffer(mm, np.uint8))
            return fd, self.io
        bypass = self.bypass or ("o_direct" if hasattr(os, "O_DIRECT") else
                                 "f_nocache" if sys.platform == "darwin" else "fadvise")
        if bypass == "o_direct":
            try:
                fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
                self._align[file] = self._probe_direct(fd, file)
                return fd, bypass
            except (OSError, MlxmoeError) as e:
                self.fallback = f"O_DIRECT failed on {file} ({e}); reading with preadv + posix_fadvise(DONTNEED)"
                warnings.warn(self.fallback)
                bypass = "fadvise"
        fd = os.open(file, os.O_RDONLY)
        if bypass == "f_nocache":
            import fcntl
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)  # 48: F_NOCACHE in <sys/fcntl.h> (macOS)
        elif bypass == "fadvise" and hasattr(os, "posix_fadvise"):
            # No readahead: it would cache bytes around each range that DONTNEED does not drop.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd, bypass

    def _probe_direct(self, fd, file):
        """The smallest alignment O_DIRECT reads of `file` accept: 512, else 4096. Some
        filesystems accept the flag and refuse the reads: then raise."""
        for align in (512, ALIGN):
            try:
                preadv_all(fd, [self._bounce(align)], align, file, align)
                return align
            except MlxmoeError as e:
                err = e
        os.close(fd)
        raise err

    def _bounce(self, n):
        """This thread's page-aligned buffer of at least n bytes (an anonymous mmap is page
        aligned): `land`'s where it copies (page-locked: its copies from there land at once)."""
        if self.land is not None:
            return self.land.buffer(n)
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            self._local.buf = buf = np.frombuffer(mmap.mmap(-1, align_up(n, 1 << 20)), np.uint8)
        return buf[:n]

    def _put(self, dest, src):
        """A read's bytes into place: by the host's stores, or by `land`."""
        if self.land is None:
            dest[...] = src
        else:
            self.land(dest, src)

    def read_run(self, run):
        """Read one run (file, start, end, [(offset, dest)]); the bytes asked of the kernel."""
        self._fd(run[0])
        how = self._how[run[0]]
        if how == "o_direct":
            return self._read_direct(*run)
        if how == "mmap":
            return self._read_mmap(*run)
        return self._read_pread(*run, fadvise=how == "fadvise")

    def start_run(self, run, lane=0):
        """LaterRuns.start: `run` asked of the kernel, not waited for (None: read_run it)."""
        return self.later.start(run, lane)

    def _read_pread(self, file, start, end, pieces, fadvise=False):
        fd = self._fds[file]
        if sum(d.nbytes for _, d in pieces) != end - start:  # gaps (a run grouped for O_DIRECT)
            ranges = [Range(file, off, d.nbytes) for off, d in pieces]
            return sum(self._read_pread(*run, fadvise) for run in runs(ranges, [d for _, d in pieces]))
        if self.land is not None:
            self._read_bounced(fd, file, start, end, pieces)
        elif preadv_all(fd, [d for _, d in pieces], start, file) < end - start:
            raise truncated(file, end)
        if fadvise and hasattr(os, "posix_fadvise"):
            # Whole pages: the kernel keeps a partly covered page.
            a = align_down(start)
            os.posix_fadvise(fd, a, align_up(end) - a, os.POSIX_FADV_DONTNEED)
        return end - start

    def _read_direct(self, file, start, end, pieces):
        fd, align = self._fds[file], self._align[file]
        a = align_down(start, align)
        if self.land is None and start % align == 0 and end % align == 0 \
                and all(off % align == 0 and d.nbytes % align == 0 for off, d in pieces) \
                and all(d.ctypes.data % align == 0 for _, d in pieces) \
                and sum(d.nbytes for _, d in pieces) == end - start:
            # Aligned and back to back (a bundled checkpoint, aligned slots): straight into the slots.
            if preadv_all(fd, [d for _, d in pieces], a, file, align) < end - start:
                raise truncated(file, end)
            return end - start
        return self._read_bounced(fd, file, start, end, pieces, align)

    def _read_bounced(self, fd, file, start, end, pieces, align=1):
        """Read [start, end) through this thread's bounce buffer (an expert's usual case: one
        bounce, each piece whole in it), at most BOUNCE bytes at a time, and put each piece's
        bytes in place; the bytes asked of the kernel."""
        a, b = align_down(start, align), align_up(end, align)
        got = 0
        for c in range(a, b, BOUNCE):
            buf = self._bounce(min(BOUNCE, b - c))
            n = preadv_all(fd, [buf], c, file, align)  # b may lie past the end of the file
            got += n
            if c + n < min(c + len(buf), end):
                raise truncated(file, end)
            for off, d in pieces:
                lo, hi = max(off, c), min(off + d.nbytes, c + n)
                if lo < hi:
                    self._put(d[lo - off:hi - off], buf[lo - c:hi - c])
        return got

    def _read_mmap(self, file, start, end, pieces):
        mm, arr = self._maps[file]
        try:  # reading a mapped page past the end of the file would kill the process (SIGBUS)
            size = os.fstat(self._fds[file]).st_size
        except OSError as e:
            raise MlxmoeError(f"reading {file} at offset {start}: {e}") from None
        if size < end or len(mm) < end:
            raise truncated(file, end)
        a, b = align_down(start, mmap.PAGESIZE), min(align_up(end, mmap.PAGESIZE), len(mm))
        if hasattr(mmap, "MADV_WILLNEED"):  # one readahead of the whole range, not a fault per page
            mm.madvise(mmap.MADV_WILLNEED, a, b - a)
        for off, d in pieces:
            self._put(d, arr[off:off + d.nbytes])
        if hasattr(mmap, "MADV_DONTNEED"):  # out of this process's RSS (the pages stay in the page cache)
            mm.madvise(mmap.MADV_DONTNEED, a, b - a)
        return b - a

    def forget(self, file):
        """Close `file` if it is open (a scratch file read once): a later read opens it again."""
        with self._open_lock:
            self._how.pop(file, None)
            self._align.pop(file, None)
            mm = self._maps.pop(file, (None,))[0]  # (the array over the map dropped with it, so it can close)
            fd = self._fds.pop(file, None)
            lanes = self.later.lanes.pop(file, [])
        for lane in lanes:
            os.close(lane)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view of it is still alive: the garbage collector closes it
                pass
        if fd is not None:
            os.close(fd)

    def close(self):
        for file in list(self._fds):
            self.forget(file)

    def __del__(self):
        # a model dropped without close() (mlx-lm's users never call it) still closes its shards
        try:
            lanes = getattr(self, "later", None)
            for fd in [*getattr(self, "_fds", {}).values(), *sum(getattr(lanes, "lanes", {}).values(), [])]:
                os.close(fd)
        except OSError:
            pass


class LaterRuns:
    """A ShardReader's runs asked of the kernel by AIO (aio.py) and waited for later, each read
    through a bounce buffer of its own (`spare`: those not in use) and put in place at its
    end. Runs started together go in lanes, each lane a fd of its own (`lanes`: per file the
    dups past the reader's own), since glibc reads one fd's requests one after the other."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.spare, self.lanes = [], {}  # (spare: (buffer, its last request))
        self.unfinished = []  # (buffer, request) of reads interrupted before their end: the kernel may still write them
        self.busy = 0  # bytes of the buffers in use

    def done(self, buf, request, kept=None) -> None:
        """A read's buffer free again (`kept`: never, its read interrupted)."""
        with self.reader._open_lock:
            self.busy -= len(buf if kept is None else kept)
            if kept is None:
                self.spare.append((buf, request))
            else:
                self.unfinished.append((kept, request))

    def start(self, run, lane=0):
        """Ask for one run (read_run's) and go on: returns finish(), which waits for its end,
        puts its bytes in place and returns the bytes asked; None where it cannot (no AIO
        here, mmap, a reader's `land`, a run longer than BOUNCE, LATER_BYTES in use)."""
        reader, (file, start, end, pieces) = self.reader, run
        fd, how = reader._fd(file), reader._how[file]
        align = reader._align[file] if how == "o_direct" else 1
        a, b = align_down(start, align), align_up(end, align)
        if AIO is None or how == "mmap" or reader.land is not None or b - a > BOUNCE:
            return None
        size = align_up(b - a, LATER_UNIT)
        with reader._open_lock:
            if self.busy + size > LATER_BYTES:
                return None
            if lane:
                lanes = self.lanes.setdefault(file, [])
                lanes.extend(os.dup(fd) for _ in range(lane - len(lanes)))
                fd = lanes[lane - 1]
            buf, request = self.spare.pop() if self.spare else (None, None)
            if buf is None or len(buf) != size:  # (experts are all of one size: made once)
                buf = np.frombuffer(mmap.mmap(-1, size), np.uint8)
            self.busy += size
        try:
            request = AIO.read(fd, buf.ctypes.data, b - a, a, request)
        except OSError:
            self.done(buf, request)
            return None

        def finish():
            try:
                n = AIO.wait(request)
            except OSError as e:
                self.done(buf, request)
                raise MlxmoeError(f"reading {file} at offset {a}: {e}") from None
            except BaseException:  # interrupted: its buffer is never used again
                self.done(None, request, kept=buf)
                raise
            try:
                if a + n < end:
                    raise truncated(file, end)
                for off, d in pieces:  # (no `land` here: the host's stores)
                    d[...] = buf[off - a:off - a + d.nbytes]
            finally:
                self.done(buf, request)
            if how == "fadvise" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, align_down(start), align_up(end) - align_down(start), os.POSIX_FADV_DONTNEED)
            return n
        return finish
