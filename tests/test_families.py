"""Every attention kind mlx-lm serves, on tiny random float32 models of each family:
greedy tokens equal mlx-lm's, alone and batched with others, with chunked prefill across
the window's edge, prefix hits before and past the window, preemption and overlap."""

from __future__ import annotations

import logging
import re

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine
from tests.families import _COMMON, FAMILIES, RECURRENT_FAMILIES, VOCAB, WINDOW, build
from tests.oracle import mlx_lm_tokens
from tests.test_scheduler import assert_idle_invariant
from worker_proc.layer_kinds import Kind, UnsupportedModelError
from worker_proc.kv_pool import StateLayerSpec, UnusedLayerSpec, attention_specs, flat_specs
from worker_proc.memory import probe_attention_specs
from worker_proc.prefill_forward import traceable

# What each family's layers must come out as (so a probe that loses a kind fails here).
EXPECTED_KINDS = {
    "llama_sliding": {Kind.FULL, Kind.SLIDING}, "gemma3_text": {Kind.FULL, Kind.SLIDING},
    "gpt_oss": {Kind.FULL, Kind.SLIDING}, "ministral3": {Kind.FULL, Kind.SLIDING},
    "mistral3": {Kind.FULL, Kind.SLIDING}, "gemma4_text": {Kind.FULL, Kind.SLIDING},
    "gemma3n": {Kind.FULL, Kind.SLIDING},
    "iquestloopcoder": {Kind.FULL, Kind.SLIDING},
    "olmo3": {Kind.FULL, Kind.SLIDING}, "cohere2": {Kind.FULL, Kind.SLIDING},
    "exaone4": {Kind.FULL, Kind.SLIDING}, "llama4_text": {Kind.FULL, Kind.CHUNKED},
}
# Scores of their own (DeepSeek-V3.2: its indexer's, and its MLA's over the keys picked).
OWN_SCORES = {"gemma2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "mistral4"}
# Some layers with scores of their own (MiniMax M3's block-sparse ones; AFM 7's layer
# whose K/V its reuse layers attend, dense), the rest not.
SOME_OWN_SCORES = {"minimax_m3_vl", "afm7"}
# ... MLA's absorbed decode: the cache's keys as keys and values, the RoPE part's scores as
# the mask (LayerKind.latent: the backend attends the pool's latent itself).
LATENT = {"deepseek_v3", "glm4_moe_lite", "mistral4"}
SINKS = {"gpt_oss"}
UNUSED = {"nemotron-nas": 1}  # caches mlx-lm makes that the model never fills
VALUES_ARE_KEYS = {"deepseek_v32"}  # one array stored as keys and values: kept once
# Recurrent families with no attention layer; whose recurrent code does not keep right
# padding out of its state (ArraysCache lengths), so each prefill chunk runs alone; with
# no depthwise convolution of mlx-lm's Conv1d (RWKV-7 shifts tokens; Recurrent Gemma's is
# a Conv1d of its own).
PURE_RECURRENT = {"mamba", "mamba2", "rwkv7"}
UNMASKED_PADDING = {"nemotron_h", "mamba", "jamba", "longcat_flash_ngram"}
NO_DEPTHWISE_CONV = {"recurrent_gemma", "rwkv7", "longcat_flash_ngram"}
# A state that fills up with the first tokens (LongCat-Flash-Ngram's last token ids).
FILLING = {"longcat_flash_ngram"}
# Their own code mishandles rows of different lengths in one forward (a per-row mask
# broadcast against grouped heads; a chunk mask from one scalar offset). (MiniMax M3's and
# AFM 7's query positions from the keys' count are mended at load, as build() does too:
# test_rows_at_their_own_positions_share_forwards.)
BY_LENGTH = {"gemma2", "llama4_text"}


def served_greedy(srv, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's n greedy tokens from a running server, all requests at once."""
    import asyncio

    from ipc.client import AsyncKilnClient

    async def all_of_them():
        async with AsyncKilnClient(srv.zmq) as client:
            return await asyncio.gather(*(
                client.generate(input_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)
                for p in prompts))

    return [r.token_ids for r in asyncio.run(all_of_them())]


# A small server for the served tests: prompts in 32-token chunks, a 4,000-token pool.
SMALL_SERVER = ("--chunked-prefill-size", "32", "--max-total-tokens", "4000")


def model_dir_and_prompts(family: str, tokenizer_dir, out, seed: int,
                          lengths: tuple[int, ...]):
    """A family's tiny checkpoint directory (write_model_dir), the model mlx_lm.load reads
    from it, and random prompts of these lengths, for the served tests."""
    import mlx_lm

    from tests.families import write_model_dir

    model_dir = write_model_dir(family, tokenizer_dir, out)
    model, _ = mlx_lm.load(str(model_dir))
    rng = np.random.default_rng(seed)
    return model_dir, model, [rng.integers(5, VOCAB, size=n).tolist() for n in lengths]


def assert_served_as_mlx_lm(srv, model, prompts: list[list[int]], n: int) -> None:
    """Each prompt's n greedy tokens from the running server, all sent at once, are
    mlx_lm.generate's."""
    for p, tokens in zip(prompts, served_greedy(srv, prompts, n)):
        assert tokens == mlx_lm_tokens(model, p, n)


def assert_mlx_lm_tokens(model, name: str, results, cases, n: int) -> None:
    """Each (rid, prompt)'s tokens in `results` are mlx-lm's n greedy tokens."""
    for rid, p in cases:
        assert results[rid].token_ids == mlx_lm_tokens(model, p, n), f"{name} {rid}"


def assert_exact_under_preemption(model, name: str, prompts: list[list[int]]) -> None:
    """Three requests in a pool that holds about one: preempted, resumed, mlx-lm's tokens."""
    tight = InProcessEngine(model, capacity=130, chunk_size=16, max_running=4)
    for i, p in enumerate(prompts):
        tight.submit(f"r{i}", p, 30, [])
    results = tight.run_until_idle()
    assert tight.scheduler.counters.preemptions > 0
    assert_mlx_lm_tokens(model, name, results, [(f"r{i}", p) for i, p in enumerate(prompts)], 30)
    assert_idle_invariant(tight.scheduler)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [3, 40, 70, 17, 1, 33]
    prompts = [rng.integers(5, VOCAB, size=n).tolist() for n in lengths]
    prompts[5][:24] = prompts[2][:24]  # a cached prefix longer than the window
    return prompts


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, build(request.param)


def test_layer_kinds_are_read_from_mlx_lm(family):
    name, model = family
    parts = flat_specs(probe_attention_specs(model))
    assert sum(isinstance(s, UnusedLayerSpec) for s in parts) == UNUSED.get(name, 0)
    kinds = [s.kind for s in parts if not isinstance(s, UnusedLayerSpec)]
    assert any(s.values_are_keys for s in attention_specs(parts)) == (name in VALUES_ARE_KEYS)
    assert {k.kind for k in kinds} == EXPECTED_KINDS.get(name, {Kind.FULL})
    assert all(k.span == WINDOW for k in kinds if k.windowed)
    assert all(k.own_attention for k in kinds) == (name in OWN_SCORES)
    assert any(k.own_attention for k in kinds) == (name in OWN_SCORES | SOME_OWN_SCORES)
    assert all(k.latent for k in kinds) == (name in LATENT)
    assert any(k.sinks for k in kinds) == (name in SINKS)
    # The query heads each layer attends with, where the attention hook sees them (the
    # kernel's block holds a KV head's queries: kernel_fits weighs them).
    heads = getattr(getattr(model, "args", None), "num_attention_heads", None)
    for spec in attention_specs(probe_attention_specs(model)):
        if spec.kind.own_attention:
            assert spec.query_heads == 0
        else:
            assert spec.query_heads == heads if heads else spec.query_heads > 0


# Families whose model call is its backbone then one output layer (runner.split_model).
HEADED = {"llama", "llama_sliding", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma3_text",
          "gpt_oss", "ministral3", "olmo3", "exaone4", "deepseek_v3", "qwen3_next", "qwen3_5",
          "lfm2", "nemotron_h", "mamba2"}


def _split_is_the_model_call(name: str, model) -> None:
    """Where runner.split_model splits the model, its head over its backbone is the
    model's own call (so a prefill forward may run the head over the positions it samples
    alone); the other families have none and are prefilled through their own call."""
    from worker_proc.runner import split_model

    split = split_model(model)
    assert (split is not None) == (name in HEADED)
    if split is not None:
        tokens = mx.array([[5, 9, 13, 21]])
        np.testing.assert_array_equal(np.array(split.head(split.backbone(tokens))),
                                      np.array(model(tokens)))


def test_an_output_head_is_the_model_calls_last_layer(family):
    _split_is_the_model_call(*family)


def test_only_models_that_cannot_batch_ragged_rows_run_rows_by_length(family, caplog):
    """The ragged-batch probe's verdict; a "no" says why in the start-up log (the rows'
    differences, or the model's failure)."""
    name, model = family
    with caplog.at_level(logging.INFO, logger="worker_proc.attention"):
        assert InProcessEngine(model).runner.ragged == (name not in BY_LENGTH)
    said = [r.getMessage() for r in caplog.records if "ragged-batch probe" in r.getMessage()]
    assert bool(said) == (name in BY_LENGTH)


def test_the_ragged_probe_says_how_many_rows_were_off(caplog):
    """A model whose rows go wrong only beside rows of other lengths (here: skewed by how
    far each row's offset is from the longest) runs rows by length, and the start-up log
    counts the rows off in the ragged batch against none at one length."""
    model = build("llama")

    class Skewed(type(model)):
        def __call__(self, inputs, cache=None, **kwargs):  # noqa: ANN001, ANN204
            out = super().__call__(inputs, cache=cache, **kwargs)
            offset = cache[0].offset if cache else 0
            if isinstance(offset, mx.array):  # rows of different lengths
                out = out + (offset.max() - offset).astype(out.dtype)[:, None, None]
            return out

    model.__class__ = Skewed
    with caplog.at_level(logging.INFO, logger="worker_proc.attention"):
        assert not InProcessEngine(model).runner.ragged
    said = [r.getMessage() for r in caplog.records if "ragged-batch probe" in r.getMessage()]
    ragged, rows = map(int, re.search(r": (\d+) of (\d+) ragged", said[0]).groups())
    assert rows - 1 <= ragged <= rows and said[0].endswith(", 0 at one length")


def test_batched_chunked_and_cached_equal_mlx_lm(family):
    name, model = family
    prompts = _prompts(seed=len(name))
    overlap = [False, True, "ahead"][len(name) % 3]
    engine = InProcessEngine(model, chunk_size=12, max_prefill_tokens=48, overlap=overlap)
    for i, p in enumerate(prompts[:5]):
        engine.submit(f"r{i}", p, 20, [])
    results = engine.run_until_idle()
    # Later: a hit on r2's prompt past the window, and r1's whole prompt again.
    engine.submit("hit", prompts[5], 20, [])
    engine.submit("again", prompts[1], 20, [])
    results = engine.run_until_idle()
    assert engine.scheduler.counters.cache_hit_tokens >= 24 + len(prompts[1]) - 1
    assert_mlx_lm_tokens(model, name, results, [*((f"r{i}", p) for i, p in enumerate(prompts[:5])),
                                                ("hit", prompts[5]), ("again", prompts[1])], 20)
    assert_idle_invariant(engine.scheduler)


def test_alone_and_under_preemption_equal_mlx_lm(family):
    name, model = family
    prompts = _prompts(seed=100 + len(name))
    alone = InProcessEngine(model, chunk_size=16)
    alone.submit("x", prompts[2], 30, [])
    assert alone.run_until_idle()["x"].token_ids == mlx_lm_tokens(model, prompts[2], 30)
    assert_exact_under_preemption(model, name, prompts[1:4])


# Families whose prefill forwards the worker spreads over steps (--prefill-spread): full
# attention only, a backbone and an output head.
SPREADS = {"llama", "qwen3", "qwen3_moe", "mixtral", "phi3", "llama_sliding", "gemma3_text",
           "gpt_oss", "ministral3", "olmo3", "exaone4", "deepseek_v3"}


def run_recording_parts(engine: InProcessEngine) -> list[tuple[int, int, int]]:
    """Run the engine until idle; each step's (parts, parts_from, parts_to)."""
    seen: list[tuple[int, int, int]] = []
    handle = engine.worker.handle

    def recording(message):  # noqa: ANN001, ANN202
        if hasattr(message, "parts"):
            seen.append((message.parts, message.parts_from, message.parts_to))
        return handle(message)

    engine.worker.handle = recording
    engine.run_until_idle()
    return seen


def test_prefill_spread_over_steps_equals_mlx_lm(family):
    """Prompts arriving while others decode, their chunks spread over 3 steps (of the 4
    blocks: 1, 2 and 1 a step): every request's tokens are mlx-lm's. A model whose
    forwards cannot be spread says why and runs them whole."""
    name, model = family
    prompts = _prompts(seed=200 + len(name))
    engine = InProcessEngine(model, chunk_size=16, max_prefill_tokens_while_decoding=16,
                             overlap=["ahead", True, False][len(name) % 3], prefill_parts=3,
                             decode_first_for_all=True)
    engine.submit("first", prompts[2], 24, [])
    for _ in range(8):  # "first" decodes from here on
        engine.step()
    for i, p in enumerate(prompts[:5]):
        engine.submit(f"r{i}", p, 12, [])
    parts = run_recording_parts(engine)
    spreads = engine.runner.spread_refusal is None
    assert spreads == (name in SPREADS), engine.runner.spread_refusal
    if spreads:
        assert (3, 0, 1) in parts and (3, 1, 2) in parts and (3, 2, 3) in parts
    else:
        assert all(p == (1, 0, 1) for p in parts)
    assert_mlx_lm_tokens(model, name, engine.results,
                         [("first", prompts[2])], 24)
    assert_mlx_lm_tokens(model, name, engine.results,
                         [(f"r{i}", p) for i, p in enumerate(prompts[:5])], 12)
    assert_idle_invariant(engine.scheduler)


@pytest.mark.parametrize("name,mode", [("qwen3", "affine"), ("gpt_oss", "mxfp4")])
def test_a_4_bit_quantized_model_equals_mlx_lm(name, mode):
    """Quantized as mlx_lm.convert -q does (the model's own predicate: GPT-OSS keeps its
    router at 8 bits); affine 4-bit and MXFP4 (GPT-OSS's experts as it ships)."""
    from mlx_lm.utils import quantize_model

    model = build(name)
    quantize_model(model, {}, 32, 4, mode=mode)
    prompts = _prompts(seed=7)
    engine = InProcessEngine(model, chunk_size=16)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(model, p, 16)


@pytest.mark.parametrize("name,mode", [("qwen3", "affine"), ("gpt_oss", "mxfp4")])
def test_a_4_bit_quantized_model_on_the_cuda_path_rewrites_equals_mlx_lm(name, mode):
    """The same models with the CUDA worker's rewrites (projections fused, fast decode
    blocks, quantized Linear layers taking a step's rows as one matrix) on the stood-in
    kernel path, compiled decode: every request, served together, gets the tokens
    mlx-lm's own code gives it alone."""
    from mlx_lm.utils import quantize_model

    from tests.engine_driver import StandInKernel
    from worker_proc.model_rewrites import rewrite_for_serving

    oracle, model = build(name), build(name)  # same weights
    for m in (oracle, model):
        quantize_model(m, {}, 32, 4, mode=mode)
    done = rewrite_for_serving(model, on_cuda=False, fuse=True, fast_blocks=True,
                               pad_experts=False, flat_rows=True)
    assert done.flat_quantized > 0 and done.fast_blocks > 0
    prompts = _prompts(seed=7)
    engine = InProcessEngine(model, chunk_size=16, backend=StandInKernel(), compile_decode=True)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(oracle, p, 16)


@pytest.mark.parametrize("name,placed", [("minimax_m3_vl", 2), ("afm7", 2)])
@pytest.mark.parametrize("path", ["plain", "compiled"])
def test_rows_at_their_own_positions_share_forwards(name, placed, path):
    """MiniMax M3's sparse layers and AFM 7's KV-reuse layers with each row's queries at
    its own positions (row_positions, as the worker loads the model): the ragged probe
    passes, so rows of different lengths share decode and prefill forwards (on the
    stood-in CUDA path, compiled decode too), and every request, prefix hits too, gets
    the tokens mlx-lm's own code gives it alone."""
    from tests.engine_driver import StandInKernel
    from worker_proc.row_positions import give_rows_their_positions

    oracle, model = build(name, as_served=False), build(name, as_served=False)  # same weights
    assert give_rows_their_positions(model) == placed
    prompts = _prompts(seed=13)
    compiled = path == "compiled"
    engine = InProcessEngine(model, chunk_size=12, max_prefill_tokens=48,
                             overlap="ahead" if compiled else True, compile_decode=compiled,
                             backend=StandInKernel() if compiled else None)
    assert engine.runner.ragged
    for i, p in enumerate(prompts[:5]):
        engine.submit(f"r{i}", p, 20, [])
    engine.run_until_idle()
    engine.submit("hit", prompts[5], 20, [])
    engine.submit("again", prompts[1], 20, [])
    results = engine.run_until_idle()
    assert engine.scheduler.counters.cache_hit_tokens >= 24 + len(prompts[1]) - 1
    assert (engine.runner.decode_traces > 0) == compiled
    assert_mlx_lm_tokens(oracle, name, results,
                         [*((f"r{i}", p) for i, p in enumerate(prompts[:5])),
                          ("hit", prompts[5]), ("again", prompts[1])], 20)


def test_a_model_with_a_layer_kind_not_served_is_refused_naming_it():
    """The pool's probe refuses it, naming the kind and its layers (the worker then runs
    the model on mlx-lm's own caches: below)."""
    with pytest.raises(UnsupportedModelError, match=r"layers 0-1: LayerCache: not supported yet"):
        probe_attention_specs(build("deepseek_v41"))


@pytest.mark.parametrize("name", ["deepseek_v41", "llama"])
def test_a_model_on_its_own_caches_equals_mlx_lm(name):
    """What the worker falls back to for a model it cannot page (OwnCacheRunner): mlx-lm's
    caches, a set a request, one request a forward. Concurrent requests in 12-token chunks,
    preempted and recomputed in a pool that holds about one, get mlx_lm.generate's tokens;
    nothing is cached between requests."""
    model = build(name)
    prompts = _prompts(seed=700)
    engine = InProcessEngine(model, chunk_size=12, max_prefill_tokens=48, own_caches=True)
    for i, p in enumerate(prompts[:4]):
        engine.submit(f"r{i}", p, 20, [])
    results = engine.run_until_idle()
    engine.submit("again", prompts[1], 20, [])
    results = engine.run_until_idle()
    assert engine.scheduler.counters.cache_hit_tokens == 0
    assert_mlx_lm_tokens(model, name, results, [*((f"r{i}", p) for i, p in enumerate(prompts[:4])),
                                                ("again", prompts[1])], 20)
    assert_idle_invariant(engine.scheduler)
    tight = InProcessEngine(model, capacity=130, chunk_size=16, max_running=4, own_caches=True)
    for i, p in enumerate(prompts[1:4]):
        tight.submit(f"t{i}", p, 30, [])
    results = tight.run_until_idle()
    assert tight.scheduler.counters.preemptions > 0
    assert set(tight.runner._caches) == set(tight.runner.requests)  # dropped with them
    assert_mlx_lm_tokens(model, name, results, [(f"t{i}", p) for i, p in enumerate(prompts[1:4])],
                         30)


def test_a_budget_on_its_own_caches_counts_bytes_a_token_and_a_request():
    """The own-cache runner's token budget: llama's KVCaches take what the pool's slot
    takes a token; DeepSeek-V4.1's take a compressed entry (32 floats) and an index key
    (16) a group of 4 tokens in each of its 2 layers, and a request's full window (16
    rows of 32 floats a layer) beside them."""
    from worker_proc.kv_pool import KVPool
    from worker_proc.own_caches import CacheBytes, cache_bytes

    llama = build("llama")
    assert cache_bytes(llama) == CacheBytes(KVPool.bytes_per_slot(probe_attention_specs(llama)),
                                            0)
    assert cache_bytes(build("deepseek_v41")) == CacheBytes(2 * (32 + 16) * 4 // 4, 2 * 16 * 32 * 4)


def test_logprobs_on_its_own_caches_are_the_paged_paths():
    """Logprobs of a prompt scored over its chunks and of the outputs, on mlx-lm's own
    caches as on kiln's pool (float32: equal to 1e-4)."""
    model, prompt = build("llama"), _prompts(seed=701)[1]
    scored = {}
    for own in (True, False):
        e = InProcessEngine(model, chunk_size=12, own_caches=own)
        e.submit("lp", prompt, 6, [], logprobs=2, prompt_logprobs=2)
        scored[own] = e.run_until_idle()["lp"]
    for a, b in ((scored[True].prompt_logprobs, scored[False].prompt_logprobs),
                 (scored[True].logprobs, scored[False].logprobs)):
        assert len(a) == len(b) > 0
        assert [x.top_ids for x in a] == [x.top_ids for x in b]
        np.testing.assert_allclose([x.logprob for x in a], [x.logprob for x in b], atol=1e-4)


def test_a_state_still_growing_after_the_probes_tokens_is_refused():
    """LongCat-Flash-Ngram's n-gram state fills up with a request's first n - 1 tokens
    (served: StateLayerSpec.filling); with n past what the probe decodes, the state looks
    like one the size of the context, which the pool cannot hold: the probe refuses it (the
    worker would run the model on mlx-lm's own caches)."""
    import importlib

    config = {**_COMMON, **RECURRENT_FAMILIES["longcat_flash_ngram"], "hidden_size": 128,
              "emb_neighbor_num": 70, "emb_split_num": 1}
    module = importlib.import_module("mlx_lm.models.longcat_flash_ngram")
    model = module.Model(module.ModelArgs.from_dict(config))
    with pytest.raises(UnsupportedModelError, match=r"^layer 0: a recurrent state that grows "
                       r"with the context: not supported yet"):
        probe_attention_specs(model)


def test_a_model_reading_what_the_served_cache_lacks_is_refused_naming_the_layers():
    """A layer whose own code reads from its cache what kiln's paged cache does not have
    (here mlx-lm's `nbytes`) is refused at start-up, found by the probe; reading the
    cache's `keys` / `values` is served (DeepSeek-V3.2's family: dense K/V)."""
    model = build("llama")
    attention = type(model.model.layers[2].self_attn)

    class Peeking(attention):
        def __call__(self, x, mask=None, cache=None):  # noqa: ANN001, ANN204
            _ = cache.nbytes if cache is not None else None
            return super().__call__(x, mask, cache)

    model.model.layers[2].self_attn.__class__ = Peeking
    with pytest.raises(UnsupportedModelError, match=r"^layer 2: the model's code reads "
                       r"`cache.nbytes`, which kiln's paged cache does not have"):
        probe_attention_specs(model)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "llama_sliding", "gemma4_text",
                                  "iquestloopcoder"])
@pytest.mark.parametrize("path", ["compiled", "in place"])
def test_the_kernel_path_reads_each_window(name, path):
    """The CUDA decode path (the kernels stood in for by their plain-MLX meaning) and its
    compiled trace: windowed layers hand it a slot table that starts at each row's
    window, sinks go to the kernel's merge; on the in-place pool the attention call
    stores every layer's new K/V, windowed and with sinks too (in the windowed layers'
    own slot space); a layer attending another's K/V (Gemma 4's shared layers,
    IQuest-Loop-Coder's second pass) reads them after that layer stored them; mlx-lm's
    tokens."""
    from tests.engine_driver import StandInInPlaceKernels, StandInKernel

    model = build(name)
    prompts = _prompts(seed=200 + len(name))
    compiled = path == "compiled"
    backend = StandInKernel() if compiled else StandInInPlaceKernels()
    stored_by_attention = []
    attend = backend._write_attend

    def write_attend(q, keys, values, slots, pool, *rest):  # noqa: ANN001, ANN202
        stored_by_attention.append(pool.shape[0])
        return attend(q, keys, values, slots, pool, *rest)

    object.__setattr__(backend, "_write_attend", write_attend)
    engine = InProcessEngine(model, chunk_size=16, compile_decode=compiled, overlap="ahead",
                             backend=backend)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 24, [])
    results = engine.run_until_idle()
    assert (engine.runner.decode_traces > 0) == compiled
    if not compiled:  # full layers and windowed ones (their own space) alike
        assert {a.shape[0] for a in engine.pool.layers} <= set(stored_by_attention)
        assert engine.pool.window_slots + 1 in stored_by_attention
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(model, p, 24), f"{name} r{i}"


