"""`mlxmoe convert --bundle`: each expert one aligned range, read in one request, the same
greedy tokens as stock mlx-lm on the original checkpoint; bad input and Ctrl-C leave no DST."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlxmoe
from mlxmoe import MlxmoeError
from mlxmoe.api import model_fingerprint
from mlxmoe.backend import detect
from mlxmoe.storage.convert import bundle
from mlxmoe.loader import open_checkpoint
from mlxmoe.storage.shards import ALIGN, BUNDLE_FORMAT, DTYPES
from mlxmoe.storage.store import align_up

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"
TOKENS = 24


@pytest.fixture(scope="module")
def bundled(checkpoint, tmp_path_factory):
    """bundled(arch, quant, layout) -> (original folder, bundled folder), converted once."""
    made = {}

    def make(arch, quant=None, layout="stacked"):
        key = (arch, quant, layout)
        if key not in made:
            src = checkpoint(arch, quant=quant, layout=layout)
            made[key] = src, bundle(src, tmp_path_factory.mktemp("bundled") / "model", progress=lambda _: None)
        return made[key]

    return make


def cli(*args):
    return subprocess.run([sys.executable, "-m", "mlxmoe", *args], capture_output=True, text=True, timeout=120)


def tokens(path, **kw):
    model, tokenizer = mlxmoe.load(str(path), **kw)
    out = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    model.expert_cache.close()
    return out, model.expert_runtime


@pytest.mark.parametrize("arch,quant,layout", [("qwen3_moe", "4bit", "stacked"), ("gpt_oss", "mxfp4", "stacked"),
                                               ("mixtral", None, "per_expert")])
def test_greedy_tokens_match_mlx_lm_on_the_original(bundled, arch, quant, layout):
    src, dst = bundled(arch, quant, layout)
    model, tokenizer = mlx_lm.load(str(src))
    detect().apply_dtype_policy(model)
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    assert len(set(want)) >= 3
    got, runtime = tokens(dst)  # everything fits
    assert got == want
    k, layers = runtime.checkpoint.top_k, runtime.checkpoint.num_layers
    for size in (k * layers, k):  # streaming
        got, runtime = tokens(dst, cache_experts=size)
        cache = runtime.cache
        assert got == want, f"cache of {size} experts changed the output"
        stats = cache.stats()
        assert stats["misses"] > 0
        assert stats["bytes_read"] == (stats["misses"] + stats["loads_prefetched"]) * cache.store.expert_file_bytes()
        assert cache.store.io_stats()["reads"] == stats["misses"] + stats["loads_prefetched"]  # one read per load


@pytest.mark.parametrize("io", ["pread", "direct"])
def test_one_read_per_bundled_expert_nine_per_stacked(bundled, on_disk, io, monkeypatch):
    src, dst = bundled("qwen3_moe", "4bit")
    stacked, packed = open_checkpoint(on_disk(src)).store, open_checkpoint(on_disk(dst)).store
    assert packed.bundled and not stacked.bundled
    assert (packed.tensors, packed.tensor_shapes, packed.tensor_dtypes) == \
        (stacked.tensors, stacked.tensor_shapes, stacked.tensor_dtypes)
    size = stacked.expert_file_bytes()
    assert packed.expert_file_bytes() == size
    stacked.set_io("pread")  # no alignment: the 9 ranges of a tiny model would share pages
    packed.set_io(io)
    checked, check = [], packed.shards.check
    monkeypatch.setattr(packed.shards, "check", lambda file: (checked.append(file), check(file)))
    for layer in range(stacked.num_layers):
        for e in range(stacked.num_experts):
            want = [np.empty(s, DTYPES[d]) for s, d in zip(stacked.tensor_shapes, stacked.tensor_dtypes)]
            got = [np.empty_like(w) for w in want]
            stacked.reset_io_stats()
            packed.reset_io_stats()
            stacked.read_expert(layer, e, want)
            assert packed.read_expert(layer, e, got) == size
            for t, w, g in zip(stacked.tensors, want, got):
                np.testing.assert_array_equal(g, w, err_msg=f"{t} of expert {e} in layer {layer}")
            assert stacked.io_stats()["reads"] == len(stacked.tensors) == 9
            s = packed.io_stats()
            assert s["reads"] == 1 and s["useful_bytes"] == size
            assert size <= s["disk_bytes"] <= align_up(size, ALIGN)  # bytes read: the expert, within padding
            if io == "direct":
                assert packed.method == "o_direct", packed.fallback
            # read again: by its plan (its one run), the same bytes and counts, its shard checked
            again = [np.zeros_like(w) for w in want]
            packed.reset_io_stats()
            checked.clear()
            assert (layer, e) in packed._plans and packed.read_expert(layer, e, again) == size
            assert packed.io_stats() == s and checked == [packed.ranges[layer][e][0].file]
            for t, w, g in zip(stacked.tensors, want, again):
                np.testing.assert_array_equal(g, w, err_msg=f"{t} of expert {e} in layer {layer}, read again")
    assert not any(stacked._plans.values())  # (nine runs an expert: never planned, nor tried again)
    with pytest.raises(MlxmoeError, match="a slot of"):  # (planned, yet a slot of another size is named)
        packed.read_expert(layer, e, [np.zeros(1, w.dtype) for w in want])
    stacked.close()
    packed.close()


def test_a_layer_calls_reads_check_its_shard_once_after_them(bundled, on_disk):
    """A demand read of several experts (SlotPools.read_keys, on the IO threads) checks the
    shard they lie in once, after every read of them, not once an expert; a shard changed
    since the load still fails it, naming the shard."""
    _, dst = bundled("qwen3_moe", "4bit")
    model, _ = mlxmoe.load(str(on_disk(dst)), cache_experts=8, prefetch=0)
    pools = model.expert_cache.pools
    store, log = pools.store, []
    read, check = store.read_expert, store.shards.check
    store.read_expert = lambda layer, e, outs, **kw: (log.append(("read", layer, e)), read(layer, e, outs, **kw))[1]
    store.shards.check = lambda file: (log.append(("check", file)), check(file))[1]
    try:
        keys = [((0, e), slot) for slot, e in enumerate((3, 1, 2))]
        assert pools.read_keys(keys) == 3 * store.expert_file_bytes()
        shard = store.ranges[0][3][0].file
        assert sorted(log[:3]) == [("read", 0, 1), ("read", 0, 2), ("read", 0, 3)] and log[3:] == [("check", shard)]
        with open(shard, "r+b") as f:  # its header changed in place, the size kept
            f.seek(9)
            f.write(b"!")
        with pytest.raises(MlxmoeError, match="changed on disk") as e:
            pools.read_keys([((0, 3), 4), ((0, 1), 5)])
        assert str(shard) in str(e.value)
    finally:
        model.expert_cache.close()


def test_a_layer_calls_asked_reads_check_its_shard_once_after_them(bundled, on_disk):
    """Reads asked of the kernel at once (SlotPools.start, AIO where there is) check the shard
    they lie in once, when all have ended, not once an expert; a shard changed since the
    load still fails them, naming it, and the bytes they read are the experts'."""
    _, dst = bundled("qwen3_moe", "4bit")
    model, _ = mlxmoe.load(str(on_disk(dst)), cache_experts=8, prefetch=0)
    pools = model.expert_cache.pools
    store, log = pools.store, []
    check = store.shards.check
    store.shards.check = lambda file: (log.append(file), check(file))[1]
    try:
        keys = [((0, e), slot) for slot, e in enumerate((3, 1, 2))]
        finish = pools.start(keys)
        assert log == []
        assert finish() == 3 * store.expert_file_bytes()
        shard = store.ranges[0][3][0].file
        assert log == [shard]
        for slot, e in ((0, 3), (1, 1)):  # (the bytes of an expert read alone, the long way)
            want = [np.empty_like(v[slot]) for v in pools.views]
            store.read_expert(0, e, want)
            assert all(np.array_equal(v[slot], w) for v, w in zip(pools.views, want))
        with open(shard, "r+b") as f:  # its header changed in place, the size kept
            f.seek(9)
            f.write(b"!")
        with pytest.raises(MlxmoeError, match="changed on disk") as e:
            pools.start([((0, 3), 4), ((0, 1), 5)])()
        assert str(shard) in str(e.value)
    finally:
        model.expert_cache.close()


