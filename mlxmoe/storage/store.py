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

from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
import threading

import numpy as np

from ..errors import MlxmoeError
from .reader import ShardReader, align_down, align_up, default_io, resolve_io, runs  # noqa: F401  (store's names)
from .shards import (ALIGN, DTYPES, Range, header_bytes, read_header, row_part, shard_files, shard_slice, stamp,
                     to_float32)

# The ranges of one expert in a stacked checkpoint (weight, scales, biases of gate, up,
# down: 9 far apart) are read by this many threads at once: with O_DIRECT one request in
# flight leaves the disk idle between ranges.
IO_WORKERS = 4
# A paced (background) read asks the disk for pieces of at most this much (until the cache's
# ReadGate has timed the disk), so that a demand read that comes meanwhile waits behind
# PIECES_AHEAD such pieces at most (a multiple of ALIGN).
CHUNK = 256 << 10
# pieces of a paced read asked of the disk at once (a demand read waits behind this many at most)
PIECES_AHEAD = 2


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


class ShardStamps:
    """What each shard was when indexed: its stamp (size, mtime) when last checked and its
    safetensors header. check() refuses a shard whose size or header changed since: its
    tensors may no longer lie where the header said. Its mtime alone may change (rsync,
    backup tools touch files): the header is read again then, and if it is the one indexed,
    the new stamp is kept. A shard put back as it was is read on (the reads go to the file
    opened at load, which keeps its bytes where a copy was renamed over it)."""

    def __init__(self) -> None:
        self.stamps = {}  # file -> stamp() when last checked
        self.headers = {}  # file -> header_bytes() when indexed

    def indexed(self, file) -> None:
        try:
            self.stamps[file], self.headers[file] = stamp(file), header_bytes(file)
        except OSError as e:
            raise MlxmoeError(f"cannot read shard {file}: {e.strerror or e}") from None

    def check(self, file) -> None:
        try:
            now = stamp(file)
            if file not in self.stamps:  # a file not indexed: as at its first read
                self.stamps[file], self.headers[file] = now, header_bytes(file)
            if self.stamps[file] == now:
                return
            header = header_bytes(file)
        except OSError as e:
            raise changed(file, e.strerror or e) from None
        if now[0] != self.stamps[file][0]:
            raise changed(file, f"size {self.stamps[file][0]} -> {now[0]} bytes")
        if header != self.headers[file]:
            raise changed(file, "its safetensors header differs")
        self.stamps[file] = now


def changed(file, why) -> MlxmoeError:
    # (the advice first: mlxmoe serve's 500 cuts a long message)
    return MlxmoeError(f"a shard changed on disk since the model was loaded ({why}): put the original back, "
                       f"or load the model again (mlxmoe serve: restart it); shard {file}")


