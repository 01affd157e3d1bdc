"""Bad input gets one clear error that names the file or value; the CLI prints no traceback."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes, save_config, save_model

import mlxmoe
from mlxmoe import MlxmoeError


@pytest.fixture
def copy(checkpoint, tmp_path):
    def make(**kw):
        dst = tmp_path / "model"
        shutil.copytree(checkpoint("qwen3_moe", quant="4bit", **kw), dst)
        return dst
    return make


def cli(*args):
    return subprocess.run([sys.executable, "-m", "mlxmoe", *args], capture_output=True, text=True, timeout=120)


def assert_clean_error(path, *needles, **load_kw):
    with pytest.raises(MlxmoeError) as e:
        mlxmoe.load(str(path), **load_kw)
    for needle in needles:
        assert needle in str(e.value)
    return str(e.value)


def assert_cli_error(args, *needles):
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    said = [l for l in r.stderr.splitlines() if not l.startswith("starting MLX")]  # (a busy machine's wait)
    assert said[0].startswith("error: "), r.stderr
    for needle in needles:
        assert needle in r.stderr


def test_missing_shard(copy):
    path = copy(max_shard_bytes=200_000)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    assert_clean_error(path, "missing shard", shards[1].name)
    assert_cli_error(["info", "--model", str(path)], "missing shard", shards[1].name)


def test_no_weights_at_all(copy):
    path = copy()
    for f in path.glob("*.safetensors*"):
        f.unlink()
    assert_clean_error(path, "no model*.safetensors", str(path))


def test_truncated_shard(copy):
    path = copy()
    f = path / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    assert_clean_error(path, "truncated shard", str(f))
    assert_cli_error(["generate", "--model", str(path), "--prompt", "hi"], "truncated shard")


@pytest.mark.parametrize("damage", ["length", "json"])
def test_corrupt_header(copy, damage):
    path = copy()
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "length":
        data[:8] = (1 << 60).to_bytes(8, "little")
    else:
        data[8:20] = b"#not json!!!"
    f.write_bytes(bytes(data))
    assert_clean_error(path, "corrupt safetensors header", str(f))
    assert_cli_error(["info", "--model", str(path)], "corrupt safetensors header")


def test_shapes_disagree_with_config(copy):
    path = copy()
    config = json.loads((path / "config.json").read_text())
    config["moe_intermediate_size"] *= 2
    (path / "config.json").write_text(json.dumps(config))
    message = assert_clean_error(path, "do not match config.json", str(path))
    assert "shape" in message
    assert_cli_error(["info", "--model", str(path)], "do not match config.json")


def test_unknown_architecture(copy):
    path = copy()
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "no_such_moe"
    (path / "config.json").write_text(json.dumps(config))
    assert_clean_error(path, "no_such_moe", "config.json")
    assert_cli_error(["info", "--model", str(path)], "no_such_moe")


def test_dense_model_has_no_experts(tmp_path, tokenizer_dir):
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 400,
              "tie_word_embeddings": True}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    save_model(tmp_path, model)
    save_config(config, tmp_path / "config.json")
    assert_clean_error(tmp_path, "no SwitchGLU/SwitchMLP experts", "llama")


def test_budget_too_small(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    message = assert_clean_error(path, "below the minimum", memory_budget="1MB")
    assert "1.0 MB" in message
    assert_cli_error(["generate", "--model", str(path), "--prompt", "hi", "--memory-budget", "1MB"],
                     "below the minimum")


def test_bad_values(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    assert_clean_error(path, "12 parsecs", memory_budget="12 parsecs")
    assert_clean_error(path, "no_such_policy", policy="no_such_policy")
    assert_clean_error(path, "at least 2", cache_experts=1)
    assert_cli_error(["info", "--model", str(path.parent / "nowhere")], "not found", "nowhere")


@pytest.mark.parametrize("field,value", [("dtype", [1]), ("shape", "abc"), ("data_offsets", [0, "x"])])
def test_corrupt_header_fields(copy, field, value):
    path = copy()
    f = path / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name][field] = value
    blob = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # same length: the tensors stay where they were
    assert len(blob) == n
    f.write_bytes(data[:8] + blob + data[8 + n:])
    assert_clean_error(path, "corrupt safetensors header entry", name)


def test_config_missing_a_field_the_model_needs(copy):
    path = copy()
    config = json.loads((path / "config.json").read_text())
    del config["num_experts"]
    (path / "config.json").write_text(json.dumps(config))
    assert_clean_error(path, "cannot build this model from config.json", "num_experts")
    assert_cli_error(["info", "--model", str(path)], "config.json")


def test_cli_mistakes_are_refused_clearly(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe", quant="4bit")
    assert_cli_error(["generate", "--model", str(path), "--prompt", " "], "the prompt is empty")
    (tmp_path / "p.txt").write_text("hello\n")
    r = cli("trace", "record", "--model", str(path), "--prompts", str(tmp_path / "p.txt"), "-o",
            str(tmp_path / "a.jsonl"), "--trace-out", str(tmp_path / "b.jsonl"))
    assert r.returncode == 2 and "--trace-out" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(MlxmoeError, match="memory_budget="):
        mlxmoe.load(str(path), "46MB")  # mlx_lm.load's second argument is tokenizer_config


def test_converted_checkpoint_is_readable_by_others(checkpoint, tmp_path):
    import os
    import stat

    from mlxmoe.storage.convert import bundle

    dst = bundle(checkpoint("qwen3_moe", quant="4bit"), tmp_path / "bundled", progress=lambda _: None)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o777 & ~umask
