"""A llama-style (qwen2, Qwen3 and its MoE, or Gemma 3, GPT-OSS) block's decode step in
fewer kernel launches (`--fast-decode-blocks`).

On MLX's CUDA backend a decode step at 64 rows is bound by the host's time per launched
kernel. mlx-lm's llama block, with fused projections (worker_proc/fused_projections.py),
launches per layer: norm, q/k/v GEMM, RoPE of q, RoPE of k, K/V store and attention, o
GEMM, residual add, norm, gate/up GEMM, SwiGLU, down GEMM, residual add, and two copies:
MLX's CUDA RoPE first copies an input that is not row-contiguous and more than 3-D, as
the fused q and k views are (their rows are the q/k/v output's): 14. For a paged decode
forward `FastDecodeBlock` computes the same thing in 10: one RoPE (and one copy) over q
and k together (adjacent heads of the fused output; RoPE works head by head with one
offset per row), and on CUDA each residual add inside its GEMM (`mx.addmm`). Its prefill
forwards over the pool take the same RoPE and residual adds (two launches a layer fewer
than mlx-lm's call, four with the adds; Gemma 3's and GPT-OSS's blocks too, their q and
k norms and RoPE as in decode; Qwen3's q and k norms as one before the one RoPE, in a
CUDA decode step with it in one kernel), and under `--experiments mixed-forward` a
forward may carry a prompt's chunk and decode rows together (MixedLayerCache). Every
other forward (the dense fallback) runs mlx-lm's code unchanged.

addmm rounds the product and the residual once where a matmul then an add round twice, so
with it the tokens may differ from mlx-lm's at near-ties (as the decode kernel's already
may). Without it (the CPU) the block's math is mlx-lm's bit for bit: the tests compare
tokens there. On the H200 (64 streams, 8B-shaped model) it served ~6% more tokens/s than
fused projections alone, so `auto` turns it on with the CUDA decode kernel.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as models_base
from mlx_lm.models import gemma3_text, gpt_oss, llama, qwen2, qwen3, qwen3_moe
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE

from worker_proc.attention import MixedLayerCache, PooledKVCache
from worker_proc.expert_rows import KernelRowsLinear
from worker_proc.fused_moe import (ExpertsPlan, NextNorm, experts_plan, fused_experts,
                                   linear_and_bias)
from worker_proc.paged_attention import RopeSpec

logger = logging.getLogger(__name__)

# Linear layers whose product is x @ weight.T (+ bias): a residual add goes inside the GEMM
# (KernelRowsLinear's own kernel then gives way to it).
_PLAIN_LINEARS = (nn.Linear, KernelRowsLinear)

def rope_spec(rope: nn.Module) -> RopeSpec | None:
    """The RopeSpec of an mlx-lm RoPE module (nn.RoPE, Llama3RoPE, YarnRoPE); None for
    other kinds."""
    if type(rope) is nn.RoPE:
        return RopeSpec(rope.dims, rope.traditional, float(rope.base), float(rope.scale))
    if type(rope) is Llama3RoPE:  # its call: base None, scale 1, its own frequencies
        return RopeSpec(rope.dims, rope.traditional, None, 1.0, rope._freqs)
    if type(rope) is YarnRoPE:  # the same, its input scaled first (GPT-OSS, DeepSeek)
        return RopeSpec(rope.dims, rope.traditional, None, 1.0, rope._freqs, float(rope.mscale))
    return None


def _paged_decode(cache: Any) -> bool:
    """Whether a block's call is a paged decode step attending through the pool (every
    other forward takes mlx-lm's call)."""
    return isinstance(cache, PooledKVCache) and cache.paged and not cache.kind.own_attention


def _pooled_prefill(cache: Any) -> bool:
    """Whether a block's call is a prefill forward over the pool through the attention
    hook (FastDecodeBlock runs those too: its RoPE and residual adds are the fewer)."""
    return isinstance(cache, PooledKVCache) and not cache.paged and not cache.kind.own_attention


