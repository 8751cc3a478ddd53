"""The fast llama decode block (--fast-decode-blocks): mlx-lm's tokens with fewer launches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine, StandInInPlaceKernels, StandInKernel, assert_greedy
from tests.oracle import divergence_off_a_tie
from worker_proc.decode_backend import DecodeBackend
from tests.test_worker import _eos, _prompts
from worker_proc.decode_block import FastDecodeBlock, speed_up_decode_blocks
from worker_proc.fused_projections import fuse_projections


def _load(model_dir):
    import mlx_lm

    return mlx_lm.load(str(model_dir))[0]


@pytest.fixture()
def fast_tiny(tiny_model_dir):
    """A fused copy of the tiny model whose blocks take the fast decode call (the
    fixture's own copy stays mlx-lm's: it is the oracle)."""
    model = _load(tiny_model_dir)
    fuse_projections(model)
    assert speed_up_decode_blocks(model, residual_in_gemm=False) == len(model.layers)
    assert all(isinstance(layer, FastDecodeBlock) for layer in model.layers)
    return model


@pytest.mark.parametrize("compile_decode", [False, True])
def test_fast_blocks_decode_mlx_lm_tokens(tiny_model, oracle, fast_tiny, monkeypatch,
                                         compile_decode):
    """Batched, ragged, chunked prompts, prefill through mlx-lm's block call and decode
    through the fast one (on the kernel path, stood in for on the CPU), eager and
    compiled: mlx-lm's greedy tokens."""
    _, tokenizer = tiny_model
    prompts = _prompts(5, [3, 70, 130, 9, 40], fast_tiny.args.vocab_size, seed=31)
    engine = InProcessEngine(fast_tiny, chunk_size=64, compile_decode=compile_decode,
                             backend=StandInKernel(),
                             overlap="ahead")
    assert_greedy(engine, prompts, 24, _eos(tokenizer), oracle, ties_of=tiny_model[0])


