"""A mixture of experts' decode step through the backend's routing and weighted sum
(worker_proc.fused_moe): mlx-lm's outputs and tokens on the CPU (the kernels' meaning in
mlx-lm's ops), and the kernels against that meaning on CUDA."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine, StandInInPlaceKernels, StandInKernel
from tests.families import build
from worker_proc import fused_moe
from worker_proc.decode_backend import KernelDecode
from worker_proc.decode_block import NormHandoff, speed_up_decode_blocks
from worker_proc.expert_padding import pad_expert_outputs
from worker_proc.fused_moe import experts_plan, fused_experts, reference_combine, reference_route
from worker_proc.fused_projections import fuse_projections


def _draw_biases(model: nn.Module, seed: int) -> None:
    """Random biases and norm weights, each layer's its own (mlx-lm starts biases at zero
    and norms at one, which would hide where a bias is added or which norm is used)."""
    for i, (_, module) in enumerate(model.named_modules()):
        if "bias" in module and isinstance(module["bias"], mx.array):
            module["bias"] = 0.5 * mx.random.normal(module["bias"].shape,
                                                    key=mx.random.key(seed + i))
        if isinstance(module, nn.RMSNorm):
            module.weight = 1 + 0.3 * mx.random.normal(module.weight.shape,
                                                       key=mx.random.key(seed + 1000 + i))
    mx.eval(model.parameters())


def _model(name: str, quantize: bool = False, fuse: bool = True, **config: Any) -> nn.Module:
    """The family's tiny model (config: values in place of the family's), biases drawn,
    experts quantized (MXFP4, as GPT-OSS ships; its router 8 bits, as mlx-lm converts it)
    and padded to whole tiles as the CUDA path pads them, gate/up fused."""
    from mlx_lm.models.switch_layers import SwitchLinear

    model = build(name, **config)
    _draw_biases(model, seed=40)
    if quantize:
        def which(path: str, module: nn.Module) -> bool | dict:
            if path.endswith("router"):
                return {"group_size": 64, "bits": 8, "mode": "affine"}
            return isinstance(module, SwitchLinear)

        nn.quantize(model, group_size=32, bits=4, mode="mxfp4", class_predicate=which)
    if fuse:
        fuse_projections(model)
        if quantize:
            assert pad_expert_outputs(model, tile=128) > 0
    return model


@pytest.mark.parametrize("name,softmax_first", [("gpt_oss", False), ("qwen3_moe", True)])
def test_blocks_get_a_plan_of_their_experts(name, softmax_first):
    """Every fast block of GPT-OSS and Qwen3-MoE has its experts' plan (the family's
    routing rule) and but the last hands the next its input norm; unfused gate/up
    projections and dense MLPs have none."""
    model = _model(name)
    assert speed_up_decode_blocks(model, residual_in_gemm=False) == len(model.layers)
    layers = model.layers
    assert all(a.handoff_out is b.handoff_in is not None for a, b in zip(layers, layers[1:]))
    assert layers[0].handoff_in is None and layers[-1].handoff_out is None
    assert all(a.handoff_out.next_norm.weight is b.input_layernorm.weight
               for a, b in zip(layers, layers[1:]))
    plans = [layer.moe_plan for layer in model.layers]
    assert all(p is not None for p in plans)
    assert {(p.routing.experts, p.routing.top_k, p.routing.softmax_first) for p in plans} == {
        (4, 2, softmax_first)}
    assert experts_plan(_model(name, fuse=False).layers[0].mlp) is None
    dense = build("llama")
    fuse_projections(dense)
    speed_up_decode_blocks(dense, residual_in_gemm=False)
    assert all(layer.moe_plan is None for layer in dense.layers)


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("tokens", [3, 40])
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_the_routing_and_sum_compute_mlx_lm_mlps(name, tokens, quantize):
    """The plan's call with the kernels' meaning (StandInKernel: reference_route and
    reference_combine) equals the residual plus mlx-lm's MLP bit for bit on the CPU: pairs
    in token order below SORT_PAIRS (3 tokens x 2), sorted by expert above (40 x 2), the
    experts' biases and a padded down projection (MXFP4) included."""
    ours, theirs = _model(name, quantize), _model(name, quantize, fuse=False)
    plan = experts_plan(ours.layers[1].mlp)
    if quantize and name == "gpt_oss":  # its router's bias goes to the routing
        assert type(plan.router) is nn.QuantizedLinear and "bias" in plan.router
    x = mx.random.normal((tokens, 1, 64), key=mx.random.key(tokens))
    residual = mx.random.normal((tokens, 1, 64), key=mx.random.key(7))
    norm = theirs.layers[2].input_layernorm
    got, normed = fused_experts(plan, StandInKernel(), x, residual,
                                fused_moe.NextNorm(norm.weight, norm.eps))
    want = residual + theirs.layers[1].mlp(x)
    assert got.shape == want.shape == normed.shape
    assert np.array_equal(np.array(got), np.array(want))
    # the next block's input norm of that sum, as that block computes it
    assert np.array_equal(np.array(normed), np.array(norm(want)))