@pytest.mark.parametrize("path", ["compiled", "in place", "fast blocks"])
def test_a_cache_the_model_never_fills_rides_the_kernel_path(path):
    """Nemotron-NAS's unused cache (UnusedLayerSpec) beside paged layers on the CUDA
    decode path, stood in for, compiled or in place, and with CUDA's fused projections
    and fast decode blocks (some of its blocks have no MLP: the runner once failed to
    start on them): mlx-lm's tokens."""
    from tests.engine_driver import StandInInPlaceKernels, StandInKernel
    from worker_proc.decode_block import speed_up_decode_blocks
    from worker_proc.fused_projections import fuse_projections

    model, prompts = build("nemotron-nas"), _prompts(seed=900)
    if path == "fast blocks":
        fuse_projections(model)
        speed_up_decode_blocks(model, residual_in_gemm=False)
    compiled = path != "in place"
    engine = InProcessEngine(model, chunk_size=16, compile_decode=compiled, overlap="ahead",
                             backend=StandInKernel() if compiled else StandInInPlaceKernels())
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 12, [])
    results = engine.run_until_idle()
    assert (engine.runner.decode_traces > 0) == compiled
    assert_mlx_lm_tokens(model, "nemotron-nas", results,
                         [(f"r{i}", p) for i, p in enumerate(prompts)], 12)


