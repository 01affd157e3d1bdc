import contextlib
import io
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A suite started in the background by a non-interactive shell (`.ci/run &`) inherits Ctrl-C
# ignored, as would every server and command the tests stop with it: give SIGINT back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest

import synthetic


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return synthetic.train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """checkpoint(arch, quant=None, layout="stacked", dtype="float32", **kw) -> folder, built once per session."""
    built = {}

    def make(arch, quant=None, layout="stacked", dtype="float32", **kw):
        key = (arch, quant, layout, dtype, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"{arch}-{quant or dtype}-{layout}")
            built[key] = synthetic.build_checkpoint(path, arch, quant=quant, layout=layout, dtype=dtype,
                                                    tokenizer_dir=tokenizer_dir, **kw)
        return built[key]

    return make


def fs_type(path):
    """The filesystem type of `path` from /proc/mounts (longest mount point that holds it)."""
    path, best = str(Path(path).resolve()), ("", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mnt, kind = line.split()[1:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                    best = (mnt, kind)
    except OSError:
        pass
    return best[1]


@pytest.fixture
def on_disk(tmp_path):
    """on_disk(folder) -> a copy of folder on a real filesystem (O_DIRECT works there, not
    on every tmpfs): under tmp_path, or /var/tmp when tmp_path is tmpfs."""
    made = []

    def copy(src):
        base = tmp_path
        if fs_type(tmp_path) == "tmpfs":
            base = Path(tempfile.mkdtemp(dir="/var/tmp"))
            made.append(base)
        dst = base / f"copy{len(list(base.iterdir()))}"
        shutil.copytree(src, dst)
        return dst

    yield copy
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def run_cli(*args):
    """(exit code, stdout, stderr) of the `mlxmoe` entry point run in this process (its
    SIGTERM handler is put back after)."""
    from mlxmoe.cli import run

    out, err = io.StringIO(), io.StringIO()
    old_argv, old_term = sys.argv, signal.getsignal(signal.SIGTERM)
    sys.argv = ["mlxmoe", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run()
                code = 0
            except SystemExit as e:
                code = e.code
    finally:
        sys.argv = old_argv
        signal.signal(signal.SIGTERM, old_term)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def cli():
    """cli(*args) -> (exit code, stderr) of `mlxmoe` in this process; never a traceback."""
    def call(*args):
        code, _, err = run_cli(*args)
        assert "Traceback" not in err
        return code, err
    return call
