"""Every architecture family through the device's served path (on MLX's CUDA backend: the
paged kernel, compiled decode, in-place pool, the gated delta kernel, shifted
convolutions, fused projections, fast decode blocks), against mlx-lm's own forward.

On a GPU, float32 kernels other than mlx-lm's sum in other orders, so a greedy token may
differ from mlx-lm's at a near tie and the sequences part. The check is therefore
teacher-forced: mlx-lm's model (unmodified, no cache) runs once over the prompt and the
tokens kiln chose, and each chosen token must be one mlx-lm's logits rank best within a
small tolerance. A wrong window, state or slot moves logits far more than that. The
oracle is mlx-lm's forward in float32 on the CPU stream: on the H200, mlx-lm's own
float32 forward of the GPT-OSS model below put its MLP outputs ~0.85 off the CPU's at
some token counts and not others (cause open: not its router's TF32 rounding;
docs/benchmarks.md, session 29, and bench/moe_gather_probe.py), which made a served
row's right tokens look wrong.

The families are tests.families' with every width doubled, so heads are 32 wide (what
the CUDA kernels take). On the CPU the same test runs the plain-MLX path (where tokens
equal mlx-lm's anyway), which keeps the check itself honest.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine
from tests.families import FAMILIES, RECURRENT_FAMILIES, VOCAB, config_of
from worker_proc.decode_backend import choose_decode_backend
from worker_proc.decode_block import speed_up_decode_blocks
from worker_proc.depthwise_conv import replace_depthwise_convs
from worker_proc.fused_projections import fuse_projections
from worker_proc.gated_delta_cuda import install_gated_delta_kernel, uses_gated_delta
from worker_proc.memory import probe_attention_specs
from worker_proc.offset_norms import sum_offset_norms
from worker_proc.paged_attention import kernel_available
from worker_proc.row_positions import give_rows_their_positions

# Widths doubled (head sizes 16 -> 32, hidden 64 -> 128, ...); kernel sizes, counts and
# state sizes kept.
WIDE_KEYS = {"hidden_size", "intermediate_size", "head_dim", "linear_key_head_dim",
             "linear_value_head_dim", "query_pre_attn_scalar", "v_head_dim", "qk_nope_head_dim",
             "qk_rope_head_dim", "kv_lora_rank", "moe_intermediate_size",
             "shared_expert_intermediate_size", "shared_intermediate_size",
             "intermediate_size_mlp", "mamba_head_dim", "mamba_d_head", "mamba_d_ssm",
             "block_dim", "block_ff_dim"}
# Gemma 3n's forward without a cache computes its KV-shared layers' own K/V, which with a
# cache (as served, and as mlx_lm.generate runs it) they take from earlier layers: its
# no-cache forward is no oracle for served tokens (tests/test_families.py checks it
# against mlx_lm.generate).
ALL = sorted(set({**FAMILIES, **RECURRENT_FAMILIES}) - {"gemma3n"})
# A chosen token's logit may trail mlx-lm's best by this share of the row's largest. On
# the H200, gpt_oss took the runner-up of a 0.0087 near-tie (row max ~2: 0.4%; the CPU
# replay of mlx-lm's logits shows the tie, docs/benchmarks.md session 13), while a wrong
# window, state or slot trails by 0.4-1.5: 1% keeps a 20x margin below the bugs.
TOLERANCE = 1e-2


def wide_config(name: str) -> dict[str, Any]:
    def widen(config: dict[str, Any]) -> dict[str, Any]:
        return {k: (widen(v) if isinstance(v, dict) else 2 * v if k in WIDE_KEYS and v else v)
                for k, v in config.items()}

    return widen(config_of(name))


def build_wide(name: str, dtype: mx.Dtype = mx.float32) -> Any:
    config = wide_config(name)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _prompts(lengths: tuple[int, ...] = (3, 40, 70, 17)) -> list[list[int]]:
    rng = np.random.default_rng(1200)
    return [rng.integers(5, VOCAB, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("name", ALL)
def test_every_family_served_picks_tokens_mlx_lm_ranks_best(name):
    _served_tokens_rank_best(name, mx.float32, TOLERANCE)


# bf16 models (the tensor-core decode kernel's dtype): kiln's bf16 forward against
# mlx-lm's float32 forward of the same (bf16-rounded) weights, which rounds nowhere in
# between (a logit near 2 is held to ~1% in bf16); a wrong window or slot trails by
# 20-75% of the row's largest.
BF16_TOLERANCE = 5e-2


@pytest.mark.skipif(not kernel_available(), reason="bf16 serving is the GPU's (slow on the CPU)")
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text", "gpt_oss", "mixtral"])
def test_bf16_families_served_through_the_tensor_core_kernel(name):
    """In bf16, decode attention takes the tensor-core kernel where the device has tensor
    cores (sliding windows and GPT-OSS's sinks included): tokens mlx-lm ranks best."""
    from worker_proc.paged_attention import tensor_cores_available

    _served_tokens_rank_best(name, mx.bfloat16, BF16_TOLERANCE,
                             expect_mma=tensor_cores_available())


@pytest.mark.skipif(not kernel_available(), reason="bf16 serving is the GPU's (slow on the CPU)")
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite", "mistral4"])
def test_bf16_mla_families_served_through_the_latent_kernel(name, monkeypatch):
    """In bf16, MLA layers' decode takes the latent kernel where the device has tensor
    cores (its widened 64-wide latent, 4 heads: a partial tile): tokens mlx-lm ranks
    best."""
    from worker_proc import decode_backend
    from worker_proc.paged_attention import tensor_cores_available

    launched = []
    kernel = decode_backend.paged_latent_attention
    monkeypatch.setattr(decode_backend, "paged_latent_attention",
                        lambda *a, **k: launched.append(a[0].shape) or kernel(*a, **k))
    _served_tokens_rank_best(name, mx.bfloat16, BF16_TOLERANCE)
    assert bool(launched) == tensor_cores_available()


# mlx-lm's MoE layers sort their (token, expert) pairs by expert from 64 pairs on
# (switch_layers: a sorted gather_mm, on CUDA a grouped GEMM), which the 4-row test above
# meets only in prefill. Here 40 rows of 2 experts decode through it too, and 64-token
# chunks prefill through it, with remainders of 33, 56 and 70 tokens among others.
SORTED_MOE_LENGTHS = tuple(33 + 7 * i for i in range(40))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_moe_families_served_through_sorted_expert_batches(name, dtype):
    """MoE models with batches past mlx-lm's sorting threshold, in prefill chunks and
    in decode steps: tokens mlx-lm ranks best."""
    if dtype == mx.bfloat16 and not kernel_available():
        pytest.skip("bf16 serving is the GPU's (slow on the CPU)")
    _served_tokens_rank_best(name, dtype, TOLERANCE if dtype == mx.float32 else BF16_TOLERANCE,
                             chunk_size=64, lengths=SORTED_MOE_LENGTHS)


def _served_tokens_rank_best(name: str, dtype: mx.Dtype, tolerance: float,
                             expect_mma: bool | None = None, chunk_size: int = 16,
                             lengths: tuple[int, ...] = (3, 40, 70, 17)) -> None:
    oracle, served = build_wide(name, dtype), build_wide(name, dtype)  # the same weights
    oracle.set_dtype(mx.float32)  # on the CPU (see above), whose gather_mm is float32's only
    if uses_gated_delta(served):
        install_gated_delta_kernel()
    if kernel_available():  # as the worker loads it there
        replace_depthwise_convs(served)
        fuse_projections(served)
        speed_up_decode_blocks(served, residual_in_gemm=True)
    sum_offset_norms(served)
    give_rows_their_positions(served)
    backend = choose_decode_backend(probe_attention_specs(served))
    if expect_mma is not None:
        assert (getattr(backend, "mma", None) is not None) == expect_mma, backend
    engine = InProcessEngine(served, chunk_size=chunk_size, compile_decode=backend.compiles,
                             overlap="ahead")
    prompts = _prompts(lengths)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    for i, prompt in enumerate(prompts):
        chosen = results[f"r{i}"].token_ids
        assert len(chosen) == 16, f"{name} r{i}"
        with mx.stream(mx.cpu):
            logits = oracle(mx.array([prompt + chosen]))[0].astype(mx.float32)
            mx.eval(logits)
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(chosen)]
        picked = mx.take_along_axis(rows, mx.array(chosen)[:, None], axis=1)[:, 0]
        best = rows.max(axis=1)
        slack = tolerance * mx.maximum(mx.abs(rows).max(axis=1), 1.0)
        trailing = (best - picked) > slack
        assert not trailing.any().item(), (
            f"{name} r{i}: tokens at {np.flatnonzero(np.array(trailing)).tolist()} trail mlx-lm's "
            f"best by {np.array(best - picked)[np.array(trailing)].tolist()}")