def _split_qkv(qkv: mx.array, n_q: int, n_kv: int, dim: int) -> tuple[mx.array, mx.array]:
    """A fused q/k/v projection's output [B, L, (n_q + 2 n_kv) * D] as the q and k heads
    together, [B, L, n_q + n_kv, D] (adjacent: one RoPE or norm serves both), and the
    values in attention's layout, [B, n_kv, L, D]."""
    b, length, _ = qkv.shape
    qk = qkv[..., :(n_q + n_kv) * dim].reshape(b, length, n_q + n_kv, dim)
    values = qkv[..., (n_q + n_kv) * dim:].reshape(b, length, n_kv, dim).transpose(0, 2, 1, 3)
    return qk, values


def _store_and_attend(cache: PooledKVCache, qk: mx.array, values: mx.array, n_q: int,
                      scale: float, sinks: mx.array | None = None) -> mx.array:
    """Store the step's keys (qk's heads past n_q, [B, H, L, D]) and values, attend with
    its queries: the o projection's input, [B, L, n_q * D]."""
    cache.update_and_fetch(qk[:, n_q:], values)
    out = cache.paged_attention(qk[:, :n_q], scale, sinks)
    b, _, length, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, length, -1)


def _prefill_attend(cache: PooledKVCache, qk: mx.array, values: mx.array, n_q: int,
                    scale: float, mask: Any, sinks: mx.array | None = None) -> mx.array:
    """A prefill forward's attention over the pool from its rotated q and k heads
    together ([B, H, L, D]) and values, as mlx-lm's call does it after RoPE (the pool
    write and read-back, then the attention hook): [B, L, n_q * D]."""
    keys, values = cache.update_and_fetch(qk[:, n_q:], values)
    out = models_base.scaled_dot_product_attention(qk[:, :n_q], keys, values, cache=cache,
                                                   scale=scale, mask=mask, sinks=sinks)
    b, _, length, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, length, -1)


def _attend(cache: PooledKVCache, qk: mx.array, values: mx.array, n_q: int, scale: float,
            mask: Any, sinks: mx.array | None = None) -> mx.array:
    """Decode or prefill attention over the pool, as the cache's layout is."""
    if cache.paged:
        return _store_and_attend(cache, qk, values, n_q, scale, sinks)
    return _prefill_attend(cache, qk, values, n_q, scale, mask, sinks)


def _rotate_qk(cache: PooledKVCache, qkv: mx.array, qk: mx.array, rope: nn.Module,
               spec: RopeSpec | None, norms: QKNorms | None) -> mx.array:
    """The q and k heads (qk, [B, L, n_q + n_kv, D], views of the fused output qkv)
    through the block's q/k norms where it has them, then its RoPE: [B, n_q + n_kv, L, D].
    A decode step hands both to the backend's one kernel (norm_rope_qk) where it has one
    and `spec`, the RoPE's arguments, rotates whole heads; else MLX's norm as one unscaled
    norm and a multiply (see QKNorms) and the model's RoPE."""
    if cache.paged and spec is not None and spec.dims == qk.shape[-1]:
        rotated = cache.backend.norm_rope_qk(qkv, qk.shape[2], cache.layout.lengths,
                                             None if norms is None else norms.scale,
                                             0.0 if norms is None else norms.eps, spec)
        if rotated is not None:
            return rotated
    if norms is not None:
        qk = mx.fast.rms_norm(qk, norms.ones, norms.eps) * norms.scale
    return rope(qk.transpose(0, 2, 1, 3), offset=cache.offset)


