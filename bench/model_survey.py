"""Which of mlx-lm's model files kiln serves exactly: every module under mlx_lm/models
built as a tiny random float32 model, three prompts (3, 40 and 17 tokens, 16-token
windows crossed) served through kiln's engine in one process against mlx_lm.generate's
greedy tokens. Rerun it when mlx-lm gains model files.

    python bench/model_survey.py [NAMES ...]     # default: every model file

Each model's config is tests/families.py's where it has that model type; else its
common tiny one, plus generic values for the fields most ModelArgs require (GENERIC)
and, where a module needs more, its own (SPECIFIC; multimodal wrappers: WRAPS,
TEXT_CONFIGS). Per model one line: OK, MISMATCH (which prompts), ERROR (kiln failed
serving), or SKIP (the config does not build, mlx-lm itself fails, or the model does not
run on this backend); a model kiln's pool cannot page runs on mlx-lm's own caches, as
the worker falls back to, and says "on its own caches" and why. Session 29 found
Mamba's dropped states, Mistral 3's mask-only windows, Gemma 4's and IQuest-Loop-Coder's
shared K/V and three start-up crashes this way (docs/benchmarks.md).

Not a test: configs are guesses per field name, and a model that needs a field no guess
covers is skipped. Each model runs in a subprocess (some crash MLX outright on the CPU:
phi3small).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.families import (_COMMON, FAMILIES, RECURRENT_FAMILIES, UNPAGED, VOCAB,  # noqa: E402
                            WINDOW, config_of)

NOT_MODELS = {"__init__", "base", "cache", "switch_layers", "rope_utils", "activations",
              "pipeline", "bitlinear_layers", "gated_delta", "ssm", "mla"}
GENERIC: dict[str, Any] = dict(
    head_dim=16, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, n_shared_experts=1, shared_expert_intermediate_size=32,
    num_key_value_heads=2, layer_norm_eps=1e-5, norm_eps=1e-5, layer_norm_epsilon=1e-5,
    norm_epsilon=1e-5, n_layer=4, n_head=4, n_embd=64, n_ctx=4096, n_positions=4096,
    n_inner=96, d_model=64, n_heads=4, n_layers=4, num_layers=4, kv_lora_rank=32,
    q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, rotary_dim=16, partial_rotary_factor=0.5, attention_bias=False,
    mlp_bias=False, decoder_sparse_step=1, mlp_only_layers=[], sliding_window=WINDOW,
    rope_scaling=None, hidden_act="silu", use_qk_norm=False, num_heads=4)
_SLIDING = ["sliding_attention", "full_attention"] * 2
_ROPE_BY_KIND = {"sliding_attention": {"rope_theta": 10000.0},
                 "full_attention": {"rope_theta": 10000.0}}
_GRANITE = dict(logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
                residual_multiplier=1.0)
SPECIFIC: dict[str, dict[str, Any]] = {
    "gemma3": dict(text_config=dict(_COMMON, **FAMILIES["gemma3_text"])),  # Gemma 3's wrapper
    "granite": _GRANITE, "granitemoe": _GRANITE,
    "minicpm": dict(dim_model_base=64, scale_depth=1.0, scale_emb=1.0),
    "stablelm": dict(use_qkv_bias=False),
    "gpt_neox": dict(rotary_emb_base=10000, rotary_pct=0.25),
    "ernie4_5": dict(use_bias=False),
    "ernie4_5_moe": dict(use_bias=False, moe_num_experts=4, moe_k=2, moe_layer_start_index=1),
    "bailing_moe": dict(num_shared_experts=1),
    "dbrx": dict(ffn_config={"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000}),
    "exaone_moe": dict(num_shared_experts=1, layer_types=_SLIDING,
                       is_moe_layer=[False, True, True, True]),
    "lfm2_moe": dict(use_expert_bias=True, num_dense_layers=1, conv_bias=False, conv_L_cache=3,
                     full_attn_idxs=[1, 3], layer_types=["conv", "full_attention"] * 2),
    "apertus": dict(post_norm=False, qk_norm=True),
    "baichuan_m1": dict(sliding_window_layers=[0, 2], conv_window=2),
    "afmoe": dict(layer_types=_SLIDING), "gear": dict(layer_types=_SLIDING),
    "deepseek_v2": dict(num_key_value_heads=4, topk_method="greedy", n_group=1, topk_group=1,
                        rope_scaling={"type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 1024,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                      "mscale_all_dim": 1.0}),
    "minimax": dict(shared_intermediate_size=32, rotary_dim=8),
    "hunyuan": dict(attention_bias=False, moe_topk=2, num_shared_expert=1,
                    use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False,
                    cla_share_factor=1, moe_intermediate_size=32,
                    rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "olmo_hybrid": dict(linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_conv_kernel_dim=4, linear_allow_neg_eigval=False,
                        layer_types=["linear_attention", "full_attention"] * 2),
    "bailing_moe_linear": dict(num_shared_experts=1, layer_group_size=2, group_norm_size=1,
                               topk_group=1),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[1, 0, 1, 0], moe_layer_freq=[0, 1, 1, 1],
                          add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
                          sliding_window_size=WINDOW, topk_method="noaux_tc",
                          scoring_func="sigmoid", layernorm_epsilon=1e-5,
                          swa_rope_theta=10000.0, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, swa_head_dim=16, swa_v_head_dim=16),
    "glm_moe_dsa": dict(index_head_dim=16, index_n_heads=2, index_topk=8, q_lora_rank=24,
                        topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "lille-130m": dict(block_size=4096, n_kv_heads=2),
    "llama4_text": dict(intermediate_size_mlp=96, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity",
                          ffn_hidden_size=96, moe_topk=2, expert_ffn_hidden_size=32,
                          zero_expert_num=2, mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mellum": dict(layer_types=_SLIDING, rope_parameters=_ROPE_BY_KIND),
    "minicpm3": dict(dim_model_base=64, scale_depth=1.0, scale_emb=1.0,
                     rope_scaling={"original_max_position_embeddings": 4096}),
    "openelm": dict(num_transformer_layers=4, model_dim=64, ffn_dim_divisor=16,
                    num_query_heads=[4] * 4, num_kv_heads=[2] * 4, ffn_multipliers=[1.5] * 4),
    "spark2_5": dict(rope_parameters=_ROPE_BY_KIND, hidden_act="gelu"),
    "step3p5": dict(num_attention_groups=2, layer_types=_SLIDING, moe_num_experts=4,
                    moe_top_k=2, moe_intermediate_size=32, share_expert_dim=32),
    "bailing_hybrid": dict(num_shared_experts=1, layer_group_size=2, group_norm_size=1),
    "qwen": dict(kv_channels=16, intermediate_size=192),
    "plamo": dict(n_shared_head=2),
    "phi3small": dict(dense_attention_every_n_layers=2, ff_intermediate_size=96,
                      gegelu_limit=20.0),
}


# Multimodal wrappers whose language model is another model file's: its config as their
# text_config (mlx-lm loads them as text models).
WRAPS = {"gemma4": "gemma4_text", "kimi_k25": "deepseek_v3", "kimi_vl": "deepseek_v3",
         "lfm2-vl": "lfm2", "pixtral": "llama", "prism_hadamard_qwen35": "qwen3_5",
         "qwen2_vl": "qwen2", "qwen3_5_moe": "qwen3_next", "qwen3_vl": "qwen3",
         "qwen3_vl_moe": "qwen3_moe"}
# Wrappers with a language model of their own: its text_config.
TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "kimi_k3": dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_token=2,
        moe_intermediate_size=32, first_k_dense_replace=1, attn_res_block_size=2,
        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 16,
                            "num_heads": 4, "short_conv_kernel_size": 4}),
    "muse_spark": dict(
        head_dim=16, post_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0},
        layer_rope_theta=[10000.0, 0.0, 10000.0, 10000.0],
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW,
        final_logit_softcapping=30.0, output_multiplier=1.0, num_local_experts=4,
        num_experts_per_tok=2, moe_hidden_size=32, moe_intermediate_size=32),
}


def config_for(name: str) -> dict[str, Any]:
    """The tests' own config where tests/families.py has the model type, else the guess."""
    tested = [f for f, c in {**FAMILIES, **RECURRENT_FAMILIES, **UNPAGED}.items()
              if c["model_type"] == name]
    if tested:
        return config_of(tested[0])
    if name in WRAPS:
        inner = config_for(WRAPS[name])
        return {**inner, "model_type": name, "text_config": inner}
    if name in TEXT_CONFIGS:
        return {"model_type": name, "text_config": {**_COMMON, **TEXT_CONFIGS[name]}}
    return {**_COMMON, **GENERIC, **SPECIFIC.get(name, {}), "model_type": name}


