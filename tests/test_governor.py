"""The memory governor (governor.py): the expert cache resized mid-generation gives stock
mlx-lm's tokens; a budget below the minimum keeps the minimum, said once; memory_budget
"auto" follows the memory available (an injected source, fake meminfo and cgroup files,
a real cgroup where one can be made); serve's POST /v1/mlxmoe/cache and chat's /budget."""

import json
import os
import time

import mlx_lm
import pytest

import mlxmoe
from mlxmoe import governor
from mlxmoe.backend import detect

PROMPT = "The quick brown fox"
TOKENS = 40


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("qwen3_moe", quant="4bit")


@pytest.fixture(scope="module")
def want(path):
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]


def budget_for(runtime, experts):
    """The budget whose expert cache holds `experts`."""
    p = runtime.plan
    return p.resident + p.kv_reserve + p.working + experts * p.slot_bytes


def generate(model, tokenizer, at=None, pause=0.0):
    """Greedy tokens and the cache's size at each; `at(i)` after token i (in the generation)."""
    tokens, sizes = [], []
    for i, r in enumerate(mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)):
        tokens.append(r.token)
        sizes.append(model.expert_cache.capacity)
        if at is not None:
            at(i)
        time.sleep(pause)
    return tokens, sizes


def shape(model):
    store = model.expert_cache.store
    return store.num_layers, store.num_experts, model.expert_runtime.checkpoint.top_k