def test_qwen2_blocks_decode_mlx_lm_tokens(tiny_model, monkeypatch):
    """Qwen2's block (q/k/v with biases) takes the fast call too: mlx-lm's tokens, compiled
    decode on the kernel path (stood in for on the CPU)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    from tests.oracle import mlx_lm_greedy

    _, tokenizer = tiny_model
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-6, vocab_size=tiny_model[0].args.vocab_size)
    mx.random.seed(5)
    theirs, ours = qwen2.Model(args), qwen2.Model(args)
    ours.load_weights(tree_flatten(theirs.parameters()))
    mx.eval(theirs.parameters(), ours.parameters())
    fuse_projections(ours)
    assert speed_up_decode_blocks(ours, residual_in_gemm=False) == 2
    prompts = _prompts(3, [33, 8, 70], args.vocab_size, seed=8)
    engine = InProcessEngine(ours, compile_decode=True, overlap="ahead", backend=StandInKernel())
    assert_greedy(engine, prompts, 20, _eos(tokenizer),
                  lambda p, n: mlx_lm_greedy(theirs, tokenizer, p, n), ties_of=theirs)


@pytest.mark.parametrize("forward", ["decode", "prefill"])
def test_the_fast_calls_compute_mlx_lm_blocks(tiny_model_dir, forward):
    """A decode step (ragged rows) and a prefill forward over the pool (two rows at
    different starts after cached contexts, ragged) through one block: both variants
    (residual adds after the GEMMs, or inside them by addmm, as on CUDA) compute what
    mlx-lm's block does, up to float32 rounding: their projections are fused matmuls,
    which a BLAS need not round as the separate ones."""
    from worker_proc.attention import ForwardLayout, build_layer_caches, install_attention_hook
    from worker_proc.kv_pool import KVPool
    from worker_proc.memory import probe_attention_specs

    install_attention_hook()
    theirs, ours = _load(tiny_model_dir), _load(tiny_model_dir)
    fuse_projections(ours)
    speed_up_decode_blocks(ours, residual_in_gemm=False)
    pool = KVPool(probe_attention_specs(theirs), 300, StandInKernel())
    rng = np.random.default_rng(3)
    table = rng.permutation(np.arange(1, 301))[:60].reshape(4, 15).astype(np.int32)
    rows, length = (4, 1) if forward == "decode" else (2, 9)
    x = mx.array(rng.standard_normal((rows, length, theirs.args.hidden_size)).astype(np.float32))

    def block_out(block):
        layout = (ForwardLayout.decode(table, np.array([10, 3, 7, 1])) if forward == "decode"
                  else ForwardLayout.prefill(table[:2], np.array([5, 2]), np.array([9, 7])))
        cache = build_layer_caches(pool, layout)[0]
        return block(x, mask=cache.make_mask(length), cache=cache)

    # Only the rows' own positions are promised: a padded query's output is never read
    # (on CUDA it differed between the two calls while the CPU happened to agree).
    valid = [(0, 1), (1, 1), (2, 1), (3, 1)] if forward == "decode" else [(0, 9), (1, 7)]
    want = np.array(block_out(theirs.layers[0]))
    for residual_in_gemm in (False, True):
        ours.layers[0].residual_in_gemm = residual_in_gemm
        got = np.array(block_out(ours.layers[0]))
        for row, n in valid:
            np.testing.assert_allclose(got[row, :n], want[row, :n], rtol=1e-5, atol=1e-5)


def test_the_flag_needs_fused_projections():
    from ipc.config import ServerConfig

    with pytest.raises(ValueError, match="fast-decode-blocks needs fused projections"):
        ServerConfig(fast_decode_blocks="on", fuse_projections="off")
    # auto follows the projections: off with them, no error
    assert ServerConfig(fuse_projections="off").fast_decode_blocks == "auto"


def test_only_fused_llama_blocks_are_sped_up(tiny_model_dir):
    model = _load(tiny_model_dir)
    assert speed_up_decode_blocks(model, residual_in_gemm=True) == 0  # not fused
    assert not any(isinstance(layer, FastDecodeBlock) for layer in model.layers)


def test_rope_in_attention_decodes_mlx_lm_tokens(tiny_model, oracle, fast_tiny, monkeypatch):
    """With RoPE left to the write-and-attend kernel (stood in for on the CPU by
    mx.fast.rope at each row's position), the block hands it unrotated q and k: mlx-lm's
    greedy tokens, ragged batches, chunked prompts, steps launched ahead."""
    _, tokenizer = tiny_model
    prompts = _prompts(5, [3, 70, 130, 9, 40], fast_tiny.args.vocab_size, seed=32)
    engine = InProcessEngine(fast_tiny, chunk_size=64, overlap="ahead",
                             backend=StandInInPlaceKernels(rope_in_kernel=True))
    assert engine.pool.in_place
    assert_greedy(engine, prompts, 24, _eos(tokenizer), oracle, ties_of=tiny_model[0])
    assert all(layer.rope_spec is not None for layer in fast_tiny.layers)


def test_qk_rope_kernel_decodes_mlx_lm_tokens(tiny_model, oracle, fast_tiny, monkeypatch):
    """By default (KernelDecode.qk_rope_kernel) a llama block's decode RoPE of q and k
    goes to the backend's norm_rope_qk without a norm (the kernel's place; the stand-in
    computes its plain-MLX meaning): mlx-lm's greedy tokens, ragged batches, chunked
    prompts; under --experiments unfused-qk-rope the block rotates them itself."""
    from worker_proc.qk_norm_rope import reference_qk_norm_rope

    scales = []

    def recording(self, qkv, heads, lengths, scale, eps, rope):  # noqa: ANN001, ANN202
        scales.append(scale)
        return reference_qk_norm_rope(qkv, heads, lengths, scale, eps, rope)

    monkeypatch.setattr(StandInKernel, "_qk_norm_rope", recording)
    _, tokenizer = tiny_model
    prompts = _prompts(5, [3, 70, 130, 9, 40], fast_tiny.args.vocab_size, seed=33)
    engine = InProcessEngine(fast_tiny, chunk_size=64, overlap="ahead", backend=StandInKernel())
    assert_greedy(engine, prompts, 24, _eos(tokenizer), oracle, ties_of=tiny_model[0])
    assert scales and all(s is None for s in scales)
    scales.clear()
    engine = InProcessEngine(fast_tiny, chunk_size=64, overlap="ahead",
                             backend=StandInKernel(qk_rope_kernel=False))
    engine.submit("r", prompts[0], 3, [])
    engine.run_until_idle()
    assert not scales


def test_rope_spec_reproduces_mlx_lm_rope_modules():
    """The kernels' RoPE arguments: nn.RoPE's, Llama3RoPE's and YarnRoPE's rotation
    exactly (as mx.fast.rope gives it; YaRN's input scale first), and none for RoPEs the
    kernels do not do."""
    from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

    from worker_proc.decode_block import rope_spec

    x = mx.random.normal((3, 4, 1, 16))
    offsets = mx.array([0, 7, 300])
    llama3 = Llama3RoPE(16, base=500000.0, scaling_config={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    yarn = YarnRoPE(16, base=150000.0, scaling_factor=32.0, original_max_position_embeddings=4096)
    assert yarn.mscale != 1.0 and rope_spec(yarn).mscale == yarn.mscale
    for module in (nn_rope(16, False, 10000.0, 1.0), nn_rope(16, True, 500000.0, 0.5), llama3, yarn):
        spec = rope_spec(module)
        assert spec is not None and spec.dims == 16
        assert mx.array_equal(spec.apply(x, offsets), module(x, offset=offsets)).item()
        assert spec.kernel_params.dtype == mx.float32
    assert rope_spec(SuScaledRoPE(16, max_position_embeddings=4096,
                                  short_factor=[1.0] * 8, long_factor=[1.0] * 8)) is None


def test_rope_over_part_of_a_head_stays_with_the_block(fast_tiny):
    """A RoPE over fewer dims than the head (partial rotary) is not the kernel's to do,
    nor is any RoPE where the backend does not take it."""
    import worker_proc.decode_block as decode_block
    from worker_proc.attention import ForwardLayout, PooledKVCache
    from worker_proc.kv_pool import KVPool
    from worker_proc.memory import probe_attention_specs

    def cache(backend):  # noqa: ANN001, ANN202
        pool = KVPool(probe_attention_specs(fast_tiny), 8, backend)
        return PooledKVCache(pool, 0, ForwardLayout.decode(np.array([[1]]), np.array([1])))

    block = fast_tiny.layers[0]
    head = block.rope_spec.dims
    rotating = cache(StandInInPlaceKernels(rope_in_kernel=True))
    assert block._kernel_rope(rotating, head) is block.rope_spec
    assert block._kernel_rope(cache(StandInInPlaceKernels()), head) is None
    block.rope_spec = decode_block.rope_spec(nn_rope(head // 2, False, 10000.0, 1.0))
    assert block._kernel_rope(rotating, head) is None


def nn_rope(dims: int, traditional: bool, base: float, scale: float):
    import mlx.nn as nn

    return nn.RoPE(dims, traditional=traditional, base=base, scale=scale)


@pytest.mark.parametrize("rope_in_attention", [False, True])
def test_fast_blocks_on_the_cuda_kernel_path_match_mlx_lm(tmp_path_factory, rope_in_attention):
    """On the CUDA backend (residual adds inside the GEMMs, K/V stored by the attention
    kernel, steps launched ahead, compiled; and with RoPE applied by that kernel):
    mlx-lm's greedy tokens on the (float32) demo model."""
    from worker_proc.decode_backend import KernelDecode
    from worker_proc.paged_attention import kernel_available

    if not kernel_available():
        pytest.skip("the CUDA decode kernel needs MLX's CUDA backend")
    import os
    from pathlib import Path

    import mlx_lm

    from tests.oracle import mlx_lm_greedy
    from worker_proc.demo_model import ensure_demo_model

    root = os.environ.get("KILN_TEST_CACHE") or tmp_path_factory.mktemp("kiln-cache")
    path = str(ensure_demo_model("demo", cache_root=Path(root)))
    theirs, tokenizer = mlx_lm.load(path)
    ours = _load(path)
    fuse_projections(ours)
    assert speed_up_decode_blocks(ours, residual_in_gemm=True) == len(ours.layers)
    engine = InProcessEngine(ours, capacity=20_000, compile_decode=True, overlap="ahead",
                             backend=KernelDecode(rope_in_kernel=rope_in_attention))
    assert engine.pool.in_place
    prompts = _prompts(4, [40, 9, 25, 130], ours.args.vocab_size, seed=6)
    assert_greedy(engine, prompts, 30, _eos(tokenizer),
                  lambda p, n: mlx_lm_greedy(theirs, tokenizer, p, n), ties_of=theirs)


def _family_pair_decodes_as_mlx_lm(theirs, ours, path: str, seed: int,
                                   backend: DecodeBackend | None = None) -> None:
    """ours (fused, fast blocks) serves the families' window-crossing prompts on the
    kernel path (stood in for on the CPU, or this backend), compiled or in place:
    theirs' greedy tokens."""
    from tests.test_families import _prompts, mlx_lm_tokens

    compiled = path == "compiled"
    backend = backend or (StandInKernel() if compiled else StandInInPlaceKernels())
    engine = InProcessEngine(ours, chunk_size=16, compile_decode=compiled, overlap="ahead",
                             backend=backend)
    prompts = _prompts(seed=seed)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 20, [])
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(theirs, p, 20), f"r{i}"


