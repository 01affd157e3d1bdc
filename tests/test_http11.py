"""`mlxmoe serve` speaks HTTP/1.1 (issue 44, item 4; issue 43, item 4): the openai client keeps
one connection for 100 requests, models.retrieve, HEAD, chunked request bodies, pipelined
requests, the legacy completions' integer logprobs, Anthropic's stream usage, idle and slow
connections closed, and a client gone stops its generation within one token. The server runs
in this process on the demo model (so the tests count its connections and tokens); it binds
127.0.0.1 on a free port, and every loop and wait is bounded."""

import http.client
import json
import select
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from mlx_lm import server as mlx_server

import mlxmoe
from mlxmoe import server as mlxmoe_server

openai = pytest.importorskip("openai")

IDLE = 2.0  # the server's --idle-timeout here
PROMPT = "The cat sat on"


@pytest.fixture(scope="module")
def served():
    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL, memory_budget="46MB")
    stock = mlx_server.stream_generate
    generator = mlxmoe_server.response_generator(model, tokenizer, "mlxmoe-demo", max_tokens=8)
    httpd = mlxmoe_server.http_server(generator, "127.0.0.1", 0, idle_timeout=IDLE)
    port = httpd.server_port
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
    yield SimpleNamespace(httpd=httpd, port=port, tokenizer=tokenizer, client=client, generator=generator)
    httpd.shutdown()
    httpd.server_close()
    generator.stop_and_join()
    mlx_server.stream_generate = stock
    model.expert_cache.close()


def connect(served, timeout=30):
    return socket.create_connection(("127.0.0.1", served.port), timeout=timeout)


def read_until(sock, ends, seconds=30):
    """What the server sends until `ends(data)` or it closes; within `seconds`."""
    data, tic = b"", time.monotonic()
    while not ends(data):
        assert time.monotonic() - tic < seconds, data[-300:]
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def closed_within(sock, seconds):
    """Seconds until the server closed `sock` (EOF or reset), or None if it did not within `seconds`."""
    tic = time.monotonic()
    while time.monotonic() - tic < seconds:
        if select.select([sock], [], [], 0.05)[0]:
            try:
                if sock.recv(65536) == b"":
                    return time.monotonic() - tic
            except ConnectionError:
                return time.monotonic() - tic
    return None


def test_the_openai_client_keeps_one_connection_for_100_requests(served):
    client, before, tic = served.client, served.httpd.connections, time.monotonic()
    messages = [{"role": "user", "content": "hi"}]
    texts = set()
    for i in range(100):
        assert time.monotonic() - tic < 240
        if i % 4 == 0:
            texts.add(client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text)
        elif i % 4 == 1:
            assert client.chat.completions.create(model="demo", messages=messages, max_tokens=2).choices[0].message
        elif i % 4 == 2:  # (mlx-lm's answer without a Content-Length: chunked)
            assert client.get(f"http://127.0.0.1:{served.port}/health", cast_to=object) == {"status": "ok"}
        else:
            assert client.models.list().data[0].id == "mlxmoe-demo"
    assert len(texts) == 1 and texts != {""}  # (greedy: the same answer each time)
    assert served.httpd.connections - before == 1  # the first request's, kept: 0 reconnects


def test_a_stream_read_to_its_end_keeps_the_connection(served):
    """A chunked stream ends with its last chunk; the next request takes the same connection.
    (The openai client breaks off at "data: [DONE]", before that last chunk, and so closes.)"""
    before = served.httpd.connections
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": PROMPT}), ("/v1/messages", {"messages": [
                           {"role": "user", "content": "hi"}]})):
        conn.request("POST", path, body=json.dumps(dict(body, max_tokens=3, stream=True)))
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Transfer-Encoding") == "chunked"
        assert r.read().rstrip().endswith(b"[DONE]" if path != "/v1/messages" else b'{"type": "message_stop"}')
    conn.close()
    assert served.httpd.connections - before == 1


