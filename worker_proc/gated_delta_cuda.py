"""The gated delta rule (Qwen3-Next, Qwen3.5 linear attention) as one CUDA kernel.

mlx-lm runs the recurrence as a Metal kernel on Apple GPUs and, everywhere else, as plain
MLX ops in a Python loop over the tokens (`gated_delta_ops`): on MLX's CUDA backend a
prefill chunk then builds and launches ~10 ops per token and layer (a 130-token prompt of
a Qwen3.5-9B shape took ~1.4 s of host time on the H200), and every decode step reads and
writes each row's float32 state [Hv, Dv, Dk] five times per layer. Here one warp carries
one (row, value head, value channel) line of the state in registers through all the
chunk's tokens: the state is read once and written once, one launch per layer.

Same math as the ops path, in float32: per token, state *= g; delta = (v - state . k) *
beta; state += k delta; y = state . q; a masked (padded) position leaves the state as it
was. Only the sums' order differs (a warp's butterfly instead of MLX's reduction).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from worker_proc.kernel_constants import MARK_SHAPE
from worker_proc.model_patch import repoint
from worker_proc.paged_attention import kernel_available
from worker_proc.pool_writes import follow_mark

logger = logging.getLogger(__name__)

_SOURCE = """
    constexpr int NPL = DK / 32;  // state elements per lane
    const int lane = threadIdx.x & 31;
    const long line = (long(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const int B = q_shape[0];
    const int T = q_shape[1];
    @START@
    if (line >= long(B) * HV * DV) return;
    const int dv = line % DV;
    const int hv = (line / DV) % HV;
    const long b = line / (long(DV) * HV);
    const int hk = hv / (HV / HK);
    const long s_at = ((@ROW@ * HV + hv) * DV + dv) * DK + lane * NPL;
    float s[NPL];
    for (int i = 0; i < NPL; ++i) s[i] = state[s_at + i];
    for (int t = 0; t < T; ++t) {
        const long bt = b * T + t;
        const long qk_at = (bt * HK + hk) * DK + lane * NPL;
        const long hv_at = bt * HV + hv;
        const float decay = g[hv_at];
        float kr[NPL];
        float kept[NPL];
        float mem = 0.0f;
        for (int i = 0; i < NPL; ++i) {
            kept[i] = s[i];
            kr[i] = static_cast<float>(k[qk_at + i]);
            s[i] *= decay;
            mem += s[i] * kr[i];
        }
        for (int o = 16; o > 0; o >>= 1) mem += __shfl_xor_sync(0xffffffff, mem, o);
        const float delta = (static_cast<float>(v[hv_at * DV + dv]) - mem) * beta[hv_at];
        float out = 0.0f;
        for (int i = 0; i < NPL; ++i) {
            s[i] += kr[i] * delta;
            out += s[i] * static_cast<float>(q[qk_at + i]);
        }
        for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffff, out, o);
        if (lane == 0) y[hv_at * DV + dv] = static_cast<InT>(out);
        @MASKED@
    }
    @STORE@
"""

# A padded position leaves the state as it was before the token.
_MASKED = "if (!mask[bt]) { for (int i = 0; i < NPL; ++i) s[i] = kept[i]; }"
_WARPS_PER_BLOCK = 4


# In the pool: the state is a recurrent layer's whole state array (KVPool.states), each
# batch row's line read at its request's row and written back there, in place (as the
# K/V pool's writes: a cast pointer, a one-element mark for readers to follow).
_IN_POOL = {
    "@START@": "if (blockIdx.x == 0 && threadIdx.x == 0) written[0] = 0;",
    "@ROW@": "long(rows[b])",
    "@STORE@": "float* pool_out = const_cast<float*>(state);\n"
               "    for (int i = 0; i < NPL; ++i) pool_out[s_at + i] = s[i];",
}
_APART = {"@START@": "", "@ROW@": "b",
          "@STORE@": "for (int i = 0; i < NPL; ++i) state_out[s_at + i] = s[i];"}


def source(masked: bool, in_pool: bool = False) -> str:
    text = _SOURCE.replace("@MASKED@", _MASKED if masked else "")
    for key, value in (_IN_POOL if in_pool else _APART).items():
        text = text.replace(key, value)
    return text


@functools.cache
def _kernel(masked: bool, in_pool: bool = False) -> Any:
    inputs = ["q", "k", "v", "g", "beta", "state", *(["rows", "after"] if in_pool else []),
              *(["mask"] if masked else [])]
    return mx.fast.cuda_kernel(
        name=f"kiln_gated_delta{'_in_pool' if in_pool else ''}{'_masked' if masked else ''}",
        input_names=inputs, output_names=["y", "written" if in_pool else "state_out"],
        source=source(masked, in_pool),
        # In the pool the state array must reach the kernel as itself, never a copy; the
        # other inputs are made contiguous by the caller.
        ensure_row_contiguous=not in_pool)


def fits(q: mx.array, v: mx.array, g: mx.array) -> bool:
    """Shapes the kernel takes: a scalar gate per head (not mlx-lm's vectorised one),
    key heads a multiple of 32 wide, value heads a multiple of key heads."""
    hk, dk = q.shape[-2:]
    hv = v.shape[-2]
    return g.ndim == 3 and dk % 32 == 0 and hv % hk == 0


def gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                state: mx.array | None = None,
                mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """gated_delta_ops' contract: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
    state [B, Hv, Dv, Dk] (float32; None: zeros); mask [B, T] (False: padding). Returns
    y [B, T, Hv, Dv] in q's dtype and the new state, float32."""
    b, _, _, dk = q.shape
    hv, dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((b, hv, dv, dk), dtype=mx.float32)
    inputs = [q, k, v, g.astype(mx.float32), beta.astype(mx.float32), state.astype(mx.float32)]
    if mask is not None:
        inputs.append(mask.astype(mx.int32))
    return _launch(q, v, inputs, mask is not None, False, (b, hv, dv, dk), mx.float32)


def gated_delta_in_pool(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                        pool: mx.array, rows: mx.array, after: mx.array | None,
                        mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """gated_delta's recurrence over rows `rows` [B] of a state array pool [R, Hv, Dv,
    Dk] (float32, contiguous), which it updates in place after the write whose mark is
    `after`. Returns y and the write's mark."""
    inputs = [mx.contiguous(x) for x in (q, k, v, g.astype(mx.float32), beta.astype(mx.float32))]
    inputs += [pool, rows.astype(mx.int32), follow_mark(after)]
    if mask is not None:
        inputs.append(mx.contiguous(mask.astype(mx.int32)))
    return _launch(q, v, inputs, mask is not None, True, MARK_SHAPE, mx.int32)


def _launch(q: mx.array, v: mx.array, inputs: list[mx.array], masked: bool, in_pool: bool,
            second_shape: tuple[int, ...], second_dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """One warp a (row, value head, value channel) line; outputs y [B, T, Hv, Dv] in q's
    dtype and the new state (apart) or the write's mark (in the pool)."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    block = 32 * _WARPS_PER_BLOCK
    y, second = _kernel(masked, in_pool)(
        inputs=inputs,
        template=[("InT", q.dtype), ("HK", hk), ("HV", hv), ("DK", dk), ("DV", dv)],
        grid=(-(-b * hv * dv * 32 // block) * block, 1, 1), threadgroup=(block, 1, 1),
        output_shapes=[(b, t, hv, dv), second_shape], output_dtypes=[q.dtype, second_dtype])
    return y, second


@dataclass
class PoolRead:
    """A recurrent state a layer cache handed the model as a gather of its requests'
    rows (`value`): where the gated delta rule meets it, it runs in the state array
    itself instead, and `written` (given the write's mark) records the write and returns
    the new state, a lazy gather the cache recognises when the model stores it back."""

    value: mx.array
    pool: mx.array
    rows: mx.array
    after: mx.array | None
    written: Callable[[mx.array], mx.array]


# The current forward's pool reads, by id of the array handed out (the model's code passes
# it on untouched); PooledStateCache adds them, build_layer_caches clears them a forward.
_POOL_READS: dict[int, PoolRead] = {}


def offer_pool_read(read: PoolRead) -> None:
    _POOL_READS[id(read.value)] = read


def forget_pool_reads() -> None:
    _POOL_READS.clear()


def _pool_read(state: mx.array | None, v: mx.array) -> PoolRead | None:
    read = _POOL_READS.get(id(state)) if state is not None else None
    if read is None or read.value is not state:
        return None
    fits_pool = (read.pool.dtype == mx.float32 and read.pool.ndim == 4
                 and read.pool.shape[1:3] == v.shape[-2:])
    return read if fits_pool else None


def uses_gated_delta(model: Any) -> bool:
    """Whether the model's mlx-lm module runs the gated delta rule."""
    import sys

    return hasattr(sys.modules.get(type(model).__module__), "gated_delta_update")


def install_gated_delta_kernel() -> bool:
    """On MLX's CUDA backend, route mlx-lm's non-Metal gated delta path (gated_delta_ops,
    which gated_delta_update calls there) to the kernel where its shapes fit; other
    shapes keep mlx-lm's ops. Its models' q/k normalisation (normalize_qk) gets norms
    with a weight (normalize_qk below). Returns whether it is installed (idempotent)."""
    if not kernel_available():
        return False
    route_gated_delta(gated_delta, gated_delta_in_pool)
    route_normalize_qk()
    return True


@functools.cache
def _row(dim: int, dtype: mx.Dtype, value: float) -> mx.array:
    row = mx.full((dim,), value, dtype=dtype)
    mx.eval(row)  # a device array (a constant: evaluable inside a compiled trace too)
    return row


def normalize_qk(q: mx.array, k: mx.array, *, inv_scale: float,
                 eps: float) -> tuple[mx.array, mx.array]:
    """mlx-lm's gated_delta.normalize_qk (q and k L2-normalised, then scaled) with the
    same values: its weightless rms_norms given a weight of ones and its scalar factors
    as rows of the dtype (a Python float meets a bf16 array as a bf16). Otherwise MLX
    reads scalars from the memory that kernels wait on (kernel_constants.
    CONSTANT_ELEMENTS): four such reads a linear-attention layer a decode step."""
    rms_eps = eps * inv_scale**2
    dq, dk = q.shape[-1], k.shape[-1]
    q = _row(dq, q.dtype, inv_scale**2) * mx.fast.rms_norm(q, _row(dq, q.dtype, 1.0), rms_eps)
    k = _row(dk, k.dtype, inv_scale) * mx.fast.rms_norm(k, _row(dk, k.dtype, 1.0), rms_eps)
    return q, k


def route_normalize_qk() -> int:
    """Point every loaded mlx-lm model module that calls mlx-lm's normalize_qk at ours;
    returns how many."""
    from mlx_lm.models import gated_delta as module

    return repoint("normalize_qk", (module.normalize_qk,), normalize_qk, skip=module)


def route_gated_delta(apart: Callable[..., tuple[mx.array, mx.array]],
                      in_pool: Callable[..., tuple[mx.array, mx.array]]) -> None:
    """Route mlx-lm's gated_delta_ops to `apart` (gated_delta's signature) or, for a
    state read from the pool (offer_pool_read), to `in_pool` (gated_delta_in_pool's),
    where the shapes fit; tests on the CPU pass plain-MLX stand-ins."""
    from mlx_lm.models import gated_delta as module

    original = getattr(module.gated_delta_ops, "__wrapped__", module.gated_delta_ops)

    def routed(q, k, v, g, beta, state=None, mask=None):  # noqa: ANN001, ANN202
        if not fits(q, v, g):
            return original(q, k, v, g, beta, state, mask)
        read = _pool_read(state, v)
        if read is None:
            return apart(q, k, v, g, beta, state, mask)
        y, mark = in_pool(q, k, v, g, beta, read.pool, read.rows, read.after, mask)
        return y, read.written(mark)

    routed.__wrapped__ = original
    module.gated_delta_ops = routed
