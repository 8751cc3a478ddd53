"""Records received by the scheduler: requests from the tokenizer, results from the worker."""

from __future__ import annotations

import msgspec

from ipc.messages.common import Message, SamplingParams, TokenLogprob


class TokenizedRequest(Message, frozen=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: list[int]
    skip_special_tokens: bool = True
    # Stop strings: the request ends with "stop" at the first step whose text contains one.
    stop: list[str] = []
    include_stop_str_in_output: bool = False


class AbortRequest(Message, frozen=True):
    rid: str


class GetStats(Message, frozen=True):
    query_id: str


class FlushCache(Message, frozen=True):
    """Drop every unlocked cached prefix; answered with a StatsReply of the same query_id."""

    query_id: str


class WorkerReady(Message, frozen=True):
    """The worker's handshake: the KV pool it allocated fixes the scheduler's capacity;
    overlap (resolved for the worker's device) whether to keep several steps in flight
    (ServerConfig.steps_in_flight);
    prefix_cache False when a prefix's cached K/V cannot serve a hit (the model has
    recurrent layers and no state snapshots are kept)."""

    num_slots: int
    max_context_len: int
    overlap: bool
    prefix_cache: bool = True
    # Recurrent layers with a prefix cache: the snapshot slots the worker keeps (a hit is
    # then taken only where a snapshot exists); 0 for models without recurrent layers.
    state_snapshots: int = 0
    # Windowed layers in a slot space of their own: its size and the layers' windows,
    # each (kind, span) as kiln_common.windows names them; 0 and [] when they share the
    # full layers' slots.
    window_slots: int = 0
    windows: list[tuple[str, int]] = []
    # Bytes one position's K/V take: in the full layers' pool and in the windowed ones'.
    bytes_per_slot: int = 0
    window_bytes_per_slot: int = 0
    # The largest prefill chunk (ServerConfig.chunk_size for the worker's attention), and
    # where a prompt's unfinished chunks should end (multiples of it; 1: anywhere).
    chunk_size: int = 2048
    chunk_align: int = 1
    # Where prefix hits are cut back to (multiples of it; 0: chunk_align).
    prefix_align: int = 0
    # Decode first (ServerConfig.decode_first_tokens, .spread_parts resolved for this
    # model and device): the prompt tokens a step computes beside the streams it
    # protects, run over this many steps (1: in one).
    decode_first_tokens: int = 512
    prefill_parts: int = 1


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprobs of prompt tokens `start`.. of one request, from one prefill chunk: entry i
    is of prompt token start + i given the tokens before it (so start >= 1), with the
    `top_k` most likely ids at that position (flat: top_k entries per token)."""

    rid: str
    start: int
    logprobs: list[float]
    top_k: int
    top_ids: list[int] = []
    top_logprobs: list[float] = []

    def entries(self) -> list[TokenLogprob]:
        k = self.top_k
        return [TokenLogprob(logprob=lp, top_ids=self.top_ids[i * k:(i + 1) * k],
                             top_logprobs=self.top_logprobs[i * k:(i + 1) * k])
                for i, lp in enumerate(self.logprobs)]


class RequestError(msgspec.Struct, frozen=True, array_like=True):
    """A request the worker cannot serve (its settings failed the worker's checks): it
    must end with this error; its forward still ran, so its K/V is sound."""

    rid: str
    message: str


class StepResult(Message, frozen=True):
    """One sampled token for every request of step `step` that asked for one, and the
    prompt logprobs its prefill chunks computed for requests that asked.

    errors: requests of this step that must end with an error (their rows' tokens, if
    any, mean nothing). failed: the step as a whole failed (an error no request could be
    blamed for); the worker then dropped every request it held and the pool's contents
    are not to be trusted: every request the scheduler had sent it must end."""

    step: int
    rids: list[str]
    token_ids: list[int]
    errors: list[RequestError] = []
    failed: str | None = None
    # The worker's whole-step failures so far (with `failed`): ForwardBatch.epoch.
    epoch: int = 0
    # Log-probabilities, only for the rows (indices into rids) whose request asked, flat:
    # row logprob_rows[j] has top_counts[j] entries of top_ids / top_logprobs, in order.
    logprob_rows: list[int] = []
    logprobs: list[float] = []
    top_counts: list[int] = []
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    prompt_logprobs: list[PromptLogprobs] = []

    def token_logprobs(self) -> dict[int, TokenLogprob]:
        """The flat lists regrouped: row index -> its TokenLogprob."""
        out: dict[int, TokenLogprob] = {}
        start = 0
        for row, lp, k in zip(self.logprob_rows, self.logprobs, self.top_counts):
            out[row] = TokenLogprob(logprob=lp, top_ids=self.top_ids[start:start + k],
                                    top_logprobs=self.top_logprobs[start:start + k])
            start += k
        return out


SchedulerMessage = (TokenizedRequest | AbortRequest | GetStats | FlushCache | WorkerReady
                    | StepResult)
