"""Models by name: a Hugging Face repo pulled into the hub's cache (`mlxmoe pull`, mlx-lm's
download), found there again by its name (never the network), and listed.

A repo's checkpoint as `mlxmoe fit` needs it, without its weights: config.json and each
safetensors shard's header come from the hub (the client's range requests: a few hundred
KB in all), and each shard is written back as a sparse file: its header, then a hole as
long as its data. The loader indexes the shards and builds the model from them as from the
real files; no weight is downloaded, and the holes read as zeros without touching the disk
(so the disk is timed elsewhere, see forecast.scratch_disk_rate).
"""

import json
import os
import re
import shutil
import sys
from pathlib import Path

from ..errors import MlxmoeError

REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def is_repo_id(path_or_repo) -> bool:
    """Whether `path_or_repo` names a hub repo (owner/name), not a local folder."""
    text = str(path_or_repo)
    return not Path(text).expanduser().exists() and REPO_ID.fullmatch(text) is not None and not text.startswith(".")


def header_checkpoint(repo_id: str, dest, revision: str | None = None) -> Path:
    """Write `repo_id`'s config.json, index and sparse shards (real headers, no data) into the
    folder `dest`; return it. Needs the hub (network); raises MlxmoeError naming the repo."""
    from huggingface_hub import get_safetensors_metadata, hf_hub_download

    try:
        meta = get_safetensors_metadata(repo_id, revision=revision)
        config = hf_hub_download(repo_id, "config.json", revision=revision)
    except Exception as e:  # the hub client raises many types; all mean "could not get them"
        raise MlxmoeError(f"{repo_id}: could not read its config.json and safetensors headers from the Hugging "
                          f"Face hub ({e}); give a local model folder, or download it with `mlxmoe pull "
                          f"{repo_id}`") from None
    dest = Path(dest)
    shutil.copyfile(config, dest / "config.json")
    for name, shard in meta.files_metadata.items():
        if Path(name).name != name:
            raise MlxmoeError(f"{repo_id}: shard {name!r} lies in a subfolder; give a local model folder")
        header = {"__metadata__": shard.metadata} if shard.metadata else {}
        for tensor, info in shard.tensors.items():
            header[tensor] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        data = max((info.data_offsets[1] for info in shard.tensors.values()), default=0)
        with open(dest / name, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            f.truncate(8 + len(raw) + data)  # a hole: no byte of the weights is written or read
    if meta.sharded:
        index = {"metadata": meta.metadata or {}, "weight_map": meta.weight_map}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


def pull(repo_id: str, revision: str | None = None) -> Path:
    """Download `repo_id` into the hub's cache, the files mlx-lm's download takes (its
    allow_patterns), a progress bar on stderr; a file an interrupted pull left in part is
    continued from its bytes (resumable_blobs). Returns the snapshot folder; raises
    MlxmoeError naming the repo."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    bar, weights = progress_class(), [p for p in DEFAULT_ALLOW_PATTERNS if p.endswith(".safetensors")]
    try:
        # config and tokenizer first: a pull stopped after is a snapshot that says it is incomplete
        snapshot_download(repo_id, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS, ignore_patterns=weights,
                          tqdm_class=bar)
        resumable_blobs(repo_id, revision, weights, bar)
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                        tqdm_class=bar))
    except MlxmoeError:
        raise
    except Exception as e:  # the hub client raises many types (network, disk); all mean "not pulled"
        cause = e.__cause__ if isinstance(e.__cause__, RepositoryNotFoundError) else e  # (a dry run's wrapping)
        if isinstance(cause, GatedRepoError):
            raise MlxmoeError(f"{repo_id}: a gated repo; accept its terms on the hub and log in (`hf auth login`)") \
                from None
        if isinstance(cause, RepositoryNotFoundError):
            raise MlxmoeError(f"{repo_id}: no such repo on the Hugging Face hub (or a private one: log in with "
                              "`hf auth login`)") from None
        if isinstance(e, OfflineModeIsEnabled) or isinstance(e.__cause__, OfflineModeIsEnabled):
            raise MlxmoeError(f"cannot pull {repo_id}: HF_HUB_OFFLINE is set; unset it") from None
        root = e.__cause__ or e  # (the client wraps a lost connection in a cache miss)
        said = (str(root).splitlines() or [""])[0][:300]
        raise MlxmoeError(f"{repo_id}: the download stopped ({type(root).__name__}: {said}); run "
                          f"`mlxmoe pull {repo_id}` again to resume it") from None
    missing = missing_files(folder)
    if missing:
        raise MlxmoeError(f"{repo_id}: the hub's files lack {missing[0]} (named by the snapshot's index)")
    return folder


def resumable_blobs(repo_id, revision, allow_patterns, bar):
    """Download the files of `repo_id` that snapshot_download would (`allow_patterns`), and
    that the hub serves over plain HTTP, into the cache's blobs (named by their etag, as the
    hub client names them) through a `<etag>.partial` kept across runs: an interrupted pull
    continues it with a range request. (huggingface_hub >= 1.0 starts each file over, in a temp file it removes
    or a kill leaves behind.) snapshot_download then finds the blobs and links them into the
    snapshot. Xet-stored files are left to it: the xet client's chunk cache resumes them."""
    import fcntl

    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, snapshot_download
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import build_hf_headers

    files = snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns, dry_run=True, tqdm_class=bar)
    blobs = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"
    for file in (f for f in files if f.will_download):
        meta = get_hf_file_metadata(hf_hub_url(repo_id, file.filename, revision=file.commit_hash))
        blob = blobs / meta.etag
        if meta.xet_file_data is not None or blob.exists():
            continue
        blobs.mkdir(parents=True, exist_ok=True)
        with open(blobs / f"{meta.etag}.partial", "ab") as out:
            try:  # one pull writes it at a time
                fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise MlxmoeError(f"{repo_id}: another pull of it is running; wait for it") from None
            if meta.size is not None and out.tell() > meta.size:  # not this file's start after all
                out.truncate(0)
            http_get(meta.location, out, resume_size=out.tell(), headers=build_hf_headers(),
                     expected_size=meta.size, displayed_filename=file.filename, tqdm_class=bar)
            out.flush()  # whole before it has the blob's name
            os.replace(out.name, blob)


