"""Reads that put their bytes in place through the reader's `land` (backend.DeviceCopy on
CUDA, where backend.DEVICE_COPY): every byte of every slot goes through it in each IO mode,
none straight into the slot, the bytes are those of a plain read, and a generation streamed
that way (its verified steps' slot tables written through it too) gives stock mlx-lm's tokens. Off by default; without a GPU a DeviceCopy fails
clearly."""

import ctypes
import mmap
import threading

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlxmoe
from mlxmoe import MlxmoeError, backend
from mlxmoe.backend import Backend, DeviceCopy, detect
from mlxmoe.loader import open_checkpoint
from mlxmoe.storage.convert import bundle
from mlxmoe.storage import reader
from mlxmoe.storage.reader import preadv_all
from mlxmoe.storage.shards import DTYPES

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"


class Landed:
    """A land that copies as numpy does, gives each thread one buffer to read into (as
    DeviceCopy's page-locked ones), and counts what it put where and from where."""

    def __init__(self):
        self.bytes, self.sizes, self.buffers, self.outside = 0, [], {}, 0
        self.closed = False

    def buffer(self, n):
        buf = self.buffers.setdefault(threading.get_ident(), np.frombuffer(mmap.mmap(-1, 4 << 20), np.uint8))
        assert n <= len(buf)
        return buf[:n]

    def __call__(self, dest, src):
        assert dest.nbytes == src.nbytes
        dest[...] = src
        self.bytes += dest.nbytes
        self.sizes.append((dest.ctypes.data, dest.nbytes))
        at = src.ctypes.data  # (DeviceCopy stages a source outside its buffers)
        self.outside += not any(b.ctypes.data <= at < b.ctypes.data + len(b) for b in self.buffers.values())

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def bundled(checkpoint, tmp_path_factory):
    src = checkpoint("qwen3_moe", quant="4bit")
    return src, bundle(src, tmp_path_factory.mktemp("bundled") / "model", progress=lambda _: None)


def slots(store):
    """An expert's slots, page-aligned and back to back as a pool's (a bundled expert's
    O_DIRECT read goes straight into such slots), filled with 7s."""
    sizes = [int(np.prod(shape)) * np.dtype(DTYPES[d]).itemsize for shape, d in zip(store.tensor_shapes, store.tensor_dtypes)]
    memory = np.frombuffer(mmap.mmap(-1, sum(sizes)), np.uint8)
    memory[:] = 7
    ends = np.cumsum(sizes)
    return [memory[end - n:end].view(DTYPES[d]).reshape(shape)
            for n, end, shape, d in zip(sizes, ends, store.tensor_shapes, store.tensor_dtypes)]


@pytest.mark.parametrize("io", ["pread", "direct", "mmap"])
@pytest.mark.parametrize("which", [0, 1], ids=["stacked", "bundled"])
def test_every_byte_lands_through_it(bundled, on_disk, io, which, monkeypatch):
    path = on_disk(bundled[which])
    plain, landed = open_checkpoint(path).store, open_checkpoint(path).store
    for store in (plain, landed):
        store.set_io(io)
    land = landed.reader.land = Landed()
    into = []  # the addresses the kernel was asked to read into
    monkeypatch.setattr(reader, "preadv_all", lambda fd, bufs, *a: (into.extend(b.ctypes.data for b in bufs),
                                                                    preadv_all(fd, bufs, *a))[1])

    def straight(outs):  # reads asked straight into these slots
        lo = outs[0].ctypes.data
        return sum(lo <= at < lo + sum(o.nbytes for o in outs) for at in into)

    for layer in range(plain.num_layers):
        for e in range(plain.num_experts):
            want, got = slots(plain), slots(landed)
            before = land.bytes
            into.clear()
            assert landed.read_expert(layer, e, got) == plain.read_expert(layer, e, want) == plain.expert_file_bytes()
            assert land.bytes - before == sum(g.nbytes for g in got) and not straight(got)  # each byte through it
            if io == "direct" and which == 1:  # (where the plain read goes straight: none through it either)
                assert plain.method == "o_direct" and straight(want)
            for t, w, g in zip(plain.tensors, want, got):
                np.testing.assert_array_equal(g, w, err_msg=f"{t} of expert {e} in layer {layer} ({io})")
    if io == "mmap":  # (from the map: DeviceCopy stages such a source)
        assert not land.buffers and land.outside
    else:  # (bounced: each through its reading thread's one buffer)
        assert 0 < len(land.buffers) <= landed.workers + 1 and land.outside == 0
    plain.close()
    landed.close()
    assert land.closed and landed.reader.land is None  # (the store's close frees its buffers)


