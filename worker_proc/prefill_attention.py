"""Prefill attention on the CUDA backend: MLX's fused call at bucketed shapes (causal, or
with a masked forward's mask as a padded bias), and the matmul path (unfused) where its
scores fit; the masks they share."""

from __future__ import annotations

import mlx.core as mx

# Largest float32 score matrix (all heads and rows of one forward) the matmul prefill path
# may materialise; a bigger one (a long chunk deep into a long context) takes MLX's fused
# attention, whose memory does not grow with the context, and pays its per-shape build.
UNFUSED_SCORES_MAX_BYTES = 1 << 30


def unfused_prefill_fits(q_shape: tuple[int, ...], key_len: int, copies: int = 1) -> bool:
    """Whether unfused_prefill_attention's scores for q [B, Hq, S, D] over key_len keys
    stay within UNFUSED_SCORES_MAX_BYTES (copies: float32 arrays of their size at once; a
    float mask a query head, made float32 to be added, is a second)."""
    b, n_q, s, _ = q_shape
    return copies * b * n_q * s * key_len * 4 <= UNFUSED_SCORES_MAX_BYTES


# Prefill attention through MLX's fused (cuDNN) kernel with shapes made to recur: queries
# padded at the end to a multiple of this, keys by as many (see bucketed_fused_attention).
FUSED_PREFILL_BUCKET = 512
# The smallest bucket a smaller decode-first budget may set (prefill_bucket_for).
MIN_PREFILL_BUCKET = 128


def prefill_bucket_for(decode_first_tokens: int) -> int:
    """The bucket for a server whose steps that decode prefill at most this many prompt
    tokens: FUSED_PREFILL_BUCKET, or that budget where it is a smaller power of two of at
    least MIN_PREFILL_BUCKET. A long prompt's chunks beside decoding then end on edges
    (ServerConfig.chunk_align) and meet the shapes the warm-up walk built, at the cost of
    more shapes (cuDNN graphs) over a long context."""
    n = decode_first_tokens
    if MIN_PREFILL_BUCKET <= n < FUSED_PREFILL_BUCKET and n & (n - 1) == 0:
        return n
    return FUSED_PREFILL_BUCKET


def fused_bucket_padding(n_new: int, n_keys: int, mask: mx.array | str | None,
                         bucket: int = FUSED_PREFILL_BUCKET) -> int | None:
    """How many positions bucketed_fused_attention pads a forward of n_new queries over
    n_keys keys with, or None where it does not apply: masks other than "causal" (rows at
    different positions, windows), cached prefixes that are not a multiple of the bucket
    (a prefix hit's arbitrary length), and fresh prompts shorter than a bucket (their
    unfused scores are small, and their many lengths would each build a graph). A short
    forward after a bucket-edge prefix (a long prompt's last chunk) is padded to a whole
    bucket: the shape of that prompt's earlier chunks, whose graph is already built."""
    causal = isinstance(mask, str) and mask == "causal"
    prefix = n_keys - n_new
    if not causal or prefix % bucket or (n_new < bucket and not prefix):
        return None
    return -n_new % bucket


def bucketed_fused_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, pad: int,
                             sinks: mx.array | None = None) -> mx.array:
    """Causal prefill attention through MLX's fused kernel, queries and keys both padded
    at the end by `pad` positions (fused_bucket_padding), the padded queries' rows
    dropped from the result.

    cuDNN builds a graph for every new shape (50 ms to over a second), so called with a
    forward's own shapes it stalls on nearly every prompt; padded, a long prompt's chunks
    meet a few shapes: queries a multiple of the bucket up to the chunk size, keys the
    chunk's start (a multiple of the bucket) plus those. Causal from the keys' end keeps
    the padding out of every real query's view: query i of S sits at key position
    L - S + i, before every padded key. In exchange the scores never exist in memory,
    and the matmuls run on tensor cores in the heads' dtype."""
    s = q.shape[2]
    q, k, v = (_pad_positions(x, pad) for x in (q, k, v))
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal", sinks=sinks)
    return out[:, :, :s] if pad else out