def test_routing_places_each_pair_once_sorted_by_expert():
    """reference_route's pairs, sorted: experts ascending, each token's j-th pair at its
    slot with that token and expert; below SORT_PAIRS, the pairs in token order."""
    routing = experts_plan(_model("qwen3_moe").layers[0].mlp).routing
    for tokens in (5, 50):
        logits = mx.random.normal((tokens, 4), key=mx.random.key(tokens))
        routed = reference_route(logits, routing)
        _, chosen = routing.select(logits)
        experts, rows, slots = (np.array(a) for a in (routed.experts, routed.rows, routed.slots))
        assert routed.sorted == (tokens * 2 >= fused_moe.SORT_PAIRS)
        assert sorted(slots.tolist()) == list(range(tokens * 2))
        assert (np.diff(experts) >= 0).all() or not routed.sorted
        pairs = np.array(chosen).reshape(-1)
        assert (experts[slots] == pairs).all() and (rows[slots] == np.arange(tokens * 2) // 2).all()


@pytest.mark.parametrize("path", ["compiled", "in place", "bf16 expert rows"])
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_served_experts_keep_mlx_lm_tokens(name, path, monkeypatch):
    """Served on the kernel path (stood in for), 36 streams at once (72 pairs: sorted) down
    to the last few (unsorted), chunked prompts: mlx-lm's greedy tokens, and the decode
    steps' experts went through the backend's routing, both ways; with `--experiments
    bf16-expert-rows` the sorted steps' (float32 standing for bfloat16) experts'
    projections through expert_rows (stood in for), the others not."""
    from tests.oracle import mlx_lm_tokens
    from tests.test_worker import _prompts

    ours, theirs = _model(name), _model(name, fuse=False)
    assert speed_up_decode_blocks(ours, residual_in_gemm=False) == len(ours.layers)
    seen: list[bool] = []
    route = StandInKernel._route_experts

    def counting(self, logits, routing, bias):  # noqa: ANN001, ANN202
        routed = route(self, logits, routing, bias)
        seen.append(routed.sorted)
        return routed

    monkeypatch.setattr(StandInKernel, "_route_experts", counting)
    handed: list[str] = []
    take, put = NormHandoff.take, NormHandoff.put

    def taking(self, x):  # noqa: ANN001, ANN202
        normed = take(self, x)
        if normed is not None:
            handed.append("taken")
        return normed

    def putting(self, source, normed):  # noqa: ANN001, ANN202
        handed.append("put")
        put(self, source, normed)

    monkeypatch.setattr(NormHandoff, "take", taking)
    monkeypatch.setattr(NormHandoff, "put", putting)
    rows_calls: list[int] = []
    stood_in = StandInKernel._expert_rows
    monkeypatch.setattr(StandInKernel, "_expert_rows",
                        lambda self, module, x, experts, tokens: rows_calls.append(
                            experts.shape[0]) or stood_in(self, module, x, experts, tokens))
    lengths = [(7 * i) % 40 + 1 for i in range(36)]
    prompts = _prompts(36, lengths, 512, seed=61)
    backend = (StandInInPlaceKernels() if path == "in place"
               else StandInKernel(dense_expert_rows=path == "bf16 expert rows"))
    engine = InProcessEngine(ours, chunk_size=16, compile_decode=path != "in place",
                             overlap="ahead", backend=backend, max_running=36)
    seen.clear()  # the start-up probes' forwards (compiled: the served buckets' traces)
    rows_calls.clear()
    budgets = [6 + i % 9 for i in range(36)]
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        engine.submit(f"r{i}", p, n, [])
    results = engine.run_until_idle()
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(theirs, p, n), f"r{i}"
    assert True in seen and False in seen
    switch = ours.layers[0].mlp.experts if name == "gpt_oss" else ours.layers[0].mlp.switch_mlp
    if path == "bf16 expert rows":
        assert rows_calls and min(rows_calls) >= switch.down_proj["weight"].shape[0], rows_calls
    else:
        assert not rows_calls
    # every next-block norm combine made was taken by that block
    assert handed and handed.count("put") == handed.count("taken")


@pytest.mark.parametrize("path", ["compiled", "in place"])
def test_gpt_oss_as_mlx_lm_converts_it_keeps_mlx_lm_tokens(path, monkeypatch):
    """GPT-OSS quantized as mlx-lm's convert quantizes it (every Linear MXFP4, the router
    8 bits; biases drawn): the quantized router's and attention output's biases go to the
    routing and add-norm kernels' meaning apart from their matmuls, and the MXFP4 experts'
    projections of sorted steps to expert_rows' (stood in for); mlx-lm's tokens."""
    from tests import engine_driver
    from tests.oracle import mlx_lm_tokens
    from tests.test_worker import _prompts

    def converted(fuse: bool) -> nn.Module:
        model = build("gpt_oss")
        _draw_biases(model, seed=43)
        nn.quantize(model, group_size=32, bits=4, mode="mxfp4", class_predicate=lambda p, m: (
            {"group_size": 64, "bits": 8, "mode": "affine"} if p.endswith("router")
            else hasattr(m, "to_quantized") and not isinstance(m, nn.Embedding)))
        if fuse:
            fuse_projections(model)
            pad_expert_outputs(model, tile=128)
            speed_up_decode_blocks(model, residual_in_gemm=True)
        return model

    ours, theirs = converted(True), converted(False)
    assert type(ours.layers[0].self_attn.o_proj) is nn.QuantizedLinear
    rows_calls = []
    stood_in = engine_driver.StandInKernel._expert_rows
    monkeypatch.setattr(engine_driver.StandInKernel, "_expert_rows",
                        lambda self, module, x, experts, tokens: rows_calls.append(
                            (experts.shape[0], module["weight"].shape[0]))
                        or stood_in(self, module, x, experts, tokens))
    # 36 streams (72 pairs: sorted, as the CUDA routing kernel always sorts) down to the
    # last few (unsorted: MLX's gather_qmm)
    lengths = [(11 * i) % 40 + 1 for i in range(36)]
    prompts = _prompts(36, lengths, 512, seed=44)
    budgets = [4 + i % 7 for i in range(36)]
    engine = InProcessEngine(ours, chunk_size=16, compile_decode=path == "compiled",
                             overlap="ahead", max_running=36,
                             backend=StandInKernel() if path == "compiled" else StandInInPlaceKernels())
    rows_calls.clear()  # (the start-up probes' forwards)
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        engine.submit(f"r{i}", p, n, [])
    results = engine.run_until_idle()
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(theirs, p, n), f"r{i}"
    assert rows_calls and all(pairs >= experts for pairs, experts in rows_calls), rows_calls


def test_unfused_moe_leaves_the_experts_to_mlx_lm(monkeypatch):
    """--experiments unfused-moe (the backend's moe_kernels off), and a step of more pairs
    than the routing kernel takes: no routing; the blocks run mlx-lm's MLP, its tokens."""
    import dataclasses

    from tests.oracle import mlx_lm_tokens
    from tests.test_worker import _prompts
    from worker_proc import decode_backend

    monkeypatch.setattr(decode_backend, "kernel_available", lambda: True)
    monkeypatch.setattr(decode_backend, "kernel_fits", lambda specs: True)
    assert decode_backend.choose_decode_backend([], frozenset({"unfused-moe"})).moe_kernels is False
    assert decode_backend.choose_decode_backend([]).moe_kernels is True
    assert decode_backend.choose_decode_backend([]).expert_rows_kernel is True
    assert decode_backend.choose_decode_backend(
        [], frozenset({"mlx-expert-matmuls"})).expert_rows_kernel is False
    plan = experts_plan(_model("gpt_oss").layers[0].mlp)
    many = fused_moe.ROUTE_MAX_PAIRS // plan.routing.top_k + 1
    assert fused_experts(plan, StandInKernel(), mx.zeros((many, 1, 64)), None) is None

    def refuse(*args):  # noqa: ANN002, ANN202
        raise AssertionError("routed with moe_kernels off")

    monkeypatch.setattr(StandInKernel, "_route_experts", refuse)
    ours, theirs = _model("gpt_oss"), _model("gpt_oss", fuse=False)
    speed_up_decode_blocks(ours, residual_in_gemm=False)
    prompts = _prompts(3, [5, 30, 12], 512, seed=62)
    engine = InProcessEngine(ours, chunk_size=16, compile_decode=True, overlap="ahead",
                             backend=dataclasses.replace(StandInKernel(), moe_kernels=False))
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 8, [])
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(theirs, p, 8)


