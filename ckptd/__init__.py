"""ckptd: asynchronous, deduplicated, verified checkpoints for distributed PyTorch."""

from ckptd.errors import CkptdError

__version__ = "0.1.0"
__all__ = ["CkptdError", "__version__"]
