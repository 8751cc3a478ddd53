"""Pointing mlx-lm's model modules at kiln's version of a function they import (their
attention call, the gated delta models' q/k normalisation)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def repoint(name: str, originals: tuple[Callable[..., Any], ...],
            replacement: Callable[..., Any], skip: ModuleType | None = None) -> int:
    """Set `name` to `replacement` in every loaded mlx_lm.models module (but `skip`) whose
    `name` is one of `originals`; returns how many. Modules imported later keep theirs."""
    routed = 0
    for module_name, module in list(sys.modules.items()):
        if (module_name.startswith("mlx_lm.models.") and module is not skip
                and any(getattr(module, name, None) is f for f in originals)):
            setattr(module, name, replacement)
            routed += 1
    return routed
