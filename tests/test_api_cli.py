"""The API mirrors mlx-lm's; the CLI's generate, chat and info work end to end."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.generate import GenerationResponse
from mlx_lm.sample_utils import make_sampler

import mlxmoe
from mlxmoe.backend import detect
from mlxmoe.cli import main
from mlxmoe.errors import MlxmoeError
from mlxmoe.caching.policies import ONLINE

ROOT = Path(__file__).resolve().parent.parent
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
    r = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", PROMPT, "--raw", "--max-tokens", "16",
                                  "--cache-experts", "4", "--stats-json", str(out)])
    assert r.exit_code == 0, r.output
    model, tokenizer = mlxmoe.load(str(path), cache_experts=4)
    assert mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=16) in r.stdout
    stats = json.loads(out.read_text())
    assert STATS_KEYS <= set(stats)
    assert stats["cache_experts"] == 4 and stats["misses"] > 0
    assert "hit rate" in r.stderr


def test_generate_applies_the_chat_template_by_default(checkpoint):
    """As mlx_lm.generate does: the model's chat template wraps the prompt unless --raw (or
    --no-chat-template) asks for a plain completion; --help says so. A one-token reply gets
    no rate: its "rate" is only the wait for it."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    want = {"chat": mlxmoe.generate(model, tokenizer, templated, max_tokens=8),
            "raw": mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=8)}
    for flags, kind in (([], "chat"), (["--chat-template"], "chat"), (["--raw"], "raw"),
                        (["--no-chat-template"], "raw")):
        r = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "8",
                                      "--cache-experts", "8", *flags])
        assert r.exit_code == 0, r.output
        assert r.stdout == want[kind] + "\n", flags
    r = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "1",
                                  "--cache-experts", "8"])
    line = next(l for l in r.stderr.splitlines() if l.startswith("prompt:"))
    assert line.endswith("; generation: 1 token") and " tok/s" in line.split(";")[0], line
    help_text = " ".join(CliRunner().invoke(main, ["generate", "--help"]).stdout.split())
    assert "--raw" in help_text and "Default: on where the model has one" in help_text


def test_save_profile_says_what_came_from_the_prior(tmp_path):
    """--save-profile after --profile writes the prior's tokens plus this run's, and says so."""
    from mlxmoe.workload.profile import ActivationProfile

    prior = ActivationProfile.load(ROOT / "profiles" / "italian.json")
    out = tmp_path / "live.json"
    r = CliRunner().invoke(main, ["generate", "--prompt", "Ciao", "--max-tokens", "4", "--profile",
                                  str(ROOT / "profiles" / "italian.json"), "--save-profile", str(out)])
    assert r.exit_code == 0, r.output
    total = ActivationProfile.load(out).tokens_total
    assert f"saved profile {out} ({total} tokens: {prior.tokens_total} of {prior.workload!r} (--profile) + " \
           f"{total - prior.tokens_total} from this run)" in r.stderr


def test_sampled_runs_vary_unless_seeded():
    """As mlx_lm.generate: a new seed each run, --seed repeats one."""
    runs = [CliRunner().invoke(main, ["generate", "--prompt", "Il", "--raw", "--max-tokens", "12", "--temp", "1.5",
                                      *s]).stdout for s in ([], [], ["--seed", "3"], ["--seed", "3"])]
    assert runs[2] == runs[3] and len(set(runs)) >= 2


