"""Low-bit fallback experts (opt-in, lossy): a copy of every expert at 2-4 bits (MLX's own
affine quantization), resident beside the expert cache. At a decode step an expert that is
not in the cache (or still on its way) computes with its low-bit copy at once, and the
full expert is read in the background for later tokens: no decode step waits on a read.

`mlxmoe convert --fallback-bits 3 SRC DST` builds the copies once into one safetensors file
(`mlxmoe.fallback/1`: per MoE layer and expert linear, `<layer>.<linear>.weight / scales /
biases` stacked over the experts, and a float `.bias` where the experts have one; metadata:
format, bits, group_size, the model's fingerprint); `load(..., fallback=DST)` uses it.
"""

import copy
import threading
from collections import deque
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..errors import MlxmoeError
from ..storage.files import write_atomic

FORMAT = "mlxmoe.fallback/1"
BITS = (2, 3, 4, 5, 6, 8)
LINEARS = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2")


def _full_weight(lin, tensors):
    """An expert linear's stacked weights [experts, out, in] as floats, from its `tensors`."""
    if isinstance(lin, QuantizedSwitchLinear):
        return mx.dequantize(tensors["weight"], tensors["scales"], tensors.get("biases"), group_size=lin.group_size,
                             bits=lin.bits, mode=lin.mode).astype(mx.float32)
    return tensors["weight"].astype(mx.float32)


def build(ckpt, fingerprint: str, dst, bits: int, group_size: int = 64, progress=None) -> int:
    """Write the low-bit copies of an opened checkpoint's experts (loader.open_checkpoint) to
    the file `dst` (atomically); return its bytes. Reads each layer's experts once, through
    the expert store."""
    from .cache import SlotPools
    from ..loader import MX_DTYPES

    if bits not in BITS:
        raise MlxmoeError(f"--fallback-bits {bits}: one of {', '.join(map(str, BITS))}")
    dst = Path(dst)
    if dst.is_dir():
        raise MlxmoeError(f"{dst}: a folder; the fallback copies are one file (e.g. {dst / 'fallback3.safetensors'})")
    E = ckpt.num_experts
    pools = SlotPools(ckpt.store, E, [MX_DTYPES[d] for d in ckpt.store.tensor_dtypes])
    out = {}
    try:
        for layer, streaming in enumerate(ckpt.experts):
            pools.read(layer, [(e, e) for e in range(E)])
            tensors = dict(zip(pools.names, pools.compute))
            for lin in LINEARS:
                if lin not in streaming._inner:
                    continue
                mine = {p.split(".")[1]: v for p, v in tensors.items() if p.startswith(lin + ".")}
                w = _full_weight(streaming._inner[lin], mine)
                if w.shape[-1] % group_size:
                    raise MlxmoeError(f"{ckpt.path}: {lin} has {w.shape[-1]} inputs, not a multiple of the group "
                                      f"size {group_size}")
                q, scales, biases = mx.quantize(w, group_size, bits)
                half = mine.get("scales", mine["weight"]).dtype  # scales as the source keeps them (16 bits)
                half = half if half in (mx.float16, mx.bfloat16) else mx.float16
                out.update({f"{layer}.{lin}.weight": q, f"{layer}.{lin}.scales": scales.astype(half),
                            f"{layer}.{lin}.biases": biases.astype(half)})
                if "bias" in mine:
                    out[f"{layer}.{lin}.bias"] = mx.array(mine["bias"])
            mx.eval(list(out.values()))  # before the next layer's read reuses the pools
            if progress:
                progress(f"layer {layer + 1}/{ckpt.num_layers}")
    finally:
        pools.close()
    meta = {"format": FORMAT, "bits": str(bits), "group_size": str(group_size), "fingerprint": fingerprint,
            "num_layers": str(ckpt.num_layers), "num_experts": str(E)}
    write_atomic(dst, lambda f: mx.save_safetensors(f, out, metadata=meta))  # (a temp name clean_stale knows)
    return dst.stat().st_size


def file_bytes(path) -> int:
    """The memory fallback file `path`'s copies take (its size: the header is a few KB)."""
    path = Path(path)
    if not path.is_file():
        named = path.with_name(path.name + ".safetensors")  # (a name given without the suffix)
        raise MlxmoeError(f"fallback copies {path}: no such file " + (f"(did you mean {named}?)" if named.is_file()
                          else "(build it with mlxmoe convert --fallback-bits)"))
    return path.stat().st_size


