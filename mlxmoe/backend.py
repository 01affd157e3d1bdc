"""What differs between cpu, metal and cuda: the device, the dtype policy, memory limits;
and device arrays of any float dtype read on the host."""

import ctypes
import ctypes.util
import mmap
import threading
import time
import warnings
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .budget import machine_memory
from .errors import MlxmoeError

FLOATS = (mx.float16, mx.bfloat16, mx.float32)
# CUDA's gather_qmm (MLX 0.32): gather_qmv for fewer rows (tokens x experts) than this, a GEMM from it
GATHER_GEMM_ROWS = 8
# Whether reads land in the slots on CUDA by the runtime's copy (DeviceCopy), not by the host's
# stores: off until a lent GPU has measured it (bench_disk.py's device-copy row)
DEVICE_COPY = False


@dataclass
class Backend:
    name: str  # "cpu" | "metal" | "cuda"
    # On CPU, MLX's bf16/f16 matmuls are 8-40x slower than float32: compute in
    # float32 there, keep the checkpoint's dtype on GPUs.
    compute_dtype: mx.Dtype = None
    # On CPU a prefill step's attention scores and probabilities are whole arrays (queries
    # x keys x heads), so they count in the working memory; Metal runs it in a fused kernel
    materialises_attention: bool = False
    # Whether a layer's experts computed in several calls get the numbers one call gives:
    # on CUDA MLX's quantized gather takes another kernel below GATHER_GEMM_ROWS rows (a
    # GEMV, from there a tensor-core GEMM: other sums, other bfloat16 roundings), so a split
    # call would not match stock mlx-lm's; Metal's kernel choice also follows the shape
    # (unmeasured: kept whole). The CPU's computes each row alone.
    split_exact: bool = True
    # Whether running ahead (caching/speculate.py) pays: on the CPU a layer computes for long
    # while the decode thread would wait idle for reads; on a GPU a layer run ahead is mostly
    # host work, which holds Python's GIL while the read threads need it (H200, 50 % cached:
    # the default 110 ms a token with it, 32 without, prefetch off 39; Metal's layers as short, unmeasured).
    runs_ahead: bool = True

    def pool_dtype(self, file_dtype):
        return self.compute_dtype if self.compute_dtype is not None and file_dtype in FLOATS else file_dtype

    def apply_dtype_policy(self, model):
        """Cast float parameters to the compute dtype (packed weights stay packed). Apply
        the same to a stock mlx-lm model to compare outputs."""
        if self.compute_dtype is not None:
            model.set_dtype(self.compute_dtype, lambda t: mx.issubdtype(t, mx.floating))
        return model

    def activation_bytes(self, model):
        """Bytes of one activation element: the compute dtype's, else the widest float
        parameter's (mlx-lm computes in the checkpoint's dtype on GPUs)."""
        if self.compute_dtype is not None:
            return self.compute_dtype.size
        sizes = [v.dtype.size for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
        return max(sizes, default=2)

    def memory(self):
        """Memory the model can use on this device: the recommended working set on
        Metal, the GPU's memory on CUDA (device_info's total_memory), physical memory
        on CPU."""
        info = mx.device_info() if self.name != "cpu" else {}
        return int(info.get("max_recommended_working_set_size") or info.get("memory_size")
                   or info.get("total_memory") or machine_memory())

    def slot_copy(self):
        """How reads put an expert's bytes into slot memory: a DeviceCopy on CUDA (where
        DEVICE_COPY), else None (the host's stores)."""
        if self.name != "cuda" or not DEVICE_COPY:
            return None
        try:
            return DeviceCopy()
        except MlxmoeError as e:
            warnings.warn(f"{e}; reads land in the slots by the host's stores")
            return None

    def activate(self, budget):
        """Make MLX honour the budget: cap its buffer cache, and wire the budget on Metal."""
        mx.set_cache_limit(min(mx.get_cache_memory() + (256 << 20), budget // 8))
        if self.name == "metal":
            mx.set_wired_limit(min(budget, self.memory()))


def detect(name=None):
    """The backend for `name` ("cpu", "metal", "cuda") or the best one available."""
    available = {"cpu": True, "metal": mx.metal.is_available(), "cuda": mx.cuda.is_available()}
    if name is None:
        name = "metal" if available["metal"] else "cuda" if available["cuda"] else "cpu"
    if name not in available:
        raise MlxmoeError(f"unknown backend {name!r}; choose cpu, metal or cuda")
    if not available[name]:
        raise MlxmoeError(f"backend {name!r} is not available in this MLX build")
    device = mx.cpu if name == "cpu" else mx.gpu
    mx.set_default_device(device)
    return Backend(name, mx.float32 if name == "cpu" else None, materialises_attention=name == "cpu",
                   split_exact=name == "cpu", runs_ahead=name == "cpu")


class DeviceCopy:
    """Copies into slot memory by the CUDA runtime (cudaMemcpy, a DMA) from page-locked
    buffers of its own. On CUDA MLX makes an array of the CPU stream (the slot pools: the host
    writes them) in managed memory: a page the GPU has read lives in the GPU's memory, a host
    store into it (numpy's, or a read's DMA into the slot) moves it back first, and the GPU's
    next use moves it there again; the runtime's copy writes it where it lives. `buffer(n)`:
    this thread's page-locked buffer to read into (a reader's bounce buffer); a copy from any
    other memory goes through this thread's staging buffer first, since only a copy from
    page-locked memory has landed when cudaMemcpy returns (MLX's streams do not wait for the
    legacy stream's copies). The buffers stay registered until close(). Raises MlxmoeError
    where the CUDA runtime cannot be loaded or used."""

    DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
    SIZE = 4 << 20  # the least a buffer is made with (reader.BOUNCE: the most a bounce asks)

    def __init__(self) -> None:
        names = ["libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart") or "libcudart.so"]
        lib = None
        for name in names:
            try:
                lib = ctypes.CDLL(name)  # (CDLL: the GIL is let go during each call)
                break
            except OSError:
                pass
        if lib is None:
            raise MlxmoeError(f"no CUDA runtime library to copy into slot memory with (tried {', '.join(names)})")
        self._lib, self._lock, self._local = lib, threading.Lock(), threading.local()
        for name, args in (("cudaMemcpy", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
                           ("cudaHostRegister", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
                           ("cudaHostUnregister", [ctypes.c_void_p]), ("cudaGetDeviceCount", [ctypes.c_void_p])):
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ctypes.c_int
        count = ctypes.c_int(0)
        self._check(lib.cudaGetDeviceCount(ctypes.byref(count)), "cudaGetDeviceCount")  # (a runtime the driver serves)
        self.pinned = []  # [(address, end, mmap)] registered, freed at close()
        self.copies = 0
        self._staging("stage", 1)  # (a refused registration refuses the copy here, not at a read)

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise MlxmoeError(f"{what} failed (CUDA error {err})")

    def _staging(self, kind: str, n: int) -> np.ndarray:
        """This thread's page-locked buffer of `kind` ("bounce" or "stage"), at least n bytes."""
        buf = getattr(self._local, kind, None)
        if buf is None or len(buf) < n:
            size = -(-max(n, self.SIZE) // (1 << 20)) * (1 << 20)
            memory = mmap.mmap(-1, size)
            buf = np.frombuffer(memory, np.uint8)
            self._check(self._lib.cudaHostRegister(buf.ctypes.data, size, 0), f"cudaHostRegister of {size} bytes")
            with self._lock:
                self.pinned.append((buf.ctypes.data, buf.ctypes.data + size, memory))
            setattr(self._local, kind, buf)  # (a smaller one replaced stays registered till close)
        return buf

    def buffer(self, n: int) -> np.ndarray:
        """This thread's page-locked buffer of n bytes to read into."""
        return self._staging("bounce", n)[:n]

    def __call__(self, dest: np.ndarray, src: np.ndarray) -> None:
        """dest[...] = src, of the same size, dest contiguous (else by numpy)."""
        if dest.nbytes != src.nbytes or not dest.flags.c_contiguous:
            dest[...] = src
            return
        at, n = src.ctypes.data, src.nbytes
        if not (src.flags.c_contiguous and any(lo <= at and at + n <= hi for lo, hi, _ in self.pinned)):
            stage = self._staging("stage", n)[:n]
            stage[...] = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
            at = stage.ctypes.data
        self._check(self._lib.cudaMemcpy(dest.ctypes.data, at, n, self.DEFAULT),
                    f"cudaMemcpy of {n} bytes into slot memory")
        with self._lock:
            self.copies += 1

    def close(self) -> None:
        """Unregister and free the buffers (no copy may run meanwhile, nor after)."""
        with self._lock:
            pinned, self.pinned = self.pinned, []
        for lo, _, memory in pinned:
            self._lib.cudaHostUnregister(ctypes.c_void_p(lo))
            try:
                memory.close()
            except BufferError:  # (an array over it still alive: freed with it)
                pass
        self._local = threading.local()


class KeepBusy:
    """`with keep_busy:` around a wait for reads keeps the GPU from idling meanwhile: an Apple
    GPU left idle lowers its clock after a few ms, and the layer computed after the read then
    runs slower (oMLX submits a trivial kernel every 50 us while it reads). A thread of its
    own queues a one-element op on a stream of its own (MLX streams belong to the thread that
    made them) every `interval` seconds while a block runs; leaving the block waits for an
    op being queued, never for the device. `kernels` counts the ops queued; `error` is why
    the thread ended early (the reads go on without it)."""

    def __init__(self, device=mx.gpu, interval: float = 50e-6) -> None:
        self.device, self.interval = device, interval
        self.kernels = 0
        self.error = None
        self._on, self._idle, self._stop = threading.Event(), threading.Event(), False
        self._idle.set()
        self._thread = None

    def __enter__(self):
        if self._stop:
            return self
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlxmoe-keep-busy", daemon=True)
            self._thread.start()
        self._on.set()
        return self

    def __exit__(self, *exc) -> None:
        self._on.clear()
        self._idle.wait()  # (set by the thread once it saw the block end: no op of it is being queued)

    def _loop(self) -> None:
        try:
            stream = mx.new_stream(self.device)
            x = mx.zeros((1,), stream=stream)
            while self._on.wait() and not self._stop:
                self._idle.clear()
                while self._on.is_set():
                    x = mx.add(x, 1, stream=stream)
                    mx.async_eval(x)
                    self.kernels += 1
                    time.sleep(self.interval)
                self._idle.set()
        except Exception as e:  # noqa: BLE001 - keeping busy is optional: never a read's error
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._stop = True
            self._idle.set()

    def close(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._on.set()
            self._thread.join()
            self._on.clear()


def host_floats(a):
    """An evaluated mx float array as a float32 numpy array [rows, last axis] (a bfloat16
    one through its bits: numpy has no bfloat16), adding no op to the graph."""
    if a.dtype == mx.bfloat16:
        bits = np.frombuffer(memoryview(a).cast("B"), dtype=np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32).reshape(-1, a.shape[-1])
    return np.array(a, dtype=np.float32).reshape(-1, a.shape[-1])


def host_dists(routers, tapped):
    """The router distributions of evaluated `routers` (one mx array), float32 [rows, experts]:
    a tapped router's logits softmaxed on the host, else its probabilities as they are."""
    return host_probs([routers])[0] if tapped else host_floats(routers)


def host_probs(logits):
    """softmax over the last axis of evaluated router logits (a list of mx arrays with the
    same last axis), on the host in float32, all in one go: a [rows, experts] numpy array
    for each."""
    rows = [host_floats(a) for a in logits]
    # in place: host_floats and concatenate made copies, and at a router's size each new array costs more than its op
    z = np.concatenate(rows) if len(rows) > 1 else rows[0]
    np.subtract(z, z.max(axis=-1, keepdims=True), out=z)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    out, start = [], 0
    for r in rows:
        out.append(z[start:start + len(r)])
        start += len(r)
    return out