# Largest additive bias (all its rows, padded, in the heads' dtype) bucketed_masked_attention
# may build; a bigger one (a long chunk deep into a long context) is not worth its memory
# (at 4,096 queries over 128k keys, 1 GiB a layer): such forwards keep their own paths.
MASKED_BIAS_MAX_BYTES = 256 << 20


def masked_bias_fits(rows: int, n_new: int, n_keys: int,
                     bucket: int = FUSED_PREFILL_BUCKET) -> bool:
    """Whether bucketed_masked_attention's bias for a mask of `rows` rows ([S, L] is one)
    stays within MASKED_BIAS_MAX_BYTES."""
    padded_queries = n_new + -n_new % bucket
    return rows * padded_queries * key_bucket(n_keys, bucket) * 2 <= MASKED_BIAS_MAX_BYTES


def masked_bias(mask: mx.array, dtype: mx.Dtype, bucket: int = FUSED_PREFILL_BUCKET) -> mx.array:
    """A boolean mask ([S, L] or [B, 1, S, L]: rows at different starts, windows) as the
    additive bias bucketed_masked_attention takes, [B or 1, 1, S', L']: queries padded to
    a multiple of `bucket`, keys to key_bucket's sizes (so chunks anywhere in a long
    context meet a few dozen shapes, not one per 512 keys: MLX keeps 256 cuDNN graphs,
    MLX_CUDA_SDPA_CACHE_SIZE). Padded keys are hidden from every query, padded queries
    (dropped from the result) shown every key so their rows stay finite. The same for
    every layer of a forward: made once (ForwardLayout.once)."""
    s, length = mask.shape[-2:]
    m = mask if mask.ndim == 4 else mask.reshape(1, 1, s, length)
    m = mx.pad(m, [(0, 0), (0, 0), (0, 0), (0, key_bucket(length, bucket) - length)],
               constant_values=False)
    m = _pad_positions(m, -s % bucket, True)
    return mx.where(m, mx.array(0, dtype), mx.array(-mx.inf, dtype))


def bucketed_masked_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                              bias: mx.array, sinks: mx.array | None = None) -> mx.array:
    """Masked prefill attention through MLX's fused kernel, queries and keys padded at the
    end to the bias's shape (masked_bias) so cuDNN's per-shape graphs recur."""
    s, length = q.shape[2], k.shape[2]
    q = _pad_positions(q, bias.shape[2] - s)
    k, v = (_pad_positions(x, bias.shape[3] - length) for x in (k, v))
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias, sinks=sinks)
    return out[:, :, :s] if out.shape[2] > s else out


