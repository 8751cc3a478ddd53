"""A mixture-of-experts layer's decode step in fewer kernel launches: routing in one
kernel, the weighted sum of the experts' outputs (with their down biases and the block's
residual) in another.

mlx-lm's call (GPT-OSS's MLPBlock, Qwen3-MoE's sparse block and their SwitchGLU) routes a
step's tokens with an argpartition, a take, a softmax, two argsorts, a floor division and
gathers of the tokens and their expert ids, gathers each projection's bias by expert, and
puts the outputs back in token order by another gather, a multiply and a sum: ~20
launches a layer besides the experts' matmuls, each ~14 us of host time on MLX's CUDA
backend (docs/benchmarks.md, session 24). Here a layer launches: the router's matmul,
`route` (a quantized router's bias added, the top k by each family's rule, their
weights, and the token-expert pairs sorted by expert with each pair's place, in one
block), a gather of the tokens (below SORT_PAIRS the matmul reads each pair's token by
index instead, and MLX then makes no index of its own), the fused gate/up matmul, its
bias's gather (GPT-OSS), the activation, the down matmul (and MLX's index of its rows)
and `combine` (each token's k outputs with their down bias, weighted and summed, plus
the residual, and that sum through the next block's input norm, which that block then
takes: decode_block.NormHandoff): 8 for GPT-OSS (a plain router adds its bias inside
its GEMM), 7 for Qwen3-MoE, a launch less each below SORT_PAIRS, and the next block's
norm a launch less.

The experts' matmuls are MLX's own (`gather_qmm` / `gather_mm`), called as mlx-lm's
SwitchLinear calls them, pairs sorted by expert once there are SORT_PAIRS or more, as
mlx-lm's SwitchGLU sorts them, unless the backend's `expert_rows` takes a 4-bit one (on
CUDA, bf16, once a step has as many pairs as experts: worker_proc.expert_rows' kernel,
which gathers the tokens itself, a launch less again; off: `--experiments
mlx-expert-matmuls`). A quantized router's logits come from its dequantized weight on CUDA
(`router_logits`). Each kernel rounds to the model's dtype where mlx-lm's ops round, but
picks the top k by value (lower expert id on a tie, which argpartition leaves open) and
sums a token's k outputs largest weight first, so on CUDA the tokens may differ from
mlx-lm's at near-ties. `reference_route` and `reference_combine` are the same steps in
mlx-lm's own ops, in its order: the CPU tests run them in the kernels' place and get
mlx-lm's tokens exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_oss, qwen3_moe
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from worker_proc.expert_padding import PaddedExperts
from worker_proc.fused_projections import ProjectionPart
from worker_proc.kernel_constants import CONSTANT_ELEMENTS, float_bits
from worker_proc.quantized_rows import quantized_matmul
from worker_proc.residual_norm import BLOCK_SUM_HEADER

# mlx-lm's SwitchGLU sorts a forward's token-expert pairs by expert from this many on.
SORT_PAIRS = 64
# The routing kernel is one block of ROUTE_THREADS: every pair of the step passes through
# its threads, each of which may use at most 128 registers (nvcc: 32-56 at up to 256
# experts and a top 8, bench/cuda_kernel_report.py; 92 at 512 and 16; the launch, having
# no bounds of its own, fails past the block's 64K).
ROUTE_MAX_PAIRS = 8192
ROUTE_MAX_EXPERTS = 256
ROUTE_MAX_K = 8
ROUTE_THREADS = 512
COMBINE_THREADS = 256


@dataclass(frozen=True)
class Routing:
    """How a family picks a token's experts from its router's logits. softmax_first:
    a softmax over every expert, then the top k of those probabilities (Qwen3-MoE), with
    `normalize` dividing them by their sum; else the top k logits, then a softmax over
    those (GPT-OSS). select: the same in mlx-lm's ops and order, [N, E] -> (weights,
    experts), each [N, k] (reference_route)."""

    experts: int
    top_k: int
    softmax_first: bool
    normalize: bool
    select: Callable[[mx.array], tuple[mx.array, mx.array]]


@dataclass(frozen=True)
class Routed:
    """A step's routing of `tokens` tokens to `top_k` experts each: their weights (the
    first tokens * top_k elements, token-major); the token-expert pairs in the order the
    experts' matmuls take them: each pair's expert and token (uint32, [tokens * top_k]);
    for each token's j-th pair (n * k + j) its place in that order (`slots`); whether
    the matmuls are told the pairs come sorted by expert (`sorted`: from SORT_PAIRS on,
    as mlx-lm's SwitchGLU sorts them); and whether they are (`grouped`: the routing
    kernel always sorts them, as expert_rows needs)."""

    weights: mx.array
    experts: mx.array
    rows: mx.array
    slots: mx.array
    sorted: bool
    tokens: int
    top_k: int
    grouped: bool


@dataclass(frozen=True)
class NextNorm:
    """The next block's input norm (mlx-lm's RMSNorm: its weight and eps), for combine to
    compute beside the sum it takes (a launch a layer less)."""

    weight: mx.array
    eps: float


@dataclass(frozen=True)
class ExpertsPlan:
    """A mixture-of-experts MLP's parts as fused_experts calls them: its router, the
    experts' fused gate/up projection (outputs [gate | up]) and down projection (whose
    outputs past out_dims are a padding's: PaddedExperts), their activation (mlx-lm's,
    called (up, gate)). dense_router: a quantized router's weight dequantized ([E, D]),
    for a backend whose quantized matmul is slow at a decode step's rows (MLX's CUDA
    backend runs a naive kernel there: router_logits)."""

    routing: Routing
    router: nn.Module
    gate_up: nn.Module
    down: nn.Module
    out_dims: int
    activation: Callable[[mx.array, mx.array], mx.array]
    dense_router: mx.array | None = None


def _gpt_oss_select(top_k: int) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    def select(logits: mx.array) -> tuple[mx.array, mx.array]:
        values, experts = gpt_oss.mlx_topk(logits, k=top_k, axis=-1)
        return mx.softmax(values, axis=-1, precise=True), experts
    return select


def _qwen3_moe_select(top_k: int, normalize: bool
                      ) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    def select(logits: mx.array) -> tuple[mx.array, mx.array]:
        gates = mx.softmax(logits, axis=-1, precise=True)
        experts = mx.stop_gradient(mx.argpartition(gates, kth=-top_k, axis=-1)[..., -top_k:])
        scores = mx.take_along_axis(gates, experts, axis=-1)
        if normalize:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return scores, experts
    return select


def _switch_parts(switch: Any) -> tuple[nn.Module, nn.Module, int] | None:
    """A SwitchGLU's fused gate/up module, its down module (a padded one's inner) and
    the down projection's output size; None unless gate/up are fused (gate first) and
    every projection is a plain (Quantized)SwitchLinear, as mlx-lm builds them."""
    if type(switch) is not SwitchGLU or "gate_up_proj" not in switch:
        return None
    gate, up = switch.gate_proj, switch.up_proj
    if not (isinstance(gate, ProjectionPart) and isinstance(up, ProjectionPart)
            and gate._shared is up._shared and (gate._index, up._index) == (0, 1)):
        return None
    down = switch.down_proj
    inner, dims = (down.inner, down.out_dims) if isinstance(down, PaddedExperts) else (
        down, down.weight.shape[1])
    for module in (switch.gate_up_proj, inner):
        if type(module) not in (SwitchLinear, QuantizedSwitchLinear):
            return None
        if type(module) is QuantizedSwitchLinear and module.global_scale is not None:
            return None
    return switch.gate_up_proj, inner, dims


def experts_plan(mlp: nn.Module) -> ExpertsPlan | None:
    """The plan of a GPT-OSS or Qwen3-MoE MLP as mlx-lm builds it (its experts' gate/up
    fused: fuse_projections), else None (the block keeps mlx-lm's call)."""
    if type(mlp) is gpt_oss.MLPBlock and mlp.sharding_group is None:
        routing = Routing(mlp.num_local_experts, mlp.num_experts_per_tok, False, False,
                          _gpt_oss_select(mlp.num_experts_per_tok))
        router, switch = mlp.router, mlp.experts
    elif type(mlp) is qwen3_moe.Qwen3MoeSparseMoeBlock and mlp.sharding_group is None:
        routing = Routing(mlp.num_experts, mlp.top_k, True, bool(mlp.norm_topk_prob),
                          _qwen3_moe_select(mlp.top_k, bool(mlp.norm_topk_prob)))
        router, switch = mlp.gate, mlp.switch_mlp
    else:
        return None
    parts = _switch_parts(switch)
    if parts is None or not (0 < routing.top_k <= min(ROUTE_MAX_K, routing.experts)
                             and routing.experts <= ROUTE_MAX_EXPERTS):
        return None
    gate_up, down, dims = parts
    return ExpertsPlan(routing, router, gate_up, down, dims, switch.activation,
                       _dequantized(router))


def _dequantized(linear: nn.Module) -> mx.array | None:
    """A quantized Linear's weight dequantized, in its bias's dtype (its scales' where it
    has none), evaluated; None for another module."""
    if not isinstance(linear, nn.QuantizedLinear):
        return None
    weight = mx.dequantize(linear["weight"], linear["scales"], linear.get("biases"),
                           group_size=linear.group_size, bits=linear.bits, mode=linear.mode)
    dtype = linear["bias"].dtype if "bias" in linear else linear["scales"].dtype
    weight = weight.astype(dtype if mx.issubdtype(dtype, mx.floating) else mx.bfloat16)
    mx.eval(weight)
    return weight


def router_logits(plan: ExpertsPlan, x: mx.array, dense: bool) -> tuple[mx.array, mx.array | None]:
    """The router's logits of x [N, D] and its bias apart where the routing kernel adds it
    (linear_and_bias); dense: through the dequantized weight where the plan has one."""
    if dense and plan.dense_router is not None:
        return x @ plan.dense_router.T, plan.router.get("bias")
    return linear_and_bias(plan.router, x)


def project_experts(module: nn.Module, x: mx.array, experts: mx.array, sort: bool,
                    rows: mx.array | None = None) -> mx.array:
    """An experts' projection without its bias, as mlx-lm's SwitchLinear calls it: of x's
    rows in pair order, or (rows given, unsorted only) of x's rows named by `rows`."""
    if type(module) is QuantizedSwitchLinear:
        return mx.gather_qmm(x, module["weight"], module["scales"], module.get("biases"),
                             lhs_indices=rows, rhs_indices=experts, transpose=True,
                             group_size=module.group_size, bits=module.bits, mode=module.mode,
                             sorted_indices=sort)
    return mx.gather_mm(x, module["weight"].swapaxes(-1, -2), lhs_indices=rows,
                        rhs_indices=experts, sorted_indices=sort)


def linear_and_bias(linear: nn.Module, x: mx.array) -> tuple[mx.array, mx.array | None]:
    """A Linear's output, and its bias apart where a kernel after it may add it: a
    quantized Linear's (GPT-OSS's router, 8 bits as mlx-lm converts it, and its attention
    output), whose call adds its bias after the matmul as an op of its own. A plain Linear
    adds its bias inside the GEMM (addmm, one rounding), so it runs as it is."""
    if isinstance(linear, nn.QuantizedLinear) and "bias" in linear:
        return quantized_matmul(linear, x), linear["bias"]
    return linear(x), None


def fused_experts(plan: ExpertsPlan, backend: Any, x: mx.array, residual: mx.array | None,
                  next_norm: NextNorm | None = None) -> tuple[mx.array, mx.array | None] | None:
    """residual + the MLP of x ([..., D]) through the backend's route and combine
    (DecodeBackend.route_experts, .combine_experts), and with next_norm that sum through
    it; None where the backend leaves the layer to mlx-lm's call."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)
    if next_norm is not None and next_norm.weight.dtype != x.dtype:
        next_norm = None  # combine writes x's dtype; mlx-lm's norm would promote
    logits, bias = router_logits(plan, flat, backend.dense_routers)
    routed = backend.route_experts(logits, plan.routing, bias)
    if routed is None:
        return None
    gate, up = mx.split(_projection(backend, plan.gate_up, flat, routed, gather=True), 2,
                        axis=-1)
    if "bias" in plan.gate_up:  # added after the split: one fused kernel with the activation
        gate_bias, up_bias = mx.split(
            mx.expand_dims(plan.gate_up["bias"][routed.experts], -2), 2, axis=-1)
        gate, up = gate + gate_bias, up + up_bias
    down = _projection(backend, plan.down, plan.activation(up, gate), routed, gather=False)
    out, normed = backend.combine_experts(
        down, routed, plan.down.get("bias"), plan.out_dims,
        None if residual is None else residual.reshape(-1, dim), next_norm)
    return out.reshape(x.shape), None if normed is None else normed.reshape(x.shape)


def _projection(backend: Any, module: nn.Module, x: mx.array, routed: Routed,
                gather: bool) -> mx.array:
    """An experts' projection of the routed pairs' rows ([pairs, 1, out]): of x's rows
    named by the pairs' tokens (gather; mlx-lm's rows: the tokens as [pairs, 1, D]) or
    of x's rows in pair order, through the backend's expert_rows where it takes them."""
    out = backend.expert_rows(module, x, routed, gather)
    if out is not None:
        return out
    if gather and not routed.sorted:
        # Few pairs: the matmul reads each pair's token row by index, where a gather of the
        # tokens and the pair-order index MLX makes without one would be two launches a
        # layer (each ~8 us of host time on CUDA, where a one-row step is bound by its
        # launches). Sorted pairs keep x gathered: MLX's grouped kernel for them needs
        # the rows in pair order.
        return project_experts(module, x[:, None], routed.experts, False, routed.rows)
    rows = x[routed.rows][:, None] if gather else x
    return project_experts(module, rows, routed.experts, routed.sorted)


def reference_route(logits: mx.array, routing: Routing, bias: mx.array | None = None,
                    sort: bool = False) -> Routed:
    """What route computes, in mlx-lm's ops and order (the router's bias add, then
    SwitchGLU's _gather_sort); sort: the pairs sorted at any count, as the kernel sorts
    them (mlx-lm from SORT_PAIRS), the matmuls told so from SORT_PAIRS on either way."""
    weights, experts = routing.select(logits if bias is None else logits + bias)
    k = routing.top_k
    flat = mx.stop_gradient(experts).flatten()
    n = weights.size // k
    if flat.size < SORT_PAIRS and not sort:
        order = mx.arange(flat.size, dtype=mx.uint32)
        return Routed(weights, flat, order // k, order, False, n, k, False)
    order = mx.argsort(flat)
    return Routed(weights, flat[order], order // k, mx.argsort(order), flat.size >= SORT_PAIRS,
                  n, k, True)


def reference_combine(down: mx.array, routed: Routed, bias: mx.array | None, out_dims: int,
                      residual: mx.array | None, next_norm: NextNorm | None = None
                      ) -> tuple[mx.array, mx.array | None]:
    """What combine computes, in mlx-lm's ops and order: the bias, the padding cut, the
    pairs back in token order, weighted and summed, then the residual, [N, out_dims];
    with next_norm, also that sum through the next block's input norm (mlx-lm's RMSNorm
    call: mx.fast.rms_norm)."""
    if bias is not None:
        down = down + mx.expand_dims(bias[routed.experts], -2)
    # (Below SORT_PAIRS mlx-lm takes no gather here: the reference's slots are then the
    # pairs' own order, so this one gives the same values.)
    down = down[..., :out_dims][routed.slots]
    n, k = routed.tokens, routed.top_k
    weights = routed.weights.reshape(-1)[:n * k].reshape(n, k, 1)
    out = (down.reshape(n, k, out_dims) * weights).sum(axis=-2)
    out = out if residual is None else residual + out
    if next_norm is None:
        return out, None
    return out, mx.fast.rms_norm(out, next_norm.weight, next_norm.eps)


def fits(logits: mx.array, routing: Routing, bias: mx.array | None = None) -> bool:
    """Whether the routing kernel takes this step's logits ([N, E]) and router bias."""
    return (logits.ndim == 2 and logits.shape[1] == routing.experts
            and logits.shape[0] * routing.top_k <= ROUTE_MAX_PAIRS
            and logits.dtype in (mx.float32, mx.float16, mx.bfloat16)
            and (bias is None or (bias.shape == (routing.experts,)
                                  and bias.dtype == logits.dtype)))


