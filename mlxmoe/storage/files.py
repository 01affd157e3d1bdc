"""Files mlxmoe writes appear whole or not at all.

Every writer goes through a temp file (or folder) beside its target, named
`<target name>.<pid>-<random>.tmp` (a folder: `.<target name>.<pid>-<random>.partial`),
then a rename. A run killed before the rename (SIGKILL, a power cut) leaves such a
partial beside the target; `clean_stale(target)` removes those whose writing process is
gone, and every writer calls it before it starts. A temp file gets the permissions a
plain open() would give (umask applied), a temp folder those of mkdir(). A symlink as
the target is kept: its target is written (write_target).

What a run may write at all is one rule, checked before any work (check_outputs): no output
is an input of the run, a file of the model folder, or another output of the run.
"""

import errno
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from ..errors import MlxmoeError

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo"  # the bundled demo model (mlxmoe.DEMO_MODEL)
DEMO_NAME = "demo"  # --model demo: the bundled model from any folder


def named_model(path_or_repo):
    """What a model argument stands for: DEMO_MODEL for None, and for "demo" unless the
    current directory holds a file or folder of that name (a local folder wins); else
    the argument as given."""
    if path_or_repo is None or (str(path_or_repo) == DEMO_NAME and not os.path.lexists(DEMO_NAME)):
        return DEMO_MODEL
    return path_or_repo


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


def write_target(path):
    """Where writing `path` lands: a symlink's final target (written there and the link
    kept, as cp and editors do); a symlink loop is an MlxmoeError."""
    try:
        return Path(os.path.realpath(path, strict=True))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MlxmoeError(f"cannot write {path}: a symlink loop ({e.strerror})") from None
    return Path(os.path.realpath(path))  # a new file, or a link to one: resolved as far as it goes


def model_folder(path_or_repo):
    """The local folder of a model as the loader finds it (None or "demo": the bundled demo
    model, see named_model; a Hugging Face repo id: its snapshot in the hub's cache, if
    downloaded), or None; never downloads anything."""
    path_or_repo = named_model(path_or_repo)
    if path_or_repo == DEMO_MODEL:
        return DEMO_MODEL
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path if (path / "config.json").exists() else None  # (else not a model: load says so)
    from .remote import snapshot

    return snapshot(str(path_or_repo))


def _paths(value):
    """An option's paths: none (not given), one, or several (a list)."""
    if value is None:
        return []
    return [v for v in value if v is not None] if isinstance(value, (list, tuple)) else [value]


def _inode(path):
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _folder_files(folder):
    """{(device, inode): path} of the files in `folder` and below, links followed (a Hugging
    Face snapshot's files are links into the cache's blobs)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            f = os.path.join(root, name)
            key = _inode(f)
            if key is not None:
                files.setdefault(key, f)
    return files


def folder_bytes(folder) -> int:
    """Bytes of the files in `folder` and below (links followed, each file once)."""
    return sum(os.stat(f).st_size for f in _folder_files(folder).values())


def check_outputs(outputs, inputs=None, updates=None):
    """The one rule for every file mlxmoe writes, checked before any work. `outputs` and
    `inputs` map an option's name to its path (None: not given; a list: several); an input
    folder is the model's. Refused, naming both: an output that is an input (one real
    path, or one device and inode), that lies in an input folder or is one of its files
    (a Hugging Face snapshot's links into its blobs included), or that is another output
    of the run; an empty path, a folder, a symlink loop, a folder that cannot be written
    (check_writable). `updates` {output: input} lets an output write back the input it
    names, read whole before the run (--save-profile over its --profile)."""
    updates, seen = updates or {}, []
    given = [(name, src) for name, value in (inputs or {}).items() for src in _paths(value)]
    folders = [(name, src, _folder_files(src)) for name, src in given if os.path.isdir(src)]
    for name, value in outputs.items():
        for out in _paths(value):
            if not str(out).strip():
                raise MlxmoeError(f"{name}: an empty path; give a file name")
            try:
                target = write_target(out)
            except MlxmoeError as e:
                raise MlxmoeError(f"{name}: {e}") from None
            if target.is_dir():
                raise MlxmoeError(f"cannot write {name} {out}: it is a folder")
            for other, path in seen:
                if same_file(target, path):
                    raise MlxmoeError(f"{other} {path} and {name} {out} are the same file: each output of a run "
                                      "needs its own")
            seen.append((name, out))
            for in_name, src in given:
                if in_name != updates.get(name) and same_file(target, src):
                    raise MlxmoeError(f"cannot write {name} {out}: it is the input {in_name} {src} of this run (it "
                                      "would be replaced); write to another file")
            for in_name, folder, files in folders:
                real = os.path.realpath(folder)
                if os.path.commonpath([target, real]) == real:
                    raise MlxmoeError(f"cannot write {name} {out}: it lies in {in_name} {folder}, an input of this "
                                      "run (the model's files are never written); write outside it")
                mine = files.get(_inode(target))
                if mine:
                    raise MlxmoeError(f"cannot write {name} {out}: it is the file {mine} of {in_name} {folder} "
                                      "(under another name), an input of this run; write to another file")
            try:
                check_writable(target)
            except MlxmoeError as e:
                raise MlxmoeError(f"{name}: {e}") from None


def check_writable(path):
    """Fail now, before a long run, if `path` cannot be written at the end (a folder, not a
    regular file, a missing or read-only folder: a temp file is made there and removed);
    remove the stale partials of `path` that killed runs left."""
    path = Path(path)
    if path.is_dir():
        raise MlxmoeError(f"cannot write {path}: it is a folder")
    if path.exists() and not path.is_file():
        raise MlxmoeError(f"cannot write {path}: not a regular file")
    fd, tmp = temp_beside(path)  # a probe: os.access says yes to root where a write fails (immutable)
    os.close(fd)
    os.unlink(tmp)


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
    """Write `data` (str, bytes, or a function given the binary file to write) to `path`
    through a temp file beside it, fsync'd, and a rename: a kill at any moment leaves the
    old file or the new one. A symlink at `path` is kept and its target written."""
    path = write_target(path)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "w" if isinstance(data, str) else "wb") as f:
            data(f) if callable(data) else f.write(data)
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
