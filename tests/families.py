"""Tiny random float32 models of mlx-lm's architecture families, built from mlx-lm's own
model classes (their make_cache() says each layer's kind), for tests against
mlx_lm.generate. Windows are shorter than the test prompts, so windows are crossed."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

VOCAB = 512
WINDOW = 16  # sliding windows and chunks shorter than most test prompts

_COMMON = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=10000.0,
               max_position_embeddings=4096, tie_word_embeddings=False)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "llama_sliding": dict(model_type="llama", sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "phi3": dict(model_type="phi3"),
    "gemma2": dict(model_type="gemma2", head_dim=16, query_pre_attn_scalar=16,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=WINDOW, sliding_window_pattern=2,
                        rope_local_base_freq=10000.0),
    "gpt_oss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "original_max_position_embeddings": 4096}),
    "ministral3": dict(model_type="ministral3", head_dim=16, sliding_window=WINDOW,
                       layer_types=["sliding_attention", "full_attention"] * 2,
                       rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                        "llama_4_scaling_beta": 0.1,
                                        "original_max_position_embeddings": 4096}),
    # Ministral 3 inside Mistral 3's multimodal wrapper, which has no make_cache of its
    # own: mlx-lm gives every layer a KVCache and the sliding layers a window mask.
    "mistral3": dict(model_type="mistral3", text_config=dict(
        _COMMON, model_type="ministral3", head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                         "llama_4_scaling_beta": 0.1,
                         "original_max_position_embeddings": 4096})),
    # Gemma 4: its last layers keep no cache and attend an earlier layer's K/V.
    "gemma4_text": dict(model_type="gemma4_text", head_dim=16, global_head_dim=32,
                        num_key_value_heads=1, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "full_attention"] * 2,
                        num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
                        hidden_size_per_layer_input=16, rope_parameters=None),
    # Gemma 3n: its last layers reuse earlier layers' K/V (keys_and_values(), their cache).
    "gemma3n": dict(model_type="gemma3n", text_config=dict(
        _COMMON, model_type="gemma3n_text", head_dim=16, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, sliding_window=WINDOW, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=16,
        altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=8, rope_local_base_freq=10000.0)),
    # IQuest-Loop-Coder: a second pass attends the first pass's K/V through its own caches.
    "iquestloopcoder": dict(model_type="iquestloopcoder", head_dim=16,
                            loop_window_size=WINDOW),
    # Nemotron-NAS (Llama-3.3-Nemotron-Super): attention and FFN pruned per layer; mlx-lm
    # makes a cache for the layer whose attention is a linear map, which it never fills.
    "nemotron-nas": dict(model_type="nemotron-nas", block_configs=[
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.5}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"replace_with_linear": True}}]),
    # AFM 7: its last layers attend the last cached layer's keys_and_values() without a
    # cache, their queries placed by the keys' count.
    "afm7": dict(model_type="afm7", hidden_dim=128, num_layers=4, num_kv_reuse_layers=2,
                 num_heads=4, num_kv_heads=2),
    "olmo3": dict(model_type="olmo3", sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"] * 2),
    "cohere2": dict(model_type="cohere2", head_dim=16, layer_norm_eps=1e-5, sliding_window=WINDOW,
                    sliding_window_pattern=2, logit_scale=0.5),
    "exaone4": dict(model_type="exaone4", head_dim=16, sliding_window=WINDOW,
                    sliding_window_pattern="LG", rope_scaling=None),
    "deepseek_v3": dict(model_type="deepseek_v3", num_key_value_heads=4, kv_lora_rank=32,
                        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                        topk_group=1, routed_scaling_factor=1.0, topk_method="noaux_tc",
                        scoring_func="sigmoid", norm_topk_prob=True),
    # DeepSeek-V3.2's sparse attention: an indexer picks each query's top index_topk keys
    # (8: picked from the prompts' 9th token on, prefill and decode).
    "deepseek_v32": dict(model_type="deepseek_v32", num_key_value_heads=4, kv_lora_rank=32,
                         q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                         moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                         num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                         topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                         index_n_heads=2, index_head_dim=16, index_topk=8),
    # MiniMax M3's block-sparse attention: an indexer keeps each query's top 2 blocks of 4
    # keys (its own among them) in every other layer.
    "minimax_m3_vl": dict(model_type="minimax_m3_vl", text_config=dict(
        _COMMON, intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, head_dim=32, partial_rotary_factor=0.5,
        layer_types=["full_attention", "sparse_attention"] * 2, index_n_heads=2,
        index_head_dim=16, index_block_size=4, index_topk_blocks=2)),
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", num_key_value_heads=4, kv_lora_rank=32,
                          q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
                          qk_nope_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                          n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                          n_group=1, topk_group=1, routed_scaling_factor=1.0,
                          norm_topk_prob=True),
    "mistral4": dict(model_type="mistral4", num_key_value_heads=4, kv_lora_rank=32,
                     q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                     moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                     routed_scaling_factor=1.0, norm_topk_prob=True,
                     rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                      "llama_4_scaling_beta": 0.1,
                                      "original_max_position_embeddings": 4096}),
    "llama4_text": dict(model_type="llama4", text_config=dict(
        model_type="llama4_text", **{**_COMMON, "num_hidden_layers": 4}, head_dim=16,
        intermediate_size_mlp=96, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=WINDOW, no_rope_layers=[1, 1, 1, 0],
        use_qk_norm=True, attention_bias=False, rope_scaling=None)),
}

# Recurrent-state and hybrid families (mlx-lm's ArraysCache layers), tiny.
RECURRENT_FAMILIES: dict[str, dict[str, Any]] = {
    "mamba": dict(model_type="mamba", intermediate_size=64, state_size=16, num_hidden_layers=2,
                  conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8),
    "jamba": dict(model_type="jamba", attn_layer_offset=1, attn_layer_period=2,
                  expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4,
                  mamba_d_state=16, mamba_expand=1, mamba_dt_rank=8, num_experts=4,
                  num_experts_per_tok=2),
    "recurrent_gemma": dict(model_type="recurrent_gemma", head_dim=16, conv1d_width=4,
                            logits_soft_cap=30.0, attention_window_size=WINDOW,
                            block_types=["recurrent", "attention"], lru_width=64,
                            embeddings_scale_by_sqrt_dim=True,
                            final_w_init_variance_scale=1.0, attention_bias=False),
    # LongCat-Flash-Ngram: MLA layers, and n-gram embeddings over the last 3 token ids,
    # kept in a state that grows with the first tokens (StateLayerSpec.filling).
    "longcat_flash_ngram": dict(model_type="longcat_flash_ngram", num_layers=2,
                                ffn_hidden_size=96, moe_topk=2, expert_ffn_hidden_size=32,
                                n_routed_experts=4, zero_expert_num=2, kv_lora_rank=32,
                                q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                v_head_dim=16, routed_scaling_factor=1.0,
                                mla_scale_q_lora=True, mla_scale_kv_lora=True,
                                ngram_vocab_size_ratio=2),
    # Kimi-Linear: KDA (gated delta) layers beside MLA layers; its code unpacks the cache.
    "kimi_linear": dict(model_type="kimi_linear", head_dim=16, model_max_length=4096,
                        num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
                        num_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                            "head_dim": 16, "num_heads": 4,
                                            "short_conv_kernel_size": 4}),
    "rwkv7": dict(model_type="rwkv7", head_dim=16, a_low_rank_dim=16, v_low_rank_dim=16,
                  gate_low_rank_dim=16, decay_low_rank_dim=16, norm_eps=1e-5),
    "mamba2": dict(model_type="mamba2", num_heads=4, head_dim=16, hidden_size=64, expand=1,
                   intermediate_size=64, state_size=16, num_hidden_layers=2,
                   layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
                   use_conv_bias=True, tie_word_embeddings=True, time_step_rank=8,
                   time_step_limit=(0.0, float("inf"))),
    "qwen3_next": dict(model_type="qwen3_next", head_dim=16, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, shared_expert_intermediate_size=32,
                       mlp_only_layers=[], moe_intermediate_size=32, partial_rotary_factor=0.5,
                       full_attention_interval=2),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", **_COMMON, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=2, partial_rotary_factor=0.5)),
    "lfm2": dict(model_type="lfm2", norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                 block_dim=64, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, block_ff_dim=96,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "nemotron_h": dict(model_type="nemotron_h", attention_bias=False, mamba_num_heads=4,
                       mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                       conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, head_dim=16,
                       hybrid_override_pattern="M*M-", time_step_limit=(0.0, float("inf"))),
    "falcon_h1": dict(model_type="falcon_h1", num_hidden_layers=2, head_dim=16,
                      rms_norm_eps=1e-5, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                      mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1),
    "granitemoehybrid": dict(model_type="granitemoehybrid", attention_bias=False,
                             embedding_multiplier=1.0, attention_multiplier=0.25,
                             logits_scaling=1.0, residual_multiplier=1.0,
                             layer_types=["mamba", "attention", "mamba", "attention"],
                             mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False,
                             mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                             mamba_conv_bias=True, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64),
}

# Models kiln's pool cannot page, served on mlx-lm's own caches (worker_proc.own_caches).
UNPAGED: dict[str, dict[str, Any]] = {
    # DeepSeek-V4.1: a cache of its own kind (LayerCache: a window, groups of 4 tokens
    # compressed to one entry, their index keys, the open group's rows) in every layer.
    "deepseek_v41": dict(model_type="deepseek_v41", num_hidden_layers=2, head_dim=32,
                         q_lora_rank=16, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
                         moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                         sliding_window=16, index_n_heads=2, index_head_dim=16, index_topk=8,
                         hc_mult=2, compress_ratios=[4, 4], kv_source_layer_ids=[0, 1],
                         index_source_layer_ids=[0, 1]),
}


def config_of(family: str) -> dict[str, Any]:
    """A family's (or an UNPAGED model's) whole config."""
    return {**_COMMON, **{**FAMILIES, **RECURRENT_FAMILIES, **UNPAGED}[family]}


def build(family: str, seed: int = 0, as_served: bool = True, **overrides: Any) -> Any:
    """The family's model with mlx-lm's own random initialisation (seeded), in float32;
    as_served: with the layers the worker swaps in at load to place each row's queries
    at its own positions (worker_proc.row_positions: mlx-lm's code where a forward has
    one offset, as mlx_lm.generate's have). overrides: config values in place of the
    family's (e.g. head_dim=64 for the kernels that take heads of 64 and up)."""
    import mlx.core as mx

    from worker_proc.row_positions import give_rows_their_positions

    config = {**config_of(family), **overrides}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    if as_served:
        give_rows_their_positions(model)
    return model


def write_model_dir(family: str, tokenizer_dir: Path, out: Path) -> Path:
    """The family's tiny model as a checkpoint directory mlx_lm.load reads (mlx-format
    weights, its config, the tokenizer files of `tokenizer_dir`, whose vocabulary must
    fit VOCAB), for tests through the real server."""
    import json
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten

    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    model = build(family)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config_of(family)))
    return out