def _cuda() -> None:
    from worker_proc.paged_attention import kernel_available

    if not kernel_available():
        pytest.skip("the kernels need MLX's CUDA backend")


def _distinct_logits(tokens: int, experts: int, seed: int) -> mx.array:
    """bfloat16 logits without ties near the top (a random order of experts 0.5 apart)."""
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.permutation(experts) for _ in range(tokens)]) * 0.5 - experts / 4
    return mx.array(rows.astype(np.float32)).astype(mx.bfloat16)


@pytest.mark.parametrize("experts,top_k,softmax_first,normalize", [
    (32, 4, False, False), (128, 8, True, True), (128, 8, True, False), (8, 2, False, False),
    (fused_moe.ROUTE_MAX_EXPERTS, fused_moe.ROUTE_MAX_K, False, False)])
@pytest.mark.parametrize("tokens", [1, 5, 64, 256])
def test_cuda_route_kernel_matches_mlx_ops(tokens, experts, top_k, softmax_first, normalize):
    """On CUDA, the routing kernel picks each token's experts as mlx-lm's ops do (logits
    without ties; a router bias added first for the top-k-first rule, GPT-OSS's), their
    weights within a bfloat16 rounding, and places every pair once, sorted by expert, at
    its slot with its token."""
    _cuda()
    routing = fused_moe.Routing(
        experts, top_k, softmax_first, normalize,
        fused_moe._qwen3_moe_select(top_k, normalize) if softmax_first
        else fused_moe._gpt_oss_select(top_k))
    logits = _distinct_logits(tokens, experts, seed=tokens + experts)
    bias = None
    if not softmax_first:  # under a quarter: within the logits' gaps of 0.5, no new ties
        bias = mx.array(np.random.default_rng(1).integers(0, 16, experts) / 64,
                        dtype=mx.bfloat16)
    got = fused_moe.route(logits, routing, bias)
    if bias is not None:
        logits = logits + bias
    want_weights, want_experts = routing.select(logits)
    pairs = tokens * top_k
    experts_out, rows, slots = (np.array(a) for a in (got.experts, got.rows, got.slots))
    weights = np.array(got.weights.astype(mx.float32))[:pairs].reshape(tokens, top_k)
    chosen = experts_out[slots].reshape(tokens, top_k)
    assert got.sorted == (pairs >= fused_moe.SORT_PAIRS)
    assert (np.diff(experts_out) >= 0).all()
    assert sorted(slots.tolist()) == list(range(pairs))
    assert (rows[slots] == np.arange(pairs) // top_k).all()
    want_e = np.array(want_experts)
    want_w = np.array(want_weights.astype(mx.float32))
    for n in range(tokens):
        assert sorted(chosen[n].tolist()) == sorted(want_e[n].tolist()), n
        by_expert = dict(zip(want_e[n].tolist(), want_w[n].tolist()))
        for e, w in zip(chosen[n].tolist(), weights[n].tolist()):
            assert abs(w - by_expert[e]) <= 2 ** -7 * max(abs(w), 2 ** -20), (n, e, w)


@pytest.mark.parametrize("softmax_first", [False, True])
def test_cuda_route_kernel_breaks_ties_to_the_lower_expert(softmax_first):
    """On CUDA, tied logits (every value four times, a top 2) give each token the two
    lowest experts of its four highest, equal weights, and every pair one place."""
    _cuda()
    experts, top_k, tokens = 16, 2, 40
    routing = fused_moe.Routing(experts, top_k, softmax_first, softmax_first,
                                fused_moe._qwen3_moe_select(top_k, True) if softmax_first
                                else fused_moe._gpt_oss_select(top_k))
    rng = np.random.default_rng(9)
    rows = np.stack([rng.permutation(np.arange(experts) // 4) for _ in range(tokens)])
    logits = mx.array(rows.astype(np.float32)).astype(mx.bfloat16)
    got = fused_moe.route(logits, routing)
    slots, experts_out = np.array(got.slots), np.array(got.experts)
    assert sorted(slots.tolist()) == list(range(tokens * top_k))
    chosen = experts_out[slots].reshape(tokens, top_k)
    top = rows.max(axis=1)
    for n in range(tokens):
        lowest = np.flatnonzero(rows[n] == top[n])[:top_k]
        assert sorted(chosen[n].tolist()) == lowest.tolist()
    weights = np.array(got.weights.astype(mx.float32))[:tokens * top_k]
    np.testing.assert_allclose(weights, 1 / top_k, rtol=2 ** -7)


@pytest.mark.parametrize("bias,residual,next_norm", [
    (True, True, True), (True, True, False), (False, False, False), (True, False, False),
    (False, True, True)])
@pytest.mark.parametrize("tokens", [1, 64])
def test_cuda_combine_kernel_matches_mlx_ops(tokens, bias, residual, next_norm):
    """On CUDA, the weighted sum of each token's experts' outputs (a padded down
    projection's first columns, its bias by expert, the residual) and that sum through
    the next block's RMS norm are reference_combine's within a rounding or two of
    bfloat16 (the k products summed, and the squares, in another order)."""
    _cuda()
    experts, top_k, dim, padded = 32, 4, 2880, 2944
    routing = fused_moe.Routing(experts, top_k, False, False, fused_moe._gpt_oss_select(top_k))
    routed = fused_moe.route(_distinct_logits(tokens, experts, seed=3), routing)
    pairs = tokens * top_k
    down = mx.random.normal((pairs, 1, padded), key=mx.random.key(1)).astype(mx.bfloat16)
    b = mx.random.normal((experts, padded), key=mx.random.key(2)).astype(mx.bfloat16) if bias else None
    r = (4 * mx.random.normal((tokens, dim), key=mx.random.key(3))).astype(mx.bfloat16) if residual else None
    norm = None
    if next_norm:
        weight = (1 + 0.3 * mx.random.normal((dim,), key=mx.random.key(4))).astype(mx.bfloat16)
        norm = fused_moe.NextNorm(weight, 1e-5)
    got = fused_moe.combine(down, routed, b, dim, r, norm)
    want = reference_combine(down, routed, b, dim, r, norm)
    assert (got[1] is None) == (want[1] is None) == (not next_norm)
    for g, w in zip(got, want):
        if w is None:
            continue
        assert g.shape == w.shape == (tokens, dim) and g.dtype == mx.bfloat16
        g, w = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
        np.testing.assert_allclose(g, w, rtol=2 ** -6, atol=2 ** -6 * max(1.0, float(np.abs(w).mean())))


@pytest.mark.parametrize("tokens", [1, 64])
def test_cuda_fused_experts_compute_mlx_lm_mlps(tokens):
    """On CUDA, GPT-OSS's MXFP4 experts (bfloat16, down padded) through both kernels give
    the residual plus mlx-lm's MLP within bfloat16's rounding of the sum. Sorted rows take
    MLX's grouped MXFP4 kernel, whose tiles span 128 of the input width: at the family's
    64 it failed to set up (for mlx-lm's call too), so this model is 192 wide."""
    _cuda()
    dims = dict(hidden_size=192, intermediate_size=256)  # down still padded (192 -> 256)
    ours = _model("gpt_oss", quantize=True, **dims)
    theirs = _model("gpt_oss", quantize=True, fuse=False, **dims)
    for model in (ours, theirs):
        model.set_dtype(mx.bfloat16)
    plan = experts_plan(ours.layers[0].mlp)
    x = mx.random.normal((tokens, 1, 192), key=mx.random.key(5)).astype(mx.bfloat16)
    residual = mx.random.normal((tokens, 1, 192), key=mx.random.key(6)).astype(mx.bfloat16)
    got, _ = fused_experts(plan, KernelDecode(), x, residual)
    want = residual + theirs.layers[0].mlp(x)
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(g, w, rtol=2 ** -5, atol=2 ** -5 * max(1.0, float(np.abs(w).mean())))


# Pairs an expert over 8 experts: a mixed step (an expert with two passes' rows, one
# with none), a one-token step and a busy one (passes of two to four row tiles, an
# expert of three passes).
_COUNTS = {"mixed": [0, 1, 35, 0, 2, 5, 0, 3], "one token": [0, 1, 0, 0, 1, 1, 0, 1],
           "busy": [20, 31, 9, 22, 0, 25, 19, 80]}


@pytest.mark.parametrize("mode,group,gather,counts", [
    *[(m, gr, ga, "mixed") for m, gr in (("mxfp4", 32), ("affine", 64), ("affine", 32),
                                         ("bf16", 0), ("bf16 registers", 0))
      for ga in (True, False)],
    ("mxfp4", 32, True, "one token"), ("affine", 128, True, "busy"), ("bf16", 0, True, "busy"),
    ("bf16 registers", 0, True, "busy"), ("bf16", 0, False, "one token")])
def test_cuda_expert_rows_match_gather_qmm(mode, group, gather, counts):
    """On CUDA, the experts' tensor-core kernel gives MLX's gather_qmm (4-bit weights) or
    gather_mm (bfloat16) of the sorted pairs within bfloat16's rounding: experts with no
    rows, one, more than a pass takes, outputs past the last whole tile and inputs past the
    last whole chunk and k-step; rows gathered by token or taken in pair order; each pass
    shape; bfloat16 weights through shared memory (the default) and through registers."""
    from worker_proc.expert_rows import expert_rows, fits, reference_expert_rows

    _cuda()
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    # a chunk and a k-step and a half (groups of 128: and a half); four tiles and a half;
    # bf16: five k-steps and a word of 32 and a word of 8
    dims, outs = {128: 640, 0: 680}.get(group, 704), 72
    mx.random.seed(3)
    form = "registers" if mode == "bf16 registers" else "staged"
    if mode.startswith("bf16"):
        module = SwitchLinear(dims, outs, 8, bias=False)
    else:
        module = QuantizedSwitchLinear(dims, outs, 8, bias=False, group_size=group, mode=mode)
    module.set_dtype(mx.bfloat16)
    experts = mx.array(np.repeat(np.arange(8), _COUNTS[counts]).astype(np.uint32))
    pairs = int(sum(_COUNTS[counts]))
    rng = np.random.default_rng(4)
    tokens = mx.array(rng.integers(0, 16, size=pairs).astype(np.uint32)) if gather else None
    x = mx.random.normal((16 if gather else pairs, dims), key=mx.random.key(5)).astype(mx.bfloat16)
    assert fits(module, dims, mx.bfloat16)
    got = expert_rows(module, x, experts, tokens, dense_form=form)
    want = reference_expert_rows(module, x, experts, tokens)
    assert got.shape == want.shape == (pairs, 1, outs) and got.dtype == mx.bfloat16
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(w).max()))


@pytest.mark.parametrize("form", ["staged", "registers"])
@pytest.mark.parametrize("rows,row_tiles", [(64, 8), (61, 8), (64, 2)])
def test_cuda_bf16_expert_rows_as_one_dense_projection(form, rows, row_tiles):
    """On CUDA, one bf16 expert taking every row (bench/skinny_gemm.py's use) gives x @ w.T
    within bfloat16's rounding, in one pass of up to 64 rows or several of 16."""
    from worker_proc.expert_rows import expert_rows

    _cuda()
    from mlx_lm.models.switch_layers import SwitchLinear

    dims, outs = 392, 200  # three k-steps and 8 inputs; twelve output tiles and a half
    module = SwitchLinear(dims, outs, 1, bias=False)
    module.set_dtype(mx.bfloat16)
    x = mx.random.normal((rows, dims), key=mx.random.key(8)).astype(mx.bfloat16)
    got = expert_rows(module, x, mx.zeros((rows,), dtype=mx.uint32), dense_form=form,
                      row_tiles=row_tiles)[:, 0]
    want = x @ module["weight"][0].T
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(w).max()))