@pytest.mark.parametrize("path", ["compiled", "in place", "norms apart"])
def test_gemma3_blocks_decode_mlx_lm_tokens(path):
    """Gemma 3's block normalises and rotates q and k together in decode (through the
    backend's norm_rope_qk on the kernel path), across sliding windows shorter than the
    prompts, beside norms summed once (as served); its sandwich norms and adds through the
    backend's residual_norm (the default), or apart (unfused-residual-norm)."""
    theirs, ours = _gemma3_pair(seed=0)
    if path == "norms apart":
        _family_pair_decodes_as_mlx_lm(theirs, ours, "compiled", seed=77,
                                       backend=StandInKernel(residual_norm_kernel=False))
    else:
        _family_pair_decodes_as_mlx_lm(theirs, ours, path, seed=77)


@pytest.mark.parametrize("name,path", [("qwen3", "compiled"), ("qwen3", "in place"),
                                       ("qwen3", "norms apart"), ("qwen3_moe", "compiled"),
                                       ("qwen3_moe", "in place")])
def test_qwen3_blocks_decode_mlx_lm_tokens(name, path):
    """Qwen3's block (dense, and its MoE with experts' layers) takes the fast call with its
    q and k norms as one (QKNorms) before one RoPE: mlx-lm's tokens across window-free
    ragged batches, compiled and in place. The norms' weights are drawn apart (mlx-lm
    starts them at ones), so a weight on the wrong heads changes the tokens."""
    from tests.families import build

    theirs, ours = build(name), build(name)
    for i, (a, b) in enumerate(zip(theirs.layers, ours.layers)):
        for j, norm in enumerate(("q_norm", "k_norm")):
            w = 1 + 0.5 * mx.random.normal(getattr(a.self_attn, norm).weight.shape,
                                           key=mx.random.key(10 * i + j))
            getattr(a.self_attn, norm).weight = w
            getattr(b.self_attn, norm).weight = mx.array(w)
    fuse_projections(ours)
    assert speed_up_decode_blocks(ours, residual_in_gemm=False) == len(ours.layers)
    assert all(layer.qk_norms is not None for layer in ours.layers)
    if path == "norms apart":  # unfused-qk-norm: the block's own norm, multiply and RoPE
        _family_pair_decodes_as_mlx_lm(theirs, ours, "compiled", seed=79,
                                       backend=StandInKernel(qk_norm_kernel=False))
    else:
        _family_pair_decodes_as_mlx_lm(theirs, ours, path, seed=79)