# The reductions: a warp's over one token's logits (route), a block's over one token's
# sums (combine's next norm).
_HEADER = r"""
__device__ __forceinline__ float kiln_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
__device__ __forceinline__ float kiln_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
""" + BLOCK_SUM_HEADER

# One block: a warp a row picks the row's top K (highest value, lower expert on a tie),
# writes its weights and, for now, each pair's expert into `places`, and counts the pairs
# per expert; then each expert's first place (a running sum, one thread: E is small);
# then each pair takes the next place of its expert. Places within an expert come in no
# fixed order: an expert's matmul computes each row alone, so its rows' order changes
# nothing. Values are rounded to T where mlx-lm's ops return T.
_ROUTE = r"""
    constexpr int WARPS = BLOCK / 32;
    constexpr int PER_LANE = (E + 31) / 32;
    const float NEG_INF = __int_as_float(0xff800000);
    __shared__ int next_at[E];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int n = logits_shape[0];
    for (int e = t; e < E; e += BLOCK) next_at[e] = 0;
    __syncthreads();
    for (int row = warp; row < n; row += WARPS) {
        float v[PER_LANE];
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int e = lane + 32 * i;
            v[i] = e < E ? static_cast<float>(logits[(size_t)row * E + e]) : NEG_INF;
            @ROUTER_BIAS@
        }
        if (SOFTMAX_FIRST) {
            float m = NEG_INF;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) m = fmaxf(m, v[i]);
            m = kiln_warp_max(m);
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                v[i] = lane + 32 * i < E ? expf(v[i] - m) : 0.f;
                s += v[i];
            }
            s = kiln_warp_sum(s);
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i)
                v[i] = lane + 32 * i < E ? static_cast<float>(static_cast<T>(v[i] / s)) : NEG_INF;
        }
        float top[K];
        int which[K];
        unsigned taken[PER_LANE];
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) taken[i] = 0u;
#pragma unroll
        for (int j = 0; j < K; ++j) {
            float best = NEG_INF;
            int id = E;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const int e = lane + 32 * i;
                if (e < E && !taken[i] && (v[i] > best || id == E)) { best = v[i]; id = e; }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(0xffffffff, best, o);
                const int oi = __shfl_xor_sync(0xffffffff, id, o);
                if (oi < E && (id == E || ob > best || (ob == best && oi < id))) {
                    best = ob;
                    id = oi;
                }
            }
            top[j] = best;
            which[j] = id;
            if ((id & 31) == lane) taken[id >> 5] = 1u;
        }
        float w[K];
        if (SOFTMAX_FIRST) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < K; ++j) s += top[j];
            s = static_cast<float>(static_cast<T>(s));
#pragma unroll
            for (int j = 0; j < K; ++j) w[j] = NORMALIZE ? top[j] / s : top[j];
        } else {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < K; ++j) { w[j] = expf(top[j] - top[0]); s += w[j]; }
#pragma unroll
            for (int j = 0; j < K; ++j) w[j] /= s;
        }
#pragma unroll
        for (int j = 0; j < K; ++j) {
            if (lane == j) {
                weights[(size_t)row * K + j] = static_cast<T>(w[j]);
                places[(size_t)row * K + j] = which[j];
                atomicAdd(&next_at[which[j]], 1);
            }
        }
    }
    __syncthreads();
    if (t == 0) {
        int run = 0;
        for (int e = 0; e < E; ++e) {
            const int c = next_at[e];
            next_at[e] = run;
            run += c;
        }
    }
    __syncthreads();
    for (int p = t; p < n * K; p += BLOCK) {
        const int e = places[p];
        const int at = atomicAdd(&next_at[e], 1);
        experts[at] = e;
        rows[at] = p / K;
        places[p] = at;
    }
"""

