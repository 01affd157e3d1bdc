"""The API mirrors mlx-lm's; the CLI's generate, chat and info work end to end."""

import json
from pathlib import Path
import re

import mlx.core as mx
import mlx_lm
import pytest
from click.testing import CliRunner
from mlx_lm.generate import GenerationResponse
from mlx_lm.sample_utils import make_sampler

import mlxmoe
from mlxmoe.backend import detect
from mlxmoe.cli import main
from mlxmoe.errors import MlxmoeError

PROMPT = "Once upon a time"
STATS_KEYS = {"tokens", "hits", "misses", "hit_rate", "bytes_read", "loads_prefetched", "prefetch_useful",
              "cache_bytes", "peak_memory", "decode_tps"}


def stock(path):
    model, tokenizer = mlx_lm.load(str(path))
    return detect().apply_dtype_policy(model), tokenizer


def test_generate_and_sampler_match_mlx_lm(checkpoint):
    path = checkpoint("qwen2_moe", quant="4bit")
    ref, ref_tok = stock(path)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=6)
    assert mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=20) == mlx_lm.generate(ref, ref_tok, PROMPT,
                                                                                        max_tokens=20)
    mx.random.seed(7)
    want = [r.token for r in mlx_lm.stream_generate(ref, ref_tok, PROMPT, max_tokens=20,
                                                    sampler=make_sampler(0.9, 0.95))]
    mx.random.seed(7)
    responses = list(mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=20, sampler=make_sampler(0.9, 0.95)))
    assert all(isinstance(r, GenerationResponse) for r in responses)
    assert [r.token for r in responses] == want
    stats = model.expert_cache.stats()
    assert STATS_KEYS <= set(stats)
    assert stats["tokens"] > 20 and stats["decode_tps"] > 0 and 0 < stats["hit_rate"] < 1


def test_cli_generate_writes_stats(checkpoint, tmp_path):
    path = checkpoint("mixtral", quant="4bit")
    out = tmp_path / "stats.json"
    r = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "16",
                                  "--cache-experts", "4", "--stats-json", str(out)])
    assert r.exit_code == 0, r.output
    model, tokenizer = mlxmoe.load(str(path), cache_experts=4)
    assert mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=16) in r.stdout
    stats = json.loads(out.read_text())
    assert STATS_KEYS <= set(stats)
    assert stats["cache_experts"] == 4 and stats["misses"] > 0
    assert "hit rate" in r.stderr


def test_cli_chat_two_turns(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    r = CliRunner().invoke(main, ["chat", "--model", str(path), "--max-tokens", "12", "--cache-experts", "8"],
                           input="hello there\nand again\n/stats\n/quit\n")
    assert r.exit_code == 0, r.output
    summaries = [l for l in r.stderr.splitlines() if "expert hit rate" in l]
    assert len(summaries) == 2, r.stderr
    assert all("tok/s" in l and " read]" in l for l in summaries)
    assert "hit rate" in r.stdout and "on demand" in r.stdout  # /stats: a short table


def test_chat_commands(checkpoint):
    """/help lists the commands, /reset says what it did, an unknown /command is refused
    rather than sent to the model, and // sends a message that starts with /."""
    path = checkpoint("qwen3_moe", quant="4bit")
    r = CliRunner().invoke(main, ["chat", "--model", str(path), "--max-tokens", "4", "--cache-experts", "8"],
                           input="/help\n/foo\n/reset\n//etc is a folder\n/quit\n")
    assert r.exit_code == 0, r.output
    assert "/reset" in r.stdout and "/stats" in r.stdout  # the /help text
    assert "unknown command /foo" in r.stdout
    assert "conversation cleared" in r.stdout
    assert len([l for l in r.stderr.splitlines() if "expert hit rate" in l]) == 1  # only the // message was sent


def test_generate_summary_adds_up(checkpoint):
    """The summary's bytes read are its demand plus prefetched loads at the expert's size,
    in the budget's binary units, with the process's memory before loading named."""
    from mlxmoe.budget import format_size

    path = checkpoint("qwen3_moe", quant="4bit")
    r = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "8",
                                  "--cache-experts", "8"])
    assert r.exit_code == 0, r.output
    line = next(l for l in r.stderr.splitlines() if l.startswith("experts:"))
    m = re.search(r"([\d.]+ \w+) read \((\d+) loads on demand \+ (\d+) prefetched\)", line)
    assert m, line
    model, _ = mlxmoe.load(str(path), cache_experts=8)
    expert = model.expert_cache.stats()["cache_bytes"] // 8
    assert m.group(1) == format_size((int(m.group(2)) + int(m.group(3))) * expert)
    assert "Python and MLX before loading" in line