def test_layout(bundled):
    src, dst = bundled("qwen3_moe", "4bit")
    ckpt = open_checkpoint(dst)
    store = ckpt.store
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["metadata"]["format"] == BUNDLE_FORMAT
    for path in ckpt.module_paths:
        assert f"{path}.bundle" in index["weight_map"]
    for layer in store.ranges:
        for row in layer:
            assert row[0].offset % ALIGN == 0  # each expert starts aligned, its tensors back to back
            assert all(a.offset + a.nbytes == b.offset for a, b in zip(row, row[1:]))
    assert all(f.read_bytes() == (src / f.name).read_bytes() for f in src.iterdir()
               if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json")
    original = {}
    for f in src.glob("*.safetensors"):
        original.update(mx.load(str(f)))
    rest = mx.load(str(dst / index["weight_map"]["model.embed_tokens.weight"]))
    assert set(rest) == set(original) - store.expert_names - set(open_checkpoint(src).store.expert_names)
    for name, v in rest.items():
        assert mx.array_equal(v, original[name]).item(), name
    assert model_fingerprint(ckpt) == model_fingerprint(open_checkpoint(src))  # profiles carry over
    store.close()


def test_refuses_bad_input(bundled, checkpoint, tmp_path):
    src, dst = bundled("qwen3_moe", "4bit")
    with pytest.raises(MlxmoeError, match="already exists"):
        bundle(src, dst)
    with pytest.raises(MlxmoeError, match="already bundled"):
        bundle(dst, tmp_path / "again")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MlxmoeError, match="no config.json"):
        bundle(tmp_path / "empty", tmp_path / "out")
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint("qwen3_moe", quant="4bit", max_shard_bytes=200_000), broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(MlxmoeError, match=f"missing shard.*{shard.name}"):
        bundle(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "again").exists()
    r = cli("convert", "--bundle", str(src), str(dst))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "already exists" in r.stderr
    r = cli("convert", str(src), str(tmp_path / "out"))
    assert r.returncode != 0 and "stacked layout already" in r.stderr and "--bundle" in r.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_bundle_version_is_refused(bundled, tmp_path):
    _, dst = bundled("qwen3_moe", "4bit")
    copy = tmp_path / "copy"
    shutil.copytree(dst, copy)
    shard = copy / json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.0.mlp.switch_mlp.bundle"]
    data = shard.read_bytes()
    shard.write_bytes(data.replace(BUNDLE_FORMAT.encode(), b"mlxmoe.bundle/9", 1))
    with pytest.raises(MlxmoeError, match="mlxmoe.bundle/9"):
        mlxmoe.load(str(copy))


def test_interrupted_conversion_leaves_nothing(checkpoint, tmp_path):
    src = checkpoint("qwen3_moe", quant="4bit")
    seen = []

    def progress(line):
        seen.append(line)
        if len(seen) == 2:  # after the first MoE layer
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bundle(src, tmp_path / "out", progress=progress)
    assert list(tmp_path.iterdir()) == []


def test_cli_convert(checkpoint, tmp_path):
    src = checkpoint("qwen3_moe", quant="4bit")
    r = cli("convert", "--help")
    assert r.returncode == 0 and "--bundle" in r.stdout and "aligned" in r.stdout
    r = cli("convert", "--bundle", str(src), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "layer 3/3" in r.stderr and (tmp_path / "out" / "config.json").exists()
    r = cli("generate", "--model", str(tmp_path / "out"), "--prompt", "Hello", "--max-tokens", "4",
            "--cache-experts", "4")
    assert r.returncode == 0, r.stderr
