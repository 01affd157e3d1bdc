"""Low-bit fallback experts (fallback.py): built once, checked against the model, close to
the full experts, and at decode steps no read is waited for while a copy exists."""

import mlx.core as mx
import numpy as np
import pytest

import mlxmoe
from mlxmoe.errors import MlxmoeError
from mlxmoe.api import build_fallback

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """fallback file of checkpoint `path` at `bits`, built once."""
    built = {}

    def make(path, bits):
        if (path, bits) not in built:
            dst = tmp_path_factory.mktemp("fallback") / f"fb{bits}.safetensors"
            build_fallback(str(path), dst, bits)
            built[(path, bits)] = dst
        return built[(path, bits)]

    return make


@pytest.mark.parametrize("quant,bits,most", [("4bit", 4, 0.15), ("4bit", 2, 1.0), (None, 3, 0.5)])
def test_copies_compute_close_to_the_full_experts(checkpoint, copies, quant, bits, most):
    # (random weights are quantization's worst case; another expert's output is ~1.41 away)
    path = checkpoint("qwen3_moe", quant=quant)
    model, _ = mlxmoe.load(str(path), fallback=copies(path, bits))  # room for every expert
    cache = model.expert_cache
    assert cache.prewarm_done(60)
    ckpt = model.expert_runtime.checkpoint
    x = mx.random.normal((1, 1, ckpt.config["hidden_size"]), key=mx.random.key(0))
    for layer, streaming in enumerate(ckpt.experts):
        for e in range(ckpt.num_experts):
            full = streaming._inner(x, mx.array([[[cache.slot_of[(layer, e)]]]], dtype=mx.uint32))
            low = streaming._fallback(x, mx.array([[[e]]], dtype=mx.uint32))
            err = float(mx.linalg.norm(low - full) / mx.linalg.norm(full))
            assert err < most, f"layer {layer} expert {e}: relative error {err:.3f} at {bits} bits"
    model.expert_runtime.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_decode_steps_never_wait_on_a_read(checkpoint, copies, arch):
    path = checkpoint(arch, quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=6, fallback=copies(path, 2))
    cache = model.expert_cache
    tokens = []
    for i, r in enumerate(mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=24)):
        if i == 0:
            cache.reset_stats()  # the prefill reads what it needs: only decode steps count
        tokens.append(r.token)
    s = cache.stats()
    assert s["substituted"] > 0 and s["fallback_bytes"] > 0
    assert s["loads_demand"] == 0 and s["prefetch_late"] == 0, "a decode step waited on a read"
    assert s["loads_prefetched"] > 0  # the full experts were read in the background
    model.expert_runtime.close()


def test_copies_of_another_model_or_no_file_are_refused(checkpoint, copies, tmp_path):
    other = copies(checkpoint("mixtral", quant="4bit"), 2)
    with pytest.raises(MlxmoeError, match="another model"):
        mlxmoe.load(str(checkpoint("qwen3_moe", quant="4bit")), fallback=other)
    with pytest.raises(MlxmoeError, match="no such file"):
        mlxmoe.load(str(checkpoint("qwen3_moe", quant="4bit")), fallback=tmp_path / "none.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(MlxmoeError, match="bad.safetensors"):
        mlxmoe.load(str(checkpoint("qwen3_moe", quant="4bit")), fallback=bad)


def test_cli_convert_and_generate(cli, checkpoint, tmp_path):
    import json

    path, dst, stats = checkpoint("qwen3_moe", quant="4bit"), tmp_path / "fb.safetensors", tmp_path / "s.json"
    code, err = cli("convert", "--fallback-bits", "3", str(path), str(dst))
    assert code == 0 and dst.exists(), err
    code, err = cli("generate", "-m", str(path), "--cache-experts", "6", "--fallback", str(dst), "--prompt", PROMPT,
                    "--max-tokens", "8", "--stats-json", str(stats))
    assert code == 0, err
    assert json.loads(stats.read_text())["substituted"] > 0 and "low-bit" in err
    from conftest import run_cli

    code, out, err = run_cli("info", "-m", str(path), "--fallback", str(dst))
    assert code == 0 and "low-bit fallback copies" in out, err
    code, err = cli("convert", "--fallback-bits", "3", "--bundle", str(path), str(tmp_path / "x"))
    assert code != 0 and "exclude" in err
