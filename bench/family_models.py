"""Random-weight models of real architectures (mlx-lm configs) for benchmarks.

The parameter names and shapes come from mlx-lm's own model class for the config (built
lazily: nothing is drawn until a shard is written), so any family mlx-lm loads can be
benchmarked at a real model's shape. The tokenizer is a demo preset's; output rows of ids
it lacks (and of its special tokens) are zero, so greedy decoding never picks them.

    python bench/family_models.py gemma3-12b ~/.cache/kiln/bench/gemma3-12b   # then serve it
    python bench/family_models.py gpt-oss-20b DIR --quantize mxfp4   # as the real one ships

--quantize writes the model as mlx-lm's quantize_model leaves it (its config's
"quantization", the model's own quant_predicate: GPT-OSS keeps its router at 8 bits):
each weight drawn as above, then packed with mx.quantize.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.h200_compare import _COMPLETE, _LOGIT_SCALE, start_model_dir, write_shards  # noqa: E402

VOCAB = 8192  # as the Llama-shaped bench model: the demo tokenizer's ids fit, the head is small


@dataclass(frozen=True)
class Quantization:
    """mlx-lm's quantization of a model: a mode (affine, mxfp4, nvfp4, mxfp8) and its bits
    and group size (None: the mode's defaults, as mlx_lm.convert takes them)."""

    mode: str = "affine"
    bits: int | None = None
    group_size: int | None = None

    @classmethod
    def parse(cls, text: str) -> Quantization:
        """MODE[:BITS[:GROUP_SIZE]], e.g. affine:4:64 or mxfp4."""
        mode, *rest = text.split(":")
        if len(rest) > 2:
            raise ValueError(f"--quantize {text!r}: MODE[:BITS[:GROUP_SIZE]]")
        numbers = [int(x) for x in rest] + [None] * (2 - len(rest))
        return cls(mode, numbers[0], numbers[1])

    @property
    def label(self) -> str:
        return ":".join(str(x) for x in (self.mode, self.bits, self.group_size) if x is not None)


_PACKED = ("weight", "scales", "biases")  # mx.quantize's outputs, in its order


@dataclass(frozen=True)
class QuantizedLayout:
    """A quantized model's parameters: names to (shape, dtype), the config mlx-lm's
    quantize_model wrote, and for each quantized module path its float weight's shape
    and (group size, bits, mode)."""

    shapes: dict[str, tuple[tuple[int, ...], Any]]
    config: dict[str, Any]
    modules: dict[str, tuple[tuple[int, ...], int, int, str]]


def quantized_layout(config: dict[str, Any], q: Quantization) -> QuantizedLayout:
    """The parameters and config of mlx-lm's model for `config` after quantize_model (on
    a lazy model: shapes only, nothing drawn)."""
    from mlx_lm.utils import quantize_model

    model = lazy_model(config)
    float_shapes = {n: shape for n, (shape, _) in model_shapes(model).items()}
    model, qconfig = quantize_model(model, config, q.group_size, q.bits, mode=q.mode)
    shapes = model_shapes(model)
    defaults = qconfig["quantization"]
    modules = {}
    for name in shapes:
        if name.endswith(".scales"):
            path = name[:-len(".scales")]
            own = defaults.get(path)
            if isinstance(own, dict):  # as nn.quantize takes it: its mode, else affine
                params = (own["group_size"], own["bits"], own.get("mode", "affine"))
            else:
                params = (defaults["group_size"], defaults["bits"], defaults["mode"])
            modules[path] = (float_shapes[path + ".weight"], *params)
    return QuantizedLayout(shapes, qconfig, modules)


@dataclass(frozen=True)
class FamilyShape:
    name: str
    config: dict[str, Any]  # mlx-lm config.json fields (vocab_size set by the maker)
    tokenizer_preset: str = "demo"
    tied: bool = field(default=False)  # the output head is the embedding


# Shapes of the public configs (text part), the vocabulary cut to VOCAB.
FAMILY_SHAPES = {s.name: s for s in (
    FamilyShape("gemma3-12b", dict(
        model_type="gemma3_text", hidden_size=3840, num_hidden_layers=48, intermediate_size=15360,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
        sliding_window=1024, sliding_window_pattern=6, max_position_embeddings=131072,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}), tied=True),
    FamilyShape("gpt-oss-20b", dict(
        model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, intermediate_size=2880,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, rms_norm_eps=1e-5, rope_theta=150000, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 4096},
        max_position_embeddings=131072)),
    # Hybrids: Gated DeltaNet (recurrent state) layers, full attention every 4th. The flat
    # text config (mlx-lm reads one without "text_config" as the text model's own), so
    # the maker's vocab_size and tie_word_embeddings reach the model. Qwen3.5-9B's text
    # part: ~7.0B parameters here, bf16 ~14 GB (the real 9B counts a 248k vocabulary and a
    # vision tower).
    FamilyShape("qwen3_5-9b", dict(
        model_type="qwen3_5", hidden_size=4096, num_hidden_layers=32, intermediate_size=12288,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        max_position_embeddings=262144, rope_parameters={
            "type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10]})),
    # Qwen3-Next-80B-A3B with 64 of its 512 experts (top 10 and the shared expert kept):
    # 11.4B parameters, bf16 ~23 GB. The full model (160 GB in bf16) fits neither the
    # H200's 141 GB nor the device machine's 64 GB disk, and a few minutes of a
    # 10-minute call go to writing weights. Experts rather than layers are cut so the 48
    # layers' mix (12 full attention, 36 DeltaNet), hence KV and state bytes per request
    # and the per-step launch count, stay the real model's. The MoE reads less a step: at
    # 32 rows all 64 experts here, ~240 of the real 512.
    FamilyShape("qwen3_next-64e", dict(
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, intermediate_size=5120,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        num_experts=64, num_experts_per_tok=10, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
        rope_theta=10_000_000, partial_rotary_factor=0.25, max_position_embeddings=262144)),
    # Moonlight-16B-A3B's shape: DeepSeek-V3's architecture (multi-head latent attention:
    # the cache holds a 512-wide latent and a 64-wide RoPE part a token, for 16 heads;
    # 64 routed experts, 6 a token, 2 shared). ~16B parameters, bf16 ~32 GB. kiln serves
    # MLA as a layer that computes its own scores (dense K/V gathered from the pool).
    FamilyShape("moonlight-16b", dict(
        model_type="deepseek_v3", hidden_size=2048, num_hidden_layers=27,
        intermediate_size=11264, moe_intermediate_size=1408, num_attention_heads=16,
        num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=1,
        topk_group=1, num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1,
        norm_topk_prob=True, scoring_func="sigmoid", rope_theta=50000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192)),
    # DeepSeek-V3.2's sparse attention (an indexer of 64 heads scores cached 128-wide keys
    # and keeps each query's top 2,048 positions of the MLA latent) at Moonlight-16B's
    # size (its layers, experts and MLA widths, with DeepSeek-V3.2's q LoRA): ~16B
    # parameters, bf16 ~32 GB; GLM-5 is the same code. kiln serves both caches of a layer
    # as dense own-score K/V; prompts past 2,048 tokens take the indexer's picks.
    FamilyShape("deepseek_v32-16b", dict(
        model_type="deepseek_v32", hidden_size=2048, num_hidden_layers=27,
        intermediate_size=11264, moe_intermediate_size=1408, num_attention_heads=16,
        num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=1,
        topk_group=1, num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1,
        norm_topk_prob=True, scoring_func="sigmoid", rope_theta=50000.0, rms_norm_eps=1e-5,
        index_n_heads=64, index_head_dim=128, index_topk=2048,
        max_position_embeddings=16384)),
    # Qwen3-8B (dense; q and k normalised per head before RoPE): ~7.0B parameters here
    # (the real 8.2B counts its 152k vocabulary), bf16 ~14 GB.
    FamilyShape("qwen3-8b", dict(
        model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False)),
    # Qwen3-30B-A3B with 32 of its 128 experts (8 a token): ~8.2B parameters, bf16 ~16 GB
    # (the full model's 61 GB do not fit the device machine's disk beside a second model).
    # Its 48 layers, attention and experts' shapes are the real model's, so the launches a
    # step are; at 64 rows every expert is read, as in the real model's ~all 128.
    FamilyShape("qwen3_moe-32e", dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, intermediate_size=6144,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        num_experts=32, num_experts_per_tok=8, moe_intermediate_size=768,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False)),
    # CPU smoke tests of the maker and the serving path.
    FamilyShape("gemma3-tiny", dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=16,
        sliding_window=16, sliding_window_pattern=2, max_position_embeddings=4096),
                tokenizer_preset="demo-tiny", tied=True),
    FamilyShape("gpt-oss-tiny", dict(
        model_type="gpt_oss", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=10000, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=4096),
                tokenizer_preset="demo-tiny"),
    FamilyShape("qwen3_5-tiny", dict(
        model_type="qwen3_5", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
        max_position_embeddings=4096, rope_parameters={
            "type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
                tokenizer_preset="demo-tiny"),
    FamilyShape("moonlight-tiny", dict(
        model_type="deepseek_v3", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.446, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        topk_method="noaux_tc", n_group=1, topk_group=1, num_experts_per_tok=2,
        moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid",
        rope_theta=50000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
                tokenizer_preset="demo-tiny"),
    FamilyShape("deepseek_v32-tiny", dict(
        model_type="deepseek_v32", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.446, kv_lora_rank=32,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        topk_method="noaux_tc", n_group=1, topk_group=1, num_experts_per_tok=2,
        moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid",
        rope_theta=50000.0, rms_norm_eps=1e-5, index_n_heads=2, index_head_dim=16,
        index_topk=32, max_position_embeddings=4096),
                tokenizer_preset="demo-tiny"),
    FamilyShape("qwen3_moe-tiny", dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False),
                tokenizer_preset="demo-tiny"),
    FamilyShape("qwen3_next-tiny", dict(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True,
        rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=4096),
                tokenizer_preset="demo-tiny"),
)}


def lazy_model(config: dict[str, Any]) -> Any:
    """mlx-lm's model for the config, its initialisers never evaluated."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model(module.ModelArgs.from_dict(config))


def model_shapes(model: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """A model's parameter names, shapes and dtypes."""
    from mlx.utils import tree_flatten

    return {name: (tuple(a.shape), a.dtype) for name, a in tree_flatten(model.parameters())}


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """mlx-lm's parameter names, shapes and dtypes for the config (a lazy model)."""
    return model_shapes(lazy_model(config))


def output_head(names: list[str]) -> str:
    """The parameter that makes the logits: the lm_head, else the tied embedding. Matched
    by suffix: a multimodal family's text model sits under a prefix
    (language_model.lm_head.weight in Qwen3.5)."""
    for suffix in ("lm_head.weight", "embed_tokens.weight"):
        found = [n for n in names if n.endswith(suffix)]
        if found:
            return found[0]
    raise ValueError("no lm_head or embed_tokens weight among the parameters")


def draw(name: str, shape: tuple[int, ...], dtype: Any, keep_rows: Any, head: bool) -> Any:
    """Ones for vectors (norms, sinks, biases), 1/sqrt(fan_in) for matrices and expert
    stacks, unit embeddings; the output head's unknown ids zeroed."""
    import mlx.core as mx

    if len(shape) == 1:
        return mx.ones(shape, dtype=dtype)
    embedding = name.endswith("embed_tokens.weight")
    std = 1.0 if embedding and not head else (
        _LOGIT_SCALE / shape[-1] ** 0.5 if head else 1.0 / shape[-1] ** 0.5)
    w = mx.random.normal(shape, dtype=dtype) * std
    if head:
        w = w * keep_rows[:, None]
    return w.astype(dtype)


def fingerprint(shape: FamilyShape, dtype_name: str, seed: int,
                quantize: Quantization | None = None) -> str:
    payload = json.dumps({"config": shape.config, "dtype": dtype_name, "seed": seed, "v": 2,
                          **({"quantize": quantize.label} if quantize else {})},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def make_family_model(shape: FamilyShape, dtype_name: str, out_dir: Path, seed: int = 0,
                      shard_bytes: int = 4 << 30, quantize: Quantization | None = None) -> Path:
    """Write the model directory unless an identical one is already complete there."""
    import mlx.core as mx

    mark = fingerprint(shape, dtype_name, seed, quantize)
    start = time.monotonic()
    tokenizer = start_model_dir(out_dir, mark, shape.tokenizer_preset)
    if tokenizer is None:
        return out_dir
    tok_vocab, specials, source = tokenizer
    vocab = max(VOCAB if shape.tokenizer_preset == "demo" else tok_vocab, tok_vocab)
    config = {**shape.config, "vocab_size": vocab, "tie_word_embeddings": shape.tied,
              "bos_token_id": source["bos_token_id"], "eos_token_id": source["eos_token_id"],
              "torch_dtype": dtype_name, "kiln_bench": {"shape": shape.name, "random_weights": True}}
    layout = quantized_layout(config, quantize) if quantize else None
    if layout is not None:
        config = layout.config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    dtype = getattr(mx, dtype_name)
    mx.random.seed(seed)
    keep = mx.concatenate([mx.ones((tok_vocab,)), mx.zeros((vocab - tok_vocab,))])
    keep[mx.array(specials)] = 0.0
    shapes = layout.shapes if layout is not None else parameter_shapes(config)
    if shape.tied:  # as the real checkpoint: no lm_head, mlx-lm then ties the embedding
        shapes = {n: s for n, s in shapes.items() if not n.rpartition(".")[0].endswith("lm_head")}
    head_name = output_head(list(shapes))
    keep_rows = keep.astype(dtype)
    packed: dict[str, dict[str, Any]] = {}  # the quantized module last drawn: its parts

    def value(name: str) -> Any:
        path, _, part = name.rpartition(".")
        if layout is None or path not in layout.modules or part not in _PACKED:
            return draw(name, shapes[name][0],
                        dtype if shapes[name][1] != mx.uint32 else mx.uint32,
                        keep_rows, name == head_name)
        if path not in packed:  # a module's parts are written one after another
            float_shape, group_size, bits, mode = layout.modules[path]
            weight = draw(path + ".weight", float_shape, dtype, keep_rows,
                          path + ".weight" == head_name)
            packed.clear()
            packed[path] = dict(zip(_PACKED, mx.quantize(weight, group_size=group_size,
                                                         bits=bits, mode=mode)))
        return packed[path][part]

    write_shards({n: s for n, (s, _) in shapes.items()}, dtype.size, value, out_dir, shard_bytes)
    (out_dir / _COMPLETE).write_text(mark + "\n")
    what = dtype_name + (f", {quantize.label}" if quantize else "")
    print(f"made {shape.name} ({what}) at {out_dir} in {time.monotonic() - start:.1f}s",
          flush=True)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(FAMILY_SHAPES))
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", type=Quantization.parse, default=None,
                   help="MODE[:BITS[:GROUP_SIZE]] (affine, mxfp4, nvfp4, mxfp8), as "
                        "mlx_lm.convert -q writes it: e.g. affine:4:64, mxfp4")
    args = p.parse_args()
    make_family_model(FAMILY_SHAPES[args.shape], args.dtype, args.out_dir, args.seed,
                      quantize=args.quantize)


if __name__ == "__main__":
    main()