def test_models_retrieve(served):
    model = served.client.models.retrieve("mlxmoe-demo")
    assert model.id == "mlxmoe-demo" and model.object == "model"
    with pytest.raises(openai.NotFoundError, match="not found"):
        served.client.models.retrieve("gpt-4")


def test_head_answers_as_get_without_a_body_and_keeps_the_connection(served):
    before = served.httpd.connections
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    for path in ("/health", "/v1/models", "/v1/mlxmoe/stats", "/v1/models/mlxmoe-demo"):
        conn.request("HEAD", path)
        head = conn.getresponse()
        assert head.status == 200 and head.read() == b"", path
        conn.request("GET", path)
        got = conn.getresponse()
        assert got.status == 200 and json.loads(got.read())
        assert head.getheader("Content-Type") == got.getheader("Content-Type")
    conn.request("HEAD", "/v1/chat/completions")
    assert conn.getresponse().status == 405
    conn.close()
    assert served.httpd.connections - before == 1


def chunked_post(sock, path, chunks):
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                 + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")


def test_a_chunked_body_is_read_as_its_content_length_twin(served):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    want = served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    for _ in range(2):  # (twice on one connection: the first body was read to its end)
        conn.request("POST", "/v1/completions", body=iter([body[:7], body[7:30], body[30:]]), encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == want
    conn.close()


def test_a_chunked_body_over_the_limit_is_refused_at_its_size_line(served):
    with connect(served) as sock:  # (the limit here: 1 MiB; a 2 MiB chunk announced, never sent)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n200000\r\n")
        tic = time.monotonic()
        data = read_until(sock, lambda d: b"\r\n\r\n" in d and d.endswith(b"}"))
        assert time.monotonic() - tic < 1
    assert data.startswith(b"HTTP/1.1 413") and b"Connection: close" in data and b"request body" in data


@pytest.mark.parametrize("raw", [b"zz\r\n{}\r\n0\r\n\r\n", b"-1\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n"])
def test_a_malformed_chunked_body_gets_400_and_a_closed_connection(served, raw):
    with connect(served) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + raw)
        data = read_until(sock, lambda d: False)  # (to the server's close)
    assert data.startswith(b"HTTP/1.1 400") and b"chunk" in data, data


def test_pipelined_requests_each_get_their_answer(served):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    post = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    with connect(served) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        data = read_until(sock, lambda d: d.count(b"HTTP/1.1 200") == 3 and d.endswith(b"0\r\n\r\n"))
    assert data.count(b"HTTP/1.1 200") == 3 and b"text_completion" in data and b"mlxmoe-demo" in data


def test_integer_logprobs_in_the_legacy_shape(served):
    r = served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and logprob <= 0
        assert top[token] == pytest.approx(logprob) == pytest.approx(max(top.values()))  # greedy: the top one
    stop = next(t for t in lp.tokens[1:] if t.strip())  # (a stop sequence: a later token's text)
    r = served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                         stop=[stop])
    assert r.choices[0].finish_reason == "stop" and "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    eos = served.tokenizer.eos_token_ids
    r = served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                         logit_bias={str(t): 100 for t in eos})  # (it ends at once)
    lp = r.choices[0].logprobs
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == "" and lp.tokens == lp.token_logprobs == []
    r = served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0)
    assert r.choices[0].logprobs.top_logprobs is None and len(r.choices[0].logprobs.token_logprobs) == 2
    for bad, stream in ((12, False), (-1, False), (2, True)):
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, logprobs=bad, stream=stream)
    with pytest.raises(openai.BadRequestError, match="logprobs"):  # (the stream would carry none)
        served.client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=2, logprobs=True, stream=True)


