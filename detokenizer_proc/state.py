"""The detokenizer's pure logic: per-request incremental text (kiln_common's
DetokenizerState), stop-string trimming and the logprob entries that follow it."""

from __future__ import annotations

import logging

from ipc.messages.common import TokenLogprob
from ipc.messages.to_detokenizer import BatchTokens, TokenOutput
from ipc.messages.to_tokenizer import BatchText, PromptTextLogprobs, TextLogprob, TextOutput
from kiln_common.incremental_text import DetokenizerState, TokenizerLike, byte_fallback_ids
from kiln_common.stops import LogprobGate, StopTrimmer

logger = logging.getLogger(__name__)


class DetokenizerManager:
    """Detokenizer states of the running requests, keyed by request id."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._byte_tokens = byte_fallback_ids(tokenizer)
        self._states: dict[str, DetokenizerState] = {}
        self._token_texts: dict[int, str] = {}  # logprobs' token texts, by id (bounded by V)
        self._trimmers: dict[str, StopTrimmer] = {}  # requests with stop strings
        self._gates: dict[str, LogprobGate[TextLogprob]] = {}  # the same requests

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def process(self, batch: BatchTokens) -> BatchText:
        """One text output per token output, in the same order."""
        return BatchText(outputs=[self._process_one(out) for out in batch.outputs])

    def _process_one(self, out: TokenOutput) -> TextOutput:
        logprobs = self._text_logprobs(out)
        try:
            text, logprobs = self._trim(out, self._detokenize(out), logprobs)
            error = out.error
        except Exception as exc:  # one bad request must not fail its batch mates
            logger.exception("request %s: detokenization failed", out.rid)
            self._states.pop(out.rid, None)
            self._trimmers.pop(out.rid, None)
            self._gates.pop(out.rid, None)
            text, error = "", out.error or f"detokenization failed: {exc}"
        return TextOutput(rid=out.rid, text=text, token_ids=out.token_ids,
                          finished=out.finished, finish_reason=out.finish_reason,
                          usage=out.usage, error=error, logprobs=logprobs,
                          prompt_logprobs=self._prompt_logprobs(out),
                          cumulative_logprob=out.cumulative_logprob, stop_str=out.stop_str)

    def _text_logprobs(self, out: TokenOutput) -> list[TextLogprob] | None:
        """The token logprobs with each token's own text (the decode of that one id)."""
        if out.logprobs is None:
            return None
        return [self._text_logprob(t, lp) for t, lp in zip(out.token_ids, out.logprobs)]

    def _text_logprob(self, token_id: int, lp: TokenLogprob) -> TextLogprob:
        return TextLogprob(token=self._token_text(token_id), logprob=lp.logprob,
                           top_tokens=[self._token_text(i) for i in lp.top_ids],
                           top_logprobs=lp.top_logprobs, token_id=token_id,
                           top_ids=lp.top_ids)

    def _prompt_logprobs(self, out: TokenOutput) -> PromptTextLogprobs | None:
        scored = out.prompt_logprobs
        if scored is None:
            return None
        ids = scored.token_ids
        return PromptTextLogprobs(
            first=self._token_text(ids[0]), first_id=ids[0],
            rest=[self._text_logprob(t, lp) for t, lp in zip(ids[1:], scored.logprobs)])

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _detokenize(self, out: TokenOutput) -> str:
        state = self._states.get(out.rid)
        if state is None:
            # Normally the first output, carrying the setup; any other starts fresh.
            state = DetokenizerState.start(self._tokenizer, out.prompt_tail,
                                           out.skip_special_tokens, self._byte_tokens)
            self._states[out.rid] = state
            if out.stop:
                self._trimmers[out.rid] = StopTrimmer(out.stop, out.include_stop_str)
                self._gates[out.rid] = LogprobGate()
        text = state.step(out.token_ids)
        if out.finished:
            text += state.finish()
            del self._states[out.rid]
        return text

    def _trim(self, out: TokenOutput, decoded: str, logprobs: list[TextLogprob] | None
              ) -> tuple[str, list[TextLogprob] | None]:
        """Cut the text at the request's first stop string and hold back what may start
        one; the logprob entries follow the text returned (LogprobGate)."""
        trimmer = self._trimmers.get(out.rid)
        if trimmer is None:
            return decoded, logprobs
        gate = self._gates[out.rid]
        if out.finished:
            del self._trimmers[out.rid], self._gates[out.rid]
        text = trimmer.push(decoded, final=out.finished)
        if out.stop_str is not None and trimmer.matched is None:
            logger.warning("request %s: the scheduler matched stop %r, the text holds none",
                           out.rid, out.stop_str)
        passed = gate.push(logprobs or [], decoded, text, trimmer.matched is not None,
                           out.finished)
        return text, passed if logprobs is not None or passed else None
