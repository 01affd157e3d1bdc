"""mlxmoe: run Mixture-of-Experts models larger than memory by streaming experts from SSD."""

from .errors import MlxmoeError

__version__ = "0.1.0"
__all__ = ["DEMO_MODEL", "load", "LoadOptions", "generate", "stream_generate", "memory_plan", "Runtime",
           "MlxmoeError", "__version__"]
_API = ("load", "LoadOptions", "generate", "stream_generate", "memory_plan", "Runtime")


def __getattr__(name: str) -> object:
    # The API (and MLX with it) is imported on first use, so that `mlxmoe` the command
    # starts handling Ctrl-C and SIGTERM before the slow imports.
    if name in _API:
        from . import api

        return getattr(api, name)
    if name == "DEMO_MODEL":  # the bundled demo model's folder
        from .loader import DEMO_MODEL

        return DEMO_MODEL
    raise AttributeError(f"module 'mlxmoe' has no attribute {name!r}")