@pytest.mark.parametrize("name", sorted(OWN_SCORES | SOME_OWN_SCORES))
@pytest.mark.parametrize("path", ["compiled", "in place"])
def test_models_with_their_own_score_math_take_the_kernel_path(name, path, monkeypatch):
    """Gemma 2's soft-capped scores and MLA's latent + RoPE parts (keys 512 wide, values
    64: no shape the attention kernel reads) still get the CUDA backend: the in-place
    pool, compiled decode where the model batches ragged rows, steps launched back to
    back. Gemma 2's layers read dense K/V gathered after the pool's writes; MLA's decode
    gets dense values only (the RoPE part the model scores) and its attention goes to the
    backend's latent attention over the pool's keys, the model's scores as its bias.
    mlx-lm's tokens."""
    from tests.engine_driver import StandInInPlaceKernels, StandInKernel
    from worker_proc import decode_backend
    from worker_proc.decode_backend import kernel_fits

    latent_calls, prefill_masks = [], []
    attend = StandInKernel._latent_attend
    monkeypatch.setattr(StandInKernel, "_latent_attend",
                        lambda self, *a: latent_calls.append(a[0].shape) or attend(self, *a))
    unfused = decode_backend.unfused_prefill_attention
    monkeypatch.setattr(decode_backend, "unfused_prefill_attention",
                        lambda q, k, v, scale, mask, sinks=None: prefill_masks.append(mask)
                        or unfused(q, k, v, scale, mask, sinks))
    model = build(name)
    assert kernel_fits(probe_attention_specs(model))
    compiled = path == "compiled"
    prompts = _prompts(seed=300 + len(name))
    engine = InProcessEngine(model, chunk_size=16, compile_decode=compiled, overlap="ahead",
                             backend=StandInKernel() if compiled else StandInInPlaceKernels())
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    assert (engine.runner.decode_traces > 0) == (compiled and name not in BY_LENGTH)
    assert_mlx_lm_tokens(model, name, results, [(f"r{i}", p) for i, p in enumerate(prompts)], 16)
    # Every latent layer's decode (one query token a row) through the latent attention.
    assert bool(latent_calls) == (name in LATENT)
    assert all(shape[2] == 1 for shape in latent_calls)
    # Their prefill attention (expanded K/V) through the backend's prefill attention, not
    # MLX's fused call (cuDNN's per-shape builds on CUDA): DeepSeek's and GLM's RoPE
    # scores as a float mask added to the scores (DeepSeek-V3.2's with its indexer's
    # picks; its call hands attention the layer's cache list; MiniMax M3's sparse layers'
    # kept blocks as a boolean mask). (Gemma 2 calls no attention function.)
    assert bool(prefill_masks) == (name != "gemma2")
    if name in {"deepseek_v3", "deepseek_v32", "glm4_moe_lite"}:
        assert any(isinstance(m, mx.array) and m.dtype != mx.bool_ for m in prefill_masks)