def read(path, fingerprint: str, num_layers: int, num_experts: int):
    """(arrays, metadata) of fallback file `path`, checked against the model."""
    path = Path(path)
    file_bytes(path)
    try:  # (safetensors whatever its name: MLX would take the format from the suffix)
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError / ValueError on a bad file
        raise MlxmoeError(f"{path}: not a readable safetensors file ({e}); fallback copies are the file "
                          "mlxmoe convert --fallback-bits writes") from None
    if meta.get("format") != FORMAT:
        raise MlxmoeError(f"{path}: not a {FORMAT} file (build it with mlxmoe convert --fallback-bits)")
    if meta.get("fingerprint") != fingerprint or meta.get("num_layers") != str(num_layers) \
            or meta.get("num_experts") != str(num_experts):
        raise MlxmoeError(f"{path}: fallback copies of another model (its fingerprint or shape differs)")
    return arrays, meta


def attach_fallback(ckpt, cache, path, fingerprint) -> int:
    """Give every StreamingExperts of `ckpt` its low-bit copies from `path` (a module like
    its own with low-bit linears) and the cache a FallbackLoader; return their bytes."""
    from .lossy import refuse_tensor_split

    refuse_tensor_split(ckpt, "low-bit fallback")
    arrays, meta = read(path, fingerprint, ckpt.all_layers, ckpt.num_experts)
    bits, group_size, total = int(meta["bits"]), int(meta["group_size"]), 0
    for layer, streaming in enumerate(ckpt.experts, start=ckpt.layer_offset):  # (a pipeline stage's: the model's index)
        inner = streaming._inner
        low = copy.copy(inner)
        for lin in LINEARS:
            if lin not in inner:
                continue
            q = QuantizedSwitchLinear.__new__(QuantizedSwitchLinear)
            nn.Module.__init__(q)  # (no random weights to quantize)
            q.group_size, q.bits, q.mode, q.global_scale = group_size, bits, "affine", None
            dtype = inner[lin]["scales"].dtype if "scales" in inner[lin] else inner[lin]["weight"].dtype
            try:
                q.weight = arrays[f"{layer}.{lin}.weight"]
                q.scales = arrays[f"{layer}.{lin}.scales"].astype(dtype)
                q.biases = arrays[f"{layer}.{lin}.biases"].astype(dtype)
                if "bias" in inner[lin]:
                    q.bias = arrays[f"{layer}.{lin}.bias"].astype(inner[lin]["bias"].dtype)
            except KeyError as e:
                raise MlxmoeError(f"{path}: no tensor {e.args[0]}") from None
            low[lin] = q
            total += sum(v.nbytes for v in (q.weight, q.scales, q.biases))
        mx.eval(low.parameters())
        streaming._fallback = low
    cache.fallback = FallbackLoader(cache)
    cache.fallback_bytes = total
    return total


class FallbackLoader:
    """Reads, in one background thread, the full experts that decode steps computed with their
    low-bit copies, the latest asked first (a slow disk falls behind: the oldest requests,
    beyond `most`, are dropped): each is given a slot (evicting the policy's victim, never what
    the current layer uses) and read at background priority, for later tokens."""

    def __init__(self, cache, most: int = 64) -> None:
        self.cache, self.most = cache, most
        self.pending: deque = deque()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.run, name="mlxmoe-fallback", daemon=True)
        self.thread.start()
        cache.closers.append(self.thread.join)  # (after cache.stop(): no read outlives the pools)

    def request(self, keys: list) -> None:
        with self.cache.lock:
            for key in keys:
                if key in self.pending:
                    self.pending.remove(key)
                self.pending.append(key)
            while len(self.pending) > self.most:
                self.pending.popleft()
        self.ready.set()

    def run(self) -> None:
        cache = self.cache
        loader = cache.loader
        while not loader.stop.is_set():
            if not self.ready.wait(0.05):
                continue
            with loader.gate.background:
                with cache.lock:
                    if not self.pending:
                        self.ready.clear()
                        continue
                    key = self.pending.pop()
                    if loader.stop.is_set() or key in cache.slot_of:
                        continue
                    room = (cache.capacity - len(cache.active)) // 2
                    taken = loader.claim([key], evict=True) if room > 0 else []
                if taken:
                    loader.load(key, taken[0][1])