@pytest.mark.parametrize("start,costly", [("all", False), ("part", False), ("part", True)])
def test_resize_mid_generation_keeps_stock_tokens(path, want, start, costly, monkeypatch):
    """(`costly`: a first host read priced as on CUDA, so that verified checks read flags, which
    the resized tables' placeholder must answer: verify.FLAG_READS)"""
    if costly:
        from mlxmoe.caching import verify

        monkeypatch.setattr(verify, "first_read_seconds", lambda: 1.0)
    probe, _ = mlxmoe.load(str(path))
    L, E, k = shape(probe)
    probe.expert_runtime.close()
    model, tokenizer = mlxmoe.load(str(path), cache_experts=L * E if start == "all" else L * E // 2)
    runtime, cache = model.expert_runtime, model.expert_cache
    small, large = k * L, L * E - 1
    asked = {5: small, 20: large}

    def at(i):
        if i in asked:
            result = runtime.resize(budget_for(runtime, asked[i]))
            assert result["applied"] is False and result["to"] == asked[i]  # (between this token and the next)

    tokens, sizes = generate(model, tokenizer, at)
    assert tokens == want
    assert sizes[5] == sizes[0] and sizes[6] == small and sizes[21] == large
    resizes = cache.stats()["resizes"]
    assert [(r["from"], r["to"]) for r in resizes] == [(sizes[0], small), (small, large)]
    assert all(r["reason"].startswith("asked for a budget of") for r in resizes)
    assert len(cache.slot_of) <= large and cache.pools.views[0].shape[0] == large + (cache.verifier is not None)
    assert sorted(cache.slot_of.values()) == sorted(set(cache.slot_of.values()))  # no slot held twice
    assert all(0 <= s < large for s in cache.slot_of.values())
    # and again on the resized cache: the same tokens, nothing read wrong
    assert generate(model, tokenizer)[0] == want
    runtime.close()


def test_shrink_between_generations_evicts_the_policys_victims(path, want):
    model, tokenizer = mlxmoe.load(str(path))
    runtime, cache = model.expert_runtime, model.expert_cache
    L, E, k = shape(model)
    generate(model, tokenizer)
    before = dict(cache.slot_of)
    evictions = cache.counters.evictions
    result = runtime.resize(budget_for(runtime, 3 * k))
    assert result["applied"] and result["to"] == 3 * k and cache.capacity == 3 * k
    assert len(cache.slot_of) == min(len(before), 3 * k) and set(cache.slot_of) <= set(before)
    assert cache.counters.evictions - evictions == len(before) - len(cache.slot_of)
    assert runtime.plan.cache_experts == 3 * k and runtime.plan.budget == budget_for(runtime, 3 * k)
    assert generate(model, tokenizer)[0] == want
    runtime.close()


def test_below_the_minimum_keeps_it_and_says_so_once(path, want, capfd):
    model, tokenizer = mlxmoe.load(str(path))
    runtime = model.expert_runtime
    L, E, k = shape(model)
    first = runtime.resize("1MB")
    second = runtime.resize(1000)
    assert first["to"] == second["to"] == k == model.expert_cache.capacity
    assert "below this model's minimum" in first["message"] and "keeps its minimum, 2 experts" in first["message"]
    assert capfd.readouterr().err.count("below this model's minimum") == 1
    assert "held at the minimum" in model.expert_cache.stats()["resizes"][-1]["reason"]
    assert generate(model, tokenizer)[0] == want
    with pytest.raises(mlxmoe.MlxmoeError, match="cannot read memory budget"):
        runtime.resize("lots")
    runtime.close()


def wait_for(condition, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_auto_follows_an_injected_source_within_a_second(path, want, monkeypatch):
    """The source says how much is available; the cache follows it during a generation."""
    model, tokenizer = mlxmoe.load(str(path))
    runtime, cache = model.expert_runtime, model.expert_cache
    L, E, k = shape(model)
    target = [budget_for(runtime, L * E)]
    # MLX holding nothing, the allowed budget is what the source says is available (a
    # source reading the memory MLX holds would race the generation, which moves it)
    monkeypatch.setattr(governor, "held_memory", lambda: 0)
    runtime.govern(0, lambda: (target[0], 1 << 40))
    seen = {}

    def at(i):
        if i == 3:
            seen["low"] = time.monotonic()
            target[0] = budget_for(runtime, L * E // 4)
        if i == 20:
            seen["high"] = time.monotonic()
            target[0] = budget_for(runtime, L * E)
        for name, size in (("low", L * E // 4), ("high", L * E)):
            if name in seen and cache.capacity == size and name + " took" not in seen:
                seen[name + " took"] = time.monotonic() - seen[name]

    tokens, sizes = generate(model, tokenizer, at, pause=0.05)
    assert tokens == want
    assert L * E // 4 in sizes and sizes[-1] == L * E
    assert seen["low took"] < 1.0 and seen["high took"] < 1.0
    assert any("fell" in r["reason"] for r in cache.stats()["resizes"])
    runtime.close()
    assert not runtime.governor.thread.is_alive()


def test_auto_reads_meminfo_and_the_cgroup(path, want, tmp_path, monkeypatch):
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    cgroup.mkdir()
    margin = 1 << 40  # far above what MLX holds here: the budget is set by what the files say

    def machine(available, room):
        meminfo.write_text(f"MemTotal:       {4 * margin >> 10} kB\nMemAvailable:   {available >> 10} kB\n")
        (cgroup / "memory.max").write_text(f"{8 * margin}\n")
        (cgroup / "memory.current").write_text(f"{8 * margin - room + (5 << 20)}\n")
        # page cache, which the kernel drops under the limit: room
        (cgroup / "memory.stat").write_text(f"anon 1\nactive_file {3 << 20}\ninactive_file {2 << 20}\n")

    machine(3 * margin, 3 * margin)
    monkeypatch.setenv("MLXMOE_MEMINFO", str(meminfo))
    monkeypatch.setenv("MLXMOE_CGROUP", str(cgroup))
    assert governor.available_memory() == (3 * margin, 4 * margin)
    model, tokenizer = mlxmoe.load(str(path), memory_budget="auto", memory_margin=margin)
    runtime, cache = model.expert_runtime, model.expert_cache
    L, E, k = shape(model)
    assert cache.capacity == L * E and runtime.governor is not None
    marks = {}

    def at(i):
        if i == 3:  # the cgroup's room falls to nothing: the minimum
            machine(3 * margin, 0)
        if i == 20:
            machine(3 * margin, 3 * margin)
        marks.setdefault(cache.capacity, i)

    tokens, sizes = generate(model, tokenizer, at, pause=0.05)
    assert tokens == want
    assert k in sizes and sizes[-1] == L * E and marks[k] - 3 <= 20  # (0.05 s a token: within a second)
    runtime.close()


def test_auto_refuses_a_fixed_cache_and_a_margin_alone(path):
    with pytest.raises(mlxmoe.MlxmoeError, match="auto"):
        mlxmoe.load(str(path), memory_budget="auto", cache_experts=4)
    with pytest.raises(mlxmoe.MlxmoeError, match="memory_margin: the memory left free"):
        mlxmoe.load(str(path), memory_budget="1GB", memory_margin="1GB")
    with pytest.raises(mlxmoe.MlxmoeError, match="cannot read memory margin"):
        mlxmoe.load(str(path), memory_budget="auto", memory_margin="a lot")


def test_serve_resizes_on_post(tmp_path):
    from test_server import Server

    s = Server("--memory-budget", "46MB")  # the demo: 57 of 128 experts
    try:
        status, _, stats = s.json("GET", "/v1/mlxmoe/stats")
        assert status == 200 and stats["cache_experts"] == 57
        plan = mlxmoe.memory_plan(mlxmoe.DEMO_MODEL, cache_experts=2)
        budget = plan.minimum + 18 * plan.slot_bytes  # 20 experts
        status, _, done = s.json("POST", "/v1/mlxmoe/cache", {"memory_budget": budget})
        assert status == 200 and (done["from"], done["to"], done["applied"]) == (57, 20, True), done
        status, _, stats = s.json("GET", "/v1/mlxmoe/stats")
        assert stats["cache_experts"] == 20 and stats["server"]["memory_budget"] == budget
        assert stats["resizes"][-1]["reason"] == "asked by POST /v1/mlxmoe/cache"
        status, _, done = s.json("POST", "/v1/mlxmoe/cache", {"memory_budget": "2MB"})
        assert status == 200 and done["to"] == 2 and "minimum" in done["message"]
        for body in ({"memory_budget": "lots"}, {"budget": "8GB"}, [1]):
            status, _, error = s.json("POST", "/v1/mlxmoe/cache", body)
            assert status == 400 and "/v1/mlxmoe/cache" in error["error"]["message"], body
        status, _, _ = s.request("GET", "/v1/mlxmoe/cache")
        assert status == 405
        r = s.client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "The cat"}],
                                             max_tokens=8, temperature=0)
        assert r.choices[0].message.content
    finally:
        assert s.stop() == 0


def test_chat_budget_command():
    from click.testing import CliRunner

    from mlxmoe.cli import main

    plan = mlxmoe.memory_plan(mlxmoe.DEMO_MODEL, cache_experts=2)
    budget = plan.minimum + 5 * plan.slot_bytes
    r = CliRunner().invoke(main, ["chat", "--max-tokens", "4", "--cache-experts", "20"],
                           input=f"/budget {budget}\nciao\n/budget 1MB\n/budget\n/quit\n")
    assert r.exit_code == 0, r.output
    assert "[expert cache: 20 -> 7 experts, memory budget" in r.stdout
    assert "[expert cache: 7 -> 2 experts" in r.stdout and "keeps its minimum, 2 experts]" in r.stdout
    assert "[/budget SIZE: give a memory budget, e.g. /budget 8GB]" in r.stdout


def test_generate_with_auto_budget(tmp_path):
    from click.testing import CliRunner

    from mlxmoe.cli import main

    meminfo, out = tmp_path / "meminfo", tmp_path / "stats.json"
    args = ["generate", "--memory-budget", "auto", "--memory-margin", "1TB", "--prompt", "The cat", "--max-tokens",
            "4", "--stats-json", str(out)]
    for available, experts in ((3 << 40, 128), (0, 2)):
        meminfo.write_text(f"MemTotal: {8 << 30} kB\nMemAvailable: {available >> 10} kB\n")
        r = CliRunner().invoke(main, args, env={"MLXMOE_MEMINFO": str(meminfo), "MLXMOE_CGROUP": str(tmp_path)})
        assert r.exit_code == 0, r.output
        assert json.loads(out.read_text())["cache_experts"] == experts
    assert "below this model's minimum" in r.stderr
    r = CliRunner().invoke(main, ["generate", "--help"])
    assert "--memory-margin" in r.stdout and "auto" in r.stdout


CHILD = """
import json, sys, time
import mlxmoe
folder, path, margin = sys.argv[1:4]
with open(folder + "/cgroup.procs", "w") as f:  # into the test's cgroup before anything is loaded
    f.write("0")
model, tokenizer = mlxmoe.load(path, memory_budget="auto", memory_margin=int(margin))
every = model.expert_cache.capacity
print(json.dumps({"ready": every}), flush=True)
sys.stdin.readline()
for i, r in enumerate(mlxmoe.stream_generate(model, tokenizer, sys.argv[4], max_tokens=int(sys.argv[5]))):
    print(json.dumps([r.token, model.expert_cache.capacity]), flush=True)
    if i == 3:  # the parent squeezes now: wait until it has (a loaded machine's hog may take seconds)
        sys.stdin.readline()
    time.sleep(0.1)
end = time.monotonic() + 20  # (memory back late, as under a loaded machine: the cache grows after the generation)
while model.expert_cache.capacity != every and time.monotonic() < end:
    time.sleep(0.1)
print(json.dumps({"resizes": model.expert_cache.stats()["resizes"], "final": model.expert_cache.capacity}), flush=True)
model.expert_runtime.close()
"""


HOG = """
import sys
with open(sys.argv[1] + "/cgroup.procs", "w") as f:
    f.write("0")
held = b"\\x01" * int(sys.argv[2])  # (written: every page counts)
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("squeeze", ["limit", "competitor"])
def test_a_real_cgroup_squeezed_mid_generation(path, want, squeeze):
    """A child process in a cgroup of its own; mid-generation its limit is lowered by 30 %
    (still far above what it uses: no OOM kill), or a competing process in the same cgroup
    takes 1.3 GB, and then the limit or the memory comes back: the cache shrinks within a
    second and grows back, the tokens are stock's."""
    import subprocess
    import sys

    parent = governor.cgroup_folder()
    if parent is None:
        pytest.skip("no memory cgroup")
    v2 = os.path.exists(os.path.join(parent, "memory.max"))
    folder = os.path.join(parent, f"mlxmoe-test-{os.getpid()}")
    try:
        os.mkdir(folder)
    except OSError as e:
        pytest.skip(f"cannot make a cgroup under {parent}: {e}")
    limit_file = os.path.join(folder, "memory.max" if v2 else "memory.limit_in_bytes")
    if not os.path.exists(limit_file):  # (v2 without the memory controller delegated to it)
        os.rmdir(folder)
        pytest.skip(f"no memory controller in a cgroup made under {parent}")
    high = 4 << 30
    low = high * 7 // 10
    margin = low + (100 << 20)  # the budget allowed: what MLX holds + the room under the limit - this
    child = hog = None

    def squeezed(on):
        nonlocal hog
        if squeeze == "limit":
            with open(limit_file, "w") as f:
                f.write(str(low if on else high))
        elif on:
            hog = subprocess.Popen([sys.executable, "-c", HOG, folder, str(13 << 27)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
            assert hog.stdout.readline() == "held\n"
        else:
            hog.communicate("\n", timeout=60)

    try:
        with open(limit_file, "w") as f:
            f.write(str(high))
        child = subprocess.Popen([sys.executable, "-c", CHILD, folder, str(path), str(margin), PROMPT, str(TOKENS)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        every = json.loads(child.stdout.readline())["ready"]
        child.stdin.write("\n")
        child.stdin.flush()
        tokens, sizes, since, took = [], [], None, None
        for i, line in enumerate(child.stdout):
            out = json.loads(line)
            if isinstance(out, dict):
                resizes, final = out["resizes"], out["final"]
                break
            tokens.append(out[0])
            sizes.append(out[1])
            if i == 3:
                squeezed(True)
                since = time.monotonic()
                child.stdin.write("\n")
                child.stdin.flush()
            elif since is not None and took is None and out[1] == 2:  # shrunk to the minimum: memory back
                took = time.monotonic() - since
                squeezed(False)
        assert child.wait(60) == 0
    finally:
        for process in (child, hog):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        os.rmdir(folder)
    assert tokens == want
    assert sizes[0] == every and min(sizes) == 2 and final == every  # all, the minimum, all again
    assert took < 1.0
    assert any("fell" in r["reason"] for r in resizes) and any("rose" in r["reason"] for r in resizes)
