"""Each expert's byte ranges in the shards (shards.py's header index), read into slot
memory: only the expert's own bytes, never the rest of a stacked tensor, which
`mx.load(...)[name][e]` would read whole.

Three IO modes (`ExpertStore(path, io=...)`, `mlxmoe --io`):

- "mmap": each shard is mapped once and an expert's bytes are copied out of the map,
  through the page cache (the path `mx.load` / `np.memmap` take).
- "pread": `os.preadv` straight into the slots, through the page cache.
- "direct": around the page cache, so that it never holds a second copy of the experts:
  O_DIRECT on Linux (aligned reads into a per-thread bounce buffer, then a copy into
  the slot), F_NOCACHE on macOS, and elsewhere, or where O_DIRECT is refused (some
  filesystems), preadv + posix_fadvise(DONTNEED).

`read_expert` returns the useful bytes; `disk_bytes` counts the bytes asked of the
kernel (aligned supersets, whole pages), so disk_bytes / useful_bytes is the read
amplification; `reads` counts the ranges asked for (9 per expert of a stacked 4-bit
checkpoint, 1 per bundled expert).
"""

import mmap
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from ..errors import MlxmoeError
from .shards import ALIGN, DTYPES, Range, read_header, row_part, shard_files, shard_slice, stamp, to_float32

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

# The ranges of one expert in a stacked checkpoint (weight, scales, biases of gate, up,
# down: 9 far apart) are read by this many threads at once: with O_DIRECT one request in
# flight leaves the disk idle between ranges.
IO_WORKERS = 4
BOUNCE = 4 << 20  # per-thread bounce buffer (a multiple of ALIGN): O_DIRECT reads of at most this
# A paced (background) read asks the disk for at most this much at a time (until the cache's
# ReadGate has timed the disk), so that a demand read that comes meanwhile waits behind one
# such piece at most (a multiple of ALIGN).
CHUNK = 256 << 10


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


def slice_span(r):
    """The bytes that hold a tensor-parallel slice's runs (`r.runs` of them, `r.step` apart)."""
    return r.step * (r.runs - 1) + r.nbytes // r.runs


def split_run(run, chunk=CHUNK):
    """`run` (see runs) cut at the file offsets that are multiples of `chunk`: pieces of at
    most `chunk` bytes, each still aligned where the run was."""
    file, start, end, pieces = run
    out = []
    for lo in range(align_down(start, chunk), end, chunk):
        hi = lo + chunk
        part = [(max(off, lo), d[max(off, lo) - off:min(off + d.nbytes, hi) - off])
                for off, d in pieces if off < hi and off + d.nbytes > lo]
        if part:
            out.append((file, part[0][0], max(off + d.nbytes for off, d in part), part))
    return out


def preadv_all(fd, bufs, offset, file, align=1):
    """preadv into `bufs` (uint8 arrays) from `offset` until they are full or the file
    ends; returns the bytes read. With align > 1 (O_DIRECT) a short read ends it, as
    the next read would start unaligned."""
    bufs = [memoryview(b) for b in bufs]
    done = 0
    while bufs:
        want = sum(len(b) for b in bufs)
        try:
            n = os.preadv(fd, bufs, offset + done)
        except OSError as e:
            raise MlxmoeError(f"reading {file} at offset {offset + done}: {e}") from None
        done += n
        if n == 0 or (n < want and n % align):
            break
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]
    return done


def truncated(file, end):
    return MlxmoeError(f"truncated shard: {file} ends before offset {end}")


