"""The IO modes (mmap, pread, direct) read the same bytes, count read amplification, give
the same greedy output, report failed reads with file and offset, and are thread-safe."""

import mmap
import os
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import mlxmoe
from mlxmoe import MlxmoeError
from mlxmoe.storage import reader as reader_module
from mlxmoe.loader import open_checkpoint
from mlxmoe.storage.shards import ALIGN, DTYPES, Range
from mlxmoe.storage.store import ExpertStore, default_io, resolve_io, start_expert

from conftest import fs_type

# (io, bypass): every way the store reads
MODES = [("mmap", None), ("pread", None), ("direct", None), ("direct", "fadvise")]
IDS = ["mmap", "pread", "direct", "direct-fadvise"]
PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"


def outs_for(store, widen=False):
    """Buffers for one expert: the file's dtypes, or float32 for bf16/f16 (the CPU policy)."""
    return [np.empty(shape, np.float32 if widen and d in ("BF16", "F16") else DTYPES[d])
            for shape, d in zip(store.tensor_shapes, store.tensor_dtypes)]


def read_all(store, widen=False):
    out = {}
    for l in range(store.num_layers):
        for e in range(store.num_experts):
            bufs = outs_for(store, widen)
            assert store.read_expert(l, e, bufs) == store.expert_file_bytes()
            out[(l, e)] = [b.copy() for b in bufs]
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for x, y in zip(a[k], b[k]):
            np.testing.assert_array_equal(x, y, err_msg=f"expert {k}")


@pytest.mark.parametrize("variant", [dict(quant="4bit"), dict(layout="per_expert"), dict(quant="4bit", dtype="bfloat16")],
                         ids=["stacked-4bit", "per_expert-float", "stacked-4bit-bf16"])
def test_modes_read_the_same_bytes(checkpoint, on_disk, variant):
    path = on_disk(checkpoint("qwen3_moe", **variant))
    store = open_checkpoint(path).store
    widen = variant.get("dtype") == "bfloat16"
    store.workers = 1  # the reference: one range after the other
    store.set_io("pread")
    want = read_all(store, widen)
    assert store.io_stats()["amplification"] == 1.0
    store.close()
    store.workers = 4  # the ranges of one expert read at once
    for io, bypass in MODES:
        store.set_io(io, bypass)
        store.reset_io_stats()
        assert_same(read_all(store, widen), want)
        s = store.io_stats()
        assert s["io"] == io and s["useful_bytes"] == store.num_layers * store.num_experts * store.expert_file_bytes()
        assert s["disk_bytes"] >= s["useful_bytes"]  # amplification >= 1
        if bypass == "fadvise" or io == "pread":
            assert s["amplification"] == 1.0
        if io == "direct" and bypass is None and hasattr(os, "O_DIRECT"):
            assert store.method == "o_direct", store.fallback
    store.close()


def test_greedy_output_same_in_every_mode(checkpoint, on_disk):
    path = on_disk(checkpoint("qwen3_moe", quant="4bit"))

    def run(**kw):
        model, tokenizer = mlxmoe.load(str(path), cache_experts=8, **kw)
        tokens = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=16)]
        cache = model.expert_cache
        cache.close()
        return tokens, cache

    want, cache = run()
    assert cache.store.io == default_io() and cache.stats()["misses"] > 0
    for io in ("mmap", "pread", "direct"):
        tokens, cache = run(io=io)
        assert cache.store.io == io
        assert tokens == want, f"io={io} changed the output"
        assert cache.store.io_stats()["useful_bytes"] > 0