def test_a_streamed_generation_landed_so_gives_stock_tokens(bundled):
    src, dst = bundled
    stock, tokenizer = mlx_lm.load(str(src))
    detect().apply_dtype_policy(stock)
    want = [r.token for r in mlx_lm.stream_generate(stock, tokenizer, PROMPT, max_tokens=24)]
    model, tokenizer = mlxmoe.load(str(dst), cache_experts=8)
    cache = model.expert_cache
    assert cache.store.reader.land is None  # (off by default)
    land = cache.store.reader.land = Landed()
    cache.reset_stats()
    got = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=24)]
    stats = cache.stats()
    cache.close()
    assert got == want
    rows = {v.ctypes.data for _, views, _ in cache.verifier.tables.sets for v in views}  # the slot tables' rows
    assert stats["misses"] > 0 and sum(n for at, n in land.sizes if at not in rows) == stats["bytes_read"]
    assert stats["verified_tokens"] > 0 and any(at in rows for at, _ in land.sizes)  # (the tables' too)


def test_only_cuda_with_the_switch_copies(monkeypatch):
    monkeypatch.setattr(backend, "DEVICE_COPY", False)
    assert Backend("cuda").slot_copy() is None
    monkeypatch.setattr(backend, "DEVICE_COPY", True)
    assert Backend("cpu").slot_copy() is None and Backend("metal").slot_copy() is None

    def missing():
        raise MlxmoeError("no CUDA runtime library to copy into slot memory with (tried libcudart.so.13)")
    monkeypatch.setattr(backend, "DeviceCopy", missing)
    with pytest.warns(UserWarning, match="no CUDA runtime library.*host's stores"):
        assert Backend("cuda").slot_copy() is None


def test_a_device_copy_copies_on_a_gpu_and_fails_clearly_without_one():
    dest = np.zeros(64, np.uint8)
    try:
        copy = DeviceCopy()
    except MlxmoeError as e:  # (no CUDA runtime library, or no driver or GPU it can use)
        assert "CUDA runtime library" in str(e) or "cudaGetDeviceCount failed" in str(e)
        return
    # (a GPU: through its buffer, page-locked, and from elsewhere, staged)
    src = copy.buffer(64)
    src[:] = np.arange(64, dtype=np.uint8)
    copy(dest, src)
    np.testing.assert_array_equal(dest, src)
    copy(dest, np.full(64, 9, np.uint8))
    assert (dest == 9).all() and copy.copies == 2
    copy.close()


class FakeRuntime:
    """libcudart as DeviceCopy calls it, on the host: registrations kept, cudaMemcpy a memmove
    that notes whether its source was registered (only such a copy has landed on return)."""

    class Call:
        def __init__(self, fn):
            self.fn, self.argtypes, self.restype = fn, None, None

        def __call__(self, *args):
            return self.fn(*args)

    def __init__(self):
        self.registered, self.unregistered, self.sources = {}, [], []
        self.cudaGetDeviceCount = self.Call(lambda count: 0)
        self.cudaHostRegister = self.Call(lambda at, n, flags: self.registered.setdefault(at, n) and 0)
        self.cudaHostUnregister = self.Call(lambda at: self.unregistered.append(at.value) or 0)
        self.cudaMemcpy = self.Call(self.memcpy)

    def memcpy(self, dest, src, n, kind):
        assert kind == 4
        self.sources.append(any(at <= src and src + n <= at + size for at, size in self.registered.items()))
        ctypes.memmove(dest, src, n)
        return 0


def test_a_device_copy_copies_from_page_locked_memory_only_and_frees_it(monkeypatch):
    runtime = FakeRuntime()
    monkeypatch.setattr(backend.ctypes, "CDLL", lambda name: runtime)
    copy = DeviceCopy()
    dest = np.zeros(1000, np.uint8)
    read_into = copy.buffer(1000)  # (a reader's bounce buffer: page-locked, its copies direct)
    read_into[:] = np.arange(1000) % 251
    copy(dest, read_into)
    np.testing.assert_array_equal(dest, read_into)
    table_row = np.arange(250, dtype=np.uint32)  # (elsewhere: through the staging buffer)
    copy(dest, table_row)
    np.testing.assert_array_equal(dest.view(np.uint32), table_row)
    assert runtime.sources == [True, True] and copy.copies == 2
    assert copy.buffer(10).ctypes.data == read_into.ctypes.data  # (one per thread, kept)
    assert len(runtime.registered) == 2  # this thread's staging buffer (made at the probe) and bounce buffer
    copy.close()
    assert sorted(runtime.unregistered) == sorted(runtime.registered) and not copy.pinned
