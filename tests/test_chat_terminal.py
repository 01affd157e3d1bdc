"""`mlxmoe chat` on a pseudo-terminal (the standard library's pty, as a user's terminal):
line editing and history through readline, Ctrl-C during a reply and at the prompt, Ctrl-D,
/save and /load, several lines as one message (issue 44, item 3). The bundled demo model,
short replies; every wait is bounded."""

import json
import os
import platform
import readline
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LEFT, UP = "\x1b[D", "\x1b[A"
CHAT = ["chat", "--model", "demo", "--max-tokens", "24"]
SELECT_CALLS = {"x86_64": {"23", "270"}, "aarch64": {"72"}}  # select, pselect6 in /proc/PID/syscall

# The chat, its standard input the pty (its controlling terminal, so that Ctrl-C is SIGINT),
# each token `delay` seconds apart (a slow model: Ctrl-C lands mid-reply).
START = """
import fcntl, sys, termios, time
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
delay = float(sys.argv[1])
if delay:
    from mlxmoe import cli
    feed = cli.Stops.feed
    cli.Stops.feed = lambda self, text: (time.sleep(delay), feed(self, text))[1]
from mlxmoe.cli import run
run(sys.argv[2:])
"""


def env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", "INPUTRC": "/dev/null"}


class Terminal:
    """A command on a pseudo-terminal: keys in, the screen's bytes out, each wait bounded."""

    def __init__(self, args, cwd, delay=0.0):
        self.fd, child = os.openpty()
        self.proc = subprocess.Popen([sys.executable, "-c", START, str(delay), *args], stdin=child, stdout=child,
                                     stderr=child, cwd=cwd, env=env(), start_new_session=True)
        os.close(child)
        self.seen = ""

    def send(self, keys):
        os.write(self.fd, keys.encode())

    def expect(self, text, timeout=60):
        """Wait for `text` on the screen; returns what came before it (and consumes both)."""
        end = time.monotonic() + timeout
        while text not in self.seen:
            left = end - time.monotonic()
            assert left > 0, f"no {text!r} within {timeout} s; the screen: {self.seen[-1500:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # EIO: the command closed the terminal
                    data = b""
                assert data, f"the command ended before {text!r}; the screen: {self.seen[-1500:]!r}"
                self.seen += data.decode("utf-8", "replace")
        before, _, self.seen = self.seen.partition(text)
        return before

    def waits_for_a_key(self, timeout=60):
        """Until the command sleeps in select() on the terminal (Linux; elsewhere half a second).
        CPython's readline looks at signals only when that select() is interrupted: a Ctrl-C that
        lands between the prompt's write and the select() (no hand is that fast, a loaded CI
        machine is) is acted on at the next key."""
        path = Path(f"/proc/{self.proc.pid}/syscall")
        calls = SELECT_CALLS.get(platform.machine())
        if calls is None or not path.exists():
            time.sleep(0.5)
            return
        end = time.monotonic() + timeout
        while path.read_text().split()[0] not in calls:
            assert time.monotonic() < end, f"the command did not wait for a key within {timeout} s"
            time.sleep(0.01)

    def exit_code(self, timeout=60):
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.fd)


@pytest.fixture
def chat(tmp_path):
    """Start chats in tmp_path (`demo` there is the bundled model); each is closed at the end."""
    started = []

    def start(*args, delay=0.0):
        t = Terminal([*CHAT, *args], tmp_path, delay)
        started.append(t)
        t.expect(">> ")
        return t

    yield start
    for t in started:
        if t.proc.poll() is None:
            t.close()


def saved(t, path):
    """/save `path` on terminal `t`; the messages it wrote."""
    t.send(f"/save {path}\r")
    t.expect(f"to {path}]")
    t.expect(">> ")
    return json.loads(Path(path).read_text())


def turn(t, message):
    t.send(message + "\r")
    t.expect(">> ")


