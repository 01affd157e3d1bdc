"""Safetensors shards: the header index of each file, the three layouts experts come in,
and the byte ranges of a tensor-parallel slice.

We parse the headers ourselves (8-byte little-endian length + JSON) so that reading an
expert never touches the other experts of a stacked tensor.

Three layouts: stacked (`switch_mlp.gate_proj.weight` `[E, out, in]`, one expert's
tensors 9 ranges far apart), Hugging Face's (per-expert `experts.N.gate_proj.weight`, or
stacked with gate and up fused in `experts.gate_up_proj` `[E, 2 * I, H]`: an expert's gate
is a block of its rows (qwen3.5, gemma4) or every other row (gpt-oss), row_part), and bundled
(`mlxmoe convert --bundle`, format `mlxmoe.bundle/1`): each MoE layer's experts in one
uint8 safetensors tensor `<module>.bundle` of shape `[E, stride]` that starts at a
4096-byte aligned file offset, `stride` a multiple of 4096, so expert e is one aligned
range. Inside a row the expert's tensors lie back to back; the file's `__metadata__`
says where: {"format": "mlxmoe.bundle/1", "bundles": JSON {bundle name: [[stacked
tensor name, dtype, per-expert shape, offset in the row], ...]}}. `read_header` lists a
bundled tensor like a stacked one whose experts lie `stride` bytes apart.
"""

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MlxmoeError
from .files import read_json

# safetensors dtype name -> (numpy dtype used to hold the raw bytes, itemsize)
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
}

PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")
BUNDLE_FORMAT = "mlxmoe.bundle/1"
MAX_HEADER = 100 << 20  # a longer safetensors header is refused as corrupt
ALIGN = 4096  # a bundle row's start and stride, in bytes (also O_DIRECT's alignment, store.py)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors name: "F32", "BF16", "U32", ...
    shape: tuple
    offset: int  # absolute byte offset in the file (of expert 0)
    nbytes: int
    stride: int = 0  # bytes from one expert's slice to the next; 0: back to back (nbytes // shape[0])
    bundle: str = None  # the bundle tensor that holds it (bundled layout)


@dataclass(frozen=True)
class Range:
    """One contiguous run of bytes of one expert's tensor, or (runs > 1, a tensor-parallel
    slice along its last axis) `runs` equal runs, `step` bytes apart, nbytes in all."""
    file: Path
    offset: int
    nbytes: int
    runs: int = 1
    step: int = 0


def shard_slice(shape, start, nbytes, axis, parts, index):
    """(shape, Range fields) of part `index` of `parts` of a tensor of `shape` stored
    row-major at `start`, split along `axis` (as mlx's shard_inplace splits it)."""
    shape = list(shape)
    inner = nbytes // math.prod(shape[:axis + 1])  # bytes of one step along `axis`
    piece = shape[axis] // parts
    outer = math.prod(shape[:axis])
    start += index * piece * inner
    shape[axis] = piece
    if outer == 1:
        return tuple(shape), dict(offset=start, nbytes=piece * inner)
    return tuple(shape), dict(offset=start, nbytes=outer * piece * inner, runs=outer, step=shape[axis] * parts * inner)


def row_part(shape, start, nbytes, how, parts, index):
    """(shape, start, nbytes) of part `index` of `parts` of the rows (axis 0) of a tensor
    of `shape` stored row-major at `start`: a block of them (how="halves"), or every
    parts-th row from row `index` ("interleaved"; then `nbytes` is the rows' own bytes,
    which lie one row apart from `start`: a Range with runs = rows)."""
    row = nbytes // shape[0]
    n = shape[0] // parts
    start += index * (n if how == "halves" else 1) * row
    return (n, *shape[1:]), start, n * row


