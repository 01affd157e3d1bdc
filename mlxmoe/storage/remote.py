"""A Hugging Face repo's checkpoint as `mlxmoe fit` needs it, without its weights.

config.json and each safetensors shard's header come from the hub (the client's range
requests: a few hundred KB in all), and each shard is written back as a sparse file: its
header, then a hole as long as its data. The loader indexes the shards and builds the model
from them as from the real files; no weight is downloaded, and the holes read as zeros
without touching the disk (so the disk is timed elsewhere, see forecast.scratch_disk_rate).
"""

import json
import re
import shutil
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
                          f"Face hub ({e}); give a local model folder") from None
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
