"""mlxmoe: run Mixture-of-Experts models larger than memory by streaming experts from SSD."""

from .api import generate, load, stream_generate
from .errors import MlxmoeError
from .loader import DEMO_MODEL

__version__ = "0.1.0"
__all__ = ["DEMO_MODEL", "load", "generate", "stream_generate", "MlxmoeError", "__version__"]