def test_cli_chat_two_turns(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    r = CliRunner().invoke(main, ["chat", "--model", str(path), "--max-tokens", "12", "--cache-experts", "8"],
                           input="hello there\nand again\n/stats\n/quit\n")
    assert r.exit_code == 0, r.output
    summaries = [l for l in r.stderr.splitlines() if "expert hit rate" in l]
    assert len(summaries) == 2, r.stderr
    shape = r"\[(\d+ tokens at [\d.]+ tok/s|1 token), expert hit rate ([\d.]+%|n/a), [\d.]+ \w+ read\]"
    assert all(re.fullmatch(shape, l) for l in summaries), summaries  # no rate for one token
    assert "hit rate" in r.stdout and "on demand" in r.stdout  # /stats: a short table
    # ... with the decode steps' path: verified (one wait a step), and whether the mode is on now
    assert re.search(r"\ndecode +[1-9]\d* steps? verified \(one wait each\), \d+ replays?; verified steps (on|off)",
                     r.stdout), r.stdout


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


def test_rank_lines_use_the_summary_units():
    """Under several ranks each rank's line reads like the summary: binary units, loads split."""
    from mlxmoe.budget import format_size
    from mlxmoe.cli import rank_line

    s = {"hit_rate": 0.5, "bytes_read": 3 * 61440, "loads_demand": 1, "loads_prefetched": 2, "cache_experts": 8,
         "peak_rss": 100 << 20, "misses": 1}
    line = rank_line(1, s)
    assert line.startswith("rank 1: hit rate 50.0%")
    assert f"{format_size(3 * 61440)} read (1 loads on demand + 2 prefetched)" in line
    assert line.endswith("process peak RSS 100.0 MB")


def test_output_for_a_log_saved_lines_and_counts(tmp_path, capsys):
    """Issue 44, item 6: prefill progress off a terminal is plain lines (no \\r), and an
    interrupted prefill's last line says where it stopped; --trace-out and --stats-json
    say where they were saved; one expert is "1 expert"."""
    from mlxmoe.cli import Waiting, lossy_figures

    waiting = Waiting(0.0)
    waiting.progress(3, 10)
    for _ in range(50):  # (at most 5 s)
        time.sleep(0.1)
        if waiting.shown:
            break
    waiting.stop()  # not finished: stopped (Ctrl-C) at 3 of 10
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("prefill: 3/10 prompt tokens") == 2 and "10/10" not in err, err
    trace, stats = tmp_path / "t.jsonl", tmp_path / "s.json"
    r = CliRunner().invoke(main, ["generate", "-p", PROMPT, "--max-tokens", "4", "--trace-out", str(trace),
                                  "--stats-json", str(stats)])
    assert r.exit_code == 0, r.output
    assert f"saved trace {trace}\n" in r.stderr and f"saved stats {stats}\n" in r.stderr
    assert trace.exists() and json.loads(stats.read_text())["tokens"] > 0
    assert lossy_figures({"skipped": 1, "biased": 2, "substituted": 0}) == ", 1 expert skipped, 2 experts biased in"


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
    from mlxmoe.caching.cache import ExpertCache

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


def test_profiles_and_traces_name_a_model_not_its_location(checkpoint, tmp_path):
    """What a profile or trace records of a checkpoint holds no path of this machine: the
    folder's name, or the repo id of a Hugging Face download."""
    from mlxmoe.api import model_name

    path = checkpoint("qwen3_moe", quant="4bit")
    (tmp_path / "p.txt").write_text("The cat sleeps on the sofa\n")
    r = CliRunner().invoke(main, ["profile", "record", "--model", str(path), "--prompts", str(tmp_path / "p.txt"),
                                  "-w", "w", "-o", str(tmp_path / "p.json"), "--max-tokens", "4",
                                  "--trace-out", str(tmp_path / "t.jsonl")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["profile", "from-trace", str(tmp_path / "t.jsonl"), "--model", str(path),
                                  "-o", str(tmp_path / "q.json"), "--no-curve"])
    assert r.exit_code == 0, r.output
    for written in ("p.json", "t.jsonl", "q.json"):
        head = json.loads((tmp_path / written).read_text().splitlines()[0] if written.endswith("l")
                          else (tmp_path / written).read_text())
        assert head["model"] == path.name, written
    snapshot = tmp_path / "hub" / "models--mlx-community--Qwen3-30B-A3B-4bit" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    assert model_name(snapshot) == "mlx-community/Qwen3-30B-A3B-4bit"
    assert model_name(mlxmoe.DEMO_MODEL) == "mlxmoe-demo"


def test_runtime_owns_what_load_built():
    """model.expert_runtime holds the checkpoint, plan, backend and cache; the cache carries
    none of them (nothing is hung on it from outside)."""
    model, _ = mlxmoe.load(mlxmoe.DEMO_MODEL, cache_experts=16)
    rt = model.expert_runtime
    assert isinstance(rt, mlxmoe.Runtime) and rt.cache is model.expert_cache
    assert rt.plan.cache_experts == rt.cache.capacity == 16 and rt.backend.name == detect().name
    assert rt.checkpoint.model is model and rt.profile is rt.cache.profile and rt.prefetcher is rt.cache.prefetcher
    assert not any(hasattr(rt.cache, a) for a in ("plan", "backend", "checkpoint", "group", "error", "trace_target"))
    rt.close()


def test_script_records_the_profile_the_cli_records(tmp_path):
    """record_profile + record_trace + generate + save_profile(curve=True) writes what
    `mlxmoe profile record` writes for the same prompts (its counts, tokens, identity and
    predicted hit-rate curve), and the name given."""
    lines = ["Ciao, come stai oggi?", "Raccontami una storia breve."]
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n")
    cli_out, api_out = tmp_path / "cli.json", tmp_path / "api.json"
    r = CliRunner().invoke(main, ["profile", "record", "--prompts", str(tmp_path / "prompts.txt"), "--chat-template",
                                  "--max-tokens", "8", "--cache-experts", "16", "-w", "Italian chat",
                                  "--half-life", "512", "-o", str(cli_out)])
    assert r.exit_code == 0, r.output

    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL, cache_experts=16)
    rt = model.expert_runtime
    mlxmoe.generate(model, tokenizer, "warm-up before recording", max_tokens=4)  # not recorded
    live = rt.record_profile("Italian chat", half_life=512)
    rt.record_trace(tmp_path / "api.trace.jsonl")  # the curve replays it
    assert rt.profile is live and live.tokens_total == 0
    for line in lines:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": line}], add_generation_prompt=True)
        mlxmoe.generate(model, tokenizer, prompt, max_tokens=8)
    with pytest.raises(MlxmoeError, match="close"):
        rt.predict_curve()  # the trace is not complete yet
    rt.close()
    replayed = []
    assert rt.save_profile(api_out, curve=True, progress=replayed.append) is live
    assert replayed == ONLINE

    want, got = json.loads(cli_out.read_text()), json.loads(api_out.read_text())
    assert got["tokens_total"] == want["tokens_total"] > 2 * 8
    for key in ("workload", "model", "fingerprint", "num_layers", "num_experts", "top_k", "decay",
                "expert_bytes", "resident_bytes", "tokens", "router_mass", "curve"):
        assert got[key] == want[key], key
    assert got["counts"] == want["counts"] and sum(map(sum, got["counts"])) > 0
    assert set(got["curve"]) == set(ONLINE)


def test_a_curve_needs_a_recorded_trace(tmp_path):
    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL, cache_experts=16)
    rt = model.expert_runtime
    mlxmoe.generate(model, tokenizer, "Il gatto", max_tokens=4)
    rt.close()
    with pytest.raises(MlxmoeError, match="record_trace"):
        rt.save_profile(tmp_path / "p.json", curve=True)
    assert not (tmp_path / "p.json").exists()  # refused before anything is written