def test_fused_own_prefill_leaves_only_own_score_layers_to_mlx(monkeypatch):
    """--experiments fused-own-prefill (KernelDecode.own_prefill off) gives MLX's fused call
    the prefill attention of layers with their own scores only: every other layer's still
    goes to the backend's."""
    from tests.engine_driver import StandInKernel
    from worker_proc import decode_backend

    calls = []
    unfused = decode_backend.unfused_prefill_attention
    monkeypatch.setattr(decode_backend, "unfused_prefill_attention",
                        lambda *a, **k: calls.append(a[0].shape) or unfused(*a, **k))
    for name, backend_prefill in (("llama", True), ("deepseek_v3", False)):
        calls.clear()
        engine = InProcessEngine(build(name), chunk_size=16,
                                 backend=StandInKernel(own_prefill=False))
        engine.submit("r0", _prompts(seed=5)[0], 4, [])
        engine.run_until_idle()
        assert bool(calls) == backend_prefill, name


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_offset_norms_summed_once_keep_mlx_lm_tokens(name):
    """Gemma's RMSNorms scale by 1 + weight; the worker makes that sum once at load
    (every layer's four norms and its q/k norms, and the final one), and decode's
    compiled trace reads it: mlx-lm's tokens, and the parameters untouched."""
    from mlx.utils import tree_flatten

    from tests.engine_driver import StandInKernel
    from worker_proc.offset_norms import sum_offset_norms

    model = build(name)
    params = dict(tree_flatten(model.parameters()))
    per_layer = 6 if name == "gemma3_text" else 4  # gemma2 has no q/k norms
    assert sum_offset_norms(model) == per_layer * len(model.layers) + 1
    assert sum_offset_norms(model) == 0  # once only
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    oracle = build(name)  # mlx-lm's modules as they are
    prompts = _prompts(seed=400 + len(name))
    engine = InProcessEngine(model, chunk_size=16, compile_decode=True, overlap="ahead",
                             backend=StandInKernel())
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    assert_mlx_lm_tokens(oracle, name, results, [(f"r{i}", p) for i, p in enumerate(prompts)], 16)