def survey_one(name: str) -> str:
    """One model's verdict (run in a subprocess of its own)."""
    import mlx.core as mx
    import numpy as np

    from tests.engine_driver import InProcessEngine
    from tests.test_families import mlx_lm_tokens
    from worker_proc.layer_kinds import UnsupportedModelError
    from worker_proc.row_positions import give_rows_their_positions

    try:
        module = importlib.import_module(f"mlx_lm.models.{name}")
        if not (hasattr(module, "ModelArgs") and hasattr(module, "Model")):
            return "SKIP not a model"
        config = config_for(name)
        missing = [p for p, v in inspect.signature(module.ModelArgs).parameters.items()
                   if v.default is inspect.Parameter.empty and p not in config]
        if missing:
            return f"SKIP config lacks {missing}"
        mx.random.seed(0)
        model = module.Model(module.ModelArgs.from_dict(config))
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    except BaseException as exc:  # noqa: BLE001 - a module may even exit on import
        return f"SKIP does not build: {type(exc).__name__}: {exc}"[:200]
    give_rows_their_positions(model)  # as the worker loads it (mlx-lm's code at one offset)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, VOCAB - 1, size=n).tolist() for n in (3, 40, 17)]
    try:
        want = [mlx_lm_tokens(model, p, 10) for p in prompts]
    except Exception as exc:  # noqa: BLE001
        return f"SKIP mlx-lm fails: {type(exc).__name__}: {exc}"[:200]
    refused = ""
    try:
        engine = InProcessEngine(model, chunk_size=12, max_prefill_tokens=48)
    except UnsupportedModelError as exc:  # the worker's fallback: mlx-lm's own caches
        refused = f" on its own caches (not paged: {exc})"
        engine = InProcessEngine(model, chunk_size=12, max_prefill_tokens=48, own_caches=True)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 10, [])
    results = engine.run_until_idle()
    got = [results[f"r{i}"] for i in range(len(prompts))]
    errors = [r.error for r in got if r.error]
    if errors:
        return f"ERROR {errors[0]}"[:200]
    same = [r.token_ids == w for r, w in zip(got, want)]
    return ("OK" if all(same) else f"MISMATCH {same}") + refused


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="model files (default: all)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the subprocess's own call
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a model")
    args = p.parse_args()
    if args.one:
        print(json.dumps(survey_one(args.one)))
        return 0
    import mlx_lm

    models = Path(mlx_lm.__file__).parent / "models"
    names = args.names or sorted(f.stem for f in models.glob("*.py") if f.stem not in NOT_MODELS)
    for name in names:
        try:
            done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                                  text=True, timeout=args.timeout)
            lines = done.stdout.strip().splitlines()
            verdict = (json.loads(lines[-1]) if done.returncode == 0 and lines
                       else f"SKIP crashed (exit {done.returncode})")
        except subprocess.TimeoutExpired:
            verdict = f"SKIP over {args.timeout:.0f} s"
        print(f"{name:24} {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