# A block a token: each of its columns' K outputs (each with its expert's bias, rounded
# as mlx-lm's add rounds) times their weights, rounded, summed in float, rounded, then
# the residual added; with the next block's input norm, the sum's RMS norm too (each
# value rounded as MLX's norm rounds it: x * r, then its product with the weight).
_COMBINE = r"""
    const int row = blockIdx.x;
    float ss = 0.f;
    float w[K];
    int at[K];
    @EXPERT_DECLARE@
#pragma unroll
    for (int j = 0; j < K; ++j) {
        w[j] = static_cast<float>(weights[row * K + j]);
        at[j] = places[row * K + j];
        @EXPERT_LOAD@
    }
    for (int d = threadIdx.x; d < D; d += BLOCK) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < K; ++j) {
            float v = static_cast<float>(down[(size_t)at[j] * DP + d]);
            @BIAS@
            acc += static_cast<float>(static_cast<T>(v * w[j]));
        }
        float o = static_cast<float>(static_cast<T>(acc));
        @RESIDUAL@
        out[(size_t)row * D + d] = static_cast<T>(o);
        o = static_cast<float>(static_cast<T>(o));
        ss += o * o;
    }
    @NEXT@
"""
_NEXT = r"""
    __shared__ float part[BLOCK / 32];
    const float r = rsqrtf(kiln_block_sum<BLOCK / 32>(ss, part) / static_cast<float>(D)
                           + __int_as_float(EPS));
    for (int d = threadIdx.x; d < D; d += BLOCK) {  // this thread's own sums, read back
        const float h = static_cast<float>(out[(size_t)row * D + d]);
        normed[(size_t)row * D + d] = static_cast<T>(static_cast<float>(next_weight[d])
            * static_cast<float>(static_cast<T>(h * r)));
    }
"""