def key_bucket(n: int, bucket: int = FUSED_PREFILL_BUCKET) -> int:
    """The padded key count for n keys under a mask: a multiple of `bucket`, and past 8
    buckets of an eighth of the next power of two (4 sizes an octave: less than a bucket
    or a quarter more keys, ~30 sizes to a 128k context)."""
    step = max(bucket, (1 << max(n - 1, 1).bit_length()) // 8)
    return -(-n // step) * step


def _pad_positions(x: mx.array, n: int, value: bool | float = 0) -> mx.array:
    """[B, H, S, ...] with n more positions (axis 2) of `value` at the end; row-major
    either way. cuDNN's graphs are keyed by strides too: a chunk's queries come as a
    transposed view of its projections, a padded copy is row-major, and a prompt's
    padded last chunk would miss the graph its unpadded chunks built."""
    if not n:
        return mx.contiguous(x)
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, n)
    return mx.pad(x, widths, constant_values=value)


def fused_builds_per_shape(dtype: mx.Dtype, head_dim: int, value_dim: int) -> bool:
    """Whether MLX's fused attention runs prefill heads of this dtype and size through
    cuDNN on CUDA, whose per-shape graph builds unfused_prefill_attention avoids: cuDNN
    takes float16/bfloat16 heads of at most 128 (multiples of 8). Other heads (the 256
    of Qwen3.5/Qwen3-Next, float32) take MLX's own matmul fallback, which builds nothing
    per shape and measured as fast as the unfused path on fresh prompts and 1.7x faster
    over cached prefixes (docs/benchmarks.md, session 14)."""
    return (dtype in (mx.float16, mx.bfloat16) and head_dim % 8 == 0 and value_dim % 8 == 0
            and head_dim <= 128 and value_dim <= 128)


def unfused_prefill_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                              mask: mx.array | str | None,
                              sinks: mx.array | None = None) -> mx.array:
    """Attention of a prefill forward as plain matmuls and a softmax, for the CUDA backend.

    MLX's fused attention there is cuDNN's, which builds (and caches) a graph for every
    new combination of shapes: 50 ms to over a second on the H200 each time. A server
    sees a new (rows, prompt length, context) nearly every prefill, so that build
    dominated time to first token (measured: single 110-token prompts 60-100 ms a
    forward, batches of prompts up to 1.7 s). Matmuls have no such cost; the price is
    the [B, H, S, L] float32 scores in memory (at a 2048-token chunk over an 8k context,
    2 GiB for a 32-head layer, transient).

    q: [B, Hq, S, D]; k, v: [B, Hkv, L, D]; mask: None, "causal" (queries aligned to the
    keys' end), a boolean [B, 1, S, L] or [S, L] array (True: may attend), or a float one,
    added to the scores, also one a query head ([B, Hq, S, L]: MLA's RoPE part, which
    its model scores itself); sinks: [Hq] attention sink logits (GPT-OSS), each a key
    with no value in its head's softmax.
    """
    b, n_q, s, d = q.shape
    n_kv, length = k.shape[1], k.shape[2]
    group = n_q // n_kv
    # Scores and softmax in float32, as fused kernels keep them: rounded to bf16, a
    # logit near 10 is off by ~0.04 and its weight by ~4%. The weights go back to the
    # values' dtype for the second matmul (as flash attention does).
    # Grouped heads share their K/V: [B, Hkv, G*S, D] against [B, Hkv, L, D].
    qf = (q.astype(mx.float32) * scale).reshape(b, n_kv, group * s, d)
    scores = (qf @ k.astype(mx.float32).swapaxes(-1, -2)).reshape(b, n_kv, group, s, length)
    if isinstance(mask, str):
        mask = causal_mask(s, length)
    if mask is not None:  # [S, L] (one for every row) or [B, 1 or Hq, S, L]
        mask = mask if mask.ndim == 4 else mask.reshape(1, 1, *mask.shape[-2:])
        grouped = (mask.reshape(mask.shape[0], n_kv, group, s, length) if mask.shape[1] == n_q > 1
                   else mask[:, :, None])
        if mask.dtype == mx.bool_:
            scores = mx.where(grouped, scores, -mx.inf)
        else:
            scores = scores + grouped.astype(mx.float32)
    if sinks is None:
        weights = mx.softmax(scores, axis=-1).astype(v.dtype)
    else:  # the sink joins each query's denominator (and its max, for range)
        sink = sinks.astype(mx.float32).reshape(1, n_kv, group, 1, 1)
        top = mx.maximum(mx.max(scores, axis=-1, keepdims=True), sink)
        exps = mx.exp(scores - top)
        den = mx.sum(exps, axis=-1, keepdims=True) + mx.exp(sink - top)
        weights = (exps / den).astype(v.dtype)
    out = weights.reshape(b, n_kv, group * s, length) @ v
    return out.reshape(b, n_q, s, v.shape[-1])


def causal_mask(n_new: int, n_keys: int) -> mx.array:
    """[n_new, n_keys] booleans: the last n_new of n_keys positions each see the keys up
    to their own. Built in the graph, never from host data (which on CUDA may wait for
    the work in flight, worker_proc.staging); a forward's layers share one
    (KernelDecode.prefill_attention, ForwardLayout.once)."""
    rows = mx.arange(n_keys - n_new, n_keys, dtype=mx.int32)[:, None]
    return rows >= mx.arange(n_keys, dtype=mx.int32)[None]