def test_swap_a_profile_mid_session():
    """use_profile makes a profile the policy's prior and the prefetcher's guess as a load
    with it does, mid-session; the output stays mlx-lm's; another model's profile is refused."""
    from mlxmoe.caching.prefetch import hottest_per_layer
    from mlxmoe.workload.profile import ActivationProfile

    italian = ROOT / "profiles" / "italian.json"
    ref, ref_tok = stock(mlxmoe.DEMO_MODEL)
    want = mlx_lm.generate(ref, ref_tok, "Il gatto", max_tokens=12)
    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL, cache_experts=20)
    rt = model.expert_runtime
    mlxmoe.generate(model, tokenizer, "The cat", max_tokens=4)
    policy = rt.cache.policy
    assert not policy.estimate.prior.any() and rt.prefetcher.hottest is None
    prior = rt.use_profile(italian)
    rates = ActivationProfile.load(italian).rates()
    assert prior.workload == "Italian chat" and np.array_equal(policy.estimate.prior, rates)
    assert rt.prefetcher.hottest == hottest_per_layer(rates, rt.prefetcher.top_k)
    loaded, _ = mlxmoe.load(mlxmoe.DEMO_MODEL, cache_experts=20, profile=italian)
    assert np.array_equal(policy.estimate.prior, loaded.expert_cache.policy.estimate.prior)  # as a load with it would
    loaded.expert_runtime.close()
    assert mlxmoe.generate(model, tokenizer, "Il gatto", max_tokens=12) == want
    other = ActivationProfile.load(italian)
    other.fingerprint = "another-model"
    with pytest.raises(MlxmoeError, match="another"):
        rt.use_profile(other)
    rt.close()