def route_source(bias: bool) -> str:
    """The routing kernel's source, with or without the router's bias (added to each
    logit and rounded, as the quantized router's own add rounds)."""
    return _ROUTE.replace("@ROUTER_BIAS@", (
        "if (e < E) v[i] = static_cast<float>(static_cast<T>("
        "v[i] + static_cast<float>(router_bias[e])));") if bias else "")


def route_inputs(bias: bool) -> list[str]:
    return ["logits", *(["router_bias"] if bias else [])]


def combine_source(bias: bool, residual: bool, next_norm: bool = False) -> str:
    """The combine kernel's source, with or without the down projection's bias, the
    residual and the next block's input norm."""
    parts = {
        "@EXPERT_DECLARE@": "int ex[K];" if bias else "",
        "@EXPERT_LOAD@": "ex[j] = experts[at[j]];" if bias else "",
        "@BIAS@": ("v = static_cast<float>(static_cast<T>(v + static_cast<float>("
                   "bias[(size_t)ex[j] * DP + d])));") if bias else "",
        "@RESIDUAL@": ("o = static_cast<float>(static_cast<T>("
                       "static_cast<float>(residual[(size_t)row * D + d]) + o));")
                      if residual else "",
        "@NEXT@": _NEXT if next_norm else ""}
    out = _COMBINE
    for key, text in parts.items():
        out = out.replace(key, text)
    return out


