"""Detokenizer logic on plain data: small tokenizers trained here, no sockets, no model."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Sequence

import pytest
from tokenizers import (AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        trainers)
from transformers import PreTrainedTokenizerFast

from detokenizer_proc.state import DetokenizerManager
from ipc.messages.common import Usage
from ipc.messages.to_detokenizer import BatchTokens, TokenOutput
from kiln_common.incremental_text import MAX_HELD_IDS, REPLACEMENT_CHAR, DetokenizerState

SPECIALS = ("<|bos|>", "<|eos|>", "<|im_end|>")
PLAIN_ADDED = "<tool>"  # an added token that is not special: never skipped

# A few KB of text with 2-, 3- and 4-byte characters, so merges cut characters apart.
SAMPLES = (
    "The café on the corner serves crème brûlée and piña colada. ",
    "日本語のテキストと漢字、ひらがな、カタカナ。東京は大きい都市です。",
    "Emoji time: 🙂🚀🎉 and again 🙂🚀 with friends 👋🏽. ",
    "Καλημέρα κόσμε, η γλώσσα μας είναι ελληνική. ",
    "Привет, мир! Как дела? Всё хорошо, спасибо. ",
    "Mixed: naïve façade — “quotes” … ¿qué? ¡sí! 1234567890 ",
)
CORPUS = [sample * 6 for sample in SAMPLES] * 4


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_tokens([AddedToken(PLAIN_ADDED, special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIALS[0],
                                   eos_token=SPECIALS[1],
                                   additional_special_tokens=[SPECIALS[2]])


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _byte_level_tokenizer()


def byte_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of text (every character cut apart)."""
    chars = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    (mapped, _), = chars.pre_tokenize_str(text)
    return tok.convert_tokens_to_ids(list(mapped))


def random_ids(tok: PreTrainedTokenizerFast, rng: random.Random, n: int) -> list[int]:
    """Ids mixing real text, lone bytes (partial and invalid UTF-8), specials, anything."""
    high_bytes = byte_ids(tok, "é日🙂") + tok.convert_tokens_to_ids(["ÿ", "À", "Ģ"])
    specials = tok.convert_tokens_to_ids([*SPECIALS, PLAIN_ADDED])
    text_ids = tok.encode("".join(SAMPLES), add_special_tokens=False)
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.3:
            start = rng.randrange(len(text_ids))
            out += text_ids[start:start + rng.randint(1, 6)]
        elif kind < 0.6:
            out.append(rng.choice(high_bytes))
        elif kind < 0.7:
            out.append(rng.choice(specials))
        else:
            out.append(rng.randrange(len(tok)))
    return out[:n]


def random_steps(ids: Sequence[int], rng: random.Random) -> list[list[int]]:
    """ids cut into consecutive chunks of 1..5."""
    steps, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        steps.append(list(ids[i:i + n]))
        i += n
    return steps


def check_deltas(deltas: list[str], full: str) -> None:
    """Joined deltas equal the full decode; no delta ends in a U+FFFD the decode lacks."""
    assert "".join(deltas) == full
    pos = 0
    for delta in deltas:
        pos += len(delta)
        if delta.endswith(REPLACEMENT_CHAR):
            assert full[pos - 1] == REPLACEMENT_CHAR


def stream(state: DetokenizerState, steps: list[list[int]]) -> list[str]:
    return [state.step(step) for step in steps] + [state.finish()]