# -- recurrent-state layers (issue 18's first part: no prefix cache for these models) -----

@pytest.fixture(scope="module", params=sorted(RECURRENT_FAMILIES))
def recurrent_family(request):
    return request.param, build(request.param)


def test_a_hybrids_output_head_is_the_model_calls_last_layer(recurrent_family):
    _split_is_the_model_call(*recurrent_family)


def test_recurrent_layers_are_read_from_mlx_lm(recurrent_family):
    name, model = recurrent_family
    parts = flat_specs(probe_attention_specs(model))  # Falcon-H1: state + K/V in each layer
    states = [s for s in parts if isinstance(s, StateLayerSpec)]
    assert states and all(s.bytes_per_request > 0 for s in states)
    assert (len(states) == len(parts)) == (name in PURE_RECURRENT)
    assert any(any(s.filling) for s in states) == (name in FILLING)


@pytest.mark.parametrize("overlap", [True, "ahead"])
def test_recurrent_models_batched_and_chunked_equal_mlx_lm(recurrent_family, overlap):
    name, model = recurrent_family
    prompts = _prompts(seed=300 + len(name))
    engine = InProcessEngine(model, chunk_size=12, max_prefill_tokens=48, overlap=overlap)
    for i, p in enumerate(prompts[:5]):
        engine.submit(f"r{i}", p, 20, [])
    engine.step()
    engine.submit("late", prompts[5], 20, [])  # joins while the others decode
    engine.submit("again", prompts[1], 20, [])  # the same prompt, maybe still prefilled
    results = engine.run_until_idle()
    assert engine.runner.ragged
    assert_mlx_lm_tokens(model, name, results, [*((f"r{i}", p) for i, p in enumerate(prompts[:5])),
                                                ("late", prompts[5]), ("again", prompts[1])], 20)
    assert_idle_invariant(engine.scheduler)


def test_recurrent_models_under_preemption_equal_mlx_lm(recurrent_family):
    name, model = recurrent_family
    assert_exact_under_preemption(model, name, _prompts(seed=400 + len(name))[1:4])


@pytest.mark.timeout(300)
def test_a_hybrid_model_through_every_process(tiny_model_dir, tmp_path):
    """LFM2 (short convolutions beside attention) served by the real server: concurrent
    requests equal mlx-lm's, and a prompt repeated later hits the cache at a state
    snapshot (its last chunk edge before the final token)."""
    import httpx

    from tests.server import Server

    model_dir, model, prompts = model_dir_and_prompts("lfm2", tiny_model_dir, tmp_path / "lfm2",
                                                      500, (3, 40, 150, 17))
    prompts.append(list(prompts[2]))
    srv = Server(model_dir, *SMALL_SERVER, "--overlap", "on", log_path=tmp_path / "log").wait_ready()
    try:
        assert_served_as_mlx_lm(srv, model, prompts, 16)

        before = srv.stats()["cache_hit_tokens_total"]
        assert served_greedy(srv, [prompts[2]], 16)[0] == mlx_lm_tokens(model, prompts[2], 16)
        stats = srv.stats()
        assert stats["cache_hit_tokens_total"] - before == 128  # 150 tokens, chunks of 32
        assert stats["state_snapshots"] == 64 and 0 < stats["state_snapshots_used"] <= 64
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "kiln_state_snapshots_capacity 64.0" in metrics
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_recurrent_models_hit_at_state_snapshots(recurrent_family):
    """Prefix hits on a model with recurrent layers start from a snapshot of their state,
    kept at every prompt chunk's end and where a request finished: an extended prompt
    hits at the old prompt's end, a multi-turn chat's next turn at the end of the last
    answer's fed tokens (all but its last), a shared head at its last chunk edge, a
    repeated prompt at its last chunk edge before the final token; all exact."""
    name, model = recurrent_family
    rng = np.random.default_rng(600 + len(name))
    first = rng.integers(5, VOCAB, size=70).tolist()
    engine = InProcessEngine(model, chunk_size=16)
    engine.submit("first", first, 8, [])
    answer = engine.run_until_idle()["first"].token_ids
    cases = {"extended": (first + rng.integers(5, VOCAB, size=30).tolist(), 70),
             "next turn": (first + answer + rng.integers(5, VOCAB, size=10).tolist(),
                           70 + len(answer) - 1),
             "shared head": (first[:40] + rng.integers(5, VOCAB, size=30).tolist(), 32),
             "repeated": (list(first), 64)}
    for rid, (prompt, hit) in cases.items():
        before = engine.scheduler.counters.cache_hit_tokens
        engine.submit(rid, prompt, 12, [])
        result = engine.run_until_idle()[rid]
        assert engine.scheduler.counters.cache_hit_tokens - before == hit, rid
        assert result.token_ids == mlx_lm_tokens(model, prompt, 12), f"{name} {rid}"
    assert_idle_invariant(engine.scheduler)


@pytest.mark.parametrize("path", ["compiled", "in place"])
def test_recurrent_models_on_the_kernel_path_equal_mlx_lm(recurrent_family, path):
    """The CUDA path on the CPU (kernels stood in for by their plain-MLX meaning):
    compiled decode and prefill carry the states through their traces (scatter-written:
    the in-place stand-ins write Python objects, which a trace cannot), the in-place pool
    writes state rows through the backend's row writer and reads them after its marks;
    batched, overlapped, with a snapshot hit and prompts of one length (compiled: a
    prefill shape met twice replays); mlx-lm's tokens."""
    from tests.engine_driver import StandInInPlaceKernels, StandInKernel

    name, model = recurrent_family
    prompts = _prompts(seed=800 + len(name))[:4]
    compiled = path == "compiled"
    engine = InProcessEngine(model, chunk_size=16, compile_decode=compiled, overlap="ahead",
                             compile_prefill=compiled,
                             backend=StandInKernel() if compiled else StandInInPlaceKernels())
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    # Alone, one after the other, prompts of one length meet the same forward shapes:
    # the second's chunks replay traces (states carried from chunk to chunk through them).
    same_length = [list(reversed(prompts[1])), prompts[1][1:] + prompts[1][:1]]
    for i, p in enumerate(same_length, start=len(prompts)):
        prompts.append(p)
        engine.submit(f"r{i}", p, 16, [])
        results.update(engine.run_until_idle())
    assert (engine.runner.decode_traces > 0) == compiled
    # (windowed attention layers beside, as Recurrent Gemma's, take no prefill traces)
    assert (engine.runner.prefill_forwards.replays > 0) == (compiled and traceable(engine.pool))
    before = engine.scheduler.counters.cache_hit_tokens
    engine.submit("again", list(prompts[2]), 16, [])
    results.update(engine.run_until_idle())
    assert engine.scheduler.counters.cache_hit_tokens > before
    assert_mlx_lm_tokens(model, name, results, [*((f"r{i}", p) for i, p in enumerate(prompts)),
                                                ("again", prompts[2])], 16)
    assert_idle_invariant(engine.scheduler)