def test_bad_io_value(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    with pytest.raises(MlxmoeError, match="unknown io mode 'fast'"):
        mlxmoe.load(str(path), io="fast")
    with pytest.raises(MlxmoeError, match="unknown io mode"):
        ExpertStore(path, io="O_DIRECT")
    with pytest.raises(MlxmoeError, match="page-cache bypass"):
        ExpertStore(path, io="direct", bypass="nope")
    assert resolve_io("auto") == resolve_io(None) == default_io()


@pytest.mark.parametrize("io,bypass", MODES, ids=IDS)
def test_truncated_shard_names_file_and_offset(checkpoint, on_disk, io, bypass):
    path = on_disk(checkpoint("qwen3_moe", quant="4bit"))
    store = open_checkpoint(path).store
    store.set_io(io, bypass)
    last = store.num_experts - 1
    r = store.ranges[0][last][0]
    os.truncate(r.file, r.offset + 10)  # after the store opened (and mapped) the shard
    with pytest.raises(MlxmoeError) as e:
        store.read_expert(0, last, outs_for(store))
    assert str(r.file) in str(e.value) and "offset" in str(e.value)
    store.close()


@pytest.mark.parametrize("io,bypass", MODES, ids=IDS)
def test_read_error_names_file_and_offset(checkpoint, on_disk, io, bypass):
    path = on_disk(checkpoint("qwen3_moe", quant="4bit"))
    store = open_checkpoint(path).store
    store.set_io(io, bypass)
    r = store.ranges[1][3][0]
    good, store._fds[r.file] = store._fds[r.file], 1 << 20  # a descriptor that is not open
    try:
        with pytest.raises(MlxmoeError) as e:
            store.read_expert(1, 3, outs_for(store))
    finally:
        store._fds[r.file] = good
    msg = str(e.value)
    assert str(r.file) in msg and "offset" in msg
    store.close()


@pytest.mark.parametrize("io,bypass", MODES, ids=IDS)
def test_concurrent_reads(checkpoint, on_disk, io, bypass):
    path = on_disk(checkpoint("qwen3_moe", quant="4bit"))
    store = open_checkpoint(path).store
    store.set_io("pread")
    want = read_all(store)
    store.set_io(io, bypass)
    store.reset_io_stats()
    keys = [random.Random(0).choice(list(want)) for _ in range(400)]

    def read(key):
        bufs = outs_for(store)
        store.read_expert(*key, bufs)
        return key, bufs

    with ThreadPoolExecutor(8) as ex:
        for key, bufs in ex.map(read, keys):
            for x, y in zip(bufs, want[key]):
                np.testing.assert_array_equal(x, y, err_msg=f"expert {key}")
    assert store.io_stats()["useful_bytes"] == len(keys) * store.expert_file_bytes()
    store.close()


@pytest.mark.skipif(reader_module.AIO is None, reason="no POSIX AIO here (glibc on 64-bit Linux)")
@pytest.mark.parametrize("io,bypass", MODES, ids=IDS)
def test_reads_asked_together_land_the_same_bytes(checkpoint, on_disk, tmp_path, monkeypatch, io, bypass):
    """Experts asked of the kernel together (start_expert, a lane each: glibc's AIO reads one
    fd's requests in turn, so each lane has a fd of its own) and waited for afterwards land
    read_expert's bytes and count alike; mmap cannot (None: the caller reads at once). A read
    interrupted in its wait keeps its buffer from reuse (the kernel may still write it); a
    shard cut short under them is named with the offset."""
    from mlxmoe.storage.convert import bundle

    path = on_disk(bundle(checkpoint("qwen3_moe", quant="4bit"), tmp_path / "bundled", progress=lambda _: None))
    store = open_checkpoint(path).store  # (bundled: an expert one run, read in one request)
    store.set_io("pread")
    want = read_all(store)
    store.set_io(io, bypass)
    store.reset_io_stats()
    keys, got = list(want), {}
    for i in range(0, len(keys), 4):
        started = []
        for lane, key in enumerate(keys[i:i + 4]):
            got[key] = outs_for(store)
            started.append(start_expert(store, *key, got[key], lane))
            assert (started[-1] is None) == (io == "mmap")
        assert all(finish is None or finish() == store.expert_file_bytes() for finish in started)
    if io == "mmap":
        return store.close()
    assert_same(got, want)
    assert store.io_stats()["useful_bytes"] == len(keys) * store.expert_file_bytes()
    later = store.reader.later
    assert sorted(len(dups) for dups in later.lanes.values())[-1] == 3
    fit = reader_module.LATER_BYTES // reader_module.LATER_UNIT  # (an expert here is far under a unit)
    started = [start_expert(store, *keys[i % len(keys)], outs_for(store)) for i in range(fit + 1)]
    assert started[-1] is None and None not in started[:-1]  # (at most LATER_BYTES of buffers in use)
    assert all(finish() == store.expert_file_bytes() for finish in started[:-1]) and later.busy == 0
    wait = reader_module.AIO.wait
    monkeypatch.setattr(reader_module.AIO, "wait", lambda request: (wait(request), (_ for _ in ()).throw(KeyboardInterrupt))[1])
    spare = len(later.spare)
    with pytest.raises(KeyboardInterrupt):
        start_expert(store, 0, 0, outs_for(store))()
    assert len(later.unfinished) == 1 and len(later.spare) == spare - 1  # (its buffer not given back)
    monkeypatch.undo()
    last = store.num_experts - 1
    r = store.ranges[0][last][0]
    os.truncate(r.file, r.offset + 10)
    with pytest.raises(MlxmoeError) as e:
        start_expert(store, 0, last, outs_for(store))()
    assert str(r.file) in str(e.value) and "offset" in str(e.value)
    store.close()
    assert not later.lanes  # (closed with their files)


def test_direct_falls_back_when_o_direct_is_refused(checkpoint, on_disk, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    path = on_disk(checkpoint("qwen3_moe", quant="4bit"))
    store = open_checkpoint(path).store
    store.set_io("pread")
    want = read_all(store)
    real_open = os.open

    def refuse(file, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(file, flags, *a)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.warns(UserWarning, match="O_DIRECT failed"):
        store.set_io("direct")
    assert store.method == "fadvise" and "O_DIRECT failed" in store.fallback
    assert_same(read_all(store), want)
    store.close()


def aligned(n):
    """A page-aligned uint8 buffer (where O_DIRECT can read straight in)."""
    return np.frombuffer(mmap.mmap(-1, n), np.uint8)


@pytest.mark.parametrize("bounce", [None, 2 * ALIGN], ids=["bounce-default", "bounce-8k"])
def test_direct_ranges_aligned_unaligned_and_sharing_pages(checkpoint, tmp_path, monkeypatch, bounce):
    """One expert as back-to-back aligned ranges (read straight into aligned slots),
    ranges a few bytes apart in one page (one O_DIRECT read, separate preads) and a
    range that ends at the end of the file; with a small bounce buffer, O_DIRECT reads
    go in several chunks."""
    if bounce:
        monkeypatch.setattr(reader_module, "BOUNCE", bounce)
    if fs_type(tmp_path) == "tmpfs":
        tmp_path = Path(tempfile.mkdtemp(dir="/var/tmp"))
    data = np.random.default_rng(0).integers(0, 256, 7 * ALIGN + 4000, dtype=np.uint8)
    f = tmp_path / "experts.bin"
    f.write_bytes(data.tobytes())
    store = ExpertStore(checkpoint("qwen3_moe", quant="4bit"))
    store.tensors, store.tensor_dtypes, store.tensor_shapes = ["a", "b"], ["U8", "U8"], [(2 * ALIGN,), (ALIGN,)]
    store.ranges = [[
        [Range(f, 0, 2 * ALIGN), Range(f, 2 * ALIGN, ALIGN)],  # aligned, back to back
        [Range(f, 3 * ALIGN + 7, 2 * ALIGN), Range(f, 5 * ALIGN + 100, ALIGN)],  # 93 bytes apart
        [Range(f, len(data) - 3 * ALIGN, 2 * ALIGN), Range(f, len(data) - ALIGN, ALIGN)],  # to the end
    ]]
    for io, bypass in MODES:
        store.set_io(io, bypass)
        for e, rows in enumerate(store.ranges[0]):
            bufs = [aligned(2 * ALIGN), aligned(ALIGN)]
            assert store.read_expert(0, e, bufs) == 3 * ALIGN
            for r, b in zip(rows, bufs):
                np.testing.assert_array_equal(b, data[r.offset:r.offset + r.nbytes], err_msg=f"{io} {bypass} {e}")
    store.close()


def test_cli_io_option(checkpoint):
    import subprocess
    import sys

    path = checkpoint("qwen3_moe", quant="4bit")
    r = subprocess.run([sys.executable, "-m", "mlxmoe", "generate", "--model", str(path), "--prompt", "Hello",
                        "--max-tokens", "4", "--cache-experts", "8", "--io", "mmap"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "mlxmoe", "generate", "--model", str(path), "--prompt", "Hello",
                        "--io", "turbo"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "turbo" in r.stderr


def test_a_short_read_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """preadv_all: a read the kernel returns short (a signal, a network filesystem) goes on
    from where it stopped, across buffers and within one; the file's end, or under O_DIRECT a
    count that is not a multiple of the alignment, ends it."""
    data = bytes(range(256)) * 4
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    real = os.preadv

    def short(fd, bufs, offset):  # at most 7 bytes a call
        left, views = 7, []
        for b in bufs:
            views.append(memoryview(b)[:left])
            left -= len(views[-1])
            if not left:
                break
        return real(fd, views, offset)

    monkeypatch.setattr(reader_module.os, "preadv", short)
    try:
        bufs = [np.zeros(5, np.uint8), np.zeros(12, np.uint8), np.zeros(3, np.uint8)]
        assert reader_module.preadv_all(fd, bufs, 10, path) == 20
        assert b"".join(b.tobytes() for b in bufs) == data[10:30]
        assert reader_module.preadv_all(fd, [np.zeros(16, np.uint8)], 0, path, align=4) == 7
        tail = np.zeros(16, np.uint8)
        assert reader_module.preadv_all(fd, [tail], len(data) - 5, path) == 5 and tail[:5].tobytes() == data[-5:]
    finally:
        os.close(fd)