def combine_inputs(bias: bool, residual: bool, next_norm: bool = False) -> list[str]:
    return ["down", "weights", "places", *(["experts", "bias"] if bias else []),
            *(["residual"] if residual else []), *(["next_weight"] if next_norm else [])]


def combine_outputs(next_norm: bool) -> list[str]:
    return ["out", *(["normed"] if next_norm else [])]


@functools.cache
def _route_kernel(bias: bool):
    return mx.fast.cuda_kernel(name=f"kiln_moe_route{'_bias' if bias else ''}",
                               input_names=route_inputs(bias),
                               output_names=["weights", "experts", "rows", "places"],
                               source=route_source(bias), header=_HEADER)


@functools.cache
def _combine_kernel(bias: bool, residual: bool, next_norm: bool):
    return mx.fast.cuda_kernel(
        name=(f"kiln_moe_combine{'_bias' if bias else ''}{'_residual' if residual else ''}"
              f"{'_norm' if next_norm else ''}"),
        input_names=combine_inputs(bias, residual, next_norm),
        output_names=combine_outputs(next_norm),
        source=combine_source(bias, residual, next_norm), header=_HEADER)


def route(logits: mx.array, routing: Routing, bias: mx.array | None = None) -> Routed:
    """The routing kernel (fits must hold): reference_route's results, the pairs always
    sorted by expert (the matmuls told so from SORT_PAIRS on)."""
    n, k = logits.shape[0], routing.top_k
    pairs = n * k
    # Outputs of 8 bytes or less would land in MLX's small-array region: made whole
    # (kernel_constants), the pairs' arrays then cut to their pairs.
    size = max(pairs, CONSTANT_ELEMENTS)
    weights, experts, rows, slots = _route_kernel(bias is not None)(
        inputs=[logits, *([] if bias is None else [bias])],
        template=[("T", logits.dtype), ("E", routing.experts), ("K", k),
                  ("SOFTMAX_FIRST", routing.softmax_first), ("NORMALIZE", routing.normalize),
                  ("BLOCK", ROUTE_THREADS)],
        grid=(ROUTE_THREADS, 1, 1), threadgroup=(ROUTE_THREADS, 1, 1),
        output_shapes=[(size,)] * 4,
        output_dtypes=[logits.dtype, mx.uint32, mx.uint32, mx.uint32])
    if size > pairs:
        experts, rows, slots = experts[:pairs], rows[:pairs], slots[:pairs]
    return Routed(weights, experts, rows, slots, pairs >= SORT_PAIRS, n, k, True)


