"""NVIDIA (CUDA) specifics: slot pools live in host-writable (managed) memory that the
GPU reads, and the backend reads the GPU's memory. Skipped without a CUDA MLX build."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxmoe.backend import detect

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend and an NVIDIA GPU")


def test_detect_picks_cuda_with_the_gpu_memory():
    be = detect()
    assert be.name == "cuda" and mx.default_device() == mx.gpu and be.compute_dtype is None
    assert not be.split_exact  # gather_qmm: a GEMV below GATHER_GEMM_ROWS rows, a GEMM from there
    assert be.memory() == mx.device_info()["total_memory"]
    model = nn.Linear(4, 4)
    model.set_dtype(mx.bfloat16)
    assert be.activation_bytes(model) == 2  # computes in the checkpoint's dtype


def test_host_writes_to_a_pool_reach_the_gpu_every_time():
    """preadv/numpy writes into a slot are seen by the next GPU kernel, also after the GPU
    has read (and migrated) the pool's pages."""
    pool = mx.zeros((8, 64, 32), dtype=mx.float32, stream=mx.cpu)
    mx.eval(pool)
    view = np.array(pool, copy=False)
    assert view.flags.writeable
    x = mx.ones((1, 32))
    for step in range(4):
        for slot in range(8):
            view[slot] = slot + 10 * step
        y = mx.matmul(x, pool[mx.array([3, 5])].swapaxes(-1, -2), stream=mx.gpu)
        got = np.array(y)
        assert np.allclose(got[0], 32 * (3 + 10 * step)) and np.allclose(got[1], 32 * (5 + 10 * step))


def test_device_copies_into_a_pool_reach_the_gpu_every_time():
    """backend.DeviceCopy (cudaMemcpy into the managed pool, the what-if DEVICE_COPY), from its
    page-locked buffer and from pageable memory (staged): the next GPU kernel sees each copy."""
    from mlxmoe.backend import DeviceCopy

    pool = mx.zeros((8, 64, 32), dtype=mx.float32, stream=mx.cpu)
    mx.eval(pool)
    view = np.array(pool, copy=False)
    copy = DeviceCopy()
    pinned = copy.buffer(64 * 32 * 4).view(np.float32).reshape(64, 32)
    x = mx.ones((1, 32))
    for step in range(4):
        for slot in range(8):
            src = pinned if slot % 2 else np.empty_like(pinned)  # (page-locked, else staged)
            src[...] = slot + 10 * step
            copy(view[slot], src)
        y = mx.matmul(x, pool[mx.array([3, 4])].swapaxes(-1, -2), stream=mx.gpu)
        got = np.array(y)
        assert np.allclose(got[0], 32 * (3 + 10 * step)) and np.allclose(got[1], 32 * (4 + 10 * step))
    assert copy.copies == 32
    copy.close()


def test_bfloat16_pool_view_on_gpu():
    storage = mx.zeros((2, 16), dtype=mx.uint16, stream=mx.cpu)
    mx.eval(storage)
    compute = storage.view(mx.bfloat16)
    mx.eval(compute)
    view = np.array(storage, copy=False)
    view[1] = np.frombuffer(np.full(16, 1.5, dtype=np.float32).tobytes(), dtype=np.uint16)[1::2]
    assert np.array((compute[1] * 2).astype(mx.float32)).tolist() == [3.0] * 16


def test_a_partly_cached_top8_model_gives_stock_tokens_every_time(checkpoint):
    """bfloat16 activations, top 8 (stock's decode calls take the GEMM kernel): with prefetch
    timing what is resident when, every generation's tokens are stock mlx-lm's (an H200 run
    before split_exact differed at a near tie in about half the runs)."""
    import mlx_lm

    import mlxmoe

    path = checkpoint("qwen3_moe", quant="4bit", dtype="bfloat16",
                      config_overrides={"num_experts": 16, "num_experts_per_tok": 8, "hidden_size": 128,
                                        "moe_intermediate_size": 128})
    prompt = "The quick brown fox jumps over the lazy dog. Il gatto"
    model, tokenizer = mlx_lm.load(str(path))
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=24)]
    for cache_experts in (24, 32):
        for _ in range(3):
            model, tokenizer = mlxmoe.load(str(path), cache_experts=cache_experts)
            assert [r.token for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=24)] == want
            model.expert_cache.close()