def test_runtime_records_a_trace_and_closes_it(tmp_path):
    """Runtime.record_trace starts a trace mid-session (one at a time); the cache's own
    close() goes through the runtime: the prefetcher's threads end and the trace is
    complete, holding the routing of the generations after it started. abort() drops one."""
    from mlxmoe.workload.trace import read_trace

    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL, cache_experts=20)
    rt, cache = model.expert_runtime, model.expert_cache
    assert cache.prefetcher is rt.prefetcher is not None and rt.trace is None
    mlxmoe.generate(model, tokenizer, "The cat", max_tokens=4)
    path = tmp_path / "late.trace.jsonl"
    rt.record_trace(path)
    with pytest.raises(MlxmoeError, match="being recorded already"):
        rt.record_trace(tmp_path / "second.trace.jsonl")
    for prompt in ("Il gatto", "Le chat"):
        mlxmoe.generate(model, tokenizer, prompt, max_tokens=5)
    assert not path.exists()  # written beside it until close
    cache.close()
    assert not rt.prefetcher.host.is_alive()
    header, records = read_trace(path)
    layers = model.expert_cache.store.num_layers
    assert {r[0] for r in records} == {0, 1} and header["fingerprint"] == rt.fingerprint
    assert len([r for r in records if r[1] == 4 and r[2] == layers - 1]) == 2  # each sequence's 5th token
    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL, cache_experts=20, trace_out=str(tmp_path / "dropped.jsonl"))
    mlxmoe.generate(model, tokenizer, "The cat", max_tokens=2)
    model.expert_runtime.abort()
    assert list(tmp_path.iterdir()) == [path]


def test_chat_switches_profile(tmp_path):
    """chat's /profile FILE goes through Runtime.use_profile; a bad file is reported and the chat goes on."""
    r = CliRunner().invoke(main, ["chat", "--max-tokens", "4", "--cache-experts", "20"],
                           input=f"/profile {ROOT / 'profiles' / 'italian.json'}\n/profile {tmp_path / 'no.json'}\n"
                                 "ciao\n/quit\n")
    assert r.exit_code == 0, r.output
    assert "[profile 'Italian chat' is the expert cache's prior now]" in r.stdout
    assert "no.json" in r.stdout and len([l for l in r.stderr.splitlines() if "expert hit rate" in l]) == 1