def stamp(path):
    """The cheap check that a shard is the one that was indexed: (size, mtime in ns)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def header_bytes(path):
    """A shard's safetensors header as stored (its 8-byte length, then the JSON that says where
    each tensor lies): with the size, what a shard whose mtime changed is checked against."""
    with open(path, "rb") as f:
        head = f.read(8)
        return head + f.read(min(int.from_bytes(head, "little"), MAX_HEADER) if len(head) == 8 else 0)


def read_header(path):
    """Return {name: TensorInfo} of one safetensors file, checking it is whole."""
    path = Path(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would hang the read, a device never end
            raise MlxmoeError(f"{path}: a shard must be a regular file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MlxmoeError(f"{path}: not a safetensors file (only {size} bytes)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(size - 8, MAX_HEADER):
                raise MlxmoeError(f"{path}: corrupt safetensors header (declared length {n}, file size {size})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise MlxmoeError(f"missing shard: {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MlxmoeError(f"{path}: corrupt safetensors header ({e})") from None
    except OSError as e:
        raise MlxmoeError(f"cannot read shard {path}: {e.strerror or e}") from None
    if not isinstance(header, dict):
        raise MlxmoeError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, h in header.items():
        try:
            dtype, shape, (start, end) = h["dtype"], tuple(h["shape"]), h["data_offsets"]
            if not isinstance(dtype, str) or not all(type(v) is int and 0 <= v < 1 << 53 for v in (*shape, start, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise MlxmoeError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if dtype not in DTYPES:
            raise MlxmoeError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        expected = tensor_bytes(dtype, shape)
        if not 0 <= start <= end or end - start != expected:
            raise MlxmoeError(
                f"{path}: corrupt safetensors header: {name!r} spans {end - start} bytes, "
                f"its shape {list(shape)} of {dtype} needs {expected}")
        if 8 + n + end > size:
            raise MlxmoeError(
                f"truncated shard: {path} is {size} bytes but tensor {name!r} ends at byte {8 + n + end}")
        tensors[name] = TensorInfo(name, path, dtype, shape, 8 + n + start, end - start)
    if isinstance(meta, dict) and str(meta.get("format", "")).startswith("mlxmoe.bundle"):
        tensors = unbundle(path, tensors, meta)
    return tensors


def tensor_bytes(dtype, shape):
    return math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize  # Python ints: a huge shape cannot wrap around


def unbundle(path, tensors, meta):
    """Replace each bundle tensor by the stacked tensors it holds (see the module doc)."""
    if meta["format"] != BUNDLE_FORMAT:
        raise MlxmoeError(f"{path}: bundle format {meta['format']!r}; this mlxmoe reads {BUNDLE_FORMAT}")
    out = dict(tensors)
    try:
        bundles = json.loads(meta["bundles"])
        if not isinstance(bundles, dict):
            raise ValueError("bundles must map each bundle tensor to its parts")
        for bname, parts in bundles.items():
            b = out.pop(bname)
            if b.dtype != "U8" or len(b.shape) != 2 or b.offset % ALIGN or b.shape[1] % ALIGN:
                raise ValueError(f"{bname} is {b.dtype} {list(b.shape)} at byte {b.offset}, not aligned uint8 rows")
            experts, stride = b.shape
            for name, dtype, shape, offset in parts:
                if not (isinstance(name, str) and isinstance(shape, list)
                        and all(type(v) is int and 0 <= v < 1 << 53 for v in (*shape, offset))):
                    raise ValueError(f"part {str(name)[:60]} of {bname}: a name, a shape and an offset in bytes")
                n = tensor_bytes(dtype, shape)
                if not 0 <= offset <= offset + n <= stride:
                    raise ValueError(f"{name} ({n} bytes at {offset}) overflows the {stride}-byte rows of {bname}")
                out[name] = TensorInfo(name, path, dtype, (experts, *shape), b.offset + offset, experts * n, stride, bname)
    except (KeyError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise MlxmoeError(f"{path}: corrupt {BUNDLE_FORMAT} metadata ({e})") from None
    return out


def shard_files(model_path):
    """The safetensors files of a checkpoint, checking the index when there is one."""
    model_path = Path(model_path)
    index = model_path / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        data = read_json(index, "shard index", 1 << 30)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise MlxmoeError(f"{index}: malformed index (weight_map must be an object of tensor name -> "
                              "shard file name)")
        files = sorted({model_path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise MlxmoeError(f"missing shard: {f} (listed in {index.name})")
        return files
    files = sorted(model_path.glob("model*.safetensors"))
    if not files:
        raise MlxmoeError(f"no model*.safetensors files in {model_path}")
    return files


def to_float32(raw, dtype):
    """Widen raw file values (bf16 held as uint16, or f16) to float32."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)