def test_a_model_that_fails_to_trace_prefills_eagerly_from_then_on():
    from tests.engine_driver import StandInKernel

    model = build("qwen3_5")
    engine = InProcessEngine(model, chunk_size=16, compile_decode=True, compile_prefill=True,
                             backend=StandInKernel())
    forwards = engine.runner.prefill_forwards
    assert forwards.compiles

    def failing_trace(*args):  # noqa: ANN002, ANN202 - as mx.compile over code it cannot trace
        forwards.traces += 1
        raise ValueError("[compile] cannot trace this")

    forwards._compiled = failing_trace
    rng = np.random.default_rng(1300)
    prompts = [rng.integers(5, VOCAB, size=40).tolist() for _ in range(3)]
    results = {}
    for i, p in enumerate(prompts):  # alone, one after the other: shapes recur
        engine.submit(f"r{i}", p, 8, [])
        results.update(engine.run_until_idle())
    assert forwards.traces == 1 and not forwards.compiles and forwards.replays == 0
    assert_mlx_lm_tokens(model, "qwen3_5", results, [(f"r{i}", p) for i, p in enumerate(prompts)], 8)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_the_gated_delta_rule_updates_its_states_in_the_pool(name, monkeypatch):
    """On the in-place pool (CUDA's, stood in for), a gated delta layer's state read from
    the pool is run where it lies (the kernel reads and writes the request rows of the
    state array, none gathered and scattered); mlx-lm's tokens, chunked and batched."""
    from mlx_lm.models import gated_delta as module

    from tests.engine_driver import StandInInPlaceKernels
    from worker_proc import gated_delta_cuda
    from worker_proc.gated_delta_cuda import route_gated_delta

    model = build(name)
    # The kernels' head-size rule is theirs; the stand-ins take the tiny models' 16.
    monkeypatch.setattr(gated_delta_cuda, "fits", lambda q, v, g: g.ndim == 3)
    original = getattr(module.gated_delta_ops, "__wrapped__", module.gated_delta_ops)
    monkeypatch.setattr(module, "gated_delta_ops", module.gated_delta_ops)  # restored after
    in_pool_calls = []

    def in_pool(q, k, v, g, beta, pool, rows, after, mask=None):
        y, state = original(q, k, v, g, beta, pool[rows], mask)
        pool[rows] = state
        in_pool_calls.append(q.shape[1])
        return y, mx.zeros((1,), dtype=mx.int32)

    route_gated_delta(original, in_pool)
    prompts = _prompts(seed=900 + len(name))[:4]
    engine = InProcessEngine(model, chunk_size=16, overlap="ahead", backend=StandInInPlaceKernels())
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    assert 1 in in_pool_calls and any(t > 1 for t in in_pool_calls)  # decode and later chunks
    assert_mlx_lm_tokens(model, name, results, [(f"r{i}", p) for i, p in enumerate(prompts)], 16)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_shifted_conv_equals_the_depthwise_conv1d(dtype):
    import mlx.nn as nn

    from worker_proc.depthwise_conv import ShiftedConv1d, is_depthwise

    mx.random.seed(3)
    for bias in (False, True):
        conv = nn.Conv1d(48, 48, 4, groups=48, bias=bias)
        conv.set_dtype(dtype)
        x = mx.random.normal((3, 11, 48)).astype(dtype)
        want, got = conv(x).astype(mx.float32), ShiftedConv1d(conv)(x).astype(mx.float32)
        tol = 1e-5 if dtype == mx.float32 else 2e-2
        assert got.shape == want.shape and mx.allclose(got, want, atol=tol, rtol=tol).item()
    assert not is_depthwise(nn.Conv1d(8, 8, 3, padding=1, groups=8))
    assert not is_depthwise(nn.Conv1d(8, 16, 3))


def test_short_convolutions_as_shifted_sums_keep_mlx_lm_tokens(recurrent_family):
    """The worker's CUDA path swaps recurrent layers' depthwise convolutions for shifted
    multiply-adds (no cuDNN graph per prefill shape): the same model so served, chunked
    and batched, gives mlx-lm's tokens from the original."""
    from worker_proc.depthwise_conv import replace_depthwise_convs

    name, model = recurrent_family
    served = build(name)  # the same seed: the same weights
    assert (replace_depthwise_convs(served) > 0) == (name not in NO_DEPTHWISE_CONV)
    prompts = _prompts(seed=1000 + len(name))[:4]
    engine = InProcessEngine(served, chunk_size=12, max_prefill_tokens=48)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    assert_mlx_lm_tokens(model, name, results, [(f"r{i}", p) for i, p in enumerate(prompts)], 16)


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_a_chats_next_turn_hits_the_last_answer_under_overlap(name):
    """Steps in flight (launched ahead, the in-place pool stood in for): a finished
    request's state is kept at the end of what the worker fed, so the next turn (prompt,
    answer, new message) hits past the answer; an aborted one keeps no snapshot; exact."""
    from tests.engine_driver import StandInInPlaceKernels

    model = build(name)
    rng = np.random.default_rng(1100 + len(name))
    first = rng.integers(5, VOCAB, size=45).tolist()
    engine = InProcessEngine(model, chunk_size=16, overlap="ahead", backend=StandInInPlaceKernels())
    engine.submit("first", first, 10, [])
    engine.submit("other", rng.integers(5, VOCAB, size=30).tolist(), 24, [])
    answer = engine.run_until_idle()["first"].token_ids
    used = engine.scheduler.cache.free_snapshots
    engine.submit("gone", rng.integers(5, VOCAB, size=20).tolist(), 50, [])
    engine.step()
    engine.step()
    engine.abort("gone")
    engine.run_until_idle()
    assert engine.scheduler.cache.free_snapshots == used - 2  # its chunk ends (16, 20) only
    turn = first + answer + rng.integers(5, VOCAB, size=12).tolist()
    before = engine.scheduler.counters.cache_hit_tokens
    engine.submit("turn", turn, 12, [])
    result = engine.run_until_idle()["turn"]
    assert engine.scheduler.counters.cache_hit_tokens - before >= len(first) + len(answer) - 1
    assert result.token_ids == mlx_lm_tokens(model, turn, 12)
    assert_idle_invariant(engine.scheduler)


def test_a_snapshot_cache_cuts_matches_back_to_its_snapshots():
    from scheduler_proc.radix_cache import SnapshotCache

    cache = SnapshotCache(capacity=2)
    ids = np.arange(10, 30, dtype=np.int32)
    mid = cache.insert(ids[:8], np.arange(1, 9, dtype=np.int32)).node
    assert cache.snapshot_at(mid) == 1 and cache.snapshot_at(mid) == 0  # once a node
    end = cache.insert(ids, np.arange(1, 21, dtype=np.int32)).node
    assert len(cache.match_prefix(ids[:15])) == 8 and cache.match_len(ids[:15]) == 8
    assert cache.snapshot_at(end) == 2 and len(cache.match_prefix(ids)) == 20
    assert len(cache.match_prefix(ids[:5])) == 0  # no snapshot at or before 5
    other = np.arange(50, 60, dtype=np.int32)
    third = cache.insert(other, np.arange(21, 31, dtype=np.int32)).node
    assert cache.free_snapshots == 0 and cache.snapshot_at(third) == 0  # none free
    assert len(cache.evict_for_snapshot()) > 0 and cache.snapshot_at(third) in (1, 2)


