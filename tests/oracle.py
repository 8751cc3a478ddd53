"""The correctness oracle: mlx-lm's own single-request greedy generation."""

from __future__ import annotations

from typing import Any

from mlx_lm import stream_generate
from mlx_lm.generate import generate_step


def mlx_lm_greedy(model: Any, tokenizer: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens mlx_lm.generate would produce, without the EOS token that ends them."""
    tokens: list[int] = []
    finish = None
    for response in stream_generate(model, tokenizer, prompt=list(prompt_ids), max_tokens=max_tokens):
        tokens.append(response.token)
        finish = response.finish_reason
    return tokens[:-1] if finish == "stop" else tokens


def model_fingerprint(model: Any) -> str:
    """What mlx-lm's output depends on, for telling models apart: every parameter's name,
    shape, dtype and sum, the classes of every module (a layer swapped for another of
    the same parameters, as the served rewrites do, runs other code) and each module's
    plain settings (a sliding window, a RoPE base, an eps, its model args: llama with
    sliding layers has llama's very parameters and classes)."""
    import hashlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    sums = mx.stack([mx.sum(v.astype(mx.float32)) for _, v in params]).tolist() if params else []
    h = hashlib.sha256()
    for (name, v), total in zip(params, sums):
        h.update(f"{name}:{v.shape}:{v.dtype}:{total!r};".encode())
    for name, module in model.named_modules():
        h.update(f"{name}={type(module).__module__}.{type(module).__qualname__}"
                 f"{_settings(module)};".encode())
    return h.hexdigest()


def _settings(module: Any) -> list[tuple[str, str]]:
    """A module's own attributes that are settings (scalars, strings, dataclasses such as
    mlx-lm's ModelArgs, and sequences of those), by name: what its code reads besides
    its parameters. Other objects are left out (their repr may hold an address)."""
    import dataclasses

    def plain(v: Any) -> bool:
        if v is None or isinstance(v, (bool, int, float, str)):
            return True
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return dataclasses.is_dataclass(v) and not isinstance(v, type)

    return sorted((k, repr(v)) for k, v in vars(module).items()
                  if not k.startswith("_") and plain(v))


# (model fingerprint, prompt) -> the longest greedy run asked for so far: a shorter one is
# its prefix (generate_step's steps do not depend on max_tokens).
_RUNS: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def mlx_lm_tokens(model: Any, prompt: list[int], n: int) -> list[int]:
    """mlx_lm.generate's greedy tokens (its generate_step, no EOS: ids run to n), memoised
    across tests: many build the same family model and ask about the same prompts."""
    import mlx.core as mx

    key = (model_fingerprint(model), tuple(prompt))
    run = _RUNS.get(key)
    if run is None or len(run) < n:
        run = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
        _RUNS[key] = run
    return run[:n]


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
