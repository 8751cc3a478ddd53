"""How attention reads and writes the KV pool: one backend object per process.

`choose_decode_backend` picks it once, at start-up, from the device and the layers'
shapes; every decision that depends on it (is the pool written in place, may decode be
compiled, are dense decode contexts kept, which kernel attends, which prefill attention
runs) is a property or method of that object, not a check repeated where it is needed.
Layer kinds (worker_proc.layer_kinds) are orthogonal: each backend serves every kind,
given the slot table of the positions a kind's queries see (`PooledKVCache.reads`).

- `KernelDecode` (MLX's CUDA backend, head sizes the kernel takes): the paged kernel
  reads the pool; the pool is written in place; decode may run through mx.compile.
  Its options are the `--experiments` A/B paths.
- `GatherDecode` (CPU, Metal, other head sizes): plain MLX. Decode attends over dense
  contexts kept across steps (DenseDecodeContext), or a gather from the pool when a batch
  is over their budget; the pool is a scatter-written MLX array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear

from ipc.config import (CUDA_CORE_EXPERIMENTS, DECODE_EXPERIMENTS, TENSOR_CORE_EXPERIMENTS,
                        kernel_body_conflict)
from worker_proc.paged_attention import (DEFAULT_STAGES, DEFAULT_WARP_TILES, fits_shared_memory,
                                         kernel_available, LatentConfig, mma_preferred,
                                         MMA_WIDE_TILES, MmaConfig,
                                         paged_decode_attention, paged_decode_qkv_attention,
                                         paged_decode_write_attention, paged_latent_attention,
                                         reference_decode_attention, reference_latent_attention,
                                         RopeSpec, tensor_cores_available)
from worker_proc.layer_kinds import Kind
from worker_proc.paged_prefill import paged_prefill_attention, paged_prefill_fits
from worker_proc.pool_writes import pool_write_in_place, rows_write_in_place
from worker_proc.prefill_attention import (bucketed_fused_attention, bucketed_masked_attention,
                                           causal_mask, fused_bucket_padding,
                                           fused_builds_per_shape, FUSED_PREFILL_BUCKET,
                                           masked_bias, masked_bias_fits,
                                           unfused_prefill_attention, unfused_prefill_fits)
from worker_proc.qk_norm_rope import decode_qk_norm_rope, fits as qk_norm_rope_fits
from worker_proc.expert_rows import expert_rows, fits as expert_rows_fit
from worker_proc.expert_rows import preferred as expert_rows_preferred
from worker_proc.fused_moe import NextNorm, Routed, Routing, combine as moe_combine
from worker_proc.fused_moe import fits as moe_route_fits
from worker_proc.fused_moe import route as moe_route
from worker_proc.residual_norm import add_norm, fits as residual_norm_fits, residual_norm

if TYPE_CHECKING:
    from worker_proc.attention import DenseDecodeContext, PooledKVCache

# Where decode attends over kept dense contexts, they may use this share of the pool's
# bytes on top of it (build_runner sizes the pool to leave the room).
DENSE_DECODE_SHARE = 0.5

# Masked prefill forwards shorter than this stay unfused (bucketed_masked): their scores
# are small, and padding them to a bucket would mostly compute padding.
MASKED_MIN_QUERIES = 256

EXPERIMENTS = frozenset(DECODE_EXPERIMENTS)  # the names --experiments takes

Once = Callable[[tuple, Callable[[], Any]], Any]  # ForwardLayout.once's shape


def _every_time(key: tuple, make: Callable[[], Any]) -> Any:
    """A `once` that shares nothing (a caller without a forward's layout)."""
    return make()


class DecodeBackend:
    """The interface both backends give the runner, the pool and the layer caches."""

    name: str = ""
    in_place: bool = False  # the pool is written in place (steps may launch back to back)
    compiles: bool = False  # decode may run through mx.compile
    kept_share: float = 0.0  # dense decode contexts' bytes, as a share of the pool's
    write_in_attention: bool = False  # decode K/V are stored by the attention kernel
    rope_in_kernel: bool = False  # ... which may also rotate q and k (fast blocks)
    bucketed_prefill: bool = False  # long causal prefill chunks padded to recurring shapes
    bucketed_masked: bool = False  # ... and masked ones
    align_chunks: bool = False  # prompt chunks end on the fused prefill bucket's edges
    pad_tails: bool = False  # a lone unaligned chunk runs padded (ModelRunner.pad_tails)
    prefill_bucket: int = FUSED_PREFILL_BUCKET  # the padded prefill shapes' multiple
    mixed_forward: bool = False  # a step's lone prompt chunk rides in its decode forward
    attends_latent: bool = False  # latent (MLA) layers' decode reads the pool's keys itself

    def decode_context(self, num_layers: int, pool_bytes: int,
                       bytes_per_token: int) -> DenseDecodeContext | None:
        """The dense contexts decode keeps across steps, if this backend keeps any."""
        return None

    def attend(self, cache: PooledKVCache, queries: mx.array, scale: float,
               sinks: mx.array | None) -> mx.array:
        raise NotImplementedError

    def attend_qkv(self, cache: PooledKVCache, qkv: mx.array, n_q: int, scale: float,
                   rope: RopeSpec) -> mx.array:
        raise RuntimeError(f"{self.name} decode cannot attend from a fused q/k/v output")

    def attend_latent(self, cache: PooledKVCache, queries: mx.array, scale: float,
                      bias: mx.array) -> mx.array:
        """A latent layer's decode attention: the pool's keys (the latent) as keys and
        values, `bias` [B, H, 1, L] added to the scores (where attends_latent)."""
        raise RuntimeError(f"{self.name} decode does not attend latent layers over the pool")

    def prefill_attention(self, queries: mx.array, keys: mx.array, values: mx.array,
                          scale: float, mask: Any, sinks: mx.array | None,
                          once: Once = _every_time) -> mx.array | None:
        """A prefill forward's attention, or None for mlx-lm's own (MLX's fused one).
        once: what the forward's layers share is made by it (ForwardLayout.once)."""
        return None

    def paged_prefill_attention(self, cache: PooledKVCache, queries: mx.array, scale: float,
                                sinks: mx.array | None) -> mx.array | None:
        """A prefill forward's attention read straight from the pool (the layer's K/V for
        this forward already stored), or None for the gathered K/V's path."""
        return None

    def own_prefill_attention(self, queries: mx.array, keys: mx.array, values: mx.array,
                              scale: float, mask: Any, sinks: mx.array | None,
                              once: Once = _every_time) -> mx.array | None:
        """A prefill forward's attention call from a layer that computes its own scores
        (MLA's expanded K/V, its RoPE scores as a float mask), or None for MLX's fused
        call."""
        return None

    def norm_rope_qk(self, qkv: mx.array, heads: int, lengths: mx.array,
                     scale: mx.array | None, eps: float, rope: RopeSpec | None) -> mx.array | None:
        """A decode step's q and k heads (the first `heads` of the fused q/k/v output
        [B, 1, F]) RMS-normalised and scaled by `scale` [heads, D] (None: neither) and
        rotated at each row's new position by `rope` (over whole heads: its dims the head
        size), as qk_norm_rope.reference_qk_norm_rope computes them, [B, heads, 1, D];
        None: the caller runs those ops itself."""
        return None

    def residual_norm(self, branch: mx.array, residual: mx.array, weight: mx.array,
                      eps: float, next_weight: mx.array | None = None
                      ) -> tuple[mx.array, mx.array | None] | None:
        """A decode step's residual + rms_norm(branch, weight) and, with next_weight, that
        sum normalised again (Gemma's sandwich norms), as
        residual_norm.reference_residual_norm computes them; None: the caller runs those
        ops itself."""
        return None

    def add_norm(self, branch: mx.array, bias: mx.array | None, residual: mx.array,
                 weight: mx.array, eps: float) -> tuple[mx.array, mx.array] | None:
        """A decode step's residual + (branch + bias) and that sum's RMS norm, as
        residual_norm.reference_add_norm computes them; None: the caller runs those ops
        itself."""
        return None

    def route_experts(self, logits: mx.array, routing: Routing,
                      bias: mx.array | None = None) -> Routed | None:
        """A decode step's tokens routed to their experts from the router's logits [N, E]
        and bias [E] (fused_moe.route, as reference_route computes it); None: the block
        runs mlx-lm's MLP call itself."""
        return None

    # Whether fused_experts takes a quantized router's logits through its dequantized
    # weight (fused_moe.router_logits): MLX's CUDA quantized matmul at a decode step's
    # rows is a naive kernel, slower than the dense GEMM by far.
    dense_routers = False

    def expert_rows(self, module: nn.Module, x: mx.array, routed: Routed,
                    gather: bool) -> mx.array | None:
        """An experts' projection (without its bias) of route_experts' pairs: of x's rows
        named by the pairs' tokens (gather) or of x's rows in pair order, [pairs, 1, out]
        (expert_rows.expert_rows, as reference_expert_rows computes it); None: the caller
        runs MLX's gather_qmm itself."""
        return None

    def combine_experts(self, down: mx.array, routed: Routed, bias: mx.array | None,
                        out_dims: int, residual: mx.array | None,
                        next_norm: NextNorm | None = None) -> tuple[mx.array, mx.array | None]:
        """The experts' down outputs of route_experts' pairs back as the tokens' MLP
        outputs plus the residual, and with next_norm that sum normalised
        (fused_moe.combine, as reference_combine computes them)."""
        raise RuntimeError(f"{self.name} decode does not route experts")

    def latent_path(self, specs: list) -> str | None:
        """How latent (MLA) layers decode, for the start-up log (None: the model has none)."""
        from worker_proc.kv_pool import attention_specs

        if not any(s.kind.latent for s in attention_specs(specs)):
            return None
        return "the model's own code over gathered K/V"

    def fuses_long_prefill(self, specs: list) -> bool:
        """Whether long causal prefill chunks over these attention layers run fused at
        recurring shapes, their scores never in memory: chunks may then be longer
        (ServerConfig.chunk_size)."""
        return False

    def write_rows(self, layer: mx.array, slots: mx.array, keys: mx.array, values: mx.array,
                   after: mx.array | None) -> mx.array:
        """In place: store the rows into the layer's own buffer; returns the write's mark."""
        raise RuntimeError(f"{self.name} decode does not write the pool in place")

    def write_state_rows(self, state: mx.array, rows: mx.array, value: mx.array,
                         after: mx.array | None) -> mx.array:
        """In place: store value's rows as rows `rows` of a recurrent layer's state array;
        returns the write's mark."""
        raise RuntimeError(f"{self.name} decode does not write the pool in place")


@dataclass(frozen=True)
class KernelDecode(DecodeBackend):
    """The CUDA paged-attention kernel over an in-place pool.

    write_in_attention: the decode kernel stores the step's K/V itself (a launch less a
    layer; off only for A/B runs). rope_in_kernel: fast decode blocks hand it the fused
    q/k/v output unrotated (`--experiments rope-in-kernel`). stages: K/V staged through
    shared memory with cp.async this many tiles ahead (the default), 0 for register
    prefetch (`--experiments register-kv`). warp_tiles: each warp copies its own tokens'
    rows of the staged tiles (off, the whole block copies them: `--experiments
    block-tiles`). bucketed_prefill: causal prefill attention of long
    chunks through MLX's fused kernel at padded shapes (bucketed_fused_attention), the
    rest unfused; off, every prefill attention that fits is unfused (`--experiments
    unfused-prefill`, the A/B arm). bucketed_masked: masked prefill forwards of
    MASKED_MIN_QUERIES+ queries (rows at different starts, windows) through the fused
    kernel too, padded and with the mask as a bias (bucketed_masked_attention); off,
    those stay unfused (`--experiments unfused-masked-prefill`, the A/B arm).
    align_chunks: the scheduler ends a prompt's unfinished chunks
    on the bucket's edges (worker_proc.prefill_chunking; `--experiments unaligned-chunks`
    is the A/B arm); a prompt's last chunk after aligned ones then runs padded to a whole
    bucket, the shape of its earlier chunks (ModelRunner.tail_bucket). pad_tails: where
    tail_bucket pads no tail (chunks not aligned, or windowed layers, which it cannot
    trace), a step's lone prompt chunk runs padded to a multiple of
    worker_proc.runner.TAIL_MULTIPLE tokens (ModelRunner.pad_tails; `--experiments
    unpadded-tails` is the A/B arm): a prompt's last chunk then meets a few recurring
    shapes, not a new one each, whose first forward costs MLX milliseconds of host work
    (docs/benchmarks.md, session 55).
    mixed_forward:
    a step's lone prompt chunk and its decode rows run as one forward, their GEMMs
    reading the weights once (ModelRunner._mixed, decode_block.MixedLayerCache's
    blocks; `--experiments mixed-forward` turns it on). mma: decode attention through
    the tensor-core kernel of this shape where it serves the heads (MmaConfig.fits:
    16-bit pools), the CUDA-core one elsewhere (None: everywhere); by default on sm_80+
    for heads up to 128 wide (see _tensor_cores). latent: latent (MLA) layers' decode
    through the latent kernel of this shape (None: over K/V gathered by the model's own
    code, `--experiments gathered-latent`). own_prefill: a prefill forward's attention
    call from a layer with its own scores through prefill_attention, as every other
    layer's (off, MLX's fused call: `--experiments fused-own-prefill`). qk_norm_kernel:
    per-head q/k norms and RoPE of a decode step in one kernel (norm_rope_qk; off, MLX's
    norm, multiply and RoPE: `--experiments unfused-qk-norm`). qk_rope_kernel: the same
    kernel's RoPE alone for blocks without q/k norms (llama, qwen2, GPT-OSS) in place of
    MLX's copy and RoPE (off: `--experiments unfused-qk-rope`). residual_norm_kernel: a
    decode step's sandwich norms and residual adds (Gemma 3's) in one kernel a pair
    (residual_norm; off: `--experiments unfused-residual-norm`, which also turns off
    add_norm, GPT-OSS's attention residual and MLP norm in one kernel). moe_kernels: a decode
    step's mixture-of-experts routing and the weighted sum of its experts' outputs in a
    kernel each (fused_moe; off: `--experiments unfused-moe`); expert_rows_kernel: with
    them, 4-bit experts' projections of the sorted pairs through expert_rows' tensor-core
    kernel once a step has as many pairs as experts, not MLX's gather_qmm (off:
    `--experiments mlx-expert-matmuls`); dense_expert_rows: bfloat16 experts' too, not
    MLX's gather_mm (`--experiments bf16-expert-rows`). paged_prefill: prefill
    attention of full and sliding layers whose heads cuDNN does not take (Gemma's 256,
    float32) through the paged prefill kernel, which reads each row's context from the
    pool: no gather, no score matrix in memory (off: `--experiments unpaged-prefill`,
    MLX's matmul attention). paged_short_rows: also rows of at most
    paged_prefill_max_queries queries over a computed context where cuDNN takes the
    heads (`--experiments paged-short-rows`)."""

    write_in_attention: bool = True
    rope_in_kernel: bool = False
    stages: int = DEFAULT_STAGES
    warp_tiles: bool = DEFAULT_WARP_TILES
    bucketed_prefill: bool = True
    bucketed_masked: bool = True
    align_chunks: bool = True
    pad_tails: bool = True
    prefill_bucket: int = FUSED_PREFILL_BUCKET
    mixed_forward: bool = False
    mma: MmaConfig | None = None
    latent: LatentConfig | None = LatentConfig()
    own_prefill: bool = True
    qk_norm_kernel: bool = True
    qk_rope_kernel: bool = True
    residual_norm_kernel: bool = True
    moe_kernels: bool = True
    expert_rows_kernel: bool = True
    dense_expert_rows: bool = False
    # Kept on by default where cuDNN does not take the heads: MLX's matmul attention
    # there holds float32 scores whose peaks push the device pool over MLX's 95% line,
    # after which MLX empties its buffer cache (docs/benchmarks.md, session 53).
    paged_prefill: bool = True
    paged_short_rows: bool = False
    # Rows of more queries than this go to cuDNN where it serves their heads: past a few
    # hundred queries a row the chunk is arithmetic, which cuDNN's kernel does faster
    # than the paged one (docs/benchmarks.md, session 32); None: no limit.
    paged_prefill_max_queries: int | None = 256

    @property
    def name(self) -> str:
        return "CUDA kernel" + (" (tensor cores)" if self.mma is not None else "")

    @property
    def attends_latent(self) -> bool:  # type: ignore[override]
        return self.latent is not None

    @property
    def dense_routers(self) -> bool:  # type: ignore[override]
        return self.moe_kernels

    in_place = True
    compiles = True

    def attend(self, cache: PooledKVCache, queries: mx.array, scale: float,
               sinks: mx.array | None) -> mx.array:
        pool, layer = cache.pool, cache.layer
        table, lengths = cache.reads()
        unwritten = cache.take_unwritten()
        if unwritten is not None:  # this step's K/V stored by the same launch
            keys, values = unwritten
            out, mark = self._write_attend(queries, keys, values, cache.write_slots,
                                           pool.layers[layer], table, lengths, scale,
                                           pool.mark(layer), sinks)
            pool.record_write(layer, mark)
            return out
        return self._attend(queries, pool.layers[layer], table, lengths, scale,
                            pool.mark(layer), sinks)

    def attend_qkv(self, cache: PooledKVCache, qkv: mx.array, n_q: int, scale: float,
                   rope: RopeSpec) -> mx.array:
        """One launch from the fused q/k/v projection's output, unrotated, to the o
        projection's input: RoPE, the pool write and attention."""
        pool, layer, layout = cache.pool, cache.layer, cache.layout
        out, mark = self._qkv_attend(qkv, n_q, rope, layout.write_slots, pool.layers[layer],
                                     layout.read_slots, layout.lengths, scale, pool.mark(layer))
        pool.record_write(layer, mark)
        return out

    def attend_latent(self, cache: PooledKVCache, queries: mx.array, scale: float,
                      bias: mx.array) -> mx.array:
        pool, layer = cache.pool, cache.layer
        table, lengths = cache.reads()
        return self._latent_attend(queries, pool.layers[layer], table, lengths, bias, scale,
                                   pool.mark(layer))

    def prefill_attention(self, queries: mx.array, keys: mx.array, values: mx.array,
                          scale: float, mask: Any, sinks: mx.array | None,
                          once: Once = _every_time) -> mx.array | None:
        if not self._fused_builds_per_shape(queries, values):
            return None  # MLX's matmul fallback, which builds nothing per shape
        # A float mask is added to the scores (MLA's RoPE part, its model's own): no
        # bucketed bias is made of it, the unfused path takes it as it is.
        additive = isinstance(mask, mx.array) and mask.dtype != mx.bool_
        # Whether the unfused path below can take it (float32 scores within bounds).
        unfused_fits = unfused_prefill_fits(queries.shape, keys.shape[2], 2 if additive else 1)
        if self.bucketed_prefill and not additive and not (
                unfused_fits and _short_fresh_prompts(queries, keys)):
            pad = fused_bucket_padding(queries.shape[2], keys.shape[2], mask,
                                       self.prefill_bucket)
            if pad is not None:
                return bucketed_fused_attention(queries, keys, values, scale, pad, sinks)
            if self._masked_bucketing(queries.shape[2], keys.shape[2], mask):
                bias = _shared_bias(mask, queries.shape[2], keys.shape[2], queries.dtype, once,
                                    self.prefill_bucket)
                return bucketed_masked_attention(queries, keys, values, scale, bias, sinks)
        # No cuDNN graph build per prompt shape, while the float32 scores stay small.
        if unfused_fits:
            if isinstance(mask, str):  # one causal mask for the forward's layers
                n_new, n_keys = queries.shape[2], keys.shape[2]
                mask = once(("causal mask", n_new, n_keys),
                            lambda: causal_mask(n_new, n_keys))
            return unfused_prefill_attention(queries, keys, values, scale, mask, sinks)
        return None

    def paged_prefill_attention(self, cache: PooledKVCache, queries: mx.array, scale: float,
                                sinks: mx.array | None) -> mx.array | None:
        kind, layout, pool, layer = cache.kind, cache.layout, cache.pool, cache.layer
        spec = pool.specs[layer]
        if not (queries.dtype == spec.dtype and self._pages_prefill(spec)):
            return None
        if self._fused_builds_per_shape(queries, queries):
            limit = self.paged_prefill_max_queries
            long_rows = limit is not None and queries.shape[2] > limit
            if not self.paged_short_rows or layout.fresh or long_rows:
                return None  # cuDNN: a fresh prompt's own K/V, a long chunk, by default all
        table = cache.read_slots
        offset = layout.offset
        starts = (mx.zeros((table.shape[0],), dtype=mx.int32) + offset
                  if isinstance(offset, int) else offset)
        window = kind.span if kind.kind is Kind.SLIDING else 0
        return self._paged_prefill(queries, pool.layers[layer], table, starts, scale,
                                   pool.mark(layer), window, sinks)

    def latent_path(self, specs: list) -> str | None:
        from worker_proc.kv_pool import attention_specs

        latent = [s for s in attention_specs(specs) if s.kind.latent]
        if not latent or self.latent is None:
            return super().latent_path(specs)
        if all(self._latent_kernel_takes(s.dtype, s.dtype, s.head_dim, s.head_dim + s.v_head_dim)
               for s in latent):
            return "the latent kernel (tensor cores)"
        return "attention over the gathered latent (plain MLX)"

    def norm_rope_qk(self, qkv: mx.array, heads: int, lengths: mx.array,
                     scale: mx.array | None, eps: float, rope: RopeSpec | None) -> mx.array | None:
        wanted = self.qk_rope_kernel if scale is None else self.qk_norm_kernel
        if not (wanted and rope is not None and qk_norm_rope_fits(rope)):
            return None
        return self._qk_norm_rope(qkv, heads, lengths, scale, eps, rope)

    def residual_norm(self, branch: mx.array, residual: mx.array, weight: mx.array,
                      eps: float, next_weight: mx.array | None = None
                      ) -> tuple[mx.array, mx.array | None] | None:
        if not (self.residual_norm_kernel and residual_norm_fits(branch.shape[-1])):
            return None
        return self._residual_norm(branch, residual, weight, eps, next_weight)

    def add_norm(self, branch: mx.array, bias: mx.array | None, residual: mx.array,
                 weight: mx.array, eps: float) -> tuple[mx.array, mx.array] | None:
        dtype = branch.dtype  # the kernel writes it (mlx-lm's ops would promote)
        if not (self.residual_norm_kernel and residual_norm_fits(branch.shape[-1])
                and residual.dtype == weight.dtype == dtype
                and (bias is None or bias.dtype == dtype)):
            return None
        return self._add_norm(branch, bias, residual, weight, eps)

    def route_experts(self, logits: mx.array, routing: Routing,
                      bias: mx.array | None = None) -> Routed | None:
        if not (self.moe_kernels and moe_route_fits(logits, routing, bias)):
            return None
        return self._route_experts(logits, routing, bias)

    def expert_rows(self, module: nn.Module, x: mx.array, routed: Routed,
                    gather: bool) -> mx.array | None:
        if not (self.moe_kernels and self.expert_rows_kernel and routed.grouped
                and (self.dense_expert_rows or type(module) is not SwitchLinear)
                and self._expert_rows_takes(module, x, routed.experts.shape[0])):
            return None
        return self._expert_rows(module, x, routed.experts, routed.rows if gather else None)

    def combine_experts(self, down: mx.array, routed: Routed, bias: mx.array | None,
                        out_dims: int, residual: mx.array | None,
                        next_norm: NextNorm | None = None) -> tuple[mx.array, mx.array | None]:
        return self._combine_experts(down, routed, bias, out_dims, residual, next_norm)

    def own_prefill_attention(self, queries: mx.array, keys: mx.array, values: mx.array,
                              scale: float, mask: Any, sinks: mx.array | None,
                              once: Once = _every_time) -> mx.array | None:
        if not self.own_prefill:
            return None
        return self.prefill_attention(queries, keys, values, scale, mask, sinks, once)

    def _masked_bucketing(self, n_new: int, n_keys: int, mask: Any) -> bool:
        """Whether a forward goes to bucketed_masked_attention: a mask (or "causal") and
        enough queries, and a bias of bounded size."""
        if not (self.bucketed_masked and n_new >= MASKED_MIN_QUERIES):
            return False
        bucket = self.prefill_bucket
        if isinstance(mask, str):
            return masked_bias_fits(1, n_new, n_keys, bucket)
        return isinstance(mask, mx.array) and masked_bias_fits(
            mask.shape[0] if mask.ndim == 4 else 1, n_new, n_keys, bucket)

    def fuses_long_prefill(self, specs: list) -> bool:
        # Only cuDNN's heads. Heads it does not take keep mlx-lm's chunk, unaligned, even
        # where the paged prefill kernel serves them (Gemma's 256): Gemma-3-12B's 4,096-token
        # chunks beside an H100's pool ran out of memory or hung the worker, and aligning
        # chunks of 2,048 bought nothing (docs/benchmarks.md, session 54).
        return self.bucketed_prefill and all(
            fused_builds_per_shape(s.dtype, s.head_dim, s.v_head_dim) for s in specs)

    def _pages_prefill(self, spec: Any) -> bool:
        """Whether prefill attention of this layer can read the pool through the paged
        prefill kernel (full or sliding attention through the hook, keys and values
        apart, heads the kernel takes)."""
        kind = spec.kind
        return (self.paged_prefill and kind.kind in (Kind.FULL, Kind.SLIDING)
                and not kind.own_attention and not spec.values_are_keys
                and self._paged_prefill_takes(spec.dtype, spec.dtype, spec.head_dim,
                                              spec.v_head_dim))

    def _fused_builds_per_shape(self, queries: mx.array, values: mx.array) -> bool:
        return fused_builds_per_shape(queries.dtype, queries.shape[-1], values.shape[-1])

    def write_rows(self, layer: mx.array, slots: mx.array, keys: mx.array, values: mx.array,
                   after: mx.array | None) -> mx.array:
        return pool_write_in_place(layer, slots, keys, values, after)

    def write_state_rows(self, state: mx.array, rows: mx.array, value: mx.array,
                         after: mx.array | None) -> mx.array:
        return rows_write_in_place(state, rows, value, after)

    # The kernels themselves: a stand-in (the CPU tests') replaces these.
    def _attend(self, q: mx.array, pool: mx.array, table: mx.array, lengths: mx.array,
                scale: float, written: mx.array | None, sinks: mx.array | None) -> mx.array:
        return paged_decode_attention(q, pool, table, lengths, scale, written, sinks=sinks,
                                      stages=self.stages, mma=self.mma,
                                      warp_tiles=self.warp_tiles)

    def _write_attend(self, q: mx.array, keys: mx.array, values: mx.array, slots: mx.array,
                      pool: mx.array, table: mx.array, lengths: mx.array, scale: float,
                      after: mx.array | None,
                      sinks: mx.array | None = None) -> tuple[mx.array, mx.array]:
        return paged_decode_write_attention(q, keys, values, slots, pool, table, lengths,
                                            scale, after, sinks=sinks, stages=self.stages,
                                            mma=self.mma, warp_tiles=self.warp_tiles)

    def _paged_prefill_takes(self, dtype: mx.Dtype, pool_dtype: mx.Dtype, key_dim: int,
                             value_dim: int) -> bool:
        return paged_prefill_fits(dtype, pool_dtype, key_dim, value_dim)

    def _paged_prefill(self, q: mx.array, pool: mx.array, table: mx.array, starts: mx.array,
                       scale: float, written: mx.array | None, window: int,
                       sinks: mx.array | None) -> mx.array:
        return paged_prefill_attention(q, pool, table, starts, scale, written, window, sinks)

    def _latent_attend(self, q: mx.array, pool: mx.array, table: mx.array, lengths: mx.array,
                       bias: mx.array, scale: float, written: mx.array | None) -> mx.array:
        """The latent kernel where the device and the queries take it, else its plain-MLX
        meaning over the gathered latent."""
        if self.latent is not None and self._latent_kernel_takes(q.dtype, pool.dtype,
                                                                 q.shape[-1], pool.shape[-1]):
            return paged_latent_attention(q, pool, table, lengths, bias, scale, written,
                                          self.latent)
        return reference_latent_attention(q, pool, table, lengths, bias, scale, written)

    def _qk_norm_rope(self, qkv: mx.array, heads: int, lengths: mx.array,
                      scale: mx.array | None, eps: float, rope: RopeSpec) -> mx.array:
        return decode_qk_norm_rope(qkv, heads, lengths, scale, eps, rope)

    def _residual_norm(self, branch: mx.array, residual: mx.array, weight: mx.array,
                       eps: float, next_weight: mx.array | None
                       ) -> tuple[mx.array, mx.array | None]:
        return residual_norm(branch, residual, weight, eps, next_weight)

    def _add_norm(self, branch: mx.array, bias: mx.array | None, residual: mx.array,
                  weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        return add_norm(branch, bias, residual, weight, eps)

    def _route_experts(self, logits: mx.array, routing: Routing,
                       bias: mx.array | None) -> Routed:
        return moe_route(logits, routing, bias)

    def _combine_experts(self, down: mx.array, routed: Routed, bias: mx.array | None,
                         out_dims: int, residual: mx.array | None,
                         next_norm: NextNorm | None) -> tuple[mx.array, mx.array | None]:
        return moe_combine(down, routed, bias, out_dims, residual, next_norm)

    def _expert_rows(self, module: nn.Module, x: mx.array, experts: mx.array,
                     tokens: mx.array | None) -> mx.array:
        return expert_rows(module, x, experts, tokens)

    def _expert_rows_takes(self, module: nn.Module, x: mx.array, pairs: int) -> bool:
        return (expert_rows_fit(module, x.shape[-1], x.dtype)
                and expert_rows_preferred(module, pairs))

    def _latent_kernel_takes(self, dtype: mx.Dtype, pool_dtype: mx.Dtype, dim: int,
                             row: int) -> bool:
        """Whether the latent kernel serves a latent of `dim` in pool rows of `row`
        elements: the device has tensor cores (sm_80+) and LatentConfig.fits."""
        return (self.latent is not None and tensor_cores_available()
                and self.latent.fits(dtype, pool_dtype, dim, row))

    def _qkv_attend(self, qkv: mx.array, n_q: int, rope: RopeSpec, slots: mx.array,
                    pool: mx.array, table: mx.array, lengths: mx.array, scale: float,
                    after: mx.array | None) -> tuple[mx.array, mx.array]:
        return paged_decode_qkv_attention(qkv, n_q, rope, slots, pool, table, lengths, scale,
                                          after, stages=self.stages, mma=self.mma,
                                          warp_tiles=self.warp_tiles)


@dataclass(frozen=True)
class GatherDecode(DecodeBackend):
    """Plain MLX: dense decode contexts kept across steps, a gather when over budget."""

    name = "plain MLX"
    kept_share = DENSE_DECODE_SHARE

    def decode_context(self, num_layers: int, pool_bytes: int,
                       bytes_per_token: int) -> DenseDecodeContext:
        from worker_proc.attention import DenseDecodeContext

        return DenseDecodeContext(num_layers, budget_bytes=int(pool_bytes * self.kept_share),
                                  bytes_per_token=bytes_per_token)

    def attend(self, cache: PooledKVCache, queries: mx.array, scale: float,
               sinks: mx.array | None) -> mx.array:
        dense = cache.layout.dense
        if dense is not None and dense.active:
            return dense.attention(cache.layer, queries, scale, cache.kind, sinks)
        pool, layer = cache.pool, cache.layer
        table, lengths = cache.reads()  # over budget: gather from the pool for this layer
        return reference_decode_attention(queries, pool.layers[layer], table, lengths, scale,
                                          pool.mark(layer), sinks)


def _shared_bias(mask: Any, n_new: int, n_keys: int, dtype: mx.Dtype, once: Once,
                 bucket: int) -> mx.array:
    """masked_bias of a forward's mask, made once for all its layers. "causal": causal,
    but a fresh forward under a bucket long or one after a prefix that is not a bucket's
    multiple (a prefix hit's arbitrary length, chunks cut off the edges), where an
    explicit mask lets both sides pad to buckets (fused_bucket_padding takes the rest). A
    mask array is shared by the forward's layers (the layout's or the model's) and told
    apart by id: the memo holds it, so no other array takes that id meanwhile."""
    causal = isinstance(mask, str)

    def make() -> tuple[Any, mx.array]:
        return mask, masked_bias(causal_mask(n_new, n_keys) if causal else mask, dtype, bucket)

    _, bias = once(("masked bias", (mask, n_new, n_keys) if causal else id(mask), dtype), make)
    return bias


def kernel_misfit(specs: list) -> str | None:
    """Why the CUDA kernel cannot serve these layers' K/V (recurrent layers keep none), or
    None where it can: it spreads a head over a warp's 32 lanes, keys and values of one
    size, and a block's query heads (those of one KV head) fit its shared memory. A layer
    that computes its own scores never meets the paged kernel (it reads dense K/V gathered
    from the pool; a latent one, the latent kernel's), so MLA's 512-wide latent beside its
    64-wide RoPE part still gets the in-place pool, compiled decode and steps launched
    back to back."""
    from worker_proc.kv_pool import attention_specs

    for i, s in enumerate(attention_specs(specs)):
        if s.kind.own_attention:
            continue
        if s.head_dim % 32 or s.v_head_dim != s.head_dim:
            return (f"attention layer {i}: keys {s.head_dim} and values {s.v_head_dim} wide "
                    "(the kernel takes one size, a multiple of 32)")
        group = max(1, s.query_heads // s.n_kv_heads)
        if not fits_shared_memory(s.head_dim, group):
            return (f"attention layer {i}: {group} query heads a KV head of {s.head_dim} "
                    "(more than a thread block's shared memory holds)")
    return None


def kernel_fits(specs: list) -> bool:
    """Whether the CUDA kernel can serve these layers (kernel_misfit)."""
    return kernel_misfit(specs) is None


def _tensor_cores(specs: list, experiments: frozenset[str]) -> MmaConfig | None:
    """The tensor-core kernel's shape decode attention takes, or None for the CUDA-core
    kernel: where the device has tensor cores, by default where every kernel-served
    layer's heads are ones it is faster for (mma_preferred), always with `--experiments
    mma-attention` or `mma-wide-tiles` (tiles in up to 64 KiB), never with
    `cuda-core-attention` or `register-kv` (the CUDA-core kernel's option). Each layer's
    dtype and shape still decide at launch (MmaConfig.fits)."""
    from worker_proc.kv_pool import attention_specs

    if conflict := kernel_body_conflict(experiments):
        raise ValueError(conflict)
    forced = experiments & TENSOR_CORE_EXPERIMENTS
    if experiments & CUDA_CORE_EXPERIMENTS or not tensor_cores_available():
        return None
    if not forced and not all(mma_preferred(s.head_dim) for s in attention_specs(specs)
                              if not s.kind.own_attention):
        return None
    return MMA_WIDE_TILES if "mma-wide-tiles" in experiments else MmaConfig()


def _short_fresh_prompts(queries: mx.array, keys: mx.array) -> bool:
    """Whether a prefill forward is several fresh prompts shorter than FUSED_PREFILL_BUCKET
    (a burst's shared forward), which the unfused path takes where its scores fit: cuDNN
    builds a graph for every new shape, the prompt count included, and a burst's forwards
    of short prompts meet a new count nearly every time (a 64-prompt wave's steps started
    in ~200 ms on the H100 with the 128-token bucket that sent those of 128+ tokens to
    cuDNN, against 9-50 ms before; docs/benchmarks.md, session 40). Those of 256-511
    tokens had gone to cuDNN through the masked path at any bucket; unfused now too,
    unmeasured. (Rows at different starts whose keys end at the longest query row pass
    this test too; the unfused path takes their mask as it is.)"""
    return (queries.shape[0] > 1 and keys.shape[2] == queries.shape[2]
            and queries.shape[2] < FUSED_PREFILL_BUCKET)


def choose_decode_backend(specs: list, experiments: frozenset[str] = frozenset(),
                          prefill_bucket: int = FUSED_PREFILL_BUCKET) -> DecodeBackend:
    """The kernel where MLX runs on CUDA and the layers fit it, else plain MLX; the
    `--experiments` names become the kernel's options (refused elsewhere), prefill_bucket
    its padded prefill shapes' multiple (paged_attention.prefill_bucket_for)."""
    unknown = experiments - EXPERIMENTS
    if unknown:
        raise ValueError(f"--experiments: unknown {', '.join(sorted(unknown))}")
    if not (kernel_available() and kernel_fits(specs)):
        if experiments:
            raise ValueError("--experiments: these decode paths need the CUDA kernel (MLX's "
                             "CUDA backend, head sizes a multiple of 32)")
        return GatherDecode()
    return KernelDecode(rope_in_kernel="rope-in-kernel" in experiments,
                        stages=0 if "register-kv" in experiments else DEFAULT_STAGES,
                        warp_tiles="block-tiles" not in experiments,
                        bucketed_prefill="unfused-prefill" not in experiments,
                        bucketed_masked="unfused-masked-prefill" not in experiments,
                        align_chunks="unaligned-chunks" not in experiments,
                        pad_tails="unpadded-tails" not in experiments,
                        mixed_forward="mixed-forward" in experiments,
                        mma=_tensor_cores(specs, experiments),
                        latent=None if "gathered-latent" in experiments else LatentConfig(),
                        own_prefill="fused-own-prefill" not in experiments,
                        qk_norm_kernel="unfused-qk-norm" not in experiments,
                        qk_rope_kernel="unfused-qk-rope" not in experiments,
                        residual_norm_kernel="unfused-residual-norm" not in experiments,
                        moe_kernels="unfused-moe" not in experiments,
                        expert_rows_kernel="mlx-expert-matmuls" not in experiments,
                        dense_expert_rows="bf16-expert-rows" in experiments,
                        paged_prefill="unpaged-prefill" not in experiments,
                        paged_short_rows="paged-short-rows" in experiments,
                        prefill_bucket=prefill_bucket)
