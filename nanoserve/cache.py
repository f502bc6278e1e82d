"""Where nanoserve keeps what it builds once and reuses: compiled CPU kernels, random checkpoints."""
from __future__ import annotations

import os


def cache_root() -> str:
    """$NANOSERVE_CACHE, else ~/.cache/nanoserve."""
    return os.environ.get("NANOSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanoserve")