def progress_class():
    """The progress bar class for the hub client: tqdm's on a terminal; elsewhere (a log, a
    pipe) the same text as plain lines, at most one each 5 s per bar and one at its end (no
    \\r, no cursor moves, no blank lines); the client's dry runs and empty bars say nothing."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        return tqdm

    class Lines(tqdm):
        def __init__(self, *args, **kwargs):
            quiet = str(kwargs.get("desc", "")).startswith("[dry-run]")
            super().__init__(*args, **{**kwargs, "file": PlainLines(), "mininterval": 5.0, "position": 0,
                                       "disable": quiet or kwargs.get("disable", False)})

        def display(self, msg=None, pos=None):
            text = str(self) if msg is None else msg
            if not self.n and not self.total:  # a bar of nothing yet (the client's byte bars at the start)
                return True
            if text != getattr(self, "_said", None):  # the end's refresh repeats the last one
                self._said = text
                self.fp.write(text)
            return True

    return Lines


class PlainLines:
    """stderr as tqdm's plain lines write to it: each text a line of its own, without the
    carriage returns and cursor moves tqdm adds, blank ones dropped."""

    def write(self, text):
        text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]|\r", "", text).strip()
        if text:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def flush(self):
        sys.stderr.flush()


def snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The folder of `repo_id`'s snapshot in the hub's cache (pulled), or None; never the network."""
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # not a repo id the hub client takes: nothing of it in the cache
        return None
    return Path(config).parent if isinstance(config, str) else None


def missing_files(folder) -> list[str]:
    """What a snapshot `folder` lacks to be loaded, as an interrupted pull leaves it (the hub
    client links a file into the snapshot only once whole): the shards its index names that
    are not there, or with no index any safetensors file."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return [index.name]
        return sorted(s for s in shards if not (folder / s).is_file())
    return [] if any(folder.glob("*.safetensors")) else ["model.safetensors"]


def pulled(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of a pulled repo, whole; an MlxmoeError saying to run `mlxmoe pull`
    where it was never pulled or its pull was interrupted."""
    folder = snapshot(repo_id, revision)
    if folder is None:
        raise MlxmoeError(f"{repo_id}: not a local folder, and not downloaded; run `mlxmoe pull {repo_id}` first")
    missing = missing_files(folder)
    if missing:
        raise MlxmoeError(f"{repo_id}: its download is incomplete ({len(missing)} weight file(s) missing: "
                          f"{', '.join(missing[:3])}); run `mlxmoe pull {repo_id}` again (it resumes)")
    return folder


def cached_models() -> list[tuple[str, Path, int]]:
    """(repo id, snapshot folder, bytes on disk) of each model in the hub's cache holding a
    config.json (the newest snapshot of each repo); none where there is no cache."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:  # (the cache named now: scan_cache_dir's default is the one when it was first imported)
        repos = scan_cache_dir(constants.HF_HUB_CACHE).repos
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        revisions = [r for r in repo.revisions if (r.snapshot_path / "config.json").is_file()]
        if repo.repo_type == "model" and revisions:
            newest = max(revisions, key=lambda r: r.last_modified)
            out.append((repo.repo_id, newest.snapshot_path, newest.size_on_disk))
    return out
