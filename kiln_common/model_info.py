"""Facts about the served model that request validation needs."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Hugging Face puts a huge sentinel in model_max_length when a tokenizer declares none.
_NO_LIMIT = 10**8
_FALLBACK_CONTEXT = 2048


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # The model maker's recommended sampling (generation_config.json): requests that leave
    # a field out get it, where the server takes the model's defaults (--sampling-defaults).
    sampling_defaults: dict[str, float] = field(default_factory=dict)


def load_model_info(name: str, model_path: str, tokenizer: Any,
                    context_length: int = 0) -> ModelInfo:
    """Read the context length and EOS ids from the model directory and its tokenizer.
    context_length: the server's own limit (--context-length; 0: the model's)."""
    config = read_json(Path(model_path) / "config.json")
    generation = read_json(Path(model_path) / "generation_config.json")
    return ModelInfo(
        name=name,
        path=model_path,
        context_len=served_context_len(config, tokenizer, context_length),
        vocab_size=_vocab_size(config, tokenizer),
        eos_token_ids=_eos_ids(config, generation, tokenizer),
        sampling_defaults=generation_sampling(generation),
    )


# The fields of generation_config.json a request can also set (vLLM's set): sampling,
# and max_new_tokens (a chat turn's default length).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "max_new_tokens")


def generation_sampling(generation: dict[str, Any]) -> dict[str, float]:
    """generation_config.json's request fields that hold numbers (its do_sample is not
    read, as vLLM does not: a config that sets a temperature means it)."""
    return {name: generation[name] for name in SAMPLING_FIELDS
            if isinstance(generation.get(name), (int, float))
            and not isinstance(generation.get(name), bool)}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; {} when the file is missing or holds no object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _vocab_size(config: dict[str, Any], tokenizer: Any) -> int:
    """Ids a request may hold: those the tokenizer knows and the model embeds (its
    embedding may be padded past the tokenizer, or, rarely, be smaller: an id past it
    would read outside the embedding)."""
    for section in (config, config.get("text_config") or {}):
        value = section.get("vocab_size")
        if isinstance(value, int) and value > 0:
            return min(value, len(tokenizer))
    return len(tokenizer)


def served_context_len(config: dict[str, Any], tokenizer: Any, context_length: int = 0) -> int:
    """The most tokens a request may hold: context_length (--context-length) where set,
    else the model's (config.json, then the tokenizer)."""
    context = _context_len(config, tokenizer)
    if context_length > context:
        logger.warning("--context-length %d is above the model's %d: positions past it are "
                       "sound only where the model's RoPE scaling covers them",
                       context_length, context)
    return context_length or context


def _context_len(config: dict[str, Any], tokenizer: Any) -> int:
    # Multimodal checkpoints keep the language model's settings under text_config.
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < _NO_LIMIT:
        return limit
    logger.warning("no context length in config.json or the tokenizer; assuming %d",
                   _FALLBACK_CONTEXT)
    return _FALLBACK_CONTEXT


def _eos_ids(config: dict[str, Any], generation: dict[str, Any],
             tokenizer: Any) -> tuple[int, ...]:
    ids: dict[int, None] = {}  # insertion-ordered set
    for value in (config.get("eos_token_id"), generation.get("eos_token_id"),
                  getattr(tokenizer, "eos_token_id", None)):
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int):
                ids.setdefault(token)
    return tuple(ids)