@pytest.mark.parametrize("mode,group", [("mxfp4", 32), ("affine", 32), ("affine", 64),
                                        ("affine", 128)])
@pytest.mark.parametrize("rows", [1, 8, 61, 256])
def test_cuda_linear_rows_match_quantized_matmul(mode, group, rows):
    """On CUDA, a 4-bit quantized Linear's rows through the experts' kernel as one expert
    (`--experiments quantized-rows-kernel`) give MLX's quantized matmul within bfloat16's
    rounding: one row, a pass's part, passes and a part, the most a step sends."""
    from worker_proc.expert_rows import linear_fits, linear_rows

    _cuda()
    dims, outs = (640 if group == 128 else 704), 200  # chunks and a half; tiles and a half
    mx.random.seed(5)
    linear = nn.QuantizedLinear(dims, outs, bias=False, group_size=group, bits=4, mode=mode)
    linear.set_dtype(mx.bfloat16)
    x = mx.random.normal((rows, dims), key=mx.random.key(6)).astype(mx.bfloat16)
    assert linear_fits(linear, dims, mx.bfloat16)
    got = linear_rows(linear, x)
    want = linear(x)
    assert got.shape == want.shape == (rows, outs) and got.dtype == mx.bfloat16
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(w).max()))


@pytest.mark.parametrize("rows", [1, 8, 61, 128])
def test_cuda_linear_rows_match_a_bf16_linear(rows):
    """On CUDA, a bfloat16 Linear's rows through the kernel's staged form (`--experiments
    bf16-rows-kernel`) give x @ w.T within bfloat16's rounding: a row, a tile, a pass of up
    to 64 rows and two."""
    from worker_proc.expert_rows import linear_fits, linear_rows

    _cuda()
    dims, outs = 392, 200  # three k-steps and 8 inputs; twelve output tiles and a half
    linear = nn.Linear(dims, outs, bias=False)
    linear.set_dtype(mx.bfloat16)
    x = mx.random.normal((rows, dims), key=mx.random.key(7)).astype(mx.bfloat16)
    assert linear_fits(linear, dims, mx.bfloat16)
    got, want = linear_rows(linear, x), linear(x)
    assert got.shape == want.shape == (rows, outs) and got.dtype == mx.bfloat16
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(w).max()))


