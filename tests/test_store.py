"""The store's byte ranges hold exactly each expert's slice of the stacked tensors, in
both layouts, and reads move exactly those bytes."""

import mlx.core as mx
import numpy as np
import pytest

from mlxmoe.loader import open_checkpoint
from mlxmoe.storage.shards import DTYPES, read_header, to_float32


def expected_slices(path, ckpt):
    """What mlx-lm's own loader puts in each stacked expert parameter."""
    import mlx_lm

    model, _ = mlx_lm.load(str(path))
    params = dict(__import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters()))
    return {(l, t): params[f"{mpath}.{t}"] for l, mpath in enumerate(ckpt.module_paths) for t in ckpt.store.tensors}


@pytest.mark.parametrize("arch,quant,layout", [("qwen3_moe", "4bit", "stacked"), ("mixtral", None, "per_expert"),
                                               ("deepseek_v3", None, "per_expert"), ("gpt_oss", "mxfp4", "stacked")])
def test_read_expert_matches_mlx_lm(checkpoint, arch, quant, layout):
    path = checkpoint(arch, quant=quant, layout=layout)
    ckpt = open_checkpoint(path)
    store = ckpt.store
    want = expected_slices(path, ckpt)
    for layer in range(store.num_layers):
        for expert in (0, store.num_experts - 1, store.num_experts // 2):
            outs = [np.empty(shape, DTYPES[d]) for shape, d in zip(store.tensor_shapes, store.tensor_dtypes)]
            n = store.read_expert(layer, expert, outs)
            assert n == store.expert_file_bytes() == sum(o.nbytes for o in outs)
            for t, out in zip(store.tensors, outs):
                ref = np.array(want[(layer, t)][expert])
                np.testing.assert_array_equal(out, ref, err_msg=f"{t} of expert {expert} in layer {layer}")
    store.close()


def test_bf16_is_widened_exactly():
    values = mx.array([1.5, -2.25, 3.0e-3, 65504.0], dtype=mx.bfloat16)
    raw = np.array(values.view(mx.uint16))
    np.testing.assert_array_equal(to_float32(raw, "BF16"), np.array(values.astype(mx.float32)))


def test_header_index(checkpoint):
    path = checkpoint("olmoe", quant="4bit")
    tensors = read_header(path / "model.safetensors")
    loaded = mx.load(str(path / "model.safetensors"))
    assert set(tensors) == set(loaded)
    for name, info in tensors.items():
        assert info.shape == tuple(loaded[name].shape)
        assert info.nbytes == loaded[name].nbytes


def test_a_paced_read_asks_pieces_ahead(checkpoint):
    """A paced (background) read has its next pieces asked of the disk while one is read
    (store.PIECES_AHEAD at once, never more), each after its pace() call, and reads the
    expert's bytes; cancelled by pace(), it returns once no piece is being read."""
    import threading
    import time

    from mlxmoe.storage.store import PIECES_AHEAD

    path = checkpoint("qwen3_moe", quant="4bit")
    store = open_checkpoint(path).store
    run, lock, state = store._read_run, threading.Lock(), {"now": 0, "most": 0, "paced": 0, "read": 0}

    def slow(piece):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["read"] += 1
            assert state["read"] <= state["paced"]  # asked only after its pace()
        time.sleep(0.01)
        try:
            return run(piece)
        finally:
            with lock:
                state["now"] -= 1

    def pace(nbytes):
        with lock:
            state["paced"] += 1

    fresh = [np.empty(shape, DTYPES[d]) for shape, d in zip(store.tensor_shapes, store.tensor_dtypes)]
    want = [o.copy() for o in fresh]
    store.read_expert(0, 1, want)
    store._read_run = slow
    assert store.read_expert(0, 1, fresh, pace=pace, chunk=4096) == store.expert_file_bytes()
    assert state["paced"] == state["read"] > 2 * PIECES_AHEAD and state["most"] == PIECES_AHEAD
    for got, ref in zip(fresh, want):
        np.testing.assert_array_equal(got, ref)

    def cancel_at_5(nbytes):
        pace(nbytes)
        if state["paced"] == 5:
            raise RuntimeError("no longer wanted")

    state.update(most=0, paced=0, read=0)
    with pytest.raises(RuntimeError):
        store.read_expert(0, 2, fresh, pace=cancel_at_5, chunk=4096)
    assert state["now"] == 0 and state["read"] == 4
    store.close()
