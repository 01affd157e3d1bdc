"""Every MoE architecture of the installed mlx-lm, found at run time (architectures.py): a
tiny checkpoint of each, float32 and 4-bit. Greedy tokens through mlxmoe equal stock
mlx-lm's with every expert resident, half and a quarter of them and the minimum; the top-k mlxmoe takes
from the model is the one the model routes with (`mlxmoe info` shows it), and a cache
below it is refused naming it. An architecture stock mlx-lm cannot run here is skipped
with the reason."""

import json

import mlx_lm
import pytest

import architectures
import mlxmoe
from conftest import run_cli
from mlxmoe.backend import detect
from mlxmoe.errors import MlxmoeError

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"
TOKENS = 6
SHARES = (1.0, 0.5, 0.25, 0.0)  # of all experts; 0: the minimum, one token's top-k

ARCHS = architectures.moe_architectures()


def greedy(model, tokenizer, generate):
    return [r.token for r in generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]


def stock_tokens(arch, path):
    """Stock mlx-lm's greedy tokens (float32 activations on CPU, as mlxmoe's dtype policy),
    or a skip naming why stock mlx-lm cannot run this architecture here."""
    try:
        model, tokenizer = mlx_lm.load(str(path))
        detect().apply_dtype_policy(model)
        return greedy(model, tokenizer, mlx_lm.stream_generate)
    except Exception as e:  # any architecture's own failure
        pytest.skip(f"stock mlx-lm cannot run {arch} here: {type(e).__name__}: {str(e)[:200]}")


def test_architectures_are_found():
    """The scan finds the MoE models of mlx-lm, wrappers included, and no dense one."""
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma4", "qwen3_5_moe"} <= set(ARCHS)
    assert not {"llama", "qwen3", "switch_layers"} & set(ARCHS)


