"""The sampling transforms on fixed logits against numpy formulas, the sampled distribution
against softmax(logits / T) under top-k / top-p / min-p (chi-square), and penalties, min_tokens,
ignore_eos and stop ids through the scheduler and worker on the tiny model."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ipc.messages.common import SamplingParams
from tests.engine_driver import InProcessEngine
from worker_proc.sampling import Penalties, SamplingBatch, apply_penalties, process_logits, sample

V = 12


def _logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, size=(rows, V)).astype(np.float32)


def _np_penalties(logits: np.ndarray, counts: np.ndarray, in_prompt: np.ndarray,
                  rep: float, freq: float, pres: float) -> np.ndarray:
    seen = in_prompt | (counts > 0)
    out = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
    return out - freq * counts - pres * (counts > 0)


# --- transforms on fixed logits -----------------------------------------------------------


def test_penalties_match_the_reference_formulas() -> None:
    logits = _logits(3)
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 3, size=(2, V)).astype(np.int32)
    in_prompt = rng.random((2, V)) < 0.3
    settings = [(1.5, 0.5, -0.75), (0.8, -1.0, 2.0)]
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in settings]
    pen = Penalties.build([0, 2], params, [mx.array(c) for c in counts],
                          [mx.array(m) for m in in_prompt])
    got = np.array(apply_penalties(mx.array(logits), pen))
    expected = logits.copy()
    for j, row in enumerate([0, 2]):
        expected[row] = _np_penalties(logits[row], counts[j], in_prompt[j], *settings[j])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert np.array_equal(got[1], logits[1])  # a row without penalties is untouched


def test_penalty_counts_advance_with_the_sampled_tokens() -> None:
    pen = Penalties.build([1], [SamplingParams(presence_penalty=1.0)],
                          [mx.zeros(V, dtype=mx.int32)], [mx.zeros(V, dtype=mx.bool_)])
    counted = np.array(pen.counted(mx.array([4, 7, 9], dtype=mx.int32)))
    assert counted.tolist() == [[1 if t == 7 else 0 for t in range(V)]]


def test_logit_bias_and_min_tokens_mask_match_the_reference() -> None:
    logits = _logits(3, seed=2)
    params = [SamplingParams(logit_bias={3: 5.0, 5: -100.0}, min_tokens=2),
              SamplingParams(min_tokens=2), SamplingParams(logit_bias={0: 1.5})]
    steps = [1, 2, 0]  # row 1 has its 2 outputs: no mask
    batch = SamplingBatch.build(params, [0, 0, 0], steps, stop_ids=[[1, 3], [1], [1]])
    got = np.array(process_logits(mx.array(logits), batch))
    expected = logits.copy()
    expected[0, 3] += 5.0
    expected[0, 5] -= 100.0
    expected[0, [1, 3]] = -np.inf
    expected[2, 0] += 1.5
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_min_tokens_mask_means_stop_ids_are_never_sampled() -> None:
    logits = np.zeros((256, V), dtype=np.float32)
    logits[:, 2] = 20.0  # the stop id dominates
    params = [SamplingParams(temperature=t, min_tokens=1) for t in (0.0, 1.0)] * 128
    batch = SamplingBatch.build(params, list(range(256)), [0] * 256, [[2]] * 256)
    assert 2 not in np.array(sample(mx.array(logits), batch)).tolist()


def test_batches_without_new_settings_skip_the_extra_work() -> None:
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * 2, [0, 0], [0, 0],
                                [[1], [1]])
    assert batch.edits is None and batch.penalties is None
    assert batch.draws is None  # all greedy: no per-row arrays built or sent


def _reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> np.ndarray:
    """softmax(logits / T), then min-p, then top-k and top-p over what min-p kept."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = (mass_before < top_p) & (np.arange(len(probs)) < (top_k or len(probs)))
    out = np.zeros_like(probs)
    out[order[keep]] = probs[order[keep]]
    return out / out.sum()


def assert_follows(samples: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square goodness of fit at p = 0.001, tokens expected < 5 times pooled; a token
    outside the support fails at once."""
    counts = np.bincount(samples, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "sampled a token the filters removed"
    expected = probs * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    if dof == 0:
        return
    # Wilson-Hilferty approximation of the chi-square quantile; z(0.999) = 3.09.
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (dof {dof})"


FILTERS = [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 6, 1.0, 0.0), (1.0, 0, 0.8, 0.0),
           (1.0, 0, 1.0, 0.05), (0.9, 8, 0.9, 0.02)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), FILTERS)
def test_sampled_tokens_follow_the_filtered_softmax(temperature: float, top_k: int, top_p: float,
                                                    min_p: float) -> None:
    logits = np.random.default_rng(3).normal(0, 1.5, size=V).astype(np.float32)
    n = 4000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * n
    batch = SamplingBatch.build(params, list(range(n)), [0] * n)
    samples = np.array(sample(mx.array(np.tile(logits, (n, 1))), batch))
    assert_follows(samples, _reference_probs(logits, temperature, top_k, top_p, min_p))


# --- through the scheduler and worker on the tiny model -----------------------------------


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, vocab, size=n).tolist()


def test_first_tokens_of_the_model_follow_its_filtered_softmax(tiny_model) -> None:
    model, _ = tiny_model
    prompt = _prompt(model.args.vocab_size, 9, seed=4)
    logits = np.array(model(mx.array([prompt]))[0, -1].astype(mx.float32))
    settings = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01)
    engine = InProcessEngine(model, max_running=64, radix_cache=True)
    n = 1500
    for i in range(n):
        engine.submit(f"r{i}", prompt, 1, [], seed=i, **settings)
    results = engine.run_until_idle()
    samples = np.array([results[f"r{i}"].token_ids[0] for i in range(n)])
    assert_follows(samples, _reference_probs(logits, 0.8, 40, 0.95, 0.01))


def _greedy_with_penalties(model, prompt: list[int], n: int, rep: float, freq: float,
                           pres: float, bias: dict[int, float]) -> list[int]:
    """The reference: a full forward per token, then numpy's bias and penalties, argmax."""
    out: list[int] = []
    vocab = model.args.vocab_size
    in_prompt = np.zeros(vocab, dtype=bool)
    in_prompt[prompt] = True
    for _ in range(n):
        logits = np.array(model(mx.array([prompt + out]))[0, -1].astype(mx.float32))
        for t, b in bias.items():
            logits[t] += b
        counts = np.bincount(out, minlength=vocab)
        out.append(int(np.argmax(_np_penalties(logits, counts, in_prompt, rep, freq, pres))))
    return out


@pytest.mark.parametrize("overlap", [True, "ahead", False])
def test_greedy_penalties_match_the_reference(tiny_model, oracle, overlap) -> None:
    model, _ = tiny_model
    vocab = model.args.vocab_size
    prompt = _prompt(vocab, 20, seed=5)
    settings = dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.4,
                    logit_bias={7: 2.0})
    engine = InProcessEngine(model, overlap=overlap)
    engine.submit("pen", prompt, 16, [], **settings)
    engine.submit("plain", _prompt(vocab, 33, seed=6), 16, [])  # a batch mate without them
    results = engine.run_until_idle()
    expected = _greedy_with_penalties(model, prompt, 16, 1.5, 0.8, 0.4, {7: 2.0})
    assert results["pen"].token_ids == expected
    assert expected != oracle(prompt, 16)  # the penalties changed something
    assert results["plain"].token_ids == oracle(_prompt(vocab, 33, seed=6), 16)


def test_seeded_penalised_sampling_ignores_batch_mix_and_preemption(tiny_model) -> None:
    model, _ = tiny_model
    vocab = model.args.vocab_size
    prompt = _prompt(vocab, 120, seed=7)
    settings = dict(temperature=1.0, top_k=30, min_p=0.02, seed=11, repetition_penalty=1.3,
                    frequency_penalty=0.5, presence_penalty=0.5, logit_bias={9: 3.0})
    alone = InProcessEngine(model)
    alone.submit("x", prompt, 60, [], **settings)
    expected = alone.run_until_idle()["x"].token_ids
    tight = InProcessEngine(model, capacity=500, max_running=8)
    tight.submit("x", prompt, 60, [], **settings)
    for i in range(7):
        mate = dict(temperature=0.7, seed=i, presence_penalty=1.0) if i % 2 else {}
        tight.submit(f"o{i}", _prompt(vocab, 120, seed=20 + i), 60, [], **mate)
    assert tight.run_until_idle()["x"].token_ids == expected
    assert tight.scheduler.counters.preemptions > 0


# --- stops: API bodies through RequestPreparer, then the real scheduler and worker --------


@pytest.fixture(scope="module")
def preparer(tiny_model_dir):
    from tokenizer_proc.prepare import RequestPreparer

    return RequestPreparer.load("tiny", str(tiny_model_dir))


def _complete(tiny_model, preparer, **body) -> tuple[list[int], str | None]:
    from tokenizer_proc.protocol import CompletionRequest

    engine = InProcessEngine(tiny_model[0])
    prompt = _prompt(tiny_model[0].args.vocab_size, 10, seed=8)
    engine.submit_message(preparer.completion(CompletionRequest(prompt=prompt, temperature=0,
                                                                **body), "r"))
    result = engine.run_until_idle()["r"]
    return result.token_ids, result.finish_reason


def test_min_tokens_holds_back_a_forced_eos(tiny_model, preparer) -> None:
    eos = preparer.info.eos_token_ids[0]
    bias = {str(eos): 100.0}  # EOS is the argmax as soon as it is allowed
    assert _complete(tiny_model, preparer, max_tokens=8, logit_bias=bias) == ([], "stop")
    ids, reason = _complete(tiny_model, preparer, max_tokens=8, logit_bias=bias, min_tokens=3)
    assert len(ids) == 3 and eos not in ids and reason == "stop"


def test_ignore_eos_generates_through_eos(tiny_model, preparer) -> None:
    eos = preparer.info.eos_token_ids[0]
    ids, reason = _complete(tiny_model, preparer, max_tokens=5, ignore_eos=True,
                            logit_bias={str(eos): 100.0})
    assert ids == [eos] * 5 and reason == "length"


def test_stop_token_ids_end_the_request_without_the_stop_token(tiny_model, preparer) -> None:
    plain, _ = _complete(tiny_model, preparer, max_tokens=12, ignore_eos=True)
    stop = plain[4]
    ids, reason = _complete(tiny_model, preparer, max_tokens=12, ignore_eos=True,
                            stop_token_ids=[stop])
    assert ids == plain[:plain.index(stop)] and reason == "stop"
    ids, reason = _complete(tiny_model, preparer, max_tokens=12, ignore_eos=True,
                            stop_token_ids=[stop], min_tokens=12)
    assert len(ids) == 12 and stop not in ids and reason == "length"
