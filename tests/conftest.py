import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from mlxmoe import synthetic


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
