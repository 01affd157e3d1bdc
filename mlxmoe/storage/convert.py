"""`mlxmoe convert`: repack a checkpoint in mlx-lm's stacked layout (restack), or with
--bundle so that each expert is one aligned range.

The bundled layout (`mlxmoe.bundle/1`, described in store.py) keeps every non-expert
tensor as it is in one ordinary safetensors shard and writes one shard per MoE layer
holding that layer's experts; config.json, the tokenizer and the other small files are
copied. The folder is written under a temporary name next to DST (files.py) and renamed
at the end, so an error, Ctrl-C or SIGTERM leaves no DST, and a later run removes what a
SIGKILL left.
"""

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from ..budget import format_size
from ..errors import MlxmoeError
from .files import temp_folder_beside
from .shards import ALIGN, BUNDLE_FORMAT, DTYPES, read_header, shard_files, tensor_bytes
from .store import align_up

COPY_CHUNK = 16 << 20


def header(entries, metadata, align=8):
    """A safetensors header for `entries` [(name, dtype, shape)] stored back to back,
    padded with spaces (as the format allows) so that the data starts at a multiple of
    `align`."""
    h, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape in entries:
        n = tensor_bytes(dtype, shape)
        h[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (align_up(8 + len(text), align) - 8 - len(text))
    return len(text).to_bytes(8, "little") + text


def copy_range(src, offset, nbytes, out):
    with open(src, "rb") as f:
        f.seek(offset)
        while nbytes:
            chunk = f.read(min(nbytes, COPY_CHUNK))
            if not chunk:
                raise MlxmoeError(f"truncated shard: {src} ends before offset {offset + nbytes}")
            out.write(chunk)
            nbytes -= len(chunk)


def finish(f):
    f.flush()
    os.fsync(f.fileno())


def check_dst(dst):
    dst = Path(dst)
    if dst.exists():
        raise MlxmoeError(f"{dst} already exists; pass a new folder")
    if not dst.parent.is_dir():
        raise MlxmoeError(f"cannot write {dst}: folder {dst.parent} does not exist")
    return dst


def copy_small_files(src, out):
    """config.json, the tokenizer and every other file of `src` but its weights."""
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)


def restack(src, dst):
    """Write checkpoint `src`, in any layout mlx-lm loads (one whose experts mlx-lm's sanitize
    computes, e.g. fp8 dequantized), in mlx-lm's stacked layout to the new folder `dst`,
    as mlx-lm's own load_model (lazy) and save_model make it; returns dst."""
    from mlx_lm.utils import load_model, save_config, save_model

    from ..loader import read_config, resolve, weights_mismatch

    dst, path = check_dst(dst), resolve(src)
    read_config(path)
    try:
        model, config = load_model(path, lazy=True, strict=True)
    except Exception as e:  # mlx-lm's own errors, of many types
        raise MlxmoeError(weights_mismatch(path, e) or f"{path}: mlx-lm cannot load this checkpoint "
                          f"({type(e).__name__}: {str(e)[:200]})") from None
    if {n for f in shard_files(path) for n in read_header(f)} == {k for k, _ in tree_flatten(model.parameters())}:
        raise MlxmoeError(f"{path} is in mlx-lm's stacked layout already: mlxmoe streams it as it is "
                          "(--bundle repacks it so that each expert is one read)")
    tmp = temp_folder_beside(dst)
    try:
        copy_small_files(path, tmp)
        save_model(tmp, model, donate_model=True)
        save_config(config, config_path=tmp / "config.json")
        os.rename(tmp, dst)
    except BaseException:  # Ctrl-C too: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def bundle(src, dst, progress=print):
    """Write the bundled copy of checkpoint `src` to the new folder `dst`; returns dst."""
    from ..loader import open_checkpoint

    dst = check_dst(dst)
    ckpt = open_checkpoint(src)
    store = ckpt.store
    try:
        if store.bundled:
            raise MlxmoeError(f"{ckpt.path} is already bundled ({BUNDLE_FORMAT})")
        tmp = temp_folder_beside(dst)
    except BaseException:
        store.close()
        raise
    try:
        _write(ckpt, tmp, progress)
        os.rename(tmp, dst)
    except BaseException:  # Ctrl-C too: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        store.close()
        raise
    store.close()
    return dst


def _write(ckpt, out, progress):
    store, t0 = ckpt.store, time.perf_counter()
    layers, experts = store.num_layers, store.num_experts
    sizes = [tensor_bytes(d, s) for d, s in zip(store.tensor_dtypes, store.tensor_shapes)]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    stride = align_up(sum(sizes), ALIGN)
    names = [f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors" for i in range(layers + 1)]
    weight_map = {}

    copy_small_files(ckpt.path, out)

    rest = sorted((i for name, i in store.index.items() if name not in store.expert_names),
                  key=lambda i: (str(i.file), i.offset))
    with open(out / names[0], "wb") as w:
        w.write(header([(i.name, i.dtype, i.shape) for i in rest], {"format": "mlx"}))
        for i in rest:
            copy_range(i.file, i.offset, i.nbytes, w)
            weight_map[i.name] = names[0]
        finish(w)
    progress(f"{names[0]}: {len(rest)} non-expert tensors, {format_size(sum(i.nbytes for i in rest))}")

    row = np.zeros(stride, np.uint8)  # one expert: its tensors back to back, zero padding
    outs = [row[o:o + size].view(DTYPES[d]).reshape(s)
            for o, size, d, s in zip(offsets, sizes, store.tensor_dtypes, store.tensor_shapes)]
    for layer, module in enumerate(ckpt.module_paths):
        bname = f"{module}.bundle"
        parts = [[f"{module}.{t}", d, list(s), o]
                 for t, d, s, o in zip(store.tensors, store.tensor_dtypes, store.tensor_shapes, offsets)]
        meta = {"format": BUNDLE_FORMAT, "bundles": json.dumps({bname: parts})}
        with open(out / names[layer + 1], "wb") as w:
            w.write(header([(bname, "U8", (experts, stride))], meta, ALIGN))
            for e in range(experts):
                store.read_expert(layer, e, outs)
                w.write(row)
            finish(w)
        weight_map[bname] = names[layer + 1]
        progress(f"{names[layer + 1]}: layer {layer + 1}/{layers}, {experts} experts x {stride} bytes "
                 f"({time.perf_counter() - t0:.1f}s)")
    total = sum(i.nbytes for i in rest) + layers * experts * stride
    index = {"metadata": {"format": BUNDLE_FORMAT, "total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