def test_an_aligned_hybrid_keeps_a_hit_whose_edge_holds_no_snapshot():
    """Chunks on bucket edges (CUDA, heads cuDNN takes: Nemotron-H, Falcon-H1) cut a hit
    back to an edge to keep chunks on built shapes, recomputing less than a bucket. A
    snapshot cache has a state only at chunk, prompt and request ends: a next turn after
    a long answer hits at the answer's end, and the edge below it holds no state, so the
    cut fell to the first prompt's end (off an edge too), recomputing the whole answer.
    Such a hit stays where it is; one whose edge holds a state is still cut; exact."""
    model = build("qwen3_next")
    rng = np.random.default_rng(710)
    first = rng.integers(5, VOCAB, size=70).tolist()
    engine = InProcessEngine(model, chunk_size=16, chunk_align=16)
    engine.submit("first", first, 41, [])
    answer = engine.run_until_idle()["first"].token_ids
    assert len(answer) == 41
    cases = {"next turn": (first + answer + rng.integers(5, VOCAB, size=10).tolist(),
                           70 + len(answer) - 1),  # the answer's end, not 70
             "extended": (first + rng.integers(5, VOCAB, size=30).tolist(), 64)}  # edge 64
    for rid, (prompt, hit) in cases.items():
        before = engine.scheduler.counters.cache_hit_tokens
        engine.submit(rid, prompt, 8, [])
        result = engine.run_until_idle()[rid]
        assert engine.scheduler.counters.cache_hit_tokens - before == hit, rid
        assert result.token_ids == mlx_lm_tokens(model, prompt, 8), rid
    assert_idle_invariant(engine.scheduler)


def test_a_snapshot_stride_spaces_the_snapshots_inside_a_prompt():
    """With --snapshot-stride 40 and chunks of 16, a 70-token prompt keeps snapshots at 48
    (the first chunk end 40 past the start) and 70 (its end), not at 16 or 32: a prompt
    sharing its first 40 tokens then hits nothing, one sharing 60 hits 48."""
    model = build("qwen3_next")
    rng = np.random.default_rng(700)
    first = rng.integers(5, VOCAB, size=70).tolist()
    engine = InProcessEngine(model, chunk_size=16, snapshot_stride=40)
    engine.submit("first", first, 4, [])
    engine.run_until_idle()
    for rid, shared, hit in (("forty", 40, 0), ("sixty", 60, 48)):
        prompt = first[:shared] + rng.integers(5, VOCAB, size=20).tolist()
        before = engine.scheduler.counters.cache_hit_tokens
        engine.submit(rid, prompt, 8, [])
        result = engine.run_until_idle()[rid]
        assert engine.scheduler.counters.cache_hit_tokens - before == hit, rid
        assert result.token_ids == mlx_lm_tokens(model, prompt, 8)


def test_recurrent_prefill_shares_forwards_where_the_model_masks_padding(recurrent_family):
    """Prompts of different lengths prefilled in one right-padded forward (mlx-lm's
    ArraysCache lengths keep the padding out of the state) equal mlx-lm's tokens; a model
    whose code does not (UNMASKED_PADDING) prefills each chunk alone."""
    name, model = recurrent_family
    shared: list[int] = []
    engine = InProcessEngine(model, chunk_size=16, max_prefill_tokens=64)
    many = engine.runner._prefill_many
    engine.runner._prefill_many = lambda chunks, *width: shared.append(len(chunks)) or many(chunks, *width)
    assert engine.runner.shares_prefill == (name not in UNMASKED_PADDING)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(5, VOCAB, size=n).tolist() for n in (10, 11, 12, 30, 33)]
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 8, [])
    results = engine.run_until_idle()
    assert_mlx_lm_tokens(model, name, results, [(f"r{i}", p) for i, p in enumerate(prompts)], 8)
    assert (max(shared, default=0) > 1) == engine.runner.shares_prefill


def serve_after_warm_up_compiling_nothing(name: str) -> None:
    """Run in a fresh process (the JIT's in-memory cache would hide a compile another
    test's serving already made): the start-up warm-up and traces, then two waves of
    prompts whose contexts cross slot-table widths (prefill forwards traced too, where
    the model allows: the second wave's shapes recur); asserts mlx-lm's tokens and that
    serving made no fused kernel library the start-up had not (each is a compiler run:
    on CUDA seconds of NVRTC in the middle of a step)."""
    import tempfile
    from pathlib import Path

    from tests.engine_driver import StandInKernel
    from worker_proc.warm_up import trace_decode_shapes, warm_up

    def libraries() -> set[str]:
        return {p.name for p in Path(tempfile.gettempdir(), "mlx").rglob("*.so")}

    model = build(name)
    engine = InProcessEngine(model, compile_decode=True, compile_prefill=True,
                             overlap="ahead", max_context=600, backend=StandInKernel())
    warm_up(engine.runner, max_batch=6)
    trace_decode_shapes(engine.runner, max_batch=6)
    made = libraries()
    forwards = engine.runner.prefill_forwards
    traces = forwards.traces
    assert made, "no fused kernel compiled at start-up: nothing to compare against"
    rng = np.random.default_rng(5)
    for wave in range(2):
        cases = [(f"w{wave}r{i}", rng.integers(5, VOCAB, size=n).tolist())
                 for i, n in enumerate((200, 7, 120))]
        for rid, p in cases:
            engine.submit(rid, p, 70, [])  # r0 crosses width 256, r2 128 and 256
        assert_mlx_lm_tokens(model, name, engine.run_until_idle(), cases, 70)
    assert (forwards.traces > traces) == forwards.compiles  # llama's yes, windowed ones' no
    assert libraries() == made, sorted(libraries() - made)


@pytest.fixture(scope="session")
def jit_path() -> str:
    """PATH for a process whose MLX JIT starts from an empty cache: MLX's preamble header
    precompiled for its g++ (tests/mlx_jit.py; tests/run.py puts it there already)."""
    import os

    from tests.mlx_jit import path_with_gxx

    return path_with_gxx(os.environ["PATH"])