def test_chat_reuses_the_prompt_cache(checkpoint):
    """The second turn prefills only its own tokens: the KV cache holds the first turn."""
    from mlx_lm.models.cache import make_prompt_cache

    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8)
    prompt_cache = make_prompt_cache(model)
    first = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    list(mlxmoe.stream_generate(model, tokenizer, first, max_tokens=5, prompt_cache=prompt_cache))
    offset = prompt_cache[0].offset
    second = tokenizer.apply_chat_template([{"role": "user", "content": "again"}], add_generation_prompt=True)
    list(mlxmoe.stream_generate(model, tokenizer, second, max_tokens=5, prompt_cache=prompt_cache))
    assert prompt_cache[0].offset >= offset + len(second)


def test_info_minimum_budget_is_the_real_minimum(checkpoint):
    path = checkpoint("olmoe", quant="4bit")
    r = CliRunner().invoke(main, ["info", "--model", str(path), "--memory-budget", "64MB", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["moe_layers"] > 0 and info["top_k"] >= 1
    assert info["budget"]["cache_experts"] == info["moe_layers"] * info["experts_per_layer"]
    model, tokenizer = mlxmoe.load(str(path), memory_budget=info["minimum_budget"])
    assert model.expert_cache.capacity == info["top_k"]
    mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=4)
    try:
        mlxmoe.load(str(path), memory_budget=info["minimum_budget"] - 1)
    except mlxmoe.MlxmoeError as e:
        shown = re.search(r"budget (.+?) is below the minimum of (.+?) for", str(e))
        assert shown and shown.group(1) != shown.group(2), str(e)  # never "38.8 MB is below ... 38.8 MB"
    else:
        raise AssertionError("a budget one byte below the minimum was accepted")
    text = CliRunner().invoke(main, ["info", "--model", str(path)]).stdout
    assert "smallest budget that works" in text and "top-" in text
    shown = re.search(r"smallest budget that works: ([0-9.]+) (\w+)", text)  # rounded up: typed back, it works
    assert mlxmoe.load(str(path), memory_budget=shown.group(1) + shown.group(2))[0].expert_cache.capacity >= info["top_k"]


def test_cli_prefetch_flag(checkpoint, tmp_path):
    """--prefetch 0 turns the background reads off; the default reads ahead."""
    path = checkpoint("qwen3_moe", quant="4bit")
    loads = {}
    for flag in ("0", "1"):
        out = tmp_path / f"stats{flag}.json"
        r = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "24",
                                      "--cache-experts", "12", "--prefetch", flag, "--stats-json", str(out)])
        assert r.exit_code == 0, r.output
        loads[flag] = json.loads(out.read_text())["loads_prefetched"]
    assert loads["0"] == 0 and loads["1"] > 0
    r = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", PROMPT, "--prefetch", "-1"])
    assert r.exit_code != 0 and "--prefetch" in r.output