@pytest.mark.parametrize("path", ["compiled", "in place", "mlx rope"])
def test_gpt_oss_blocks_decode_mlx_lm_tokens(path):
    """GPT-OSS's block rotates q and k together in decode, with its sinks and sliding
    windows shorter than the prompts. The sinks are drawn (mlx-lm starts them at 0)."""
    from tests.families import build

    theirs, ours = build("gpt_oss"), build("gpt_oss")
    for i, (a, b) in enumerate(zip(theirs.layers, ours.layers)):
        sinks = mx.random.normal(a.self_attn.sinks.shape, key=mx.random.key(i))
        a.self_attn.sinks, b.self_attn.sinks = sinks, mx.array(sinks)
    fuse_projections(ours)
    assert speed_up_decode_blocks(ours, residual_in_gemm=True) == len(ours.layers)
    if path == "mlx rope":  # unfused-qk-rope: its YaRN RoPE by mlx-lm's ops, not norm_rope_qk
        assert all(layer.rope_spec.mscale != 1.0 for layer in ours.layers)
        _family_pair_decodes_as_mlx_lm(theirs, ours, "compiled", seed=78,
                                       backend=StandInKernel(qk_rope_kernel=False))
    else:
        _family_pair_decodes_as_mlx_lm(theirs, ours, path, seed=78)