UNPLANNED = object()  # an expert read_expert has not planned yet


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
        self.shards = ShardStamps()  # a shard read from must be the one indexed
        for f in self.files:
            self.index.update(read_header(f))  # (first: it refuses a FIFO, which a read would wait on)
            self.shards.indexed(f)
        self.tensors = []  # names of one expert's tensors, in read order
        self.tensor_dtypes = []  # safetensors dtype of each
        self.tensor_shapes = []  # per-expert shape of each
        self.model_shapes = []  # the same in the checkpoint, before a tensor split's slice (the fingerprint's)
        self.ranges = []  # [layer][expert] -> [Range per tensor]
        self.expert_names = set()  # the file tensors that hold experts
        self.reader = ShardReader(io, bypass)
        self._lock = threading.Lock()  # the byte counters
        self._plans = {}  # (layer, expert) -> (its one run, its slots' dtypes and sizes): _read_planned
        self._pool_lock = threading.Lock()
        self.useful_bytes = self.disk_bytes = self.reads = 0
        self.workers = workers  # threads reading the separate ranges of one expert at once
        self._workers = None

    # the reader's mode and state, as the store's callers know them
    io = property(lambda self: self.reader.io)
    bypass = property(lambda self: self.reader.bypass)
    fallback = property(lambda self: self.reader.fallback)
    method = property(lambda self: self.reader.method)
    _fds = property(lambda self: self.reader._fds)

    def set_io(self, io="auto", bypass=None):
        """Switch the IO mode; the shards are reopened."""
        self.reader.set_io(io, bypass)
        self._plans.clear()  # (their runs: widened to the alignment of the mode)

    def _read_run(self, run):
        return self.reader.read_run(run)

    def map_layers(self, layers):
        """Record the byte ranges of every expert.

        `layers[l]` is {tensor: [(file tensor name, expert row or None[, shard[, rows]])] * num_experts}:
        a row index into a stacked [E, ...] tensor, or None for a per-expert tensor; shard
        (axis of one expert's tensor, parts, index): only that part (tensor parallelism);
        rows ("halves" or "interleaved", parts, index): only that part of the expert's rows
        (gate's or up's of a fused gate_up tensor, shards.row_part).
        """
        self.tensors = list(layers[0])
        self._plans.clear()
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
            self.reader._fd(f)

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

    def read_expert(self, layer, expert, outs, pace=None, chunk=CHUNK, check=True):
        """Read expert `expert` of MoE layer `layer` into `outs` (one numpy array per tensor).

        An out whose dtype differs from the file's (bf16/f16 scales into float32 on
        CPU) is filled through a converting copy; otherwise bytes land in place.
        Returns the number of useful bytes read (the expert's bytes on disk);
        `disk_bytes` also counts what the mode read around them. With `pace` (a background
        read), the ranges are read in order in pieces of at most `chunk` bytes, PIECES_AHEAD
        of them asked at once, and pace(nbytes) is called before each is asked: it may wait
        (a demand read goes first) or raise (the read is no longer wanted), and the slot is
        then left half-written. `check`: False where the caller checks the shards read from
        once its reads end (check_shards), not each read.
        """
        run = None if pace is not None else planned(self, layer, expert, outs)
        if run is not None:
            return self._read_planned(run, outs, check)
        ranges, plain = self.ranges[layer][expert], []
        dests, converts, sliced = [], [], []
        for r, out, dtype in zip(ranges, outs, self.tensor_dtypes):
            raw_dtype = DTYPES[dtype]
            if lands_as_is(out, dtype):
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
            disk = self._read_paced([piece for run in todo for piece in split_run(run, chunk)], pace)
        elif self.workers > 1 and len(todo) > 1:  # the ranges of a stacked expert: all at once
            futures = [self._pool().submit(self._read_run, run) for run in todo]
            try:
                disk = sum(f.result() for f in futures)
            except BaseException:  # Ctrl-C or an error: no worker may write into the slot once it is given back
                wait(futures)
                raise
        else:
            disk = sum(map(self._read_run, todo))
        disk += read_slices(self._read_run, sliced, pace)
        if check:
            self.check_shards([(layer, expert)])
        for out, buf, dtype in converts:
            out[...] = to_float32(buf, dtype) if out.dtype == np.float32 else buf.astype(out.dtype)
        useful = sum(r.nbytes for r in ranges)
        self._count(useful, disk, len(todo))
        return useful

    def check_shards(self, keys):
        """The shards that experts `keys` [(layer, expert)] lie in, checked once each (ShardStamps.check)."""
        for file in {r.file for layer, e in keys for r in self.ranges[layer][e]}:
            self.shards.check(file)

    def _read_planned(self, plan, outs, check=True, ended=None):
        """read_expert of a planned expert (planned()): `plan` is its run; `ended`: the bytes
        asked of the kernel where it has been read already (start_expert)."""
        disk = self._read_run(into(plan, outs)) if ended is None else ended
        if check:
            self.shards.check(plan[0])
        useful = sum(outs[i].nbytes for _, i in plan[3])
        self._count(useful, disk, 1)
        return useful

    def _count(self, useful, disk, reads):
        with self._lock:
            self.useful_bytes += useful
            self.disk_bytes += disk
            self.reads += reads

    def _read_paced(self, pieces, pace):
        """A paced read's pieces, pace(nbytes) before each, PIECES_AHEAD of them asked of the
        disk at once: with one at a time the disk idles from each piece's end until the next
        is asked for (1.18x the time of one long read at 64 KiB pieces on a 40 MB/s disk,
        1.07x with two). Returns the bytes read, once no piece is being read any more."""
        asked, disk = [], 0
        try:
            for piece in pieces:
                if len(asked) >= PIECES_AHEAD:
                    disk += asked[0].result()
                    asked.pop(0)
                pace(piece[2] - piece[1])
                asked.append(self._pool().submit(self._read_run, piece))
            while asked:
                disk += asked[0].result()
                asked.pop(0)
        except BaseException:  # cancelled (pace) or an error: no piece may write into the slot once it is given back
            wait(asked)
            raise
        return disk

    def _pool(self):
        if self._workers is None:
            with self._pool_lock:
                if self._workers is None:
                    self._workers = ThreadPoolExecutor(self.workers, thread_name_prefix="mlxmoe-read")
        return self._workers

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
        self.reader.close()
        land, self.reader.land = self.reader.land, None
        if land is not None:  # (its page-locked buffers: no read runs now)
            land.close()


