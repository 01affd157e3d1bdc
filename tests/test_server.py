"""`mlxmoe serve` on the demo model, through the official openai client and raw HTTP:
greedy text equal to mlxmoe generate, concurrent streams each equal to its solo answer
within the memory budget, per-request profiles, bad requests, disconnects, SIGTERM.
Servers bind 127.0.0.1 on a free port (--port 0); every wait is bounded."""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mlxmoe
from mlxmoe.workload.profile import ActivationProfile
from test_threads import in_threads

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
DEMO = Path(mlxmoe.__file__).parent / "demo"
PROMPTS = ["The cat sat on", "Il gatto è sul tavolo", "Le chat est", "Der Hund ist", "El perro", "Una storia di Roma",
           "The kernel option", "La lingua italiana"]


class Server:
    def __init__(self, *args, timeout=90, launch=(), env=None):
        """`launch`: a launcher's command line (mlx.launch ... --) that starts the ranks; they
        and it run in a process group of their own."""
        self.proc = subprocess.Popen([*launch, sys.executable, "-m", "mlxmoe", "serve", "--port", "0",
                                      *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     cwd=ROOT, env=env, start_new_session=bool(launch))
        self.drained = threading.Event()
        self.lines, self.port = [], None
        started = threading.Event()

        def drain():  # read the port, then keep the pipe from filling
            for line in self.proc.stderr:
                self.lines.append(line)
                if self.port is None and line.startswith("mlxmoe serve:"):
                    self.port = int(line.rsplit(":", 1)[1])
                    started.set()
            started.set()
            self.drained.set()

        threading.Thread(target=drain, daemon=True).start()
        started.wait(timeout)
        assert self.port is not None, "".join(self.lines)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=60, max_retries=0)

    def request(self, method, path, body=None, raw=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out = r.status, dict(r.getheaders()), r.read()
        conn.close()
        return out

    def json(self, method, path, body=None):
        status, headers, data = self.request(method, path, body)
        return status, headers, json.loads(data)

    def stop(self, sig=signal.SIGINT, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def server():
    s = Server("--memory-budget", "46MB")  # 57 of 128 experts: the cache evicts and reads
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local():
    return mlxmoe.load(str(DEMO))


def chat(server, prompt, max_tokens=24, stream=False, **kw):
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = server.client.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens,
                                                  temperature=0, **kw)
        return r.choices[0].message.content or ""
    return "".join(c.choices[0].delta.content or "" for c in server.client.chat.completions.create(
        model="demo", messages=messages, max_tokens=max_tokens, temperature=0, stream=True, **kw) if c.choices)


def test_openai_client_text_equals_generate(server, local):
    model, tok = local
    for prompt in PROMPTS[:2]:
        want = mlxmoe.generate(model, tok, prompt, max_tokens=24)
        last = list(mlxmoe.stream_generate(model, tok, prompt, max_tokens=24))[-1]
        r = server.client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == last.generation_tokens
        assert r.choices[0].finish_reason == last.finish_reason
        got = "".join(c.choices[0].text for c in server.client.completions.create(
            model="demo", prompt=prompt, max_tokens=24, temperature=0, stream=True))
        assert got == want
        templated = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        want = mlxmoe.generate(model, tok, templated, max_tokens=24)
        assert chat(server, prompt) == want
        assert chat(server, prompt, stream=True) == want
    # the CLI itself, with its chat template
    cli = subprocess.run([sys.executable, "-m", "mlxmoe", "generate", "-p", PROMPTS[1], "--chat-template",
                          "--max-tokens", "24"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.rstrip("\n") == chat(server, PROMPTS[1])


def test_a_shard_changed_under_the_server_fails_that_request_only(tmp_path):
    """A touched shard is served on; one whose header changed fails the request that reads it,
    saying how to recover; once the original is back, requests are answered again (issue 44)."""
    model = shutil.copytree(DEMO, tmp_path / "demo")
    shard = model / "model.safetensors"
    s = Server("--model", model, "--cache-experts", "8", "--prefetch", "0")
    try:
        want = chat(s, PROMPTS[0], max_tokens=12)
        os.utime(shard, ns=(0, shard.stat().st_mtime_ns + 10 ** 9))
        assert chat(s, PROMPTS[1], max_tokens=12) and chat(s, PROMPTS[0], max_tokens=12) == want
        data = shard.read_bytes()
        at = data.index(b'"dtype"') + 1
        with open(shard, "r+b") as f:
            f.write(data[:at] + b"D")
        status, _, body = s.json("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                                   PROMPTS[2]}], "max_tokens": 12})
        message = body["error"]["message"]
        assert status == 500 and "changed on disk" in message and "restart it" in message, body
        with open(shard, "r+b") as f:
            f.write(data[:at + 1])
        assert chat(s, PROMPTS[2], max_tokens=12) and chat(s, PROMPTS[0], max_tokens=12) == want
    finally:
        assert s.stop() == 0


def test_usage_stats_models_health(server):
    status, headers, body = server.json("POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8})
    assert status == 200 and headers["X-Mlxmoe-Profile"] == "none"
    usage = body["usage"]["mlxmoe"]
    assert usage["expert_hits"] + usage["expert_misses"] > 0 and 0 <= usage["expert_hit_rate"] <= 1
    status, _, stats = server.json("GET", "/v1/mlxmoe/stats")
    assert status == 200 and stats["cache_experts"] == 57 and stats["server"]["requests"] >= 1
    read = usage["mb_read"] * (1 << 20)  # MB as budgets count them: whole experts read
    assert read == int(read) and int(read) % (stats["cache_bytes"] // stats["cache_experts"]) == 0
    assert stats["hits"] >= usage["expert_hits"]
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["mlxmoe-demo"]
    assert body["model"] == "mlxmoe-demo"  # one name everywhere, whatever the request asked for
    assert server.json("GET", "/health")[2] == {"status": "ok"}
    for path in ("/health/", "/v1/models/", "/v1/mlxmoe/stats/"):  # a trailing slash, alike for every route
        assert server.request("GET", path)[0] == 200, path
    status, _, body = server.json("POST", "/v1/completions/", {"prompt": PROMPTS[0], "max_tokens": 2, "model": "x"})
    assert status == 200 and body["model"] == "mlxmoe-demo"
    # the start says what is served
    assert any(l.startswith("serving mlxmoe-demo: memory budget 46.0 MB, expert cache 57 of 128 experts")
               for l in server.lines), server.lines
    # usage in a stream, when asked for
    chunks = list(server.client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=6, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens <= 6 and chunks[-1].model_extra is not None
    assert "mlxmoe" in chunks[-1].usage.model_extra


def test_stop_seed_logprobs_reach_mlx_lm(server):
    # mlx-lm's stop handling: a stop string ends the response where its tokens are the ones
    # generated ("\n" here; stock mlx_lm.server does the same), elsewhere it is cut from the text
    def complete(prompt, **kw):
        return server.client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, **kw)

    prompt, free = next((p, f) for p in PROMPTS for f in [complete(p)] if "\n" in f.choices[0].text)
    cut = complete(prompt, stop=["\n"])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == free.choices[0].text.split("\n")[0]
    sampled = [server.client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                                                seed=s).choices[0].text for s in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]
    r = server.client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPTS[1]}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)


def test_anthropic_messages(server, local):
    model, tok = local
    body = {"model": "demo", "max_tokens": 16, "system": "You are brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]}
    status, _, msg = server.json("POST", "/v1/messages", body)
    templated = tok.apply_chat_template([{"role": "system", "content": "You are brief."},
                                         {"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True)
    assert status == 200 and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"][0]["text"] == mlxmoe.generate(model, tok, templated, max_tokens=16)
    assert msg["usage"]["output_tokens"] <= 16 and "mlxmoe" in msg["usage"]
    status, headers, data = server.request("POST", "/v1/messages", dict(body, stream=True))
    events = [line[7:] for line in data.decode().splitlines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "content_block_start"] and events[-2:] == ["message_delta", "message_stop"]
    deltas = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]
    assert "".join(d["delta"]["text"] for d in deltas if d["type"] == "content_block_delta") == msg["content"][0]["text"]


def test_concurrent_streams_each_get_their_solo_answer_within_budget(server):
    solo = [chat(server, p, stream=True) for p in PROMPTS]
    got = in_threads(lambda p: chat(server, p, stream=True), [(p,) for p in PROMPTS])
    assert got == solo
    stats = server.json("GET", "/v1/mlxmoe/stats")[2]
    assert stats["peak_memory"] <= stats["server"]["memory_budget"]


def test_bad_requests_get_400_naming_the_field(server):
    def error(path, body=None, raw=None, expect=400):
        status, _, data = server.request("POST", path, body, raw)
        assert status == expect, data
        error = json.loads(data)["error"]
        assert error["type"] == "invalid_request_error"
        return error["message"] if error["param"] is None else f"{error['param']} | {error['message']}"

    assert "Invalid JSON" in error("/v1/completions", raw=b'{"prompt": "x')
    assert "JSON dictionary" in error("/v1/completions", raw=b'[1, 2]')
    assert "max_tokens" in error("/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert "max_tokens" in error("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": -5})
    assert "temperature" in error("/v1/completions", {"prompt": "x", "temperature": "hot"})
    assert "mlxmoe.profile" in error("/v1/completions", {"prompt": "x", "mlxmoe": {"profile": "klingon"}})
    assert "messages" in error("/v1/chat/completions", {"max_tokens": 4})
    assert "prompt" in error("/v1/completions", {"max_tokens": 4})
    long = error("/v1/completions", {"prompt": "word " * 5000, "max_tokens": 4}, expect=413)  # (issue 29)
    assert long.startswith("prompt | prompt:") and "4096-token context" in long
    assert "messages[0].content" in error("/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client.completions.create(model="demo", prompt="x", max_tokens=0)
    assert server.json("GET", "/health")[2] == {"status": "ok"}


def open_stream(port, path, body, events=3, timeout=30):
    """A raw socket holding a streaming request once `events` SSE data lines came."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    got, tic = b"", time.monotonic()
    while got.count(b"data: ") < events:
        assert time.monotonic() - tic < timeout
        got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    return sock


def test_disconnect_mid_stream_frees_the_generation(server):
    before = server.json("GET", "/v1/mlxmoe/stats")[2]["server"]["requests"]
    sock = open_stream(server.port, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3000, "stream": True})
    sock.close()
    tic = time.monotonic()
    while time.monotonic() - tic < 30:  # the generation ends at its next token's write
        stats = server.json("GET", "/v1/mlxmoe/stats")[2]
        if stats["server"]["requests"] > before and not stats.get("busy"):
            break
        time.sleep(0.1)
    assert stats["server"]["requests"] == before + 1
    assert time.monotonic() - tic < 10  # 3000 tokens would take far longer
    assert chat(server, PROMPTS[2], max_tokens=4)


def copy_profiles(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    for name in ("italian", "english"):
        shutil.copy(ROOT / "profiles" / f"{name}.json", folder)
    return folder


def heldout_prompts(lang, n=None, max_chars=400):
    """bench/heldout.py's prompts(): held-out text of `lang` cut into prompts."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from heldout import prompts
    finally:
        sys.path.pop(0)
    return prompts(lang, n, max_chars=max_chars)


def test_profiles_matched_per_request_and_named(tmp_path):
    folder = copy_profiles(tmp_path)
    s = Server("--profiles", folder, "--cache-experts", 64)
    try:
        right = 0
        for lang, want in (("it", "italian"), ("en", "english")):
            for p in heldout_prompts(lang, 4):
                status, headers, body = s.json("POST", "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": p}], "max_tokens": 2})
                assert status == 200 and body["usage"]["mlxmoe"]["profile"] == headers["X-Mlxmoe-Profile"]
                right += headers["X-Mlxmoe-Profile"] == want
        assert right >= 7  # of 8 held-out prompts (bench/server_profiles.py measures more)
        status, headers, body = s.json("POST", "/v1/completions", {"prompt": "The cat", "max_tokens": 2,
                                                                   "mlxmoe": {"profile": "italian"}})
        assert headers["X-Mlxmoe-Profile"] == "italian"
        stats = s.json("GET", "/v1/mlxmoe/stats")[2]["server"]["profiles"]
        assert sum(stats.values()) == 9 and stats["italian"] >= 4
    finally:
        assert s.stop() == 0, "".join(s.lines[-20:])


def test_profiles_saved_every_n_requests_and_at_sigterm_mid_request(tmp_path):
    folder = copy_profiles(tmp_path)
    before = {n: ActivationProfile.load(folder / f"{n}.json").tokens_total for n in ("italian", "english")}
    s = Server("--profiles", folder, "--save-profiles", "--save-every", 2)
    try:
        for i in range(2):
            assert s.json("POST", "/v1/completions", {"prompt": "Il gatto", "max_tokens": 4,
                                                      "mlxmoe": {"profile": "italian"}})[0] == 200
        tic = time.monotonic()  # written every 2 requests, just after the second's response
        while ActivationProfile.load(folder / "italian.json").tokens_total == before["italian"]:
            assert time.monotonic() - tic < 10
            time.sleep(0.05)
        sock = open_stream(s.port, "/v1/completions", {"prompt": PROMPTS[6], "max_tokens": 3000, "stream": True,
                                                       "mlxmoe": {"profile": "english"}})
        assert s.stop(signal.SIGTERM) == 0
        sock.close()
    finally:
        s.proc.kill()
    after = {n: ActivationProfile.load(folder / f"{n}.json").tokens_total for n in ("italian", "english")}
    assert after["italian"] > before["italian"] and after["english"] > before["english"]
    s.drained.wait(10)
    assert any("; profiles english, italian from" in l and "(learning:" in l for l in s.lines
               if l.startswith("serving mlxmoe-demo")), s.lines
    assert any(l.startswith("saved ") and "english.json" in l for l in s.lines), s.lines  # what SIGTERM saved
    assert sorted(p.name for p in folder.iterdir()) == ["english.json", "italian.json"]  # no temp file left