@pytest.mark.parametrize("path", ["compiled", "in place"])
def test_llama_blocks_with_sliding_layers_prefill_and_decode_mlx_lm_tokens(path):
    """A llama with sliding `layer_types` (windows shorter than the prompts, 16-token
    chunks across their edges) through the fast blocks, whose calls also run its prefill
    forwards (q and k rotated together, the hook's windowed masks): mlx-lm's tokens."""
    from tests.families import build

    theirs, ours = build("llama_sliding"), build("llama_sliding")
    fuse_projections(ours)
    assert speed_up_decode_blocks(ours, residual_in_gemm=False) == len(ours.layers)
    _family_pair_decodes_as_mlx_lm(theirs, ours, path, seed=79)


@pytest.mark.parametrize("multiple", [64, 1])
@pytest.mark.parametrize("backend", ["scatter", "in place", "rope in kernel"])
def test_a_chunk_riding_in_the_decode_forward_keeps_mlx_lm_tokens(tiny_model, oracle, fast_tiny,
                                                                 backend, multiple, caplog,
                                                                 monkeypatch):
    """--experiments mixed-forward: prompts arrive while others decode, and each step's
    lone chunk (a 16-token decode-first budget, prompts over several steps, one starting
    after a cached prefix, a prompt's last chunk padded to the 16-token bucket) runs in
    one forward with the decode rows (the steps between them compiled, on the scatter
    pool), its rows padded to a multiple of 64 with scratch-slot rows (dense MLPs: the
    runner's default) or not padded at all. Every request gets mlx-lm's greedy tokens,
    the steps did run mixed, and each forward's rows were the multiple's."""
    import worker_proc.runner as runner_module

    totals = []

    def spy(pool, chunk, rows, n_chunk):
        totals.append(n_chunk + rows.lengths.shape[0])
        return build(pool, chunk, rows, n_chunk)

    build = runner_module.build_mixed_caches
    monkeypatch.setattr(runner_module, "build_mixed_caches", spy)
    _, tokenizer = tiny_model
    eos = _eos(tokenizer)
    made = {"scatter": lambda: StandInKernel(mixed_forward=True),
            "in place": lambda: StandInInPlaceKernels(mixed_forward=True),
            "rope in kernel": lambda: StandInInPlaceKernels(mixed_forward=True,
                                                            rope_in_kernel=True)}[backend]
    engine = InProcessEngine(fast_tiny, chunk_size=16, overlap="ahead", backend=made(),
                             compile_decode=backend == "scatter",  # decode steps between
                             max_prefill_tokens_while_decoding=16, decode_first_for_all=True,
                             chunk_align=16, tail_bucket=16)  # prompts' tails padded
    assert engine.runner.mixes_rows and engine.runner.mixed_rows_multiple == 64
    engine.runner.mixed_rows_multiple = multiple
    vocab = fast_tiny.args.vocab_size
    early = _prompts(2, [5, 12], vocab, seed=41)
    late = _prompts(3, [70, 33, 50], vocab, seed=42)
    late.append(late[0][:40] + _prompts(1, [9], vocab, seed=43)[0])  # a prefix hit on late[0]
    for i, p in enumerate(early):
        engine.submit(f"e{i}", p, 40, eos)
    for _ in range(3):
        engine.step()
    for i, p in enumerate(late):
        engine.submit(f"l{i}", p, 12, eos)
        engine.step()
    with caplog.at_level("DEBUG", logger="worker_proc"):
        results = engine.run_until_idle()
    assert engine.runner.mixed_forwards >= 10 and len(totals) == engine.runner.mixed_forwards
    assert all(t % multiple == 0 for t in totals)
    assert multiple == 64 or any(t % 64 for t in totals)  # unpadded rows of other counts
    # The worker's step lines say so (bench/step_log.py counts them).
    assert "its chunk rode in the decode forward" in caplog.text
    for rid, p, n in [*((f"e{i}", p, 40) for i, p in enumerate(early)),
                      *((f"l{i}", p, 12) for i, p in enumerate(late))]:
        problem = divergence_off_a_tie(tiny_model[0], p, results[rid].token_ids, oracle(p, n), eos)
        assert problem is None, f"{rid}: {problem}"


