"""`mlxmoe pull`, `mlxmoe list` and `--model OWNER/NAME`, against a fake Hugging Face hub: a
local HTTP server speaking the hub's API as huggingface_hub's snapshot_download calls it
(repo info, file tree, resolve with ranges). No real network."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
REPO = "someone/tiny-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 10 << 20  # huggingface_hub writes what it receives in chunks of this (constants.DOWNLOAD_CHUNK_SIZE)


class FakeHub(ThreadingHTTPServer):
    """The hub's routes for `repos` {repo id: folder}, on 127.0.0.1 at a free port. The first
    GET of the file `stall` sends `stall_bytes` of it, then holds the connection until
    `release` (as a network that stops mid-file); `requests` logs (method, path, Range)."""
    daemon_threads = True

    def __init__(self, repos, stall=None, stall_bytes=0):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos, self.stall, self.stall_bytes = repos, stall, stall_bytes
        self.requests, self.stalled, self.release = [], threading.Event(), threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class HubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.route(body=False)

    def do_GET(self):
        self.route(body=True)

    def route(self, body):
        hub, path = self.server, unquote(urlsplit(self.path).path)
        hub.requests.append((self.command, path, self.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+|/tree/([^/]+))?/?", path) \
            or re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        folder = hub.repos.get(m.group(1)) if m else None
        if folder is None:
            return self.reply(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        if path.startswith("/api/") and m.group(2) is None:  # repo info
            info = {"id": m.group(1), "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
            return self.reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if path.startswith("/api/"):  # the file tree
            tree = [{"type": "file", "path": f, "size": (folder / f).stat().st_size, "oid": sha(folder / f)[:40]}
                    for f in files]
            return self.reply(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        name = m.group(2)
        if name not in files:
            return self.reply(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, body)
        self.send_file(folder / name, body)

    def send_file(self, path, body):
        hub, data = self.server, path.read_bytes()
        start = int(re.fullmatch(r"bytes=(\d+)-", self.headers["Range"]).group(1)) if self.headers.get("Range") else 0
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha(path)}"', "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if body and path.name == hub.stall and not hub.stalled.is_set():
            self.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data[:hub.stall_bytes])
            self.wfile.flush()
            hub.stalled.set()
            hub.release.wait(60)
            self.close_connection = True
            return
        self.reply(206 if start else 200, data[start:], headers, body)

    def reply(self, status, data, headers, body):
        self.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def hub(tmp_path):
    """hub(repos, stall=None, stall_bytes=0) -> a running FakeHub; stopped after the test."""
    made = []

    def start(repos, **kw):
        server = FakeHub(repos, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
        return server

    yield start
    for server in made:
        server.release.set()
        server.shutdown()
        server.server_close()


def hub_env(tmp_path, server):
    return {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
            "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_ETAG_TIMEOUT": "10", "HF_HUB_DOWNLOAD_TIMEOUT": "30", "PYTHONPATH": str(ROOT),
            "HF_TOKEN": "", "NO_COLOR": "1"}


def pull(env, repo=REPO, timeout=120):
    r = subprocess.run([sys.executable, "-m", "mlxmoe", "pull", repo], env=env, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A 4-layer, 64-expert qwen3_moe in two shards, the first over huggingface_hub's 10 MiB
    write chunk (so an interrupted download leaves bytes on disk to resume from)."""
    import synthetic

    tokenizer = synthetic.train_tokenizer(tmp_path_factory.mktemp("tok"))
    return synthetic.build_checkpoint(tmp_path_factory.mktemp("big-moe"), "qwen3_moe", tokenizer_dir=tokenizer,
                                      config_overrides={"num_experts": 64, "moe_intermediate_size": 128,
                                                        "num_hidden_layers": 4, "num_experts_per_tok": 4},
                                      max_shard_bytes=16 << 20)


def snapshot_of(env, repo=REPO):
    return Path(env["HF_HUB_CACHE"]) / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT


def cli_json(env, *args):
    r = subprocess.run([sys.executable, "-m", "mlxmoe", *args, "--json"], env=env, capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_pull_shows_progress_and_the_model_runs_by_name(checkpoint, hub, tmp_path, monkeypatch):
    """A pull: its files byte for byte, a progress bar on stderr as lines (not a terminal:
    no \\r); then `list` shows it with its shape and what fits, and `--model OWNER/NAME`
    generates what the folder generates, from the local copy (the hub offline)."""
    import huggingface_hub.constants

    src = checkpoint("qwen3_moe", quant="4bit", max_shard_bytes=100_000)
    server = hub({REPO: src})
    env = hub_env(tmp_path, server)
    code, out, err = pull(env)
    assert code == 0, err
    folder = snapshot_of(env)
    assert f"pulled {REPO}" in out and str(folder) in out
    assert "Fetching" in err and "\r" not in err and "\x1b" not in err
    assert re.search(r"^model-00001-of-\d+\.safetensors: 100%", err, re.M), err  # a line a weight file
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(p.name for p in folder.glob("*.safetensors")) == shards
    for f in src.iterdir():
        assert (folder / f.name).read_bytes() == f.read_bytes(), f.name
    rows = {r["name"]: r for r in cli_json(env, "list", "--backend", "cpu")}
    config = json.loads((src / "config.json").read_text())
    row = rows[REPO]
    assert (row["moe_layers"], row["experts_per_layer"], row["top_k"]) == (
        config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"])
    assert row["path"] == str(folder) and row["disk_bytes"] >= sum(f.stat().st_size for f in src.iterdir())
    assert row["fits"] == "all_resident" and 0 < row["minimum_budget"] < row["all_resident_budget"] <= row["memory"]
    assert "demo" in rows and "error" not in rows["demo"]
    # by name, in this process: the hub's cache, never the network (conftest sets HF_HUB_OFFLINE)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    asked = len(server.requests)
    args = ("--prompt", "hello", "--max-tokens", "8", "--backend", "cpu", "--cache-experts", "4")
    by_name = run_cli("generate", "--model", REPO, *args)
    by_path = run_cli("generate", "--model", src, *args)
    assert by_name[0] == 0 and by_path[0] == 0, by_name[2]
    assert by_name[1] == by_path[1] and by_name[1].strip()
    code, out, err = run_cli("fit", "--model", REPO, "--disk-gbps", "2", "--memory-budget", "1GB", "--json")
    assert code == 0 and json.loads(out)["model"] == str(folder), err  # the pulled copy, not the hub's headers
    code, out, err = run_cli("list")
    assert code == 0 and re.search(rf"^{REPO}  .*  3 x 8 experts, top-2  qwen3_moe  every expert resident$", out,
                                   re.M), out
    assert len(server.requests) == asked
    # a machine that holds the minimum but not every expert, then not even the minimum
    from mlxmoe.backend import Backend

    for memory, fits, said in ((row["minimum_budget"] + 1, "streaming", "streams experts (min "),
                               (row["minimum_budget"] - 1, "no", "over this machine's memory")):
        monkeypatch.setattr(Backend, "memory", lambda self, m=memory: m)
        code, out, err = run_cli("list", "--backend", "cpu", "--json")
        assert code == 0 and {r["name"]: r for r in json.loads(out)}[REPO]["fits"] == fits, err
        assert said in run_cli("list", "--backend", "cpu")[1]


def test_a_missing_repo_is_a_clear_error(hub, tmp_path, checkpoint, cli):
    """pull of a repo the hub lacks says so; --model of a repo never pulled says to pull it
    (no connection error; fit, which reads a repo's headers from the hub, after trying);
    pull refuses a name that is not a repo id."""
    server = hub({REPO: checkpoint("qwen3_moe", quant="4bit")})
    code, out, err = pull(hub_env(tmp_path, server), "nobody/nothing")
    assert code == 2 and "error: nobody/nothing: no such repo on the Hugging Face hub" in err, err
    assert "Traceback" not in err
    for command in (("generate", "--prompt", "hi"), ("info",), ("fit", "--disk-gbps", "1")):
        code, err = cli(*command, "--model", "nobody/nothing")
        assert code == 2 and "mlxmoe pull nobody/nothing`" in err, err  # (fit: after the hub's headers)
    code, err = cli("pull", "not a repo")
    assert code == 2 and "not a Hugging Face repo id" in err


def test_an_interrupted_pull_resumes_and_is_not_used_half_done(big_checkpoint, hub, tmp_path):
    """The network stops mid-shard and the user presses Ctrl-C: the pull ends at once and
    says to pull again; the half snapshot is refused by name (info, list) with that advice;
    the next pull asks the shard from the bytes on disk (a range) and completes it, whole."""
    index = json.loads((big_checkpoint / "model.safetensors.index.json").read_text())
    stall = sorted(set(index["weight_map"].values()))[0]
    size = (big_checkpoint / stall).stat().st_size
    assert size > CHUNK + (1 << 20)
    server = hub({REPO: big_checkpoint}, stall=stall, stall_bytes=CHUNK + (1 << 20))
    env = hub_env(tmp_path, server)
    proc = subprocess.Popen([sys.executable, "-m", "mlxmoe", "pull", REPO], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    blobs = Path(env["HF_HUB_CACHE"]) / "models--someone--tiny-moe" / "blobs"
    deadline = time.monotonic() + 60
    while not ((snapshot_of(env) / "config.json").exists() and server.stalled.is_set()
               and any(p.stat().st_size >= CHUNK for p in blobs.glob("*.partial"))):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    tic = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and time.monotonic() - tic < 10, err
    assert f"interrupted; run `mlxmoe pull {REPO}` again to resume" in err
    assert not (snapshot_of(env) / stall).exists()
    r = subprocess.run([sys.executable, "-m", "mlxmoe", "info", "--model", REPO], env=env, capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and f"{REPO}: its download is incomplete" in r.stderr, r.stderr
    assert f"missing: {stall}, " in r.stderr and f"run `mlxmoe pull {REPO}` again (it resumes)" in r.stderr
    row = {r["name"]: r for r in cli_json(env, "list", "--backend", "cpu")}[REPO]
    assert "incomplete" in row["error"] and "moe_layers" not in row
    server.release.set()
    before = len(server.requests)
    code, out, err = pull(env)
    assert code == 0, err
    gets = [rng for method, path, rng in server.requests[before:] if method == "GET" and path.endswith("/" + stall)]
    assert gets == [f"bytes={CHUNK}-"], server.requests[before:]
    for f in big_checkpoint.iterdir():
        assert (snapshot_of(env) / f.name).read_bytes() == f.read_bytes(), f.name
    info = cli_json(env, "info", "--model", REPO, "--backend", "cpu")
    assert (info["moe_layers"], info["experts_per_layer"], info["top_k"]) == (4, 64, 4)
