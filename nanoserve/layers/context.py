"""What every layer is handed at construction: the device backend and the tensor-parallel group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.distributed.group import TPGroup

if TYPE_CHECKING:
    from nanoserve.backends.base import Backend


@dataclass(frozen=True)
class ModelContext:
    backend: "Backend"
    tp: TPGroup = field(default_factory=TPGroup)