def test_mixed_forward_is_off_where_blocks_cannot_run_it(tiny_model_dir):
    """Without the fast blocks (mlx-lm's own call) the runner keeps the chunk and the
    rows apart, also when the backend asks to mix them; the option is an --experiments
    name."""
    from ipc.config import ServerConfig

    engine = InProcessEngine(_load(tiny_model_dir), backend=StandInKernel(mixed_forward=True))
    assert not engine.runner.mixes_rows
    assert "mixed-forward" in ServerConfig(experiments="mixed-forward").experiment_set


def _gemma3_pair(seed: int):
    """mlx-lm's Gemma 3 (tiny, float32) and a copy with the fast blocks, norms summed once
    (as served); the q and k norms' weights drawn apart (mlx-lm starts both at the same
    ones), so a scale on the wrong heads changes the tokens."""
    from tests.families import build
    from worker_proc.offset_norms import sum_offset_norms

    theirs, ours = build("gemma3_text"), build("gemma3_text")
    for i, (a, b) in enumerate(zip(theirs.layers, ours.layers)):
        for j, name in enumerate(("q_norm", "k_norm")):
            w = mx.random.normal((16,), key=mx.random.key(seed + 2 * i + j))
            getattr(a.self_attn, name).weight = w
            getattr(b.self_attn, name).weight = mx.array(w)
    fuse_projections(ours)
    assert speed_up_decode_blocks(ours, residual_in_gemm=False) == len(ours.layers)
    assert sum_offset_norms(ours) > 0
    return theirs, ours


def test_gemma3_decode_norms_and_rope_go_to_the_backend(monkeypatch):
    """A Gemma 3 decode step hands its q/k norms and RoPE to the backend's one call
    (norm_rope_qk, the CUDA kernel's place; the stand-in computes its plain-MLX meaning),
    each layer once a step, with the rows' lengths and the layer's own RoPE; under
    --experiments unfused-qk-norm (qk_norm_kernel off) it computes them itself."""
    from worker_proc.qk_norm_rope import reference_qk_norm_rope

    _, ours = _gemma3_pair(seed=5)
    calls = []

    def recording(self, qkv, heads, lengths, scale, eps, rope):  # noqa: ANN001, ANN202
        calls.append((heads, lengths.tolist(), rope))
        return reference_qk_norm_rope(qkv, heads, lengths, scale, eps, rope)

    monkeypatch.setattr(StandInKernel, "_qk_norm_rope", recording)
    attn = ours.layers[0].self_attn
    for kernel, expected in ((False, 0), (True, len(ours.layers))):
        engine = InProcessEngine(ours, backend=StandInKernel(qk_norm_kernel=kernel))
        calls.clear()  # after start-up's probes and warm-up
        engine.submit("r", [5, 6, 7, 8, 9], 3, [])
        engine.run_until_idle()
        assert len(calls) == 2 * expected  # two decode steps (the first token: prefill's)
    heads, lengths, rope = calls[0]
    assert heads == attn.n_heads + attn.n_kv_heads and lengths == [6]
    assert rope == ours.layers[0].rope_spec and rope.dims == attn.head_dim


def test_gemma3_sandwich_and_next_input_norms_go_to_the_backend(monkeypatch):
    """By default (KernelDecode.residual_norm_kernel) a Gemma 3 decode step hands each
    layer's two residual adds and their norms to the backend's residual_norm: twice a
    layer, the first also normalising the sum with the pre-MLP norm's scale, the second
    with the next layer's input norm's, which that layer then takes instead of running
    its own (NormHandoff); each the arrays mlx-lm's norms multiply by. Under
    unfused-residual-norm, never, and every layer runs its input norm."""
    from worker_proc.residual_norm import reference_residual_norm

    _, ours = _gemma3_pair(seed=5)
    layers = ours.layers
    calls, input_norms = [], []

    def recording(self, branch, residual, weight, eps, next_weight):  # noqa: ANN001, ANN202
        calls.append((weight, next_weight))
        return reference_residual_norm(branch, residual, weight, eps, next_weight)

    norm_class = type(layers[1].input_layernorm)
    plain_call = norm_class.__call__
    inputs = {id(b.input_layernorm): i for i, b in enumerate(layers)}

    def counting(self, x):  # noqa: ANN001, ANN202
        if id(self) in inputs:
            input_norms.append(inputs[id(self)])
        return plain_call(self, x)

    monkeypatch.setattr(StandInKernel, "_residual_norm", recording)
    monkeypatch.setattr(norm_class, "__call__", counting)
    for kernel in (False, True):
        engine = InProcessEngine(ours, backend=StandInKernel(residual_norm_kernel=kernel))
        calls.clear()  # after start-up's probes and warm-up
        input_norms.clear()
        engine.submit("r", [5, 6, 7, 8, 9], 3, [])  # a prefill forward, two decode steps
        engine.run_until_idle()
        assert len(calls) == (2 * 2 * len(layers) if kernel else 0)
        runs = [input_norms.count(i) for i in range(len(layers))]
        assert runs == ([3] + [1] * (len(layers) - 1) if kernel else [3] * len(layers))
    for i, block in enumerate(layers):  # the first decode step's calls, two a layer
        (w1, n1), (w2, n2) = calls[2 * i:2 * i + 2]
        assert mx.array_equal(w1, 1.0 + block.post_attention_layernorm.weight).item()
        assert mx.array_equal(n1, 1.0 + block.pre_feedforward_layernorm.weight).item()
        assert mx.array_equal(w2, 1.0 + block.post_feedforward_layernorm.weight).item()
        if i + 1 < len(layers):
            assert mx.array_equal(n2, 1.0 + layers[i + 1].input_layernorm.weight).item()
        else:
            assert n2 is None  # the model's final norm stays mlx-lm's