def lands_as_is(out, dtype):
    """Whether a tensor of safetensors `dtype` is read into `out` as its bytes are (bf16 into
    uint16 storage too), not through a converting copy."""
    return out.dtype == DTYPES[dtype] or (dtype == "BF16" and out.dtype == np.uint16)


def planned(store, layer, expert, outs, like=None):
    """An expert's run where it has a plan (plan_expert) and `outs` are slots like those it
    was planned with, else None (a slot of another size goes the long way, which names it).
    `like`: outs' [(dtype, nbytes)], rows of C-contiguous pools (SlotPools.slot)."""
    plan = store._plans.get((layer, expert), UNPLANNED)
    if plan is UNPLANNED:  # (kept either way: a stacked checkpoint's experts are not planned at each read)
        plan = store._plans[(layer, expert)] = plan_expert(store.ranges[layer][expert], outs, store.tensor_dtypes,
                                                            ALIGN if store.io == "direct" else 1)
    if plan is not None and (plan[1] == like if like is not None else all(
            o.dtype == d and o.nbytes == n and o.flags.c_contiguous for o, (d, n) in zip(outs, plan[1]))):
        return plan[0]
    return None


def start_expert(store, layer, expert, outs, lane=0, dests=None, like=None, check=True):
    """read_expert of a planned expert asked of the kernel and not waited for
    (ShardReader.start_run, `lane` its): returns finish(), which waits for it and returns its
    useful bytes (its shard checked, where `check`; else the caller checks it: check_shards);
    None where it cannot be (read_expert it). `dests`: outs' bytes (into()'s), `like`:
    planned()'s, where the caller keeps them."""
    run = planned(store, layer, expert, outs, like)
    finish = None if run is None else store.reader.start_run(into(run, outs, dests), lane)
    return None if finish is None else lambda: store._read_planned(run, outs, check, ended=finish())


def into(plan, outs, dests=None):
    """A planned run (plan_expert) with its pieces' destinations: `outs`' bytes (`dests`, where given)."""
    file, start, end, pieces = plan
    if dests is None:
        return file, start, end, [(off, outs[i].reshape(-1).view(np.uint8)) for off, i in pieces]
    return file, start, end, [(off, dests[i]) for off, i in pieces]


def plan_expert(ranges, outs, dtypes, align):
    """The plan of an expert (ExpertStore.read_expert) whose `ranges` are one run and whose
    slots (like `outs`) take the file's bytes as they are: (that run (file, start, end,
    [(offset, tensor index)]), the slots' dtypes and sizes); else None (the long way: it
    converts, or names a slot of the wrong size)."""
    if any(r.runs > 1 for r in ranges) or not all(
            o.flags.c_contiguous and o.nbytes == r.nbytes and lands_as_is(o, d) for o, r, d in zip(outs, ranges, dtypes)):
        return None
    todo = runs(ranges, list(range(len(ranges))), align)
    return (todo[0], [(o.dtype, o.nbytes) for o in outs]) if len(todo) == 1 else None


def read_slices(read_run, sliced, pace=None):
    """Read slices [(Range with runs `step` bytes apart, dest)] with `read_run`: a
    tensor-parallel slice along the last axis, or one of a fused tensor's interleaved row
    sets (gpt-oss's gate and up rows). The span that holds a slice's runs is read and its
    runs kept (the span's bytes count as read); slices whose spans overlap (gate's and up's
    rows of one expert) are read as one span."""
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
        disk += read_run((file, start, end, [(start, buf)]))
        for r, dest in members:
            runs = np.lib.stride_tricks.as_strided(buf[r.offset - start:], (r.runs, r.nbytes // r.runs), (r.step, 1))
            dest.reshape(runs.shape)[...] = runs
    return disk
