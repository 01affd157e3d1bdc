"""Safetensors header index and expert byte ranges, read with preadv into slot memory.

We parse the headers ourselves (8-byte little-endian length + JSON) so that reading an
expert never touches the other experts of a stacked tensor (`mx.load(...)[name][e]`
reads the whole tensor, see mlx-notes).
"""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import MlxmoeError

# safetensors dtype name -> (numpy dtype used to hold the raw bytes, itemsize)
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
}

PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors name: "F32", "BF16", "U32", ...
    shape: tuple
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class Range:
    """One contiguous run of bytes of one expert's tensor."""
    file: Path
    offset: int
    nbytes: int


def read_header(path):
    """Return {name: TensorInfo} of one safetensors file, checking it is whole."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MlxmoeError(f"{path}: not a safetensors file (only {size} bytes)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(size - 8, 100 << 20):
                raise MlxmoeError(f"{path}: corrupt safetensors header (declared length {n}, file size {size})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise MlxmoeError(f"missing shard: {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MlxmoeError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise MlxmoeError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    tensors = {}
    for name, h in header.items():
        try:
            dtype, shape, (start, end) = h["dtype"], tuple(h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise MlxmoeError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if dtype not in DTYPES:
            raise MlxmoeError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        if not 0 <= start <= end or end - start != expected:
            raise MlxmoeError(
                f"{path}: corrupt safetensors header: {name!r} spans {end - start} bytes, "
                f"its shape {list(shape)} of {dtype} needs {expected}")
        if 8 + n + end > size:
            raise MlxmoeError(
                f"truncated shard: {path} is {size} bytes but tensor {name!r} ends at byte {8 + n + end}")
        tensors[name] = TensorInfo(name, path, dtype, shape, 8 + n + start, end - start)
    return tensors


def shard_files(model_path):
    """The safetensors files of a checkpoint, checking the index when there is one."""
    model_path = Path(model_path)
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise MlxmoeError(f"{index}: malformed index ({e})") from None
        files = sorted({model_path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise MlxmoeError(f"missing shard: {f} (listed in {index.name})")
        return files
    files = sorted(model_path.glob("model*.safetensors"))
    if not files:
        raise MlxmoeError(f"no model*.safetensors files in {model_path}")
    return files


class ExpertStore:
    """Maps (layer, expert) to the byte ranges of its tensors and reads them.

    `tensors` are the names of one expert's tensors as the model sees them (e.g.
    "gate_proj.weight"); `ranges[layer][expert][i]` is where tensor i of that expert lies.
    """

    def __init__(self, model_path):
        self.path = Path(model_path)
        self.files = shard_files(self.path)
        self.index = {}
        for f in self.files:
            self.index.update(read_header(f))
        self.tensors = []  # names of one expert's tensors, in read order
        self.tensor_dtypes = []  # safetensors dtype of each
        self.tensor_shapes = []  # per-expert shape of each
        self.ranges = []  # [layer][expert] -> [Range per tensor]
        self._fds = {}

    def map_layers(self, layers):
        """Record the byte ranges of every expert.

        `layers[l]` is {tensor: [(file tensor name, expert row or None)] * num_experts}:
        a row index into a stacked [E, ...] tensor, or None for a per-expert tensor.
        """
        self.tensors = list(layers[0])
        for l, layer in enumerate(layers):
            if list(layer) != self.tensors:
                raise MlxmoeError(f"MoE layer {l} has expert tensors {list(layer)}, layer 0 has {self.tensors}")
            experts = []
            for e in range(len(next(iter(layer.values())))):
                row = []
                for t, sources in layer.items():
                    name, k = sources[e]
                    info = self.index[name]
                    if k is None:
                        shape, start, nbytes = info.shape, info.offset, info.nbytes
                    else:
                        nbytes = info.nbytes // info.shape[0]
                        shape, start = info.shape[1:], info.offset + k * nbytes
                    if l == 0 and e == 0:
                        self.tensor_dtypes.append(info.dtype)
                        self.tensor_shapes.append(tuple(shape))
                    else:
                        i = self.tensors.index(t)
                        if (info.dtype, tuple(shape)) != (self.tensor_dtypes[i], self.tensor_shapes[i]):
                            raise MlxmoeError(
                                f"{info.file}: {name} has {info.dtype} {list(shape)} per expert, "
                                f"other experts have {self.tensor_dtypes[i]} {list(self.tensor_shapes[i])}")
                    row.append(Range(info.file, start, nbytes))
                experts.append(row)
            self.ranges.append(experts)
        # Open every shard now: IO threads then only read a dict.
        for f in {r.file for experts in self.ranges for row in experts for r in row}:
            self._fd(f)

    @property
    def num_layers(self):
        return len(self.ranges)

    @property
    def num_experts(self):
        return len(self.ranges[0]) if self.ranges else 0

    def expert_file_bytes(self):
        """Bytes one expert occupies on disk."""
        return sum(r.nbytes for r in self.ranges[0][0])

    def _fd(self, file):
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def read_expert(self, layer, expert, outs):
        """Read expert `expert` of MoE layer `layer` into `outs` (one numpy array per tensor).

        An out whose dtype differs from the file's (bf16/f16 scales into float32 on
        CPU) is filled through a converting copy; otherwise bytes land in place.
        Returns the number of bytes read.
        """
        total = 0
        for r, out, dtype in zip(self.ranges[layer][expert], outs, self.tensor_dtypes):
            raw_dtype = DTYPES[dtype]
            direct = out.dtype == raw_dtype or (dtype == "BF16" and out.dtype == np.uint16)
            buf = out if direct else np.empty(out.shape, raw_dtype)
            self._pread(r, memoryview(buf.reshape(-1).view(np.uint8)))
            if not direct:
                out[...] = to_float32(buf, dtype) if out.dtype == np.float32 else buf.astype(out.dtype)
            total += r.nbytes
        return total

    def _pread(self, r, mem):
        fd, done = self._fd(r.file), 0
        while done < r.nbytes:
            try:
                n = os.preadv(fd, [mem[done:]], r.offset + done)
            except OSError as e:
                raise MlxmoeError(f"reading {r.file} at offset {r.offset + done}: {e}") from None
            if n == 0:
                raise MlxmoeError(f"truncated shard: {r.file} ends before offset {r.offset + r.nbytes}")
            done += n

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def to_float32(raw, dtype):
    """Widen raw file values (bf16 held as uint16, or f16) to float32."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)