@pytest.mark.parametrize("dim,traditional,freqs,dtype,norm,mscale", [
    (256, False, False, mx.bfloat16, True, 1.0), (128, False, True, mx.bfloat16, True, 1.0),
    (128, True, False, mx.float16, True, 1.0), (64, False, False, mx.float32, True, 1.0),
    (16, False, False, mx.bfloat16, True, 1.0), (32, True, True, mx.bfloat16, True, 1.0),
    (128, False, True, mx.bfloat16, False, 1.0), (64, True, False, mx.float16, False, 1.0),
    (64, False, True, mx.bfloat16, False, 1.3466)])
def test_cuda_qk_norm_rope_kernel_matches_mlx_ops(dim, traditional, freqs, dtype, norm, mscale):
    """On CUDA, the q/k norm and RoPE kernel gives MLX's norm, multiply and RoPE (or RoPE
    alone, YaRN's input scale too) of the same heads (read in place from a fused q/k/v
    output, here a strided view of a wider one), at each row's own position: within a
    rounding step or two of the dtype (the sum of squares is reduced in another order: in
    float32 that shows in most outputs' last bits, in 16-bit ones in a few)."""
    from worker_proc.paged_attention import RopeSpec, kernel_available
    from worker_proc.qk_norm_rope import decode_qk_norm_rope, fits, reference_qk_norm_rope

    if not kernel_available():
        pytest.skip("the kernel needs MLX's CUDA backend")
    n_q, n_kv, batch = 4, 2, 5
    freq_arr = mx.array(10000.0 ** (mx.arange(dim // 2) / (dim // 2)) * 1.7) if freqs else None
    rope = RopeSpec(dim, traditional, None if freqs else 10000.0, 0.125 if not freqs else 1.0,
                    freq_arr, mscale)  # 1.3466: GPT-OSS's YaRN
    assert fits(rope)
    width = (n_q + 2 * n_kv) * dim
    wide = (mx.random.normal((batch, 1, width + 8), key=mx.random.key(dim)) * 3).astype(dtype)
    qkv = wide[..., 8:]  # the projection's output as a view: its rows strided
    scale = (1 + 0.2 * mx.random.normal((n_q + n_kv, dim), key=mx.random.key(1))).astype(dtype)
    lengths = mx.array([1, 7, 300, 4096, 33], dtype=mx.int32)
    scale = scale if norm else None  # RoPE alone (llama's blocks)
    got = decode_qk_norm_rope(qkv, n_q + n_kv, lengths, scale, 1e-6, rope)
    want = reference_qk_norm_rope(qkv, n_q + n_kv, lengths, scale, 1e-6, rope)
    assert got.shape == want.shape == (batch, n_q + n_kv, 1, dim) and got.dtype == dtype
    ulp = {mx.bfloat16: 2.0 ** -7, mx.float16: 2.0 ** -10, mx.float32: 2.0 ** -20}[dtype]
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(g, w, rtol=2 * ulp, atol=4 * ulp)
    if dtype != mx.float32:  # mostly the same bits: the same formulas and roundings (in
        assert np.mean(g != w) < 0.05  # float32 the reduction's order shows in most)


@pytest.mark.parametrize("dim,dtype,next_norm", [
    (3840, mx.bfloat16, True), (3840, mx.bfloat16, False), (1152, mx.float16, True),
    (64, mx.float32, True), (6144, mx.bfloat16, True), (5376, mx.bfloat16, True)])
def test_cuda_residual_norm_kernel_matches_mlx_lm_ops(dim, dtype, next_norm):
    """On CUDA, the sandwich-norm kernel gives mlx-lm's norm and clip_residual (and the
    sum's own norm) within a rounding step or two of the dtype (its sums of squares are
    reduced in another order), float16 sums clipped to its range as mlx-lm clips them."""
    from worker_proc.paged_attention import kernel_available
    from worker_proc.residual_norm import fits, reference_residual_norm, residual_norm

    if not kernel_available():
        pytest.skip("the kernel needs MLX's CUDA backend")
    assert fits(dim)
    rows = (3, 1)
    branch = (mx.random.normal((*rows, dim), key=mx.random.key(dim)) * 4).astype(dtype)
    residual = (mx.random.normal((*rows, dim), key=mx.random.key(1)) * 50).astype(dtype)
    if dtype == mx.float16:  # near the top of its range: the sum clips
        residual = mx.where(mx.arange(dim) % 7 == 0, mx.array(65500.0, dtype), residual)
    weight = (1 + 0.3 * mx.random.normal((dim,), key=mx.random.key(2))).astype(dtype)
    after = (1 + 0.3 * mx.random.normal((dim,), key=mx.random.key(3))).astype(dtype)
    got = residual_norm(branch, residual, weight, 1e-6, after if next_norm else None)
    want = reference_residual_norm(branch, residual, weight, 1e-6, after if next_norm else None)
    ulp = {mx.bfloat16: 2.0 ** -7, mx.float16: 2.0 ** -10, mx.float32: 2.0 ** -20}[dtype]
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape and g.dtype == dtype
        g, w = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
        np.testing.assert_allclose(g, w, rtol=2 * ulp, atol=4 * ulp * max(1.0, float(np.abs(w).mean())))


@pytest.mark.parametrize("dim,dtype,bias", [
    (2880, mx.bfloat16, True), (2880, mx.bfloat16, False), (64, mx.float32, True),
    (4096, mx.float16, True)])
def test_cuda_add_norm_kernel_matches_mlx_lm_ops(dim, dtype, bias):
    """On CUDA, the residual add (the branch's bias first) and the sum's RMS norm in one
    kernel give mlx-lm's ops within a rounding step or two of the dtype."""
    from worker_proc.paged_attention import kernel_available
    from worker_proc.residual_norm import add_norm, fits, reference_add_norm

    if not kernel_available():
        pytest.skip("the kernel needs MLX's CUDA backend")
    assert fits(dim)
    rows = (5, 1)
    branch = (mx.random.normal((*rows, dim), key=mx.random.key(dim)) * 4).astype(dtype)
    residual = (mx.random.normal((*rows, dim), key=mx.random.key(1)) * 20).astype(dtype)
    b = mx.random.normal((dim,), key=mx.random.key(2)).astype(dtype) if bias else None
    weight = (1 + 0.3 * mx.random.normal((dim,), key=mx.random.key(3))).astype(dtype)
    got = add_norm(branch, b, residual, weight, 1e-5)
    want = reference_add_norm(branch, b, residual, weight, 1e-5)
    ulp = {mx.bfloat16: 2.0 ** -7, mx.float16: 2.0 ** -10, mx.float32: 2.0 ** -20}[dtype]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype
        g, w = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
        np.testing.assert_allclose(g, w, rtol=2 * ulp, atol=4 * ulp * max(1.0, float(np.abs(w).mean())))


def test_only_dense_mlps_take_padded_mixed_rows():
    """Pad rows cost a dense MLP GEMM rows alone; a mixture of experts would route them,
    so its runner leaves the rows unpadded (ModelRunner.mixed_rows_multiple)."""
    from tests.families import build
    from worker_proc.decode_block import dense_mlps

    def served(family: str):
        model = build(family)
        fuse_projections(model)
        speed_up_decode_blocks(model, residual_in_gemm=False)
        return model

    assert dense_mlps(served("llama")) and dense_mlps(served("qwen3"))
    assert not dense_mlps(served("qwen3_moe")) and not dense_mlps(build("llama"))  # unfused
