"""Structured output on the worker: an llguidance matcher per constrained request, and the
host side of its token mask.

A matcher follows its request's outputs (it consumes each sampled token once the host has
it) and yields a bitmask of the tokens the grammar allows next, one bit per tokenizer id
(bit t % 32 of word t // 32). `sampling.GrammarMask` turns the masks into -inf logits in
the step's graph. Pure host logic: no MLX here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from kiln_common.background import BackgroundBuild

logger = logging.getLogger(__name__)


class GrammarMatchers:
    """Makes matchers for grammar texts and fills a step's masks.

    The llguidance tokenizer takes up to a second to build on a 150k vocabulary; built by
    the first constrained request, it would stall that whole batch's step. So start-up
    starts building it in the background (`start_building`), and the first use waits only
    for what is left of that (or builds it, where nothing started it). Compiled grammars
    are kept (a few, least recently used dropped): n choices of one request, or clients
    repeating a schema, then get a copy of a compiled matcher instead of compiling again.
    """

    CACHED_GRAMMARS = 32

    def __init__(self, make_tokenizer: Callable[[], Any]) -> None:
        self._tokenizer: BackgroundBuild[Any] = BackgroundBuild(make_tokenizer,
                                                                "llguidance tokenizer")
        self._executor: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def start_building(self) -> None:
        """Build the llguidance tokenizer on a thread from now on (start-up: readiness does
        not wait for it)."""
        self._tokenizer.start()

    @property
    def building_started(self) -> bool:
        return self._tokenizer.started

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer.get()

    @property
    def executor(self) -> Any:
        """llguidance's thread pool for filling many rows' masks at once."""
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor

    @property
    def words(self) -> int:
        """int32 words in one row's mask."""
        return (self.tokenizer.vocab_size + 31) // 32

    def matcher(self, grammar: str, consumed: Sequence[int] = ()) -> Any:
        """A matcher at the grammar's start that has then consumed `consumed` (the outputs
        a resumed request already has)."""
        matcher = self._compile(grammar).deep_copy()
        if consumed and not matcher.consume_tokens(list(consumed)):
            # A bug, as in advance: the failed matcher allows only EOS, so the request
            # ends at once instead of the worker.
            logger.error("a grammar refused a resumed request's own outputs: %s",
                         matcher.get_error())
        return matcher

    def fill(self, matchers: Sequence[Any]) -> np.ndarray:
        """The next-token masks of these matchers, [len, words] int32.

        NOTE: a row never allows nothing (all -inf logits would sample garbage): a matcher
        that is finished or failed already allows only EOS; any empty row gets EOS too.
        """
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        masks = np.zeros((len(matchers), self.words), dtype=np.int32)
        if len(matchers) == 1:  # no thread hand-off for a lone row
            fill_next_token_bitmask(matchers[0], masks)
        else:
            fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                        masks)
        empty = ~masks.any(axis=1)
        if empty.any():
            bits = masks.view(np.uint32)
            for eos in self.tokenizer.eos_tokens:
                bits[empty, eos // 32] |= np.uint32(1 << (eos % 32))
        return masks

    @staticmethod
    def advance(matcher: Any, token: int) -> None:
        """Feed a sampled token. The mask allowed it, so a refusal is a bug worth a log
        line; the matcher then allows only EOS, which ends the request."""
        if not matcher.consume_token(token):
            logger.warning("a grammar refused sampled token %d: %s", token, matcher.get_error())

    def _compile(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        compiled = self._compiled.pop(grammar, None)
        if compiled is None:
            compiled = LLMatcher(self.tokenizer, grammar)
            if compiled.is_error():
                # The tokenizer process validated it against the same tokenizer, so this
                # is a bug; the failed matcher allows only EOS (the request ends at once).
                logger.error("invalid grammar reached the worker: %s", compiled.get_error())
                return compiled
        self._compiled[grammar] = compiled
        while len(self._compiled) > self.CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled
