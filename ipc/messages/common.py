"""Records shared by several message families."""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Base of every wire record; the tag is the class name."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling settings, already validated by the tokenizer process.

    top_k == 0 means "no top-k"; temperature == 0 means greedy; seed None means the
    worker draws one, so the request is still sampled independently of its batch mates.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 16
    min_p: float = 0.0  # drop tokens with probability < min_p * the top probability
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before anything else
    repetition_penalty: float = 1.0  # over prompt + outputs (HF / vLLM definition)
    frequency_penalty: float = 0.0  # over outputs (OpenAI definitions)
    presence_penalty: float = 0.0
    min_tokens: int = 0  # stop ids cannot be sampled before this many outputs exist
    # Log-probabilities of each sampled token and of the `logprobs` most likely ones
    # (0..20); -1: off. Of the raw model distribution (see TokenLogprob).
    logprobs: int = -1
    # Log-probabilities of the prompt's own tokens (each given the ones before it) with
    # the top `prompt_logprobs` (0..20); -1: off. A request asking computes its whole
    # prompt: the prefix cache would skip positions.
    prompt_logprobs: int = -1
    # Structured output: an llguidance grammar (the text `LLMatcher.grammar_from_*` makes
    # of a JSON schema, regex or Lark grammar), validated by the tokenizer process; the
    # worker masks every token it does not allow. None: unconstrained.
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """Log-probabilities at one sampled position, of the raw model distribution: the
    log-softmax of the model's logits before logit_bias, penalties, temperature and the
    filters. `top_ids` are the k most likely tokens, most likely first."""

    logprob: float  # of the sampled token
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class SchedulerStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the scheduler's KV and queue state.

    NOTE: free_slots + cached_slots + slots held by running requests == capacity_slots
    always (slots_consistent); when idle, free + cached == capacity.
    """

    capacity_slots: int
    used_slots: int
    free_slots: int
    running_requests: int
    waiting_requests: int
    prompt_tokens_total: int
    computed_prompt_tokens_total: int
    generated_tokens_total: int
    finished_requests_total: int
    aborted_requests_total: int
    cached_slots: int = 0
    evictable_slots: int = 0
    preemptions_total: int = 0
    cache_hit_tokens_total: int = 0
    slots_consistent: bool = True
    # Models with recurrent layers: the prefix cache's state snapshots (--state-snapshots),
    # in all and in use (each one request's recurrent state, in the worker's memory).
    state_snapshots: int = 0
    state_snapshots_used: int = 0
    # Models with windowed layers (sliding, chunked) in a slot space of their own: its
    # slots in all and in use (positions still inside some window, or cached prefix
    # tails). kv_bytes_per_slot: one position's K/V in the full layers' pool;
    # window_kv_bytes_per_slot: in the windowed layers' (0: they share the full pool).
    window_capacity_slots: int = 0
    window_used_slots: int = 0
    window_held_slots: int = 0  # of those, what running requests' queries see (the rest: cache)
    kv_bytes_per_slot: int = 0
    window_kv_bytes_per_slot: int = 0
    prefill_chunk_tokens: int = 0  # the largest prefill chunk (--chunked-prefill-size resolved)
    # Steps a decode-first step's prefill runs over (--prefill-spread resolved, as the
    # model allows: 1 where its forwards run whole), and the prompt tokens a step it
    # takes (--max-prefill-tokens-while-decoding resolved; 0: no decode first).
    prefill_parts: int = 1
    decode_first_tokens: int = 0

    @property
    def kv_bytes_used(self) -> int:
        """Bytes of K/V the positions in use hold, both spaces together."""
        return (self.used_slots * self.kv_bytes_per_slot
                + self.window_used_slots * self.window_kv_bytes_per_slot)
