"""The correctness oracle: mlx-lm's own single-request greedy generation."""

from __future__ import annotations

from typing import Any

from mlx_lm import stream_generate


def mlx_lm_greedy(model: Any, tokenizer: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens mlx_lm.generate would produce, without the EOS token that ends them."""
    tokens: list[int] = []
    finish = None
    for response in stream_generate(model, tokenizer, prompt=list(prompt_ids), max_tokens=max_tokens):
        tokens.append(response.token)
        finish = response.finish_reason
    return tokens[:-1] if finish == "stop" else tokens