def test_budget_to_experts_without_loading(tmp_path):
    """mlxmoe.memory_plan says what --memory-budget resolves to: the count `info` prints,
    the cache `load` and `generate` build."""
    first = mlxmoe.memory_plan(mlxmoe.DEMO_MODEL, cache_experts=2)
    budget = first.minimum + 5 * first.slot_bytes + first.slot_bytes // 2
    plan = mlxmoe.memory_plan(mlxmoe.DEMO_MODEL, budget)
    assert plan.cache_experts == 2 + 5 and plan.budget == budget  # top-k 2, five more whole experts
    r = CliRunner().invoke(main, ["info", "--memory-budget", str(budget), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["budget"]["cache_experts"] == plan.cache_experts
    out = tmp_path / "stats.json"
    r = CliRunner().invoke(main, ["generate", "--memory-budget", str(budget), "--prompt", PROMPT, "--max-tokens", "2",
                                  "--stats-json", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["cache_experts"] == plan.cache_experts
    model, _ = mlxmoe.load(mlxmoe.DEMO_MODEL, memory_budget=budget)
    assert model.expert_cache.capacity == plan.cache_experts
    model.expert_runtime.close()
    with pytest.raises(MlxmoeError, match="below the minimum"):
        mlxmoe.memory_plan(mlxmoe.DEMO_MODEL, first.minimum - 1)


def test_public_api_has_type_hints():
    """Every function exported from mlxmoe and every public Runtime method names the types
    of its arguments and result, and the names resolve."""
    import inspect
    import typing

    funcs = [getattr(mlxmoe, n) for n in mlxmoe.__all__ if inspect.isfunction(getattr(mlxmoe, n))]
    funcs += [f for n, f in vars(mlxmoe.Runtime).items() if not n.startswith("_") and inspect.isfunction(f)]
    funcs += [p.fget for p in vars(mlxmoe.Runtime).values() if isinstance(p, property)]
    assert {f.__name__ for f in funcs} >= {"load", "generate", "stream_generate", "memory_plan", "record_profile",
                                           "use_profile", "save_profile", "close", "profile"}
    for f in funcs:
        hints = typing.get_type_hints(f)
        params = [p for p in inspect.signature(f).parameters.values()
                  if p.name != "self" and p.kind is not p.VAR_KEYWORD]
        missing = [p.name for p in params if p.name not in hints] + ([] if "return" in hints else ["return"])
        assert not missing, f"{f.__qualname__}: no type for {missing}"


def test_light_commands_start_without_mlx_lm():
    """Commands that open no model (profile show, trace replay, --help) never import mlx-lm,
    which brings transformers (most of a second): they answer at once."""
    code = ("import sys\nfrom mlxmoe.cli import run\ntry:\n    run(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\nassert 'mlx_lm' not in sys.modules and 'transformers' not in sys.modules")
    for args in (["profile", "show", str(ROOT / "profiles" / "italian.json")], ["--help"],
                 ["trace", "replay", str(ROOT / "examples" / "routing" / "demo.trace.jsonl"), "--cache-experts", "16"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, (args, r.stderr)


def test_load_and_prewarm_waits_are_said(monkeypatch):
    """A load, and a profile's pre-warm, still running when their notice comes (2 s on; at
    once here) each get a line saying what the wait is."""
    from mlxmoe import cli
    from mlxmoe.caching.cache import ExpertCache

    monkeypatch.setattr(cli, "notice", lambda seconds, line, notice=cli.notice: notice(0.0, line))
    monkeypatch.setattr(ExpertCache, "prewarm_done", lambda self, timeout=None: False)  # as on a slow disk
    profile = ROOT / "profiles" / "italian.json"
    r = CliRunner().invoke(main, ["generate", "-p", "Ciao", "--max-tokens", "4", "--profile", str(profile)])
    assert r.exit_code == 0, r.output
    assert "loading the demo model..." in r.stderr
    workload = mlxmoe.workload.profile.ActivationProfile.load(profile).workload
    assert f"pre-warming the cache with the hottest experts of {workload!r} in the background" in r.stderr
