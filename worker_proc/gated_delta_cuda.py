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
from typing import Any

import mlx.core as mx

from worker_proc.paged_attention import kernel_available

logger = logging.getLogger(__name__)

_SOURCE = """
    constexpr int NPL = DK / 32;  // state elements per lane
    const int lane = threadIdx.x & 31;
    const long line = (long(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const int B = q_shape[0];
    const int T = q_shape[1];
    if (line >= long(B) * HV * DV) return;
    const int dv = line % DV;
    const int hv = (line / DV) % HV;
    const long b = line / (long(DV) * HV);
    const int hk = hv / (HV / HK);
    const long s_at = ((b * HV + hv) * DV + dv) * DK + lane * NPL;
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
    for (int i = 0; i < NPL; ++i) state_out[s_at + i] = s[i];
"""

# A padded position leaves the state as it was before the token.
_MASKED = "if (!mask[bt]) { for (int i = 0; i < NPL; ++i) s[i] = kept[i]; }"
_WARPS_PER_BLOCK = 4


def source(masked: bool) -> str:
    return _SOURCE.replace("@MASKED@", _MASKED if masked else "")


@functools.cache
def _kernel(masked: bool) -> Any:
    return mx.fast.cuda_kernel(
        name=f"kiln_gated_delta{'_masked' if masked else ''}",
        input_names=["q", "k", "v", "g", "beta", "state", *(["mask"] if masked else [])],
        output_names=["y", "state_out"], source=source(masked))


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
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((b, hv, dv, dk), dtype=mx.float32)
    inputs = [q, k, v, g.astype(mx.float32), beta.astype(mx.float32), state.astype(mx.float32)]
    if mask is not None:
        inputs.append(mask.astype(mx.int32))
    lines = b * hv * dv
    block = 32 * _WARPS_PER_BLOCK
    y, new_state = _kernel(mask is not None)(
        inputs=inputs,
        template=[("InT", q.dtype), ("HK", hk), ("HV", hv), ("DK", dk), ("DV", dv)],
        grid=(-(-lines * 32 // block) * block, 1, 1), threadgroup=(block, 1, 1),
        output_shapes=[(b, t, hv, dv), (b, hv, dv, dk)], output_dtypes=[q.dtype, mx.float32])
    return y, new_state


def uses_gated_delta(model: Any) -> bool:
    """Whether the model's mlx-lm module runs the gated delta rule."""
    import sys

    return hasattr(sys.modules.get(type(model).__module__), "gated_delta_update")


def install_gated_delta_kernel() -> bool:
    """On MLX's CUDA backend, route mlx-lm's non-Metal gated delta path (gated_delta_ops,
    which gated_delta_update calls there) to the kernel where its shapes fit; other
    shapes keep mlx-lm's ops. Returns whether it is installed (idempotent)."""
    if not kernel_available():
        return False
    from mlx_lm.models import gated_delta as module

    original = getattr(module.gated_delta_ops, "__wrapped__", module.gated_delta_ops)

    def routed(q, k, v, g, beta, state=None, mask=None):  # noqa: ANN001, ANN202
        if fits(q, v, g):
            return gated_delta(q, k, v, g, beta, state, mask)
        return original(q, k, v, g, beta, state, mask)

    routed.__wrapped__ = original
    module.gated_delta_ops = routed
    return True