class FastDecodeBlock:
    """Mixed into a block's class (see speed_up_decode_blocks): its parameters and
    submodules stay where mlx-lm put them; only the call differs, for forwards over the
    pool (paged decode, prefill, a chunk and decode rows together)."""

    residual_in_gemm: bool = False  # set per block by speed_up_decode_blocks
    rope_spec: RopeSpec | None = None  # its attention's RoPE, ditto
    qk_norms: QKNorms | None = None  # its q and k norms (Qwen3's), ditto
    moe_plan: ExpertsPlan | None = None  # its mixture of experts' parts (fused_moe), ditto
    handoff_in: NormHandoff | None = None  # from the block before (_link_expert_norms)
    handoff_out: NormHandoff | None = None  # to the block after, ditto

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(cache, MixedLayerCache):
            return self._mixed(x, mask, cache)
        if _paged_decode(cache):
            qkv = self.self_attn.qkv_proj(_input_norm(self, x))  # type: ignore[attr-defined]
            return self._after_attention(x, self._decode_attention(qkv, cache), cache)
        if _pooled_prefill(cache):
            qkv = self.self_attn.qkv_proj(self.input_layernorm(x))  # type: ignore[attr-defined]
            return self._after_attention(x, self._prefill_attention(qkv, mask, cache))
        return super().__call__(x, mask, cache)  # type: ignore[misc]

    def _decode_attention(self, qkv: mx.array, cache: PooledKVCache) -> mx.array:
        """Decode rows' attention from their fused q/k/v output [B, 1, F]: the o
        projection's input, [B, 1, n_q * D]."""
        attn = self.self_attn  # type: ignore[attr-defined]
        n_q, n_kv = attn.n_heads, attn.n_kv_heads
        dim = qkv.shape[-1] // (n_q + 2 * n_kv)
        rope = self._kernel_rope(cache, dim) if cache.attends_from_qkv else None
        if rope is not None:  # one kernel from the projection's output to o's input
            return cache.attend_qkv(qkv, n_q, attn.scale, rope)
        qk, values = _split_qkv(qkv, n_q, n_kv, dim)
        qk = _rotate_qk(cache, qkv, qk, attn.rope, self.rope_spec, self.qk_norms)
        return _store_and_attend(cache, qk, values, n_q, attn.scale)

    def _mixed(self, x: mx.array, mask: Any, cache: MixedLayerCache) -> mx.array:
        """A prompt's chunk and decode rows in one forward ([1, n + B, D]): the q/k/v, o
        and MLP GEMMs read the weights once for all of them; attention runs apart, the
        chunk's as mlx-lm's call does it (RoPE from the chunk's start, the pool write and
        read-back, the attention hook), each row's as the decode call."""
        n = cache.n_chunk
        qkv = self.self_attn.qkv_proj(self.input_layernorm(x))  # type: ignore[attr-defined]
        chunk_out = self._prefill_attention(qkv[:, :n], mask, cache.chunk)
        rows_out = self._decode_attention(qkv[0, n:, None], cache.rows)
        out = mx.concatenate([chunk_out, rows_out.reshape(1, -1, rows_out.shape[-1])], axis=1)
        return self._after_attention(x, out)

    def _prefill_attention(self, qkv: mx.array, mask: Any, cache: PooledKVCache) -> mx.array:
        """A prefill forward's attention from its fused q/k/v output [B, L, F], as mlx-lm's
        call computes it (RoPE from the cache's offset, the pool write and read-back, the
        attention hook) but with one RoPE (and one copy of its strided input, on CUDA)
        over q and k together: the o projection's input, [B, L, n_q * D]."""
        attn = self.self_attn  # type: ignore[attr-defined]
        n_q, n_kv = attn.n_heads, attn.n_kv_heads
        qk, values = _split_qkv(qkv, n_q, n_kv, qkv.shape[-1] // (n_q + 2 * n_kv))
        qk = _rotate_qk(cache, qkv, qk, attn.rope, self.rope_spec, self.qk_norms)
        return _prefill_attend(cache, qk, values, n_q, attn.scale, mask)

    def _after_attention(self, x: mx.array, out: mx.array,
                         decode: PooledKVCache | None = None) -> mx.array:
        """The o projection and residual, then the MLP (a SwiGLU's, its gate and up fused;
        else the block's own, e.g. a mixture of experts: in a decode step (`decode`, its
        cache) through the backend's routing where it has that) and its residual."""
        attn, mlp = self.self_attn, self.mlp  # type: ignore[attr-defined]
        h = self._residual(x, attn.o_proj, out)
        normed = self.post_attention_layernorm(h)  # type: ignore[attr-defined]
        if "gate_up_proj" not in mlp:
            return _experts_or_mlp(self.moe_plan, mlp, decode, normed, h, self.handoff_out)
        gate, up = mx.split(mlp.gate_up_proj(normed), 2, axis=-1)
        return self._residual(h, mlp.down_proj, swiglu(gate, up))

    def _kernel_rope(self, cache: PooledKVCache, head_dim: int) -> RopeSpec | None:
        """The RoPE for the attention kernel to apply, where its backend does that (the
        kernel's rope_in_kernel option): the block's own, where the kernel can do it (over
        whole heads). The kernel then takes the fused q/k/v output whole: the block skips
        RoPE and the copy MLX's CUDA RoPE makes of the strided q/k heads (two launches a
        layer) and ~11 view nodes. Off by default: on the H200 it saved host time but added
        more device time than RoPE's launches cost (session 8 in docs/benchmarks.md)."""
        spec = self.rope_spec
        if (cache.backend.rope_in_kernel and spec is not None and spec.dims == head_dim
                and spec.mscale == 1.0 and self.qk_norms is None):  # nor scale, nor normalise
            return spec
        return None

    def _residual(self, x: mx.array, proj: nn.Module, a: mx.array) -> mx.array:
        """x + proj(a), the add inside the GEMM where it may be."""
        if self.residual_in_gemm and type(proj) in _PLAIN_LINEARS and "bias" not in proj:
            # As 2-D operands: one GEMM over all rows, never a batch of one-row GEMMs.
            out = mx.addmm(x.reshape(-1, x.shape[-1]), a.reshape(-1, a.shape[-1]), proj.weight.T)
            return out.reshape(x.shape)
        return x + proj(a)


@dataclass(frozen=True)
class QKNorms:
    """A layer's q and k norms (Gemma 3's, Qwen3's) as one: each head's scale ([n_q +
    n_kv, D]: q's heads, then k's) and their eps; a norm by ones then a multiply by it is
    MLX's CPU rms_norm with it, bit for bit. `ones` [D] is that norm's weight: without
    one, MLX reads a scalar 1 of its own from the memory that kernels wait on (see
    kernel_constants.CONSTANT_ELEMENTS). (Held in a plain object: an array attribute of an
    mlx Module would become one of the model's parameters.)"""

    scale: mx.array
    eps: float

    @functools.cached_property
    def ones(self) -> mx.array:
        return mx.ones(self.scale.shape[-1:], dtype=self.scale.dtype)


@dataclass(frozen=True)
class SandwichNorms:
    """A Gemma 3 layer's norms around its residual adds, as the arrays mlx-lm's norms
    multiply by (1 + weight, rounded in the weight's dtype), and their one eps."""

    post_attention: mx.array
    pre_feedforward: mx.array
    post_feedforward: mx.array
    eps: float


class NormHandoff:
    """The next block's input norm, computed by this block's last kernel of a decode step
    (Gemma 3: residual_norm's second output; a mixture of experts: combine's, `next_norm`)
    and taken by that block instead of its own norm: a launch a layer less. mlx-lm's
    model loop hands block i's output straight to block i + 1, so the output is the key;
    anything else computes its own norm. (A plain object: an mlx Module's array or
    Module attributes become its parameters.)"""

    def __init__(self, next_norm: NextNorm) -> None:
        # The next block's input norm: its weight (Gemma 3's 1 + weight) and eps.
        self.next_norm = next_norm
        self._source: mx.array | None = None
        self._normed: mx.array | None = None

    def put(self, source: mx.array, normed: mx.array) -> None:
        self._source, self._normed = source, normed

    def take(self, x: mx.array) -> mx.array | None:
        """The norm put for x (None: none was, or for another array); forgets it."""
        source, normed = self._source, self._normed
        self._source = self._normed = None
        return normed if source is x else None


class FastGemma3Block:
    """Gemma 3's block (mlx-lm's gemma3_text) for paged decode and prefill over the pool:
    the q and k norms and RoPE over q and k together. mlx-lm normalises then rotates q and
    k apart: two norms and two RoPEs a layer, each of the strided q or k view of the fused
    projection's output (MLX's CUDA kernels copy such an input first). Here the heads of q
    and k go through one unscaled norm, one multiply by both norms' scales ([heads, D],
    made at load) and one RoPE (RoPE works head by head with one offset per row). That
    multiply is the scale step of MLX's CPU rms_norm, so on the CPU the tokens are
    mlx-lm's bit for bit (the tests compare them); CUDA's norm kernel scales before
    rounding, so there they may differ at near-ties. A decode step's norm, multiply and
    RoPE are one kernel where the backend has it (DecodeBackend.norm_rope_qk: CUDA), and
    its sandwich norms and residual adds two where it has those (residual_norm), the
    second also the next block's input norm (NormHandoff). Attention and the MLP are
    mlx-lm's calls."""

    qk_norms: QKNorms | None = None  # set per block by speed_up_decode_blocks
    rope_spec: RopeSpec | None = None  # its attention's RoPE, ditto
    sandwich: SandwichNorms | None = None  # ditto, where its norms are mlx-lm's
    handoff_in: NormHandoff | None = None  # from the block before (_link_gemma3_norms)
    handoff_out: NormHandoff | None = None  # to the block after, ditto

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not (_paged_decode(cache) or _pooled_prefill(cache)):
            return super().__call__(x, mask, cache)  # type: ignore[misc]
        attn = self.self_attn  # type: ignore[attr-defined]
        qk, values = self._qk(attn.qkv_proj(_input_norm(self, x)), cache)
        out = attn.o_proj(_attend(cache, qk, values, attn.n_heads, attn.scale, mask))
        return self._after_attention(x, out, cache)

    def _qk(self, qkv: mx.array, cache: PooledKVCache) -> tuple[mx.array, mx.array]:
        """The q and k heads normalised, scaled and rotated ([B, n_q + n_kv, L, D]), and
        the values in attention's layout: one kernel in a decode step where the backend
        has it (norm_rope_qk)."""
        attn = self.self_attn  # type: ignore[attr-defined]
        qk, values = _split_qkv(qkv, attn.n_heads, attn.n_kv_heads, attn.head_dim)
        return _rotate_qk(cache, qkv, qk, attn.rope, self.rope_spec, self.qk_norms), values

    def _after_attention(self, x: mx.array, out: mx.array, cache: PooledKVCache) -> mx.array:
        """The sandwich-normed residuals around the MLP: in a decode step two kernels
        where the backend has them (residual_norm), else mlx-lm's norms and adds."""
        sandwich = self.sandwich
        if cache.paged and sandwich is not None:
            backend = cache.backend
            first = backend.residual_norm(out, x, sandwich.post_attention, sandwich.eps,
                                          sandwich.pre_feedforward)
            if first is not None:
                h, normed = first
                r = self.mlp(normed)  # type: ignore[attr-defined]
                handoff = self.handoff_out
                y, after = backend.residual_norm(r, h, sandwich.post_feedforward, sandwich.eps,
                                                 None if handoff is None else handoff.next_norm.weight)
                if handoff is not None and after is not None:
                    handoff.put(y, after)
                return y
        h = gemma3_text.clip_residual(x, self.post_attention_layernorm(out))  # type: ignore[attr-defined]
        r = self.mlp(self.pre_feedforward_layernorm(h))  # type: ignore[attr-defined]
        return gemma3_text.clip_residual(h, self.post_feedforward_layernorm(r))  # type: ignore[attr-defined]


class FastGptOssBlock:
    """GPT-OSS's block (mlx-lm's gpt_oss) for paged decode and prefill over the pool: one
    RoPE over the adjacent q and k heads of the fused q/k/v output (mlx-lm rotates each
    apart, each a copy of its strided view first on CUDA; in a CUDA decode step one kernel,
    YaRN's input scale included: DecodeBackend.norm_rope_qk), then mlx-lm's attention with
    sinks, o projection, MoE and residuals. RoPE works head by head, so the tokens are
    mlx-lm's on the CPU (tests). In a decode step the attention's residual add and the
    MLP's norm are one kernel where the backend has it (add_norm), and the experts go
    through its routing and sum (fused_moe), which also compute the next block's input
    norm (NormHandoff)."""

    rope_spec: RopeSpec | None = None  # its YaRN RoPE, set by speed_up_decode_blocks
    moe_plan: ExpertsPlan | None = None  # its experts' parts (fused_moe), ditto
    handoff_in: NormHandoff | None = None  # from the block before (_link_expert_norms)
    handoff_out: NormHandoff | None = None  # to the block after, ditto

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not (_paged_decode(cache) or _pooled_prefill(cache)):
            return super().__call__(x, mask, cache)  # type: ignore[misc]
        attn = self.self_attn  # type: ignore[attr-defined]
        n_q = attn.num_attention_heads
        qkv = attn.qkv_proj(_input_norm(self, x))
        qk, values = _split_qkv(qkv, n_q, attn.num_key_value_heads, attn.head_dim)
        qk = _rotate_qk(cache, qkv, qk, attn.rope, self.rope_spec, None)
        out = _attend(cache, qk, values, n_q, attn.sm_scale, mask, attn.sinks)
        h, normed = _residual_and_norm(self, x, out, cache)
        return _experts_or_mlp(self.moe_plan, self.mlp, cache if cache.paged else None,  # type: ignore[attr-defined]
                               normed, h, self.handoff_out)


def _residual_and_norm(block: Any, x: mx.array, out: mx.array, cache: PooledKVCache
                       ) -> tuple[mx.array, mx.array]:
    """h = x + o_proj(out) and the MLP's input norm of h: in a decode step one kernel of
    the backend's where it has it (add_norm, a quantized o_proj's bias added there too),
    else mlx-lm's ops."""
    norm = block.post_attention_layernorm
    branch, bias = linear_and_bias(block.self_attn.o_proj, out)
    if cache.paged and type(norm) is nn.RMSNorm:
        made = cache.backend.add_norm(branch, bias, x, norm.weight, norm.eps)
        if made is not None:
            return made
    h = x + (branch if bias is None else branch + bias)
    return h, norm(h)


def _experts_or_mlp(plan: ExpertsPlan | None, mlp: nn.Module, decode: PooledKVCache | None,
                    x: mx.array, residual: mx.array, handoff: NormHandoff | None) -> mx.array:
    """residual + mlp(x): in a decode step (`decode`, its cache) a mixture of experts
    with a plan goes through its backend's routing and sum (fused_moe.fused_experts),
    where the backend takes them, the sum's norm for the next block put in `handoff`."""
    if plan is not None and decode is not None:
        made = fused_experts(plan, decode.backend, x, residual,
                             None if handoff is None else handoff.next_norm)
        if made is not None:
            out, normed = made
            if handoff is not None and normed is not None:
                handoff.put(out, normed)
            return out
    return residual + mlp(x)


def _input_norm(block: Any, x: mx.array) -> mx.array:
    """The block's input norm of x: the one the block before computed (its handoff)
    where it did, else its own."""
    handoff = block.handoff_in
    normed = handoff.take(x) if handoff is not None else None
    return block.input_layernorm(x) if normed is None else normed


def _sandwich_norms(block: nn.Module) -> SandwichNorms | None:
    """Gemma 3's sandwich norms, where all three are mlx-lm's RMSNorm of one eps."""
    names = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    norms = [getattr(block, name, None) for name in names]
    if not all(isinstance(n, gemma3_text.RMSNorm) for n in norms):
        return None
    if len({n.eps for n in norms}) != 1:
        return None
    return SandwichNorms(*(1.0 + n.weight for n in norms), norms[0].eps)


def _plain_qk_norms_fit(attn: nn.Module) -> bool:
    """Whether Qwen3's q and k norms are nn.RMSNorms of one eps (_plain_qk_norms)."""
    q_norm, k_norm = attn.q_norm, attn.k_norm
    return type(q_norm) is type(k_norm) is nn.RMSNorm and q_norm.eps == k_norm.eps


def _heads_scale(attn: nn.Module, q_scale: mx.array, k_scale: mx.array) -> mx.array:
    """QKNorms.scale: q's scale for each of the n_q heads, then k's for the n_kv heads."""
    dim = q_scale.shape[-1]
    return mx.concatenate([mx.broadcast_to(q_scale, (attn.n_heads, dim)),
                           mx.broadcast_to(k_scale, (attn.n_kv_heads, dim))])


def _plain_qk_norms(attn: nn.Module) -> QKNorms:
    """Qwen3's q and k norms as one (_plain_qk_norms_fit must hold)."""
    return QKNorms(_heads_scale(attn, attn.q_norm.weight, attn.k_norm.weight), attn.q_norm.eps)


def _qk_norms(attn: nn.Module) -> QKNorms | None:
    """Gemma 3's q and k norms as one, where they are mlx-lm's (offset) RMSNorms of one
    eps; None otherwise."""
    q_norm, k_norm = attn.q_norm, attn.k_norm
    if not all(isinstance(getattr(n, "eps", None), float) and "weight" in n for n in (q_norm, k_norm)):
        return None
    if q_norm.eps != k_norm.eps:
        return None
    # The arrays mlx-lm's norm multiplies by (its 1 + weight, rounded in the weight's dtype).
    return QKNorms(_heads_scale(attn, 1.0 + q_norm.weight, 1.0 + k_norm.weight), q_norm.eps)


# mlx-lm block classes whose call, attention and MLP are the math FastDecodeBlock does
# (pre-norm residual block; q/k/v projections, with or without bias, q/k norms or not,
# RoPE on q and k with the cache's offset, attention, o projection; SwiGLU MLP, or
# experts called as mlx-lm calls them), read from their source. Other model types reuse
# these modules (mistral is llama's).
_FAMILIES: dict[type, tuple[type, tuple[type, ...]]] = {
    llama.TransformerBlock: (llama.Attention, (llama.MLP,)),
    qwen2.TransformerBlock: (qwen2.Attention, (qwen2.MLP,)),
    # Qwen3: the same with q and k norms (QKNorms) before RoPE; its MoE, experts or a
    # SwiGLU a layer (the experts' MLP is mlx-lm's call).
    qwen3.TransformerBlock: (qwen3.Attention, (qwen3.MLP,)),
    qwen3_moe.Qwen3MoeDecoderLayer: (qwen3_moe.Attention,
                                     (qwen3_moe.MLP, qwen3_moe.Qwen3MoeSparseMoeBlock)),
}
# Families whose attention normalises q and k per head (nn.RMSNorm) before RoPE.
_QK_NORMED = (qwen3.Attention, qwen3_moe.Attention)
_FAST_CLASSES = {base: type(f"Fast{base.__module__.rsplit('.', 1)[-1].title()}Block",
                            (FastDecodeBlock, base), {}) for base in _FAMILIES}


_GEMMA3 = type("FastGemma3TextBlock", (FastGemma3Block, gemma3_text.TransformerBlock), {})
_GPT_OSS = type("FastGptOssTransformerBlock", (FastGptOssBlock, gpt_oss.TransformerBlock), {})


def _eligible(block: nn.Module) -> bool:
    """A block of a family above, as mlx-lm builds it, with its q/k/v fused (a SwiGLU's
    gate/up too; Qwen3's q and k norms mlx-lm's RMSNorms of one eps)."""
    parts = _FAMILIES.get(type(block))
    if parts is None:
        return False
    attn, mlp = block.self_attn, block.mlp
    if type(attn) is not parts[0] or type(mlp) not in parts[1]:
        return False
    if isinstance(attn, _QK_NORMED) and not _plain_qk_norms_fit(attn):
        return False
    return "qkv_proj" in attn and ("gate_up_proj" in mlp or not hasattr(mlp, "gate_proj"))


def _eligible_gemma3(block: nn.Module) -> bool:
    """mlx-lm's Gemma 3 block as it builds it, its q/k/v fused."""
    return (type(block) is gemma3_text.TransformerBlock
            and type(block.self_attn) is gemma3_text.Attention and "qkv_proj" in block.self_attn)


def _eligible_gpt_oss(block: nn.Module) -> bool:
    """mlx-lm's GPT-OSS block as it builds it, its q/k/v fused."""
    return (type(block) is gpt_oss.TransformerBlock
            and type(block.self_attn) is gpt_oss.AttentionBlock and "qkv_proj" in block.self_attn)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's decoder blocks (mlx-lm's model.layers), none where it has no such list."""
    return getattr(getattr(model, "model", None), "layers", None) or []


def _link_gemma3_norms(model: nn.Module) -> None:
    """Give each pair of consecutive Gemma 3 fast blocks (sandwich norms both, the later
    one's input norm mlx-lm's RMSNorm of the same eps) a NormHandoff."""
    layers = _blocks(model)
    for block, after in zip(layers, layers[1:]):
        norm = getattr(after, "input_layernorm", None)
        if (isinstance(block, _GEMMA3) and isinstance(after, _GEMMA3)
                and block.sandwich is not None and after.sandwich is not None
                and isinstance(norm, gemma3_text.RMSNorm) and norm.eps == block.sandwich.eps):
            scale = 1.0 + norm.weight
            mx.eval(scale)
            block.handoff_out = after.handoff_in = NormHandoff(NextNorm(scale, norm.eps))


def _link_expert_norms(model: nn.Module) -> None:
    """Give each block with an experts' plan whose next block takes the fast decode call
    with mlx-lm's RMSNorm as its input norm a NormHandoff of that norm."""
    layers = _blocks(model)
    for block, after in zip(layers, layers[1:]):
        norm = getattr(after, "input_layernorm", None)
        if (getattr(block, "moe_plan", None) is not None
                and isinstance(after, (FastDecodeBlock, FastGptOssBlock))
                and type(norm) is nn.RMSNorm):
            block.handoff_out = after.handoff_in = NormHandoff(
                NextNorm(norm.weight, float(norm.eps)))