class ExpertStore:
    """Maps (layer, expert) to the byte ranges of its tensors and reads them.

    `tensors` are the names of one expert's tensors as the model sees them (e.g.
    "gate_proj.weight"); `ranges[layer][expert][i]` is where tensor i of that expert lies.
    `io` is "auto", "mmap", "pread" or "direct"; `bypass` forces how "direct" goes
    around the page cache ("o_direct", "f_nocache", "fadvise"; default: the platform's).
    read_expert may be called from several threads at once.
    """

    def __init__(self, model_path, io="auto", bypass=None, workers=IO_WORKERS):
        self.path = Path(model_path)
        self.files = shard_files(self.path)
        self.index = {}
        self.stamps = {}  # file -> stamp() when its header was read: a shard changed since is refused
        for f in self.files:
            try:
                self.stamps[f] = stamp(f)
            except OSError as e:
                raise MlxmoeError(f"cannot read shard {f}: {e.strerror or e}") from None
            self.index.update(read_header(f))
        self.tensors = []  # names of one expert's tensors, in read order
        self.tensor_dtypes = []  # safetensors dtype of each
        self.tensor_shapes = []  # per-expert shape of each
        self.model_shapes = []  # the same in the checkpoint, before a tensor split's slice (the fingerprint's)
        self.ranges = []  # [layer][expert] -> [Range per tensor]
        self.expert_names = set()  # the file tensors that hold experts
        self._fds = {}  # file -> fd
        self._how = {}  # file -> "mmap", "pread", or the bypass used for "direct"
        self._maps = {}  # file -> (mmap, uint8 array over it), io="mmap"
        self._align = {}  # file -> O_DIRECT alignment
        self._lock = threading.Lock()  # the byte counters
        self._open_lock = threading.Lock()
        self._local = threading.local()  # per-thread O_DIRECT bounce buffer
        self.fallback = None  # why "direct" could not use O_DIRECT, when it could not
        self.useful_bytes = self.disk_bytes = self.reads = 0
        self.workers = workers  # threads reading the separate ranges of one expert at once
        self._workers = None
        self.io, self.bypass = resolve_io(io), self._check_bypass(bypass)

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

    def map_layers(self, layers):
        """Record the byte ranges of every expert.

        `layers[l]` is {tensor: [(file tensor name, expert row or None[, shard[, rows]])] * num_experts}:
        a row index into a stacked [E, ...] tensor, or None for a per-expert tensor; shard
        (axis of one expert's tensor, parts, index): only that part (tensor parallelism);
        rows ("halves" or "interleaved", parts, index): only that part of the expert's rows
        (gate's or up's of a fused gate_up tensor, shards.row_part).
        """
        self.tensors = list(layers[0])
        for l, layer in enumerate(layers):
            if list(layer) != self.tensors:
                raise MlxmoeError(f"MoE layer {l} has expert tensors {list(layer)}, layer 0 has {self.tensors}")
            experts = []
            for e in range(len(next(iter(layer.values())))):
                row = []
                for t, sources in layer.items():
                    name, k, *parts = sources[e]
                    shard, rows = (*parts, None, None)[:2]
                    info = self.index[name]
                    self.expert_names.add(name)
                    if k is None:
                        shape, start, nbytes = info.shape, info.offset, info.nbytes
                    else:
                        nbytes = info.nbytes // info.shape[0]
                        shape, start = info.shape[1:], info.offset + k * (info.stride or nbytes)
                    if rows is not None:
                        shape, start, nbytes = row_part(shape, start, nbytes, *rows)
                    where, whole = dict(offset=start, nbytes=nbytes), tuple(shape)
                    if rows is not None and rows[0] == "interleaved":
                        where.update(runs=shape[0], step=rows[1] * nbytes // shape[0])
                    if shard is not None:
                        shape, where = shard_slice(shape, start, nbytes, *shard)
                    if l == 0 and e == 0:
                        self.tensor_dtypes.append(info.dtype)
                        self.tensor_shapes.append(tuple(shape))
                        self.model_shapes.append(whole)
                    else:
                        i = self.tensors.index(t)
                        if (info.dtype, tuple(shape)) != (self.tensor_dtypes[i], self.tensor_shapes[i]):
                            raise MlxmoeError(
                                f"{info.file}: {name} has {info.dtype} {list(shape)} per expert, "
                                f"other experts have {self.tensor_dtypes[i]} {list(self.tensor_shapes[i])}: "
                                "experts of mixed precision or shape (e.g. a mixed-bit quantization) are not "
                                "supported yet; quantize every expert alike")
                    row.append(Range(info.file, **where))
                experts.append(row)
            self.ranges.append(experts)
        # Open every shard now: IO threads then only read a dict.
        for f in {r.file for experts in self.ranges for row in experts for r in row}:
            self._fd(f)

    @property
    def bundled(self):
        """Whether the experts are in the bundled layout (`mlxmoe convert --bundle`)."""
        return any(info.bundle for info in self.index.values())

    @property
    def num_layers(self):
        return len(self.ranges)

    @property
    def num_experts(self):
        return len(self.ranges[0]) if self.ranges else 0

    def expert_file_bytes(self):
        """Bytes one expert occupies on disk."""
        return sum(r.nbytes for r in self.ranges[0][0])

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
        """This thread's page-aligned buffer of at least n bytes (an anonymous mmap is page aligned)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            self._local.buf = buf = np.frombuffer(mmap.mmap(-1, align_up(n, 1 << 20)), np.uint8)
        return buf[:n]

    def read_expert(self, layer, expert, outs, pace=None, chunk=CHUNK):
        """Read expert `expert` of MoE layer `layer` into `outs` (one numpy array per tensor).

        An out whose dtype differs from the file's (bf16/f16 scales into float32 on
        CPU) is filled through a converting copy; otherwise bytes land in place.
        Returns the number of useful bytes read (the expert's bytes on disk);
        `disk_bytes` also counts what the mode read around them. With `pace` (a background
        read), the ranges are read one after another in pieces of at most `chunk` bytes and
        pace(nbytes) is called before each: it may wait (a demand read goes first) or raise
        (the read is no longer wanted), and the slot is then left half-written.
        """
        ranges, plain = self.ranges[layer][expert], []
        dests, converts, sliced = [], [], []
        for r, out, dtype in zip(ranges, outs, self.tensor_dtypes):
            raw_dtype = DTYPES[dtype]
            if out.dtype == raw_dtype or (dtype == "BF16" and out.dtype == np.uint16):
                if not out.flags.c_contiguous:
                    raise MlxmoeError("expert slots must be contiguous memory")
                buf = out
            else:
                buf = np.empty(out.shape, raw_dtype)
                converts.append((out, buf, dtype))
            dest = buf.reshape(-1).view(np.uint8)
            if dest.nbytes != r.nbytes:
                raise MlxmoeError(f"a slot of {dest.nbytes} bytes for {r.nbytes} bytes at {r.file}:{r.offset}")
            if r.runs > 1:
                sliced.append((r, dest))
            else:
                plain.append(r)
                dests.append(dest)
        todo = runs(plain, dests, ALIGN if self.io == "direct" else 1)
        if pace is not None:
            disk = 0
            for piece in (piece for run in todo for piece in split_run(run, chunk)):
                pace(piece[2] - piece[1])
                disk += self._read_run(piece)
        elif self.workers > 1 and len(todo) > 1:  # the ranges of a stacked expert: all at once
            futures = [self._pool().submit(self._read_run, run) for run in todo]
            try:
                disk = sum(f.result() for f in futures)
            except BaseException:  # Ctrl-C or an error: no worker may write into the slot once it is given back
                wait(futures)
                raise
        else:
            disk = sum(map(self._read_run, todo))
        disk += self._read_slices(sliced, pace)
        for file in {r.file for r in ranges}:
            self.check_unchanged(file)
        for out, buf, dtype in converts:
            out[...] = to_float32(buf, dtype) if out.dtype == np.float32 else buf.astype(out.dtype)
        useful = sum(r.nbytes for r in ranges)
        with self._lock:
            self.useful_bytes += useful
            self.disk_bytes += disk
            self.reads += len(todo)
        return useful

    def check_unchanged(self, file):
        """Refuse a shard whose size or modification time changed since it was indexed:
        its bytes may no longer be the tensors the header described."""
        try:
            now = stamp(file)
        except OSError as e:
            raise MlxmoeError(f"shard {file} changed on disk since the model was loaded ({e.strerror or e}); "
                              "load it again") from None
        if self.stamps.setdefault(file, now) != now:  # (a file not indexed: as at its first read)
            raise MlxmoeError(f"shard {file} changed on disk since the model was loaded (size, modification "
                              f"time {self.stamps[file]} -> {now}); load it again")

    def _read_slices(self, sliced, pace=None):
        """Slices [(Range with runs `step` bytes apart, dest)]: a tensor-parallel slice along
        the last axis, or one of a fused tensor's interleaved row sets (gpt-oss's gate and up
        rows). The span that holds a slice's runs is read and its runs kept (the span's bytes
        count as read); slices whose spans overlap (gate's and up's rows of one expert) are
        read as one span."""
        groups = []  # [file, start, end, [(range, dest)]]
        for r, dest in sorted(sliced, key=lambda rd: (str(rd[0].file), rd[0].offset)):
            end = r.offset + slice_span(r)
            if groups and groups[-1][0] == r.file and r.offset < groups[-1][2]:
                groups[-1][2] = max(groups[-1][2], end)
                groups[-1][3].append((r, dest))
            else:
                groups.append([r.file, r.offset, end, [(r, dest)]])
        disk = 0
        for file, start, end, members in groups:
            if pace is not None:
                pace(end - start)
            buf = np.empty(end - start, np.uint8)
            disk += self._read_run((file, start, end, [(start, buf)]))
            for r, dest in members:
                runs = np.lib.stride_tricks.as_strided(buf[r.offset - start:], (r.runs, r.nbytes // r.runs), (r.step, 1))
                dest.reshape(runs.shape)[...] = runs
        return disk

    def _pool(self):
        if self._workers is None:
            with self._open_lock:
                if self._workers is None:
                    self._workers = ThreadPoolExecutor(self.workers, thread_name_prefix="mlxmoe-read")
        return self._workers

    def _read_run(self, run):
        self._fd(run[0])
        how = self._how[run[0]]
        if how == "o_direct":
            return self._read_direct(*run)
        if how == "mmap":
            return self._read_mmap(*run)
        return self._read_pread(*run, fadvise=how == "fadvise")

    def _read_pread(self, file, start, end, pieces, fadvise=False):
        fd = self._fds[file]
        if sum(d.nbytes for _, d in pieces) != end - start:  # gaps (a run grouped for O_DIRECT)
            ranges = [Range(file, off, d.nbytes) for off, d in pieces]
            return sum(self._read_pread(*run, fadvise) for run in runs(ranges, [d for _, d in pieces]))
        if preadv_all(fd, [d for _, d in pieces], start, file) < end - start:
            raise truncated(file, end)
        if fadvise and hasattr(os, "posix_fadvise"):
            # Whole pages: the kernel keeps a partly covered page.
            a = align_down(start)
            os.posix_fadvise(fd, a, align_up(end) - a, os.POSIX_FADV_DONTNEED)
        return end - start

    def _read_direct(self, file, start, end, pieces):
        fd, align = self._fds[file], self._align[file]
        a, b = align_down(start, align), align_up(end, align)
        if all(off % align == 0 and d.nbytes % align == 0 and d.ctypes.data % align == 0 for off, d in pieces) \
                and sum(d.nbytes for _, d in pieces) == end - start:
            # Aligned and back to back (a bundled checkpoint, aligned slots): straight into the slots.
            if preadv_all(fd, [d for _, d in pieces], a, file, align) < end - start:
                raise truncated(file, end)
            return end - start
        got = 0
        for c in range(a, b, BOUNCE):  # through the bounce buffer, at most BOUNCE bytes at a time
            buf = self._bounce(min(BOUNCE, b - c))
            n = preadv_all(fd, [buf], c, file, align)  # b may lie past the end of the file
            got += n
            if c + n < min(c + len(buf), end):
                raise truncated(file, end)
            for off, d in pieces:
                lo, hi = max(off, c), min(off + d.nbytes, c + n)
                if lo < hi:
                    d[lo - off:hi - off] = buf[lo - c:hi - c]
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
            d[...] = arr[off:off + d.nbytes]
        if hasattr(mmap, "MADV_DONTNEED"):  # out of this process's RSS (the pages stay in the page cache)
            mm.madvise(mmap.MADV_DONTNEED, a, b - a)
        return b - a

    def io_stats(self):
        """{"io", "method", "useful_bytes", "disk_bytes", "amplification", "reads", "fallback"}."""
        with self._lock:
            useful, disk, reads = self.useful_bytes, self.disk_bytes, self.reads
        return {"io": self.io, "method": self.method, "useful_bytes": useful, "disk_bytes": disk,
                "amplification": disk / useful if useful else 1.0, "reads": reads, "fallback": self.fallback}

    def reset_io_stats(self):
        with self._lock:
            self.useful_bytes = self.disk_bytes = self.reads = 0

    def close(self):
        if self._workers is not None:
            self._workers.shutdown()
            self._workers = None
        mms = [mm for mm, _ in self._maps.values()]
        self._maps = {}  # drops the arrays over the maps, so they can close
        for mm in mms:
            try:
                mm.close()
            except BufferError:  # a view of it is still alive: the garbage collector closes it
                pass
        for fd in self._fds.values():
            os.close(fd)
        self._fds, self._how, self._align = {}, {}, {}

    def __del__(self):
        # a model dropped without close() (mlx-lm's users never call it) still closes its shards
        try:
            for fd in getattr(self, "_fds", {}).values():
                os.close(fd)
        except OSError:
            pass
