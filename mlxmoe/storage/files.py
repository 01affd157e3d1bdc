"""Files mlxmoe writes appear whole or not at all.

Every writer goes through a temp file (or folder) beside its target, named
`<target name>.<pid>-<random>.tmp` (a folder: `.<target name>.<pid>-<random>.partial`),
then a rename. A run killed before the rename (SIGKILL, a power cut) leaves such a
partial beside the target; `clean_stale(target)` removes those whose writing process is
gone, and every writer calls it before it starts. A temp file gets the permissions a
plain open() would give (umask applied), a temp folder those of mkdir().
"""

import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from ..errors import MlxmoeError


def umask():
    """The process's file-mode creation mask (reading it means setting it: set it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _partial_name(name):
    """A regex for the partial files and folders of target `name`; group 1 is the pid."""
    n = re.escape(name)
    return re.compile(rf"(?:{n}\.(\d+)-[^/]*\.tmp|\.{n}\.(\d+)-[^/]*\.partial)")


def _alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: leave its files
        return True
    return True


def stale_partials(path):
    """The partial files and folders of `path` (our naming) whose writer has exited."""
    path = Path(path)
    pattern = _partial_name(path.name)
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and not _alive(int(m.group(1) or m.group(2))):
            out.append(entry)
    return sorted(out)


def clean_stale(path):
    """Remove what killed runs left beside `path` (see the module doc); returns them."""
    removed = []
    for entry in stale_partials(path):
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:
            pass  # not ours to remove after all (permissions): leave it
    return removed


def same_file(a, b):
    """Whether paths `a` and `b` name one file: the same path once resolved, or (links,
    other spellings) the same device and inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def check_writable(path, inputs=()):
    """Fail now, before a long run, if `path` cannot be written at the end, or is one of
    the command's `inputs` (writing it would replace what is being read); remove the stale
    partials of `path` that killed runs left."""
    path = Path(path)
    for src in inputs:
        if src is not None and same_file(path, src):
            raise MlxmoeError(f"cannot write {path}: it is the input {src} of this command (it would be "
                              "replaced); write to another file")
    if path.is_dir():
        raise MlxmoeError(f"cannot write {path}: it is a folder")
    if path.exists() and not path.is_file():
        raise MlxmoeError(f"cannot write {path}: not a regular file")
    if not path.parent.is_dir():
        raise MlxmoeError(f"cannot write {path}: folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise MlxmoeError(f"cannot write {path}: folder {path.parent} is not writable")
    clean_stale(path)


def temp_beside(path):
    """A temp file in `path`'s folder (so the final rename is atomic), with the
    permissions a plain open() would give; stale partials of `path` are removed first.
    Returns (fd, temp path)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise MlxmoeError(f"cannot write {path}: folder {path.parent} does not exist")
    clean_stale(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.{os.getpid()}-", suffix=".tmp")
    except OSError as e:
        raise MlxmoeError(f"cannot write {path}: {e.strerror or e}") from None
    os.chmod(tmp, 0o666 & ~umask())
    return fd, tmp


def temp_folder_beside(path):
    """A temp folder in `path`'s folder, with the permissions mkdir() would give (not
    mkdtemp's 0700); stale partials of `path` are removed first."""
    path = Path(path)
    if not path.parent.is_dir():
        raise MlxmoeError(f"cannot write {path}: folder {path.parent} does not exist")
    clean_stale(path)
    try:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}-", suffix=".partial"))
    except OSError as e:
        raise MlxmoeError(f"cannot write {path}: {e.strerror or e}") from None
    os.chmod(tmp, 0o777 & ~umask())
    return tmp


def write_atomic(path, data):
    """Write `data` (str or bytes) to `path` through a temp file beside it and a rename."""
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def regular_file(path, what):
    """`path` if it is a regular file (a FIFO or device would hang or never end a read),
    else an MlxmoeError that names it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise MlxmoeError(f"{what} not found: {path}") from None
    except OSError as e:
        raise MlxmoeError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise MlxmoeError(f"{what} {path} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise MlxmoeError(f"{what} {path} is not a regular file")
    return path


def read_lines(path, what):
    """The lines of a user's text file, or an MlxmoeError that names it."""
    path = regular_file(path, what)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except UnicodeDecodeError:
        raise MlxmoeError(f"{path}: not a UTF-8 text file") from None
    except OSError as e:
        raise MlxmoeError(f"cannot read {what} {path}: {e.strerror or e}") from None


def read_bytes(path, what, limit):
    """The bytes of the regular file `path`, refused (naming it) above `limit` bytes."""
    path = regular_file(path, what)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise MlxmoeError(f"{path}: {size} bytes is too large for a {what} (at most {limit})")
            return f.read(limit + 1)
    except OSError as e:
        raise MlxmoeError(f"cannot read {what} {path}: {e.strerror or e}") from None


def read_json(path, what, limit):
    """The JSON value in the regular file `path` (UTF-8, at most `limit` bytes), or an
    MlxmoeError that names it."""
    data = read_bytes(path, what, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MlxmoeError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise MlxmoeError(f"{path}: not valid JSON ({str(e)[:200]})") from None
