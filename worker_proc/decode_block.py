"""A llama-style block's decode step in fewer kernel launches (`--fast-decode-blocks`).

On MLX's CUDA backend a decode step at 64 rows is bound by the host's time per launched
kernel. mlx-lm's llama block, with fused projections (worker_proc/fused_projections.py),
launches per layer: norm, q/k/v GEMM, RoPE of q, RoPE of k, K/V store and attention, o
GEMM, residual add, norm, gate/up GEMM, SwiGLU, down GEMM, residual add, and two copies:
MLX's CUDA RoPE first copies an input that is not row-contiguous and more than 3-D, as
the fused q and k views are (their rows are the q/k/v output's): 14. For a paged decode
forward `FastDecodeBlock` computes the same thing in 10: one RoPE (and one copy) over q
and k together (adjacent heads of the fused output; RoPE works head by head with one
offset per row), and on CUDA each residual add inside its GEMM (`mx.addmm`). Every other
forward (prefill, the dense fallback) runs mlx-lm's code unchanged.

addmm rounds the product and the residual once where a matmul then an add round twice, so
with it the tokens may differ from mlx-lm's at near-ties (as the decode kernel's already
may). Without it (the CPU) the block's math is mlx-lm's bit for bit: the tests compare
tokens there. On the H200 (64 streams, 8B-shaped model) it served ~6% more tokens/s than
fused projections alone, so `auto` turns it on with the CUDA decode kernel.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import Llama3RoPE

from worker_proc.attention import PooledKVCache
from worker_proc.paged_attention import RopeSpec

logger = logging.getLogger(__name__)

def rope_spec(rope: nn.Module) -> RopeSpec | None:
    """The RopeSpec of an mlx-lm RoPE module (nn.RoPE, Llama3RoPE); None for other kinds
    (scaled variants that also scale the input)."""
    if type(rope) is nn.RoPE:
        return RopeSpec(rope.dims, rope.traditional, float(rope.base), float(rope.scale))
    if type(rope) is Llama3RoPE:  # its call: base None, scale 1, its own frequencies
        return RopeSpec(rope.dims, rope.traditional, None, 1.0, rope._freqs)
    return None


class FastDecodeBlock:
    """Mixed into a block's class (see speed_up_decode_blocks): its parameters and
    submodules stay where mlx-lm put them; only the call differs, for paged decode."""

    residual_in_gemm: bool = False  # set per block by speed_up_decode_blocks
    rope_spec: RopeSpec | None = None  # its attention's RoPE, ditto

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not (isinstance(cache, PooledKVCache) and cache.paged):
            return super().__call__(x, mask, cache)  # type: ignore[misc]
        attn, mlp = self.self_attn, self.mlp  # type: ignore[attr-defined]
        b, length, _ = x.shape
        n_q, n_kv = attn.n_heads, attn.n_kv_heads
        qkv = attn.qkv_proj(self.input_layernorm(x))  # type: ignore[attr-defined]
        dim = qkv.shape[-1] // (n_q + 2 * n_kv)
        rope = self._kernel_rope(cache, dim) if cache.attends_from_qkv else None
        if rope is not None:  # one kernel from the projection's output to o's input
            out = cache.attend_qkv(qkv, n_q, attn.scale, rope)
        else:
            qk = qkv[..., :(n_q + n_kv) * dim].reshape(b, length, n_q + n_kv, dim).transpose(0, 2, 1, 3)
            qk = attn.rope(qk, offset=cache.offset)
            values = qkv[..., (n_q + n_kv) * dim:].reshape(b, length, n_kv, dim).transpose(0, 2, 1, 3)
            cache.update_and_fetch(qk[:, n_q:], values)
            out = cache.paged_attention(qk[:, :n_q], attn.scale)
            out = out.transpose(0, 2, 1, 3).reshape(b, length, -1)
        h = self._residual(x, attn.o_proj, out)
        normed = self.post_attention_layernorm(h)  # type: ignore[attr-defined]
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
        if cache.backend.rope_in_kernel and spec is not None and spec.dims == head_dim:
            return spec
        return None

    def _residual(self, x: mx.array, proj: nn.Module, a: mx.array) -> mx.array:
        """x + proj(a), the add inside the GEMM where it may be."""
        if self.residual_in_gemm and type(proj) is nn.Linear and "bias" not in proj:
            # As 2-D operands: one GEMM over all rows, never a batch of one-row GEMMs.
            out = mx.addmm(x.reshape(-1, x.shape[-1]), a.reshape(-1, a.shape[-1]), proj.weight.T)
            return out.reshape(x.shape)
        return x + proj(a)


# mlx-lm block classes whose call, attention and MLP are the math FastDecodeBlock does
# (pre-norm residual block; q/k/v projections, with or without bias, RoPE on q and k with
# the cache's offset, attention, o projection; SwiGLU MLP), read from their source. Other
# model types reuse these modules (mistral is llama's).
_FAMILIES: dict[type, tuple[type, type]] = {
    llama.TransformerBlock: (llama.Attention, llama.MLP),
    qwen2.TransformerBlock: (qwen2.Attention, qwen2.MLP),
}
_FAST_CLASSES = {base: type(f"Fast{base.__module__.rsplit('.', 1)[-1].title()}Block",
                            (FastDecodeBlock, base), {}) for base in _FAMILIES}


def _eligible(block: nn.Module) -> bool:
    """A block of a family above, as mlx-lm builds it, with its q/k/v and gate/up fused."""
    parts = _FAMILIES.get(type(block))
    if parts is None:
        return False
    attn, mlp = block.self_attn, block.mlp
    if (type(attn), type(mlp)) != parts:
        return False
    return "qkv_proj" in attn and "gate_up_proj" in mlp


def speed_up_decode_blocks(model: nn.Module, residual_in_gemm: bool) -> int:
    """Give every eligible block (mlx-lm's llama or qwen2 block, projections fused) the
    decode call of FastDecodeBlock; returns how many. residual_in_gemm: residual adds
    inside the o and down GEMMs (CUDA)."""
    count = 0
    for _, module in model.named_modules():
        if _eligible(module):
            module.__class__ = _FAST_CLASSES[type(module)]
            module.residual_in_gemm = residual_in_gemm
            module.rope_spec = rope_spec(module.self_attn.rope)
            if module.rope_spec is not None:  # evaluated here, never inside a compiled trace
                mx.eval(module.rope_spec.kernel_params)
            count += 1
    if count:
        logger.info("%d blocks take the fast decode call (residual adds in GEMMs: %s)",
                    count, residual_in_gemm)
    return count
