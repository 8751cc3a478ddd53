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


# A rounding difference can flip greedy's pick only where the two best logits are this
# close (relative to their size): fused projections and residual adds inside GEMMs round
# differently from mlx-lm's separate ops (BLAS builds disagree in the last bit), and
# promise mlx-lm's tokens up to such near-ties, not bit patterns.
NEAR_TIE = 1e-4


def divergence_off_a_tie(model: Any, prompt_ids: list[int], got: list[int], want: list[int],
                         eos: list[int]) -> str | None:
    """None if `got` is `want`, or first leaves it where mlx-lm's logits for the two
    picks are within NEAR_TIE (what follows a tie is not compared); else what differs."""
    import mlx.core as mx

    t = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if got == want:
        return None
    logits = model(mx.array([list(prompt_ids) + want[:t]]))[0, -1].astype(mx.float32)
    picks = [seq[t] if t < len(seq) else max(eos, key=lambda e: logits[e].item())
             for seq in (got, want)]
    a, b = (logits[p].item() for p in picks)
    if abs(a - b) <= NEAR_TIE * max(1.0, abs(a), abs(b)):
        return None
    return f"at token {t}: {picks[0]} (logit {a:.6f}) instead of {picks[1]} (logit {b:.6f})"