@pytest.mark.parametrize("name", ["gemma3_text", "llama"])
def test_compiled_decode_compiles_no_kernel_while_serving(name, tmp_path, jit_path):
    """Serving after the warm-up compiles no fused kernel. Nothing in the compiled decode
    trace may depend on the slot table's width as a number (a windowed layer's table was
    capped by width - 1): a constant of a fused kernel, so one kernel per width, compiled
    the first time a context crosses into it: 3-5 s stalls on the H200 (seconds per wave
    on Gemma 3). And a traced multi-row prefill's kernels are made by the warm-up, not
    by a burst's first recurring shape (a 13 s step)."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("g++") is None and shutil.which("clang++") is None:
        pytest.skip("MLX's CPU backend fuses kernels only with a C++ compiler")
    script = ("from tests.test_families import serve_after_warm_up_compiling_nothing as f; "
              f"f({name!r})")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TMPDIR": str(tmp_path),
                                           "PATH": jit_path})
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("path", ["compiled", "in place", "aligned, spread"])
def test_prefill_read_from_the_pool_equals_mlx_lm(name, path):
    """Prefill attention of heads cuDNN does not take (256 wide, as Gemma's; the stand-in
    judges float32 as bfloat16) reads each row's K/V from the pool through the prefill kernel (stood in
    for by its plain-MLX meaning) by default: full and sliding layers (Gemma 3's,
    GPT-OSS's with sinks), fresh prompts, chunks across the window's edge, prefix hits,
    rows at different starts: mlx-lm's tokens. "aligned, spread": chunks end on the
    bucket's edges, prompts' tails padded, decode first's prefill spread over steps, as
    cuDNN models' chunks are where `--experiments paged-short-rows` sends their short rows
    to the kernel."""
    from tests.engine_driver import StandInInPlaceKernels, StandInKernel, record_paged_prefill

    model = build(name, head_dim=256)
    compiled = path != "in place"
    backend = (StandInInPlaceKernels if path == "in place" else StandInKernel)()
    calls = record_paged_prefill(backend)
    prompts = _prompts(seed=300 + len(name))
    aligned = ({"chunk_align": 16, "tail_bucket": 16, "max_prefill_tokens_while_decoding": 8,
                "prefill_parts": 2, "decode_first_for_all": True}
               if path == "aligned, spread" else {})
    engine = InProcessEngine(model, chunk_size=16, compile_decode=compiled, overlap="ahead",
                             backend=backend, **aligned)
    short = list(prompts[0][:10])  # one fresh chunk, no context
    engine.submit("short", short, 12, [])
    results = engine.run_until_idle()
    assert calls, "a fresh prompt's forward did not read the pool"
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 12, [])
    parts = run_recording_parts(engine)
    results.update(engine.results)
    assert ((2, 1, 2) in parts) == bool(aligned), parts
    engine.submit("again", list(prompts[1]), 12, [])
    results.update(engine.run_until_idle())
    assert engine.scheduler.counters.cache_hit_tokens > 0
    kinds = {c.window for c in calls}
    assert 0 in kinds and (name == "llama" or WINDOW in kinds), kinds
    assert any(c.sinks for c in calls) == (name in SINKS)
    expected = [("short", short), *((f"r{i}", p) for i, p in enumerate(prompts)),
                ("again", prompts[1])]
    assert_mlx_lm_tokens(model, name, results, expected, 12)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "llama4_text"])
def test_padded_tails_keep_mlx_lm_tokens(name):
    """On the CUDA path (unless `--experiments unpadded-tails`), where no bucket pads a
    prompt's tail, a step's lone prompt chunk runs right-padded to a multiple of a tail
    size (16 here): the kernel path with decode first's prefill spread over steps,
    sliding layers beside full ones (with sinks too) and chunk-local ones, prefix hits
    past the window. mlx-lm's tokens, and tails were padded. A model with recurrent
    state refuses it (padding would run through it)."""
    from tests.engine_driver import StandInKernel

    model = build(name, head_dim=256)
    engine = InProcessEngine(model, chunk_size=16, overlap="ahead", backend=StandInKernel(),
                             max_prefill_tokens_while_decoding=8, prefill_parts=2,
                             decode_first_for_all=True, pad_tails=16)
    widths: list[tuple[int, int]] = []
    padded_width = engine.runner._padded_width

    def recorded(group):  # noqa: ANN001, ANN202
        widths.append((len(group[0].token_ids), padded_width(group)))
        return widths[-1][1]

    engine.runner._padded_width = recorded
    prompts = _prompts(seed=311)
    cases = [(f"r{i}", p) for i, p in enumerate(prompts)]
    for rid, p in cases:
        engine.submit(rid, p, 12, [])
    results = engine.run_until_idle()
    engine.submit("again", list(prompts[2]), 12, [])  # a hit past the window
    results.update(engine.run_until_idle())
    assert engine.scheduler.counters.cache_hit_tokens > 0
    assert_mlx_lm_tokens(model, name, results, [*cases, ("again", prompts[2])], 12)
    assert {w for n, w in widths if 1 < n < 16} == {16}, widths
    hybrid = InProcessEngine(build("qwen3_next"), chunk_size=16, backend=StandInKernel())
    assert not hybrid.runner.pad_tails(16) and hybrid.runner.tail_multiple == 0


@pytest.mark.parametrize("limit", [8, None, "default"])
def test_paged_prefill_leaves_long_chunks_to_cudnn(limit):
    """Where cuDNN serves a layer's heads (stood in for here), prefill attends through
    it by default. Under `--experiments paged-short-rows` only a forward whose rows hold
    more queries than paged_prefill_max_queries does (a long chunk is arithmetic,
    cuDNN's strength); shorter ones over a computed context read the pool through the
    prefill kernel. mlx-lm's tokens either way."""
    from tests.engine_driver import StandInKernel, record_paged_prefill

    class CudnnHeads(StandInKernel):
        def _fused_builds_per_shape(self, queries, values):  # noqa: ANN001, ANN202
            return True

    model = build("llama", head_dim=64)
    backend = (CudnnHeads() if limit == "default" else
               CudnnHeads(paged_short_rows=True, paged_prefill_max_queries=limit))
    calls = record_paged_prefill(backend)
    prompts = _prompts(seed=307)
    engine = InProcessEngine(model, chunk_size=16, backend=backend)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 6, [])
    results = engine.run_until_idle()
    rows = [c.queries for c in calls]
    if limit == "default":
        assert not rows, rows
    else:
        assert rows, "no forward over a computed context read the pool"
    if limit is None:
        assert max(rows) > 8, rows  # the long chunks the limit turns away exist
    elif limit != "default":
        assert max(rows) <= limit, rows
    assert_mlx_lm_tokens(model, "llama", results, [(f"r{i}", p) for i, p in enumerate(prompts)], 6)


@pytest.mark.parametrize("path", ["plain", "kernel"])
@pytest.mark.parametrize("name", sorted(OWN_SCORES))
def test_own_score_models_decode_rows_of_one_length_together(name, path):
    """Rows of one length decode in one forward with no length mask (each sees every
    position). Gemma 2 batches only such rows (its grouped [B, Hkv, G, 1, L] scores) and
    a [B, 1, 1, L] mask failed to broadcast from three rows on, ending every request of
    the step (found by bench/schedule_soak.py, seed 11002)."""
    model = build(name)
    prompt = _prompts(seed=41)[0]
    prompts = [prompt[:-1] + [t] for t in (5, 6, 7, 8)]  # one length, four rows
    if path == "kernel":  # the CUDA path's decode over the pool, stood in for
        from tests.engine_driver import StandInKernel

        engine = InProcessEngine(model, chunk_size=16, backend=StandInKernel())
    else:
        engine = InProcessEngine(model, chunk_size=16)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 8, [])
    results = engine.run_until_idle()
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    assert_mlx_lm_tokens(model, name, results, [(f"r{i}", p) for i, p in enumerate(prompts)], 8)


def test_one_token_prefill_forwards_equal_mlx_lm():
    """A prefill forward of one token a row (prompts whose cached prefix leaves one,
    sharing a forward at one start) gets no mask, as mlx-lm's caches give one token:
    DeepSeek-V3.2's sparse attention gathers a mask it is given by its top-k picks and
    failed on the [1, L] causal array, ending every request of the step (found by
    bench/schedule_soak.py, seed 3002)."""
    model = build("deepseek_v32")
    prompts = _prompts(seed=33)
    prefix = prompts[1]  # 40 tokens: past the indexer's top-k (8), so it picks
    engine = InProcessEngine(model, chunk_size=16)
    engine.submit("first", prefix, 8, [])
    results = engine.run_until_idle()
    cases = [("first", prefix), ("one", prefix + [7]), ("other", prefix + [11])]
    for rid, p in cases[1:]:  # all but their last token cached: one forward of two rows
        engine.submit(rid, p, 8, [])
    results.update(engine.run_until_idle())
    assert engine.scheduler.counters.cache_hit_tokens >= 2 * len(prefix)
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    assert_mlx_lm_tokens(model, "deepseek_v32", results, cases, 8)


def test_the_oracles_memo_tells_apart_models_that_differ_in_settings_alone():
    """mlx_lm_tokens memoises mlx-lm's runs by model fingerprint across tests: llama with
    sliding layers has plain llama's parameters and classes but other tokens past its
    window, so the fingerprint covers the modules' settings (one served the other's
    memoised run before: a bench/schedule_soak.py run of llama, then llama_sliding,
    failed); the same build twice shares one."""
    from tests.oracle import model_fingerprint

    full, sliding = build("llama", as_served=False), build("llama_sliding", as_served=False)
    assert model_fingerprint(full) != model_fingerprint(sliding)
    assert model_fingerprint(full) == model_fingerprint(build("llama", as_served=False))
    prompt = [(7 * i) % 500 + 1 for i in range(40)]  # past the sliding window of 16
    assert mlx_lm_tokens(full, prompt, 6) != mlx_lm_tokens(sliding, prompt, 6)