def test_arrow_keys_edit_the_line_up_recalls_it_ctrl_c_says_how_to_leave_ctrl_d_leaves(chat, tmp_path):
    t = chat()
    turn(t, "Il gato dorme" + LEFT * 7 + "t")  # the cursor moved back into the line, a letter inserted
    turn(t, UP)  # the last line again
    messages = saved(t, tmp_path / "c.json")
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Il gatto dorme"] * 2
    assert all(m["content"] for m in messages if m["role"] == "assistant")
    t.waits_for_a_key()
    t.send("\x03")  # Ctrl-C at the prompt: the chat goes on
    t.expect("use /quit, /bye or Ctrl-D to leave")
    t.expect(">> ")
    assert saved(t, tmp_path / "d.json") == messages
    t.send("\x04")  # Ctrl-D
    assert t.exit_code() == 0


def test_ctrl_c_during_a_reply_keeps_the_conversation(chat, tmp_path):
    """Ctrl-C stops the reply; the message and its partial reply are dropped, the turns before
    are kept, and the next reply is the one a conversation without the dropped turn gets."""
    t = chat(delay=0.4)
    turn(t, "hello")
    t.send("Tell me a story\r")
    t.expect("Tell me a story\r\n")
    time.sleep(1.5)  # the reply has begun (tokens 0.4 s apart)
    t.send("\x03")
    t.expect("[interrupted: this message and its partial reply are dropped")
    t.expect(">> ")
    turn(t, "Come stai?")
    interrupted = saved(t, tmp_path / "a.json")
    t.send("/quit\r")
    assert t.exit_code() == 0
    assert [m["content"] for m in interrupted if m["role"] == "user"] == ["hello", "Come stai?"]
    plain = subprocess.run([sys.executable, "-m", "mlxmoe", *CHAT], capture_output=True, text=True, timeout=120,
                           input=f"hello\nCome stai?\n/save {tmp_path}/b.json\n", cwd=tmp_path, env=env())
    assert plain.returncode == 0, plain.stderr
    assert json.loads((tmp_path / "b.json").read_text()) == interrupted


def test_save_load_and_several_lines(chat, tmp_path):
    t = chat()
    if "libedit" in readline.__doc__:  # (macOS's editline has no bracketed paste: the other two ways)
        t.send("line one\\\r")
        t.expect("... ")
        turn(t, "line two")
    else:
        turn(t, "\x1b[200~line one\nline two\x1b[201~")  # a bracketed paste of two lines
    t.send("ab\\\r")  # a trailing backslash continues the message
    t.expect("... ")
    turn(t, "cd")
    for line in ('"""', "uno"):  # lines between \"\"\" (as Ollama)
        t.send(line + "\r")
        t.expect("... ")
    turn(t, 'due"""')
    first = saved(t, tmp_path / "a.json")
    assert [m["content"] for m in first if m["role"] == "user"] == ["line one\nline two", "ab\ncd", "uno\ndue"]
    turn(t, "/reset")
    t.send(f"/load {tmp_path}/a.json\r")
    t.expect("[loaded 6 messages")
    t.expect(">> ")
    assert saved(t, tmp_path / "b.json") == first  # the round trip
    turn(t, "hello")  # continues the loaded conversation
    assert saved(t, tmp_path / "c.json")[:6] == first
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "shape.json").write_text('[{"role": "user", "text": "hi"}]')
    for name, why in (("bad.json", "not valid JSON"), ("shape.json", "message 0 is not"), ("none.json", "not found")):
        t.send(f"/load {tmp_path / name}\r")
        said = next(line for line in t.expect(">> ").splitlines() if why in line)
        assert str(tmp_path / name) in said, said
    assert saved(t, tmp_path / "d.json") == saved(t, tmp_path / "c.json")  # a refused /load changed nothing
    t.send(f"/save {ROOT / 'mlxmoe' / 'demo' / 'x.json'}\r")  # never into the model's folder
    t.expect("the model's files are never written")
    assert not (ROOT / "mlxmoe" / "demo" / "x.json").exists()
    t.send("/bye\r")
    assert t.exit_code() == 0
