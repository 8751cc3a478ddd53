"""Does a model need code that ships with it? The launcher asks before starting anything.

Such code (transformers' `auto_map` classes, mlx-lm's `model_file`) runs with the server's
rights, so it is refused unless the user passed --trust-remote-code; with the flag, the
tokenizer, detokenizer and worker pass `trust_remote_code=True` to their loaders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln_common.model_info import read_json
from tokenizer_proc.mlx_lm_shim import mlx_lm_has_module


class UntrustedModelError(Exception):
    """The model needs remote code and --trust-remote-code was not given."""


def check_remote_code(model_dir: str | Path, trusted: bool) -> None:
    """Raise UntrustedModelError with an explanation when the model needs code we may not run."""
    reasons = remote_code_reasons(Path(model_dir))
    if reasons and not trusted:
        listed = "\n".join(f"  - {reason}" for reason in reasons)
        raise UntrustedModelError(
            f"the model in {model_dir} needs code that ships with it:\n{listed}\n"
            "That code would run with this user's rights, so it is off by default. If you "
            "trust the model's author, start again with --trust-remote-code.")


def remote_code_reasons(model_dir: Path) -> list[str]:
    """Why the model needs remote code, one line per reason; empty when it does not."""
    config = read_json(model_dir / "config.json")
    tokenizer_config = read_json(model_dir / "tokenizer_config.json")
    reasons = []
    if config.get("auto_map"):
        reasons.append("config.json has an 'auto_map' (model classes defined by the model)")
    if tokenizer_config.get("auto_map"):
        reasons.append("tokenizer_config.json has an 'auto_map' (a tokenizer class defined "
                       "by the model)")
    if config.get("model_file"):
        reasons.append(f"config.json names a model file to import ({config['model_file']!r})")
    elif isinstance(config.get("model_type"), str) and not mlx_lm_knows(config):
        reasons.append(f"mlx-lm has no built-in architecture for model_type "
                       f"{config['model_type']!r}")
    return reasons


def mlx_lm_knows(config: dict[str, Any]) -> bool:
    """Whether mlx-lm builds this architecture itself (its own lookup, remappings included).
    A model_type with a module of its own in mlx-lm's models package is found without
    importing mlx-lm: that import (transformers with it) is most of the launcher's time
    before it starts the processes (docs/benchmarks.md, session 48)."""
    if _ships_model_module(config["model_type"]):
        return True
    from mlx_lm.utils import _get_classes  # heavy: for remapped or unknown types only

    try:
        _get_classes(config)
    except ValueError:  # mlx-lm's "Model type ... not supported."
        return False
    return True


def _ships_model_module(model_type: str) -> bool:
    """Whether mlx-lm's models package holds a module named model_type (what its lookup
    imports for a type it does not remap; a remapped one leads to another of its own
    modules, so mlx-lm knows the type either way), mlx-lm's package unimported; a name
    that is not an identifier is left to mlx-lm's own lookup."""
    return model_type.isidentifier() and mlx_lm_has_module(f"models.{model_type}")