def mixes_rows(model: nn.Module) -> bool:
    """Whether every block of the model takes FastDecodeBlock's call, which also runs
    mixed forwards (MixedLayerCache): a prompt's chunk beside decode rows."""
    layers = _blocks(model)
    return bool(layers) and all(isinstance(b, FastDecodeBlock) for b in layers)


def dense_mlps(model: nn.Module) -> bool:
    """Whether every block's MLP is one dense SwiGLU (its gate and up fused, as
    _after_attention runs it), not a mixture of experts: rows padded onto such a forward
    cost GEMM rows only, where an expert layer would route them."""
    layers = _blocks(model)
    # (Nemotron-NAS blocks may have no MLP at all: mlp None.)
    return bool(layers) and all("gate_up_proj" in (getattr(b, "mlp", None) or {})
                                for b in layers)


def speed_up_decode_blocks(model: nn.Module, residual_in_gemm: bool) -> int:
    """Give every eligible block the decode call of FastDecodeBlock (mlx-lm's llama or
    qwen2 block, projections fused), FastGemma3Block or FastGptOssBlock (q/k/v fused);
    returns how many. residual_in_gemm: residual adds inside the o and down GEMMs (CUDA;
    llama and qwen2 only: Gemma 3 normalises before its adds, GPT-OSS's MLP is experts)."""
    count = 0
    for _, module in model.named_modules():
        if _eligible(module):
            module.__class__ = _FAST_CLASSES[type(module)]
            module.residual_in_gemm = residual_in_gemm
            if isinstance(module.self_attn, _QK_NORMED):
                module.qk_norms = _plain_qk_norms(module.self_attn)
        elif _eligible_gemma3(module) and (norms := _qk_norms(module.self_attn)) is not None:
            module.__class__ = _GEMMA3
            module.qk_norms = norms
            module.sandwich = _sandwich_norms(module)
        elif _eligible_gpt_oss(module):
            module.__class__ = _GPT_OSS
        else:
            continue
        module.moe_plan = experts_plan(module.mlp)
        module.rope_spec = rope_spec(module.self_attn.rope)
        made = [] if module.rope_spec is None else [module.rope_spec.kernel_params]
        if getattr(module, "qk_norms", None) is not None:
            made += [module.qk_norms.scale, module.qk_norms.ones]
        if getattr(module, "sandwich", None) is not None:
            made += [module.sandwich.post_attention, module.sandwich.pre_feedforward,
                     module.sandwich.post_feedforward]
        mx.eval(made)  # here, never inside a compiled trace
        count += 1
    _link_gemma3_norms(model)
    _link_expert_norms(model)
    if count:
        planned = sum(getattr(m, "moe_plan", None) is not None for m in _blocks(model))
        logger.info("%d blocks take the fast decode call (residual adds in GEMMs: %s; "
                    "experts routed by the backend: %d)", count, residual_in_gemm, planned)
    return count