@pytest.mark.parametrize("quant", [None, "4bit"], ids=["float32", "4bit"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_stock(arch, quant, tokenizer_dir, tmp_path):
    if arch in architectures.NOT_BUILDABLE:
        pytest.skip(f"{arch}: {architectures.NOT_BUILDABLE[arch]}")
    path, config = architectures.build(tmp_path / arch, arch, tokenizer_dir, quant)
    check_against_stock(arch, path, config, quant or "float32", info=quant is None)


# The most used families in the other forms their checkpoints come in: bf16 (as most are
# published), mxfp4 (gpt-oss as mlx-community ships it: experts mxfp4, the rest 8-bit) and
# the Hugging Face layout (as the model's own repo ships it; gpt-oss's with its mxfp4 experts)
VARIANTS = [(arch, "stacked", "bfloat16", None) for arch in architectures.FAMILIES]
VARIANTS += [("gpt_oss", "stacked", "float32", "mxfp4")]
VARIANTS += [(arch, "hf", "bfloat16", "mxfp4" if arch == "gpt_oss" else None) for arch in architectures.FAMILIES]


@pytest.mark.parametrize("arch,layout,dtype,quant", VARIANTS,
                         ids=[f"{a}-{l}-{q or d}" for a, l, d, q in VARIANTS])
def test_families_in_every_form(arch, layout, dtype, quant, tokenizer_dir, tmp_path):
    path, config = architectures.build(tmp_path / arch, arch, tokenizer_dir, quant, dtype=dtype, layout=layout)
    check_against_stock(arch, path, config, f"{layout} {quant or dtype}")


def check_against_stock(arch, path, config, what, info=False):
    """Greedy tokens through mlxmoe equal stock mlx-lm's at every SHARE of the experts;
    the cache below the top-k is refused naming it (and `mlxmoe info` shows it)."""
    want = stock_tokens(arch, path)
    k = architectures.expected_top_k(config)

    # one below the true top-k is refused with it (a top-1 model's 0 is no number of experts at all)
    refused = rf"at least {k} experts \(top-k\), got {k - 1}" if k > 1 else "cache_experts 0"
    with pytest.raises(MlxmoeError, match=refused):
        mlxmoe.load(str(path), cache_experts=k - 1)
    if info:
        code, out, err = run_cli("info", "--model", path, "--json")
        assert code == 0, err
        assert json.loads(out)["top_k"] == k

    total = None
    for share in SHARES:
        slots = None if share == 1.0 else max(k, int(total * share))  # (total: known after the first)
        model, tokenizer = mlxmoe.load(str(path), cache_experts=slots)
        runtime = model.expert_runtime
        ckpt = runtime.checkpoint
        try:
            assert ckpt.top_ks == [k] * ckpt.num_layers
            total = ckpt.num_layers * ckpt.num_experts
            assert runtime.cache.capacity == (total if slots is None else slots)
            tokens = greedy(model, tokenizer, mlxmoe.stream_generate)
            stats = runtime.cache.stats()
        finally:
            runtime.close()
        assert tokens == want, f"{arch} {what}: a cache of {runtime.cache.capacity} of {total} " \
                               "experts changed the tokens"
        if slots is not None:
            assert stats["misses"] > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_top_k_above_half_the_experts(checkpoint, arch):
    """Top-5 of 8 experts: the prefetcher's guesses per rank are never wider than the
    experts there are (a prompt's argsort cannot be), at half the experts and at the
    minimum (the top-k), with the prefetcher on."""
    path = checkpoint(arch, config_overrides={"num_experts_per_tok": 5})
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    want = greedy(model, tokenizer, mlx_lm.stream_generate)
    for slots in (12, 5):
        model, tokenizer = mlxmoe.load(str(path), cache_experts=slots, prefetch=1)
        runtime = model.expert_runtime
        try:
            assert runtime.checkpoint.top_k == 5 and runtime.prefetcher is not None
            assert runtime.prefetcher.width == 8
            assert greedy(model, tokenizer, mlxmoe.stream_generate) == want
        finally:
            runtime.close()
    with pytest.raises(MlxmoeError, match=r"at least 5 experts \(top-k\), got 4"):
        mlxmoe.load(str(path), cache_experts=4)


def test_top_k_declared_where_routing_cannot_run(checkpoint, monkeypatch):
    """Where running the model's routing on one token fails, the top-k its MoE blocks
    declare is taken; where neither tells, the load is refused naming the model type."""
    from mlxmoe import loader

    path = checkpoint("qwen3_moe", config_overrides={"num_experts_per_tok": 3})
    monkeypatch.setattr(loader, "routed_widths", lambda model, switches: ({}, RuntimeError("no backend")))
    assert mlxmoe.memory_plan(str(path), cache_experts=3).cache_experts == 3
    with pytest.raises(MlxmoeError, match=r"at least 3 experts \(top-k\), got 2"):
        mlxmoe.memory_plan(str(path), cache_experts=2)
    monkeypatch.setattr(loader, "declared_top_k", lambda model, path, num_experts: None)
    with pytest.raises(MlxmoeError, match=r"cannot tell how many experts model_type 'qwen3_moe' routes each token "
                                          r"to .*no backend"):
        mlxmoe.memory_plan(str(path))


def test_top_k_per_layer(tokenizer_dir, tmp_path):
    """A model whose layers route to different numbers of experts (hunyuan's moe_topk as a
    list): each layer's top-k from the model, the cache's minimum the largest, `mlxmoe
    info` shows both; the tokens at that minimum are stock mlx-lm's."""
    path, _ = architectures.build(tmp_path / "hunyuan", "hunyuan", tokenizer_dir, overrides={"moe_topk": [1, 3]})
    want = stock_tokens("hunyuan", path)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=3)
    runtime = model.expert_runtime
    try:
        assert runtime.checkpoint.top_ks == [1, 3] and runtime.checkpoint.top_k == 3
        assert greedy(model, tokenizer, mlxmoe.stream_generate) == want
    finally:
        runtime.close()
    code, out, err = run_cli("info", "--model", path)
    assert code == 0, err
    assert "top-3 (top-1, 3 by layer)" in out
    with pytest.raises(MlxmoeError, match=r"at least 3 experts \(top-k\), got 2"):
        mlxmoe.load(str(path), cache_experts=2)


def test_layout_mlx_lm_computes_is_converted(tokenizer_dir, tmp_path):
    """deepseek_v3 as DeepSeek ships it: fp8 experts with block scales, which mlx-lm's
    sanitize dequantizes. mlxmoe cannot stream bytes that are computed: refused naming
    `mlxmoe convert`; converted by it, the tokens are stock mlx-lm's on the original."""
    src, config = architectures.build(tmp_path / "fp8", "deepseek_v3", tokenizer_dir, "fp8", dtype="bfloat16",
                                      layout="hf")
    with pytest.raises(MlxmoeError, match=rf"model.safetensors: .*experts\.\d+\.\w+\.weight.* sanitize computes "
                                          rf".*`mlxmoe convert {src} DST`"):
        mlxmoe.load(str(src))
    code, _, err = run_cli("convert", src, tmp_path / "stacked")
    assert code == 0, err
    assert stock_tokens("deepseek_v3", tmp_path / "stacked") == stock_tokens("deepseek_v3", src)
    check_against_stock("deepseek_v3", tmp_path / "stacked", config, "fp8 converted")