def combine(down: mx.array, routed: Routed, bias: mx.array | None, out_dims: int,
            residual: mx.array | None, next_norm: NextNorm | None = None
            ) -> tuple[mx.array, mx.array | None]:
    """The combine kernel: reference_combine's results ([N, out_dims], the dtype of
    `down`, [pairs, 1, DP])."""
    n, k = routed.tokens, routed.top_k
    padded = down.shape[-1]
    inputs = [down, routed.weights, routed.slots]
    if bias is not None:
        inputs += [routed.experts, bias]
    if residual is not None:
        inputs.append(residual)
    if next_norm is not None:
        inputs.append(next_norm.weight)
    outs = _combine_kernel(bias is not None, residual is not None, next_norm is not None)(
        inputs=inputs,
        template=[("T", down.dtype), ("D", out_dims), ("DP", padded), ("K", k),
                  ("BLOCK", COMBINE_THREADS),
                  ("EPS", float_bits(next_norm.eps if next_norm is not None else 0.0))],
        grid=(n * COMBINE_THREADS, 1, 1), threadgroup=(COMBINE_THREADS, 1, 1),
        output_shapes=[(n, out_dims)] * (1 + (next_norm is not None)),
        output_dtypes=[down.dtype] * (1 + (next_norm is not None)))
    return outs[0], outs[1] if next_norm is not None else None