def test_anthropic_stream_reports_the_prompt_and_output_tokens(served):
    body = {"model": "claude", "max_tokens": 6, "system": "Be brief.",
            "messages": [{"role": "user", "content": "Il gatto"}]}
    prompt = served.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Il gatto"}], add_generation_prompt=True)
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("POST", "/v1/messages", body=json.dumps(body))
    whole = json.loads(conn.getresponse().read())
    conn.request("POST", "/v1/messages", body=json.dumps(dict(body, stream=True)))
    r = conn.getresponse()
    assert r.getheader("Transfer-Encoding") == "chunked"
    lines = r.read().decode().splitlines()
    conn.close()
    events = {json.loads(x[6:])["type"]: json.loads(x[6:]) for x in lines if x.startswith("data: ")}
    text = "".join(json.loads(x[6:])["delta"]["text"] for x in lines if '"content_block_delta"' in x)
    start, delta = events["message_start"]["message"]["usage"], events["message_delta"]["usage"]
    assert start["input_tokens"] == len(prompt) == whole["usage"]["input_tokens"] == delta["input_tokens"]
    assert delta["output_tokens"] == whole["usage"]["output_tokens"] == 6  # (6: max_tokens; the demo runs on)
    assert text == whole["content"][0]["text"]


def test_an_idle_connection_is_closed_after_the_timeout(served):
    with connect(served) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_until(sock, lambda d: d.endswith(b"0\r\n\r\n")).startswith(b"HTTP/1.1 200")
        waited = closed_within(sock, IDLE + 5)
    assert waited is not None and IDLE - 0.5 <= waited <= IDLE + 3


def test_idle_connections_give_back_their_threads(served):
    """(Before the timeout, 200 idle clients held 224 threads for ever.)"""
    before = set(threading.enumerate())  # (an earlier test's connection thread may end meanwhile)
    socks = [connect(served) for _ in range(20)]
    tic = time.monotonic()
    while len(new := set(threading.enumerate()) - before) < 20:  # a thread for each connection
        assert time.monotonic() - tic < 10
        time.sleep(0.05)
    assert all(closed_within(sock, IDLE + 3) is not None for sock in socks)
    while any(t.is_alive() for t in new):
        assert time.monotonic() - tic < IDLE + 10, sum(t.is_alive() for t in new)
        time.sleep(0.05)
    for sock in socks:
        sock.close()


def test_headers_sent_a_byte_at_a_time_are_cut_off(served):
    """A slowloris client: each byte within the timeout, the headers never done."""
    with connect(served) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        tic = time.monotonic()
        waited = None
        for _ in range(40):  # (10 s of headers at most)
            try:
                sock.sendall(b"X")
            except ConnectionError:
                break
            if closed_within(sock, 0.25) is not None:
                break
        waited = time.monotonic() - tic
    assert waited <= IDLE + 3


def counting_stream(monkeypatch, sock, close_at):
    """mlxmoe's stream_generate, as the server calls it, closing the client's connection as it
    yields token `close_at`; what it yields after that is in `after` (tokens generated for nobody)."""
    stock, seen = mlxmoe_server.stream_generate, SimpleNamespace(closed=False, after=[], tokens=0)

    def generate(*args, **kwargs):
        for i, response in enumerate(stock(*args, **kwargs)):
            seen.tokens += 1
            if seen.closed:
                seen.after.append(response.token)
            if i == close_at:
                sock.close()
                seen.closed = True
            yield response
    monkeypatch.setattr(mlxmoe_server, "stream_generate", generate)
    return seen


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_stops_its_generation_within_one_token(served, monkeypatch, stream):
    sock, before = connect(served), served.generator.served
    seen = counting_stream(monkeypatch, sock, close_at=8)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": stream}).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    tic = time.monotonic()
    while served.generator.served == before:  # (the request's generation has ended)
        assert time.monotonic() - tic < 30, "the generation still runs 30 s after its client went away"
        time.sleep(0.01)
    assert seen.closed, "the generation ended before its client went away"
    assert len(seen.after) <= 1, f"{len(seen.after)} tokens generated after the client went away"
    assert seen.tokens <= 10  # (of the 300 asked)
