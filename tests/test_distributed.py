"""Several ranks on 127.0.0.1 (mlx.launch, ring backend): mlx-lm's pipeline split with one
expert stream per stage gives the tokens of one process, each rank reads only its own
layers' experts within its own budget, profiles merge on rank 0, failures stop every rank."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlx_lm
import numpy as np
import pytest

import mlxmoe
from mlxmoe.distributed import free_port_base
from mlxmoe.workload.profile import ActivationProfile

WORKER = Path(__file__).with_name("dist_worker.py")
DEEPSEEK = {"num_hidden_layers": 6}  # its first layer is dense: every stage of 2 or 3 keeps a MoE layer
LIMIT = 150  # seconds for one launch


def launch(ranks, *command, timeout=LIMIT, python=True):
    """Run `command` as `ranks` ranks under mlx.launch; (returncode, output, seconds)."""
    env = dict(os.environ, MLXMOE_DIST_TIMEOUT="60", HF_HUB_OFFLINE="1")
    cmd = [shutil.which("mlx.launch") or "mlx.launch", "--backend", "ring", "-n", str(ranks),
           "-p", str(free_port_base(ranks))]
    if python:
        cmd += ["--python", sys.executable]
    tic = time.monotonic()
    r = subprocess.run(cmd + ["--", *command], capture_output=True, text=True, timeout=timeout, env=env)
    log = r.stdout + r.stderr
    # mlx.launch returns 0 whatever its ranks did; it reports a rank that failed or that it stopped
    failed = r.returncode or "exited with code" in log or "was killed" in log
    return int(bool(failed)), log, time.monotonic() - tic


def run_worker(tmp_path, ranks, *args):
    out = tmp_path / f"out{ranks}-{args[1] if len(args) > 1 else ''}{time.monotonic_ns()}"
    out.mkdir()
    rc, log, _ = launch(ranks, str(WORKER), str(args[0]), str(out), *map(str, args[1:]))
    assert rc == 0, log
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def one_process(path, cache_experts):
    model, tokenizer = mlxmoe.load(path, cache_experts=cache_experts)
    got = [r.token for r in mlxmoe.stream_generate(model, tokenizer, "Once upon a time there was a fox", max_tokens=10)]
    model.expert_cache.close()
    return got, model.expert_cache.stats()["bytes_read"]


def stock(path):
    model, tokenizer = mlx_lm.load(str(path))
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, "Once upon a time there was a fox",
                                                    max_tokens=10)]


@pytest.mark.parametrize("arch,overrides", [("qwen3_moe", {}), ("deepseek_v3", DEEPSEEK)])
@pytest.mark.parametrize("ranks", [2, 3])
def test_tokens_equal_one_process_and_stock(checkpoint, tmp_path, arch, overrides, ranks):
    path = checkpoint(arch, config_overrides=overrides)
    results = run_worker(tmp_path, ranks, path, "parity")
    first = results[0]["full"]
    L, E = first["all_layers"], first["num_experts"]
    want = stock(path)
    full, full_bytes = one_process(path, L * E)
    half, _ = one_process(path, L * E // 2)
    assert full == want and half == want
    for name in ("full", "half"):
        for r in results:
            assert r[name]["tokens"] == want, (name, r)
    # mlx-lm's split: rank r runs the layers after those of ranks r+1.., together all of them once
    stages = sorted((r["full"]["layer_offset"], r["full"]["num_layers"]) for r in results)
    assert stages[0][0] == 0 and sum(n for _, n in stages) == L
    assert all(a + n == b for (a, n), (b, _) in zip(stages, stages[1:]))
    assert results[-1]["full"]["layer_offset"] == 0  # the last rank has the first layers
    for r in results:
        f, h = r["full"], r["half"]
        # each rank read exactly its own layers' experts (at full cache: each once), nothing else
        assert f["bytes_read"] == f["num_layers"] * E * f["expert_file_bytes"]
        assert f["useful_bytes"] == f["bytes_read"] and h["useful_bytes"] == h["bytes_read"]
        assert h["cache_experts"] == f["num_layers"] * E // 2
    assert sum(r["full"]["bytes_read"] for r in results) == full_bytes  # the whole model, once
    assert results[0]["full"]["total_bytes_read"] == full_bytes  # aggregated on rank 0


def test_each_rank_streams_within_its_budget(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe", config_overrides={"hidden_size": 256, "moe_intermediate_size": 512,
                                                      "num_experts": 32, "num_hidden_layers": 4})
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    budget = size // 4  # each rank's; its stage holds about half the checkpoint
    for m in run_worker(tmp_path, 2, path, "budget", budget):
        assert m["budget"] == budget
        assert m["cache_experts"] < m["local_experts"] and m["misses"] > 0  # the experts really stream
        assert m["mlx_peak"] <= 1.05 * budget, m
        assert m["peak_rss"] - m["base_rss"] <= 1.05 * budget, m


def test_profile_recorded_under_two_ranks_equals_one_process(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nIl modello a miscela di esperti\n")
    # every expert cached: in one process the counts differ between cache sizes (6 and 12 experts here)
    record = ["profile", "record", "-m", str(path), "--prompts", str(prompts), "--max-tokens", "6", "-w", "tale"]
    one = subprocess.run([sys.executable, "-m", "mlxmoe", *record, "-o", str(tmp_path / "one.json")],
                         capture_output=True, text=True, timeout=LIMIT)
    assert one.returncode == 0, one.stderr
    rc, log, _ = launch(2, sys.executable, "-m", "mlxmoe", *record, "-o", str(tmp_path / "two.json"),
                        python=False)
    assert rc == 0, log
    a, b = ActivationProfile.load(tmp_path / "one.json"), ActivationProfile.load(tmp_path / "two.json")
    assert (a.num_layers, a.fingerprint, a.tokens_total) == (b.num_layers, b.fingerprint, b.tokens_total)
    assert (a.counts == b.counts).all() and a.counts.sum() > 0
    assert a.curve == b.curve  # predicted from the ranks' traces merged on rank 0
    # and a whole-model profile loads on any split
    rc, log, _ = launch(3, sys.executable, "-m", "mlxmoe", "generate", "-m", str(path), "-p", "Once", "--max-tokens",
                        "2", "--profile", str(tmp_path / "two.json"), python=False)
    assert rc == 0 and "experts: hit rate" in log, log


def test_missing_shard_on_one_rank_stops_all_named_on_rank0(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe", max_shard_bytes=200_000)
    broken = tmp_path / "m1"
    shutil.copytree(path, broken)
    shards = sorted(broken.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    shutil.copytree(path, tmp_path / "m0")
    rc, log, seconds = launch(2, "bash", "-c", f'exec "{sys.executable}" -m mlxmoe generate -m {tmp_path}/m$MLX_RANK '
                              '-p Once --max-tokens 2', python=False)
    assert rc != 0 and "rank 0 exited with code 2" in log
    # mlx.launch may print its own "[WARN]" prefix on the same line as a rank's output
    rank0 = [l[l.index("error: "):] for l in log.splitlines() if "error: " in l]
    assert rank0 and "rank 1" in rank0[0] and "missing shard" in rank0[0] and shards[-1].name in rank0[0], log
    assert seconds < LIMIT


def test_read_error_while_decoding_stops_all_ranks(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe")
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    shutil.copytree(path, str(copy) + "-rank1")
    r0, r1 = run_worker(tmp_path, 2, copy, "readfail")
    assert r0["error"] == r1["error"]
    assert r0["error"].startswith("rank 1 ") and "truncated" in r0["error"], r0


def test_architecture_without_pipeline_refused(checkpoint):
    path = checkpoint("mixtral")
    rc, log, _ = launch(2, sys.executable, "-m", "mlxmoe", "generate", "-m", str(path), "-p", "Once", python=False)
    # mlx.launch may print its own "[WARN]" prefix on the same line as a rank's output
    rank0 = [l[l.index("error: "):] for l in log.splitlines() if "error: " in l]
    assert rank0 and "'mixtral'" in rank0[0] and "pipeline" in rank0[0], log


def test_start_up_without_peers_is_bounded(tmp_path):
    hosts = tmp_path / "hosts.json"
    base = free_port_base(2)
    hosts.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    env = dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK="0", MLXMOE_DIST_TIMEOUT="3")
    tic = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mlxmoe", "generate", "-p", "Once"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode != 0 and "did not finish within 3 s" in r.stderr, r.stderr
    assert time.monotonic() - tic < 30


def test_chat_under_two_ranks_answers_as_one_process(checkpoint):
    path = checkpoint("qwen3_moe")
    turns = "Once upon a time\nIl modello\n/stats\n/quit\n"
    chat = ["-m", "mlxmoe", "chat", "-m", str(path), "--max-tokens", "6"]
    one = subprocess.run([sys.executable, *chat], input=turns, capture_output=True, text=True, timeout=LIMIT)
    assert one.returncode == 0, one.stderr
    env = dict(os.environ, MLXMOE_DIST_TIMEOUT="60")
    cmd = ["mlx.launch", "--backend", "ring", "-n", "2", "-p", str(free_port_base(2)), "--", sys.executable, *chat]
    two = subprocess.run(cmd, input=turns, capture_output=True, text=True, timeout=LIMIT, env=env)
    # /stats: tokens, bytes, cache and decode path agree (hits and loads race with the background pre-warm,
    # memory differs)
    table = ("tokens", "hit rate", "loads", "read", "cache", "memory", "decode")
    replies = lambda out: [l for l in out.splitlines() if not l.startswith(table)]
    counts = lambda out: [l for l in out.splitlines() if l.startswith(("tokens", "read", "cache", "decode"))]
    assert replies(two.stdout) == replies(one.stdout), two.stdout + two.stderr  # rank 0's replies only, the same
    assert counts(two.stdout) == counts(one.stdout) and "policy activation" in two.stdout, two.stdout
    assert two.stderr.count(", expert hit rate") == 2  # one summary per turn (rank 0's)
    assert "exited with code" not in two.stderr, two.stderr


THREE = {"qwen3_moe": {"num_attention_heads": 6, "num_key_value_heads": 3, "moe_intermediate_size": 96},
         "deepseek_v3": {"num_attention_heads": 6, "num_key_value_heads": 6, "moe_intermediate_size": 96,
                         "intermediate_size": 96}}  # heads and widths that 3 ranks divide


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # of the synthetic archs, those mlx-lm shards
@pytest.mark.parametrize("ranks", [2, 3])
def test_tensor_split_streams_a_slice_of_every_expert(checkpoint, tmp_path, arch, ranks):
    """mlx-lm's model.shard: every rank runs every layer with 1/ranks of each expert's rows
    (gate, up) and columns (down), streamed from the stacked tensors."""
    path = checkpoint(arch, config_overrides=THREE[arch] if ranks == 3 else {})
    want = stock(path)
    results = run_worker(tmp_path, ranks, path, "tensor")
    every = results[0]["full"]["experts"]
    full, full_bytes = one_process(path, every)
    for r in results:
        assert r["stock"] == want == full
        assert r["full"]["tokens"] == want and r["half"]["tokens"] == want
        # 1/ranks of each expert's bytes, each expert once at full cache
        assert ranks * r["full"]["expert_file_bytes"] * every == full_bytes == ranks * r["full"]["bytes_read"]
        assert r["full"]["io"]["useful_bytes"] == r["full"]["bytes_read"]
        # the down projection's columns are strided: its whole span is read (a third of an
        # expert), never more: (2 / 3 + ranks / 3) x the useful bytes
        assert r["full"]["io"]["disk_bytes"] <= (2 + ranks) / 3 * r["full"]["bytes_read"] + (1 << 16)


def test_tensor_split_ranks_take_the_resident_path_together(checkpoint, tmp_path):
    """A rank whose cache holds every expert while another's does not (a background pre-warm
    done on one rank, not on the other) still gives stock tokens: every rank streams until
    every rank's cache is full, then every rank takes the resident path. (A rank alone on
    the resident path skips the all_sum of a prompt chunk's last layer that a streaming rank
    evaluates with its router: every later all_sum then pairs the wrong arrays.)"""
    path = checkpoint("qwen3_moe")
    want = stock(path)
    for r in run_worker(tmp_path, 2, path, "uneven"):
        for ready in r:  # rank 0's cache full first, then rank 1's
            assert ready["first"] == want and ready["second"] == want, r
            assert not ready["resident_first"] and ready["resident_second"], r


@pytest.mark.parametrize("arch,split,says", [("mixtral", "tensor", "no shard()"),
                                             ("gpt_oss", "tensor", "bias after the ranks' sum"),
                                             ("gpt_oss", "pipeline", "no pipeline()")])
def test_architecture_or_split_that_cannot_work_refused(checkpoint, arch, split, says):
    rc, log, _ = launch(2, sys.executable, "-m", "mlxmoe", "generate", "-m", str(checkpoint(arch)), "-p", "Once",
                        "--split", split, python=False)
    # mlx.launch may print its own "[WARN]" prefix on the same line as a rank's output
    rank0 = [l[l.index("error: "):] for l in log.splitlines() if "error: " in l]
    assert rc and rank0 and f"'{arch}'" in rank0[0] and says in rank0[0], log


def launcher(ranks):
    return ["mlx.launch", "--backend", "ring", "-n", str(ranks), "-p", str(free_port_base(ranks)), "--"]


def rank_pids(launcher_pid):
    """{rank: pid} of the ranks mlx.launch started (its children, each with MLX_RANK set)."""
    pids = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
                pids[int(env["MLX_RANK"])] = int(d.name)
        except (OSError, KeyError, ValueError):
            continue
    return pids


def kill_group(server):
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def serving(ranks, *args):
    """`mlxmoe serve ARGS` as one process, or as `ranks` ranks under mlx.launch; killed
    (every rank) whatever happens."""
    from test_server import Server

    s = Server(*args, launch=launcher(ranks) if ranks > 1 else (), env=dict(os.environ, MLXMOE_DIST_TIMEOUT="60"))
    try:
        yield s
    finally:
        kill_group(s) if ranks > 1 else s.proc.kill()


def terminate(server, ranks, rank=0):
    """SIGTERM to `rank` alone (to the one process); every rank must end cleanly."""
    if ranks > 1:
        os.kill(rank_pids(server.proc.pid)[rank], signal.SIGTERM)
    else:
        server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0


def test_serve_under_two_ranks_answers_as_one_process(checkpoint):
    """Rank 0 serves HTTP, rank 1 follows each request; the text of every request equals
    one process's and stock mlx-lm's; a client gone mid-stream stops both ranks' generation
    at the next token; SIGTERM to rank 0 alone stops every rank."""
    from test_server import Server, chat, open_stream

    path = checkpoint("qwen3_moe")
    model, tok = mlxmoe.load(path)
    stock_model, stock_tok = mlx_lm.load(str(path))
    env = dict(os.environ, MLXMOE_DIST_TIMEOUT="60")
    s = Server("-m", path, launch=launcher(2), env=env)
    try:
        for prompt in ("Once upon a time there was a fox", "Il modello a miscela di esperti"):
            want = mlxmoe.generate(model, tok, prompt, max_tokens=10)
            assert want == mlx_lm.generate(stock_model, stock_tok, prompt, max_tokens=10)
            r = s.client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0)
            assert r.choices[0].text == want and r.usage.completion_tokens == 10
            assert "".join(c.choices[0].text for c in s.client.completions.create(
                model="m", prompt=prompt, max_tokens=10, temperature=0, stream=True)) == want
            templated = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            want = mlxmoe.generate(model, tok, templated, max_tokens=10)
            assert chat(s, prompt, max_tokens=10) == want == chat(s, prompt, max_tokens=10, stream=True)
        sock = open_stream(s.port, "/v1/completions", {"prompt": "Once", "max_tokens": 3000, "stream": True})
        sock.close()
        tic = time.monotonic()
        r = s.client.completions.create(model="m", prompt="Once upon a time there was a fox", max_tokens=10,
                                        temperature=0)
        assert r.choices[0].text == mlxmoe.generate(model, tok, "Once upon a time there was a fox", max_tokens=10)
        assert time.monotonic() - tic < 30  # 3000 tokens would take far longer
        stats = s.json("GET", "/v1/mlxmoe/stats")[2]
        assert stats["ranks"] == 2 and len(stats["per_rank"]) == 2 and stats["server"]["requests"] == 10
        assert sum(r["hits"] for r in stats["per_rank"]) == stats["hits"] > 0
        pids = rank_pids(s.proc.pid)
        assert sorted(pids) == [0, 1]
        os.kill(pids[0], signal.SIGTERM)
        assert s.proc.wait(60) == 0
        assert s.drained.wait(10)
        log = "".join(s.lines)
        assert "exited with code" not in log and "was killed" not in log, log
    finally:
        kill_group(s)


def test_serve_stops_with_the_error_when_a_rank_dies(checkpoint):
    from test_server import Server

    path = checkpoint("qwen3_moe")
    s = Server("-m", path, launch=launcher(2), env=dict(os.environ, MLXMOE_DIST_TIMEOUT="60"))
    try:
        assert s.client.completions.create(model="m", prompt="Once", max_tokens=4, temperature=0).choices[0].text
        os.kill(rank_pids(s.proc.pid)[1], signal.SIGKILL)
        s.proc.wait(60)
        assert s.drained.wait(10)
        errors = [l for l in s.lines if "error: " in l]  # (mlx.launch may write its [WARN] prefix into the line)
        assert errors and "a rank failed or its connection was lost" in errors[0], "".join(s.lines)
    finally:
        kill_group(s)


def test_serve_learns_one_profile_of_the_whole_model_and_stops_from_a_follower(checkpoint, tmp_path):
    """--save-profiles under 2 ranks writes what one process writes (the stages' routing
    merged on rank 0); SIGTERM to rank 1 alone stops every rank, and the profile is saved."""
    path = checkpoint("qwen3_moe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    r = subprocess.run([sys.executable, "-m", "mlxmoe", "profile", "record", "-m", str(path), "--prompts",
                        str(prompts), "--max-tokens", "4", "-w", "tale", "-o", str(tmp_path / "p.json")],
                       capture_output=True, text=True, timeout=LIMIT)
    assert r.returncode == 0, r.stderr
    for ranks in (1, 2):
        shutil.copy(tmp_path / "p.json", tmp_path / f"p{ranks}.json")
        # (one request at a time as under ranks: a batch's decode steps learn the live profile as one call)
        with serving(ranks, "-m", path, "--profile", tmp_path / f"p{ranks}.json", "--save-profiles",
                     "--max-batch", "1") as s:
            for prompt in ("Il gatto", "The cat sat"):
                assert s.client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0).choices
            terminate(s, ranks, rank=1)
    start, one, two = (ActivationProfile.load(tmp_path / f) for f in ("p.json", "p1.json", "p2.json"))
    assert two.tokens_total == one.tokens_total > start.tokens_total
    assert (two.counts == one.counts).all() and (two.counts != start.counts).any(axis=1).all()  # every layer learnt


def test_serve_profiles_under_two_ranks_choose_and_learn_as_one_process(tmp_path):
    """--profiles under 2 ranks: every request's prefill routing, summed over the ranks'
    stages, picks the profile one process picks; the text is one process's; a request that
    names a profile gets it; --save-profiles writes what one process writes. Under the
    tensor split every rank routes every layer: the same, with the profiles of the whole model."""
    from test_server import ROOT, copy_profiles

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from heldout import prompts
    finally:
        sys.path.pop(0)
    asked = [{"prompt": p, "max_tokens": 6} for lang in ("it", "en") for p in prompts(lang, 2)]
    asked.append({"prompt": "The cat sat on", "max_tokens": 6, "mlxmoe": {"profile": "italian"}})
    answers, runs = {}, {"one": (1, ()), "pipeline": (2, ()), "tensor": (2, ("--split", "tensor"))}
    for run, (ranks, split) in runs.items():
        (tmp_path / run).mkdir()
        folder = copy_profiles(tmp_path / run)
        with serving(ranks, "--profiles", folder, "--save-profiles", "--save-every", 0, *split) as s:
            answers[run] = []
            for body in asked:
                status, headers, got = s.json("POST", "/v1/completions", {**body, "temperature": 0})
                assert status == 200, got
                assert got["usage"]["mlxmoe"]["profile"] == headers["X-Mlxmoe-Profile"]
                answers[run].append((headers["X-Mlxmoe-Profile"], got["choices"][0]["text"]))
            stats = s.json("GET", "/v1/mlxmoe/stats")[2]["server"]["profiles"]
            assert sum(stats.values()) == len(asked)
            terminate(s, ranks)
    assert answers["pipeline"] == answers["one"] == answers["tensor"], answers
    one = answers["one"]
    assert {p for p, _ in one[:2]} == {"italian"} and {p for p, _ in one[2:4]} == {"english"} and one[4][0] == "italian"
    for name in ("italian", "english"):
        shipped = ActivationProfile.load(ROOT / "profiles" / f"{name}.json")
        one, two, tensor = (ActivationProfile.load(tmp_path / run / "profiles" / f"{name}.json") for run in runs)
        assert two.tokens_total == one.tokens_total == tensor.tokens_total > shipped.tokens_total
        assert (two.counts == one.counts).all() and (two.mass == one.mass).all()
        # the tensor split's hidden states are the ranks' sums: the router's probabilities differ in the last bits
        assert (tensor.counts == one.counts).all() and np.allclose(tensor.mass, one.mass, rtol=1e-5)


@pytest.mark.parametrize("ranks,when", [(2, "mid-request"), (3, "idle")])
def test_a_rank_that_stops_answering_ends_the_server_naming_it(checkpoint, ranks, when):
    """Rank 1 stopped (SIGSTOP), not dead: rank 0 waits on it no longer than
    MLXMOE_DIST_TIMEOUT (between requests in the request sharing and stop vote, during one
    in a generation step), then exits 2 with an error naming rank 1 (of 3: the one whose
    heartbeat stopped); its client is cut."""
    from test_server import Server, open_stream

    s = Server("-m", checkpoint("qwen3_moe"), launch=launcher(ranks), env=dict(os.environ, MLXMOE_DIST_TIMEOUT="10"))
    pids = rank_pids(s.proc.pid)
    sock = None
    try:
        assert s.client.completions.create(model="m", prompt="Once", max_tokens=4, temperature=0).choices[0].text
        if when == "mid-request":
            sock = open_stream(s.port, "/v1/completions", {"prompt": "Once", "max_tokens": 3000, "stream": True})
        os.kill(pids[1], signal.SIGSTOP)
        tic = time.monotonic()
        errors = []
        while not errors and time.monotonic() - tic < 60:
            time.sleep(0.2)
            errors = [l for l in s.lines if "error: " in l]  # (mlx.launch may write its [WARN] prefix into the line)
        waited = time.monotonic() - tic
        assert errors and "rank 0: no answer from rank 1 within 10 s" in errors[0], "".join(s.lines)  # not 2
        waits = ("generating a token", "voting to stop") if when == "mid-request" else ("sharing the next request",)
        assert any(w in errors[0] for w in waits), errors[0]
        assert 10 <= waited < 30
        if sock is not None:  # the stream ends: rank 0 is gone
            sock.settimeout(10)
            while sock.recv(4096):
                pass
        os.kill(pids[1], signal.SIGCONT)  # mlx.launch's SIGTERM to it was pending
        s.proc.wait(60)
        assert "rank 0 exited with code 2" in "".join(s.lines)
    finally:
        if sock is not None:
            sock.close()
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
        kill_group(s)