def test_load_takes_mlx_lm_arguments(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer, config = mlxmoe.load(str(path), {}, None, return_config=True, lazy=True, cache_experts=8)
    assert config["model_type"] == "qwen3_moe" and model.expert_cache.capacity == 8
    model.expert_cache.close()
    model, _ = mlxmoe.load(str(path), model_config={"rms_norm_eps": 0.5}, cache_experts=8)
    assert model.args.rms_norm_eps == 0.5
    model.expert_cache.close()
    with pytest.raises(MlxmoeError, match="adapters are not supported"):
        mlxmoe.load(str(path), adapter_path="lora")


def test_interrupt_between_slot_and_read_leaves_no_garbage(checkpoint, monkeypatch):
    """Ctrl-C can land after a miss got its slot and before its bytes were read: the next
    generation must not compute with whatever that slot held."""
    from mlxmoe.cache import ExpertCache

    path = checkpoint("qwen3_moe", quant="4bit")
    ref, ref_tok = stock(path)
    want = [r.token for r in mlx_lm.stream_generate(ref, ref_tok, PROMPT, max_tokens=16)]
    access = ExpertCache.access
    for when in range(1, 6):  # interrupt the when-th layer call that has misses
        model, tokenizer = mlxmoe.load(str(path), cache_experts=20, prefetch=0, prewarm=False)
        seen = []

        def interrupted(self, *a, **kw):
            out = access(self, *a, **kw)
            seen.append(bool(out[1]))
            if out[1] and sum(seen) == when:
                raise KeyboardInterrupt
            return out

        monkeypatch.setattr(ExpertCache, "access", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mlxmoe.generate(model, tokenizer, "Il gatto e la volpe", max_tokens=30)
        monkeypatch.setattr(ExpertCache, "access", access)
        assert [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=16)] == want, when
        model.expert_cache.close()


def test_closed_model_and_no_leaked_files(checkpoint):
    import gc
    import os

    path = checkpoint("qwen3_moe", quant="4bit")
    gc.collect()  # models of earlier tests
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):  # refused loads close their shards
        with pytest.raises(MlxmoeError, match="below the minimum"):
            mlxmoe.load(str(path), memory_budget="1MB")
    assert len(os.listdir("/proc/self/fd")) <= fds
    model, tokenizer = mlxmoe.load(str(path), cache_experts=6)
    model.expert_cache.close()
    with pytest.raises(MlxmoeError, match="closed"):
        mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=4)
    for _ in range(3):  # a model dropped without close() (as mlx-lm users do) closes its shards too
        model, tokenizer = mlxmoe.load(str(path), cache_experts=6, prefetch=0)
        mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=2)
        del model, tokenizer
        gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds + 1


def test_interrupted_read_leaves_no_writer_behind(checkpoint):
    """Ctrl-C while the store's threads read a stacked expert's tensors: once the interrupt
    reaches the caller, no thread writes into the slot (it is given to the next miss)."""
    import os
    import signal
    import threading
    import time

    path = checkpoint("qwen3_moe")  # float32, stacked: one run per tensor, read by the store's threads
    model, _ = mlxmoe.load(str(path), cache_experts=2, prefetch=0, prewarm=False)
    cache = model.expert_cache
    store, real = cache.store, cache.store._read_run
    ended = []

    def slow(run):  # a large tensor on a slow disk
        time.sleep(0.3)
        try:
            return real(run)
        finally:
            ended.append(time.perf_counter())

    store._read_run = slow
    cache.tick(1)
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        cache.fetch(0, [0])
    raised = time.perf_counter()
    store._read_run = real
    time.sleep(0.5)
    assert len(ended) == len(cache.store.tensors) and max(ended) <= raised
    assert (0, 0) not in cache.slot_of  # and the key left the cache
    cache.close()


def test_stats_after_reset_count_only_the_new_window(checkpoint):
    path = checkpoint("qwen3_moe")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=12, prefetch=2, prewarm=False)
    cache = model.expert_cache
    mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=20)
    cache.prefetcher.drain()
    cache.reset_stats()
    cache.tick(1)
    for layer in range(cache.store.num_layers):  # every expert: uses whatever was prefetched before the reset
        cache.fetch(layer, list(range(cache.store.num_experts)))
    s = cache.stats()
    assert s["prefetch_useful"] <= s["loads_prefetched"] == 0
    assert sum(s["resident_per_layer"]) == len(cache.slot_of)
    cache.close()


def test_demo_model_is_named_not_located():
    """Profiles of the bundled demo model name it, not the folder it was installed in."""
    model, _ = mlxmoe.load(mlxmoe.DEMO_MODEL, cache_experts=8)
    assert model.expert_cache.profile.model == "mlxmoe-demo"
    root = Path(__file__).resolve().parent.parent
    for name in ("italian.json", "english.json"):
        assert json.loads((root / "profiles" / name).read_text())["model"] == "mlxmoe-demo"