def test_expert_rows_takes_bf16_4bit_experts_once_pairs_reach_experts():
    """The tensor-core kernel takes bf16 rows over 4-bit MXFP4 or affine (bf16 scales and
    biases, groups of 32-128) experts as wide as the rows, and is preferred once a step
    has as many pairs as experts; anything else keeps MLX's gather_qmm."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    from worker_proc.expert_rows import fits, preferred

    def experts(mode: str, group: int, bits: int = 4, dtype=mx.bfloat16) -> QuantizedSwitchLinear:
        m = QuantizedSwitchLinear(128, 32, 8, bias=False, group_size=group, bits=bits, mode=mode)
        m.set_dtype(dtype)
        return m

    for mode, group in (("mxfp4", 32), ("affine", 32), ("affine", 64), ("affine", 128)):
        m = experts(mode, group)
        assert fits(m, 128, mx.bfloat16)
        assert not fits(m, 128, mx.float32) and not fits(m, 128, mx.float16)
        assert not fits(m, 256, mx.bfloat16)
    # float32 scales would promote gather_qmm's output past x's dtype
    assert not fits(experts("affine", 64, dtype=mx.float32), 128, mx.bfloat16)
    assert not fits(experts("affine", 64, bits=8), 128, mx.bfloat16)
    # bfloat16 experts as wide as a multiple of 8 (a float32 SwitchLinear: MLX's gather_mm)
    dense = SwitchLinear(136, 32, 8, bias=False)
    assert not fits(dense, 136, mx.bfloat16)
    dense.set_dtype(mx.bfloat16)
    assert fits(dense, 136, mx.bfloat16) and not fits(dense, 136, mx.float32)
    assert not fits(dense, 128, mx.bfloat16)
    narrow = SwitchLinear(132, 32, 8, bias=False)
    narrow.set_dtype(mx.bfloat16)
    assert not fits(narrow, 132, mx.bfloat16)
    m = experts("mxfp4", 32)
    assert not preferred(m, 4) and preferred(m, 8) and preferred(m, 256)


def test_bf16_experts_take_the_kernel_only_under_their_experiment(monkeypatch):
    """bfloat16 experts' projections stay MLX's gather_mm unless `--experiments
    bf16-expert-rows` asks for the kernel; 4-bit ones take it either way."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    dense = SwitchLinear(128, 32, 8, bias=False)
    dense.set_dtype(mx.bfloat16)
    quantized = QuantizedSwitchLinear(128, 32, 8, bias=False, group_size=32, mode="mxfp4")
    quantized.set_dtype(mx.bfloat16)
    x = mx.random.normal((16, 128)).astype(mx.bfloat16)
    pairs = mx.arange(32, dtype=mx.uint32)  # 16 tokens, 2 experts each, grouped by expert
    routed = fused_moe.Routed(mx.ones((32,)), pairs // 4, pairs % 16, pairs, False, 16, 2, True)
    plain, asked = StandInKernel(), StandInKernel(dense_expert_rows=True)
    assert plain.expert_rows(dense, x, routed, True) is None
    assert plain.expert_rows(quantized, x, routed, True) is not None
    got = asked.expert_rows(dense, x, routed, True)
    assert got is not None and got.shape == (32, 1, 32)
    from worker_proc import decode_backend

    monkeypatch.setattr(decode_backend, "kernel_available", lambda: True)
    monkeypatch.setattr(decode_backend, "kernel_fits", lambda specs: True)
    choose = decode_backend.choose_decode_backend
    assert choose([], frozenset({"bf16-expert-rows"})).dense_expert_rows is True
    assert choose([]).dense_expert_rows is False


def test_a_dense_router_gives_the_quantized_routers_logits():
    """GPT-OSS's 8-bit router (as mlx_lm.convert leaves it) through its dequantized weight
    (router_logits, dense: what the CUDA path takes) gives its quantized matmul's logits
    within their bfloat16 rounding, and the same bias apart; unquantized routers and
    dense=False keep linear_and_bias."""
    from worker_proc.fused_moe import linear_and_bias, router_logits

    with mx.stream(mx.cpu):  # (MLX's CUDA quantized matmul takes no 64-wide rows)
        model = _model("gpt_oss", quantize=True)
        model.set_dtype(mx.bfloat16)
        plan = experts_plan(model.layers[0].mlp)
        assert plan.dense_router is not None and plan.dense_router.dtype == mx.bfloat16
        x = mx.random.normal((64, model.args.hidden_size), key=mx.random.key(7)).astype(mx.bfloat16)
        (dense, bias), (quantized, same) = router_logits(plan, x, True), linear_and_bias(plan.router, x)
        assert bias is same and dense.dtype == quantized.dtype == mx.bfloat16
        d, q = np.array(dense.astype(mx.float32)), np.array(quantized.astype(mx.float32))
        np.testing.assert_allclose(d, q, rtol=2 ** -6, atol=2 ** -6 * float(np.abs(q).max()))
        kept = router_logits(plan, x, False)[0]
        assert mx.array_equal(kept, quantized).item()
        assert experts_plan(_model("gpt_oss").layers[0].mlp).dense_router is None


def test_the_moe_layers_benchmark_runs_its_variants_exactly_on_the_cpu():
    """bench/moe_layers.py --tiny: mlx-lm's blocks and kiln's fused path (the stand-in
    kernels, with and without expert_rows' meaning) at two row counts, the same outputs."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "moe_layers.py"), "--tiny",
                          "--rows", "64,1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("rows")]
    assert len(lines) == 6 and all(ln.endswith("max |diff| 0") for ln in lines), out.stdout
    assert sorted(int(ln.split()[1]) for ln in lines) == [1, 1, 1, 64, 64, 64]
