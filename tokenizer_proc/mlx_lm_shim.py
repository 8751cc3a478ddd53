"""mlx-lm's modules reached without its package __init__, which imports MLX, its
generation stack and transformers: the front process never loads MLX (on a GPU that
would open a device context there too), and the launcher's model checks stay quick."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_MLX_LM_SHIM = "_kiln_mlx_lm"


def _shim() -> str:
    """The name of a stand-in package whose path is mlx-lm's (made once a process)."""
    if _MLX_LM_SHIM not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")  # a top-level spec: nothing is imported
        assert spec is not None and spec.submodule_search_locations is not None
        shim = types.ModuleType(_MLX_LM_SHIM)
        shim.__path__ = list(spec.submodule_search_locations)
        sys.modules[_MLX_LM_SHIM] = shim
    return _MLX_LM_SHIM


def mlx_lm_module(name: str) -> types.ModuleType:
    """A module of mlx-lm (`tokenizer_utils`, `tool_parsers.X`), imported through the shim."""
    return importlib.import_module(f"{_shim()}.{name}")


def mlx_lm_has_module(name: str) -> bool:
    """Whether mlx-lm ships a module of this dotted name (`models.llama`): found by Python's
    own finder, the module itself not run (its parent packages are: mlx-lm's `models`
    package is empty)."""
    return importlib.util.find_spec(f"{_shim()}.{name}") is not None