# -- DetokenizerState -----------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_join_to_full_decode(tok: PreTrainedTokenizerFast, skip: bool) -> None:
    rng = random.Random(1234 + skip)
    for _ in range(400):
        ids = random_ids(tok, rng, rng.randint(0, 60))
        tail = random_ids(tok, rng, rng.randint(0, 6)) if rng.random() < 0.7 else None
        state = DetokenizerState.start(tok, tail, skip_special_tokens=skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        check_deltas(stream(state, random_steps(ids, rng)), full)


def test_text_streams_as_soon_as_it_is_complete(tok: PreTrainedTokenizerFast) -> None:
    # Holding back is only allowed while the decode so far ends in U+FFFD.
    rng = random.Random(7)
    for _ in range(200):
        ids = random_ids(tok, rng, 40)
        state = DetokenizerState.start(tok, tok.encode("Hi there", add_special_tokens=False))
        seen: list[int] = []
        emitted = ""
        for step in random_steps(ids, rng):
            seen += step
            emitted += state.step(step)
            so_far = tok.decode(seen, skip_special_tokens=True)
            assert so_far.startswith(emitted)
            if not so_far.endswith(REPLACEMENT_CHAR):
                assert emitted == so_far


def test_emoji_cut_into_bytes_never_appears_split(tok: PreTrainedTokenizerFast) -> None:
    state = DetokenizerState.start(tok)
    deltas = [state.step([i]) for i in byte_ids(tok, "a🙂🚀b")] + [state.finish()]
    assert deltas == ["a", "", "", "", "🙂", "", "", "", "🚀", "b", ""]


def test_real_text_cut_mid_character_by_merges(tok: PreTrainedTokenizerFast) -> None:
    text = "日本語 🙂🚀 café Привет"
    ids = tok.encode(text, add_special_tokens=False)
    state = DetokenizerState.start(tok)
    deltas = stream(state, [[i] for i in ids])
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_unfinished_character_is_flushed_at_finish(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("ok ", add_special_tokens=False) + byte_ids(tok, "🙂")[:2]
    state = DetokenizerState.start(tok)
    assert state.step(ids) == "ok "
    assert state.finish() == REPLACEMENT_CHAR == tok.decode(byte_ids(tok, "🙂")[:2])


def test_special_tokens_skipped_or_kept(tok: PreTrainedTokenizerFast) -> None:
    eos, plain = tok.convert_tokens_to_ids([SPECIALS[1], PLAIN_ADDED])
    ids = byte_ids(tok, "日")[:2] + [eos, plain] + byte_ids(tok, "日")[2:] + [eos]
    for skip in (True, False):
        state = DetokenizerState.start(tok, skip_special_tokens=skip)
        check_deltas(stream(state, [[i] for i in ids]), tok.decode(ids, skip_special_tokens=skip))


def test_byte_level_prompt_tail_does_not_change_the_text(tok: PreTrainedTokenizerFast) -> None:
    prompt = tok.encode("Say: 日本", add_special_tokens=False)
    ids = tok.encode("語 🙂 done", add_special_tokens=False)
    cut_prompt = prompt + byte_ids(tok, "語")[:1]  # prompt ending inside a character
    for tail in (prompt[-4:], cut_prompt[-4:]):
        state = DetokenizerState.start(tok, tail)
        assert "".join(stream(state, [[i] for i in ids])) == tok.decode(ids)


@dataclass
class RecordingDecoder:
    """Wraps a tokenizer and records how many ids each decode call received."""

    inner: PreTrainedTokenizerFast
    lengths: list[int] = field(default_factory=list)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(token_ids))
        return self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.inner.get_vocab()


def test_work_per_step_is_bounded(tok: PreTrainedTokenizerFast) -> None:
    rng = random.Random(99)
    text_ids = tok.encode("".join(SAMPLES) * 40, add_special_tokens=False)
    ids = random_ids(tok, rng, 400) + text_ids  # garbage first, then plain text
    ids = ids[:2000]
    assert len(ids) == 2000
    recorder = RecordingDecoder(tok)
    state = DetokenizerState.start(recorder, text_ids[:4])
    steps = random_steps(ids, rng)
    deltas = stream(state, steps)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert max(recorder.lengths) < 16
    assert len(recorder.lengths) <= 10 * len(steps)


# -- a SentencePiece-style tokenizer: left-context spaces and byte-fallback runs ---------


def _sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2-like: "▁" for spaces, "<0xNN>" byte tokens, a decoder that strips one space."""
    trainer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    trainer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], max_token_length=6))
    model = json.loads(trainer.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = trainer.normalizer
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def spm() -> PreTrainedTokenizerFast:
    return _sentencepiece_style_tokenizer()


def test_prompt_tail_gives_the_leading_space_of_a_continuation(
        spm: PreTrainedTokenizerFast) -> None:
    prompt = spm.encode("The café", add_special_tokens=False)
    generated = spm.encode("on the corner", add_special_tokens=False)  # starts with "▁"
    assert spm.decode(generated) == "on the corner"  # a plain decode loses the space
    assert spm.decode(prompt + generated) == "The café on the corner"
    state = DetokenizerState.start(spm, prompt[-4:])
    assert "".join(stream(state, [[i] for i in generated])) == " on the corner"
    # A skipped special token in between gives no context: the space must survive it.
    state = DetokenizerState.start(spm, prompt[-4:])
    deltas = stream(state, [[spm.eos_token_id], *[[i] for i in generated]])
    assert "".join(deltas) == " on the corner"


def test_byte_fallback_runs_stream_whole_characters(spm: PreTrainedTokenizerFast) -> None:
    # A run of byte tokens decodes as a whole (an invalid run is all U+FFFD), so only
    # runs of valid UTF-8 can stream exactly; those are what a real model emits.
    rng = random.Random(11)
    pieces = [i for i in range(len(spm)) if not spm.convert_ids_to_tokens(i).startswith("<")]
    chars = ["a", " ", "\n", "é", "日", "🙂", "ꙮ", "𝔘"]
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(0, 30)):
            if rng.random() < 0.5:
                ids.append(rng.choice(pieces))
            else:
                ids += byte_fallback(spm, rng.choice(chars))
        tail = [rng.choice(pieces) for _ in range(4)]
        deltas = stream(DetokenizerState.start(spm, tail), random_steps(ids, rng))
        before = spm.decode(tail)
        assert "".join(deltas) == spm.decode(tail + ids)[len(before):]
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_endless_invalid_byte_run_keeps_the_window_bounded(
        spm: PreTrainedTokenizerFast) -> None:
    # No cut inside an invalid byte-fallback run is provably final: held ids pile up
    # until the safety valve emits them.
    ids = spm.convert_tokens_to_ids(["<0xFF>"]) * 300
    state = DetokenizerState.start(spm)
    deltas = []
    for i in ids:
        deltas.append(state.step([i]))
        assert state.window_size <= 2 * MAX_HELD_IDS + 2
    deltas.append(state.finish())
    assert "".join(deltas) == spm.decode(ids) == REPLACEMENT_CHAR * 300


def byte_fallback(spm: PreTrainedTokenizerFast, char: str) -> list[int]:
    return spm.convert_tokens_to_ids([f"<0x{byte:02X}>" for byte in char.encode()])


# -- DetokenizerManager ---------------------------------------------------------------


def test_manager_routes_interleaved_requests(tok: PreTrainedTokenizerFast) -> None:
    rng = random.Random(5)
    manager = DetokenizerManager(tok)
    plans = {f"r{n}": random_steps(random_ids(tok, rng, 50), rng) for n in range(4)}
    skips = {rid: n % 2 == 0 for n, rid in enumerate(plans)}
    texts = {rid: "" for rid in plans}
    cursors = {rid: 0 for rid in plans}
    while any(cursors[rid] < len(steps) for rid, steps in plans.items()):
        live = [rid for rid in plans if cursors[rid] < len(plans[rid])]
        batch = [_next_output(rid, plans[rid], cursors, skips[rid])
                 for rid in rng.sample(live, rng.randint(1, len(live)))]
        result = manager.process(BatchTokens(outputs=batch))
        for sent, got in zip(batch, result.outputs, strict=True):
            assert (got.rid, got.token_ids, got.finished) == (sent.rid, sent.token_ids,
                                                              sent.finished)
            assert (got.finish_reason, got.usage) == (sent.finish_reason, sent.usage)
            texts[got.rid] += got.text
            assert (got.rid in manager) != got.finished  # state lives until finished
    for rid, steps in plans.items():
        ids = [i for step in steps for i in step]
        assert texts[rid] == tok.decode(ids, skip_special_tokens=skips[rid])
    assert len(manager) == 0


def _next_output(rid: str, steps: list[list[int]], cursors: dict[str, int],
                 skip: bool) -> TokenOutput:
    n = cursors[rid]
    cursors[rid] += 1
    last = n == len(steps) - 1
    return TokenOutput(rid=rid, token_ids=steps[n], finished=last,
                       finish_reason="stop" if last else None,
                       usage=Usage(prompt_tokens=3, completion_tokens=9) if last else None,
                       prompt_tail=[1, 2, 3] if n == 0 else None,
                       skip_special_tokens=skip)


def test_manager_tolerates_outputs_without_setup(tok: PreTrainedTokenizerFast) -> None:
    manager = DetokenizerManager(tok)
    ids = tok.encode("café 🙂", add_special_tokens=False)
    first = manager.process(BatchTokens(outputs=[TokenOutput(rid="a", token_ids=ids[:3])]))
    last = manager.process(BatchTokens(outputs=[
        TokenOutput(rid="a", token_ids=ids[3:], finished=True),
        TokenOutput(rid="ghost", token_ids=[], finished=True, finish_reason="abort",
                    error="aborted"),
    ]))
    assert first.outputs[0].text + last.outputs[0].text == "café 🙂"
    ghost = last.outputs[1]
    assert (ghost.text, ghost.finish_reason, ghost.error) == ("", "abort", "aborted")
    assert len(manager) == 0


def test_manager_reports_a_failed_request_and_serves_the_rest(
        tok: PreTrainedTokenizerFast) -> None:
    manager = DetokenizerManager(tok)
    good = tok.encode("fine", add_special_tokens=False)
    result = manager.process(BatchTokens(outputs=[
        TokenOutput(rid="bad", token_ids=[-1]),  # not a token id: decode raises
        TokenOutput(rid="good", token_ids=good, finished=True),
    ]))
    bad, ok = result.outputs
    assert bad.error is not None and bad.text == "" and "bad" not in manager
    assert (ok.text, ok.error) == ("fine", None)
