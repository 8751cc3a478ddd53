"""The step plan the scheduler sends to the worker.

NOTE: per-step traffic is O(batch): the worker keeps each request's slot list and last
token itself, so a decode entry carries only the one new slot id.
"""

from __future__ import annotations

import msgspec

from ipc.messages.common import Message, SamplingParams


class NewRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Sent once per admission, in the first step that touches the request.

    prefix_slot_ids: slots of a cached prefix whose K/V the request reads instead of
    computing (its first chunk starts after them). num_sampled: tokens sampled before a
    preemption, so a seeded request resumes its random stream where it stopped.
    stop_token_ids: what min_tokens masks (sent only with min_tokens). prompt_ids and
    output_ids (sent only with penalties) let the worker (re)build the request's token
    counts, also after a preemption; output_ids are also sent with a grammar, whose
    matcher must have consumed them before it masks the next token.
    """

    rid: str
    sampling: SamplingParams
    prefix_slot_ids: list[int] = []
    # Windowed layers in their own slot space: the window slot of each prefix position
    # (0 where it has none: behind every window of the first chunk's queries).
    prefix_window_slot_ids: list[int] = []
    # Recurrent layers: the snapshot of their state at the cached prefix's end, which the
    # request's first chunk starts from (0: none; the prefix is then empty).
    state_snapshot: int = 0
    num_sampled: int = 0
    stop_token_ids: list[int] = []
    prompt_ids: list[int] = []
    output_ids: list[int] = []


class PrefillChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Compute `token_ids` at positions start.. and store their K/V in `slot_ids`.

    `sample` is set on the chunk that ends the prompt: its last position yields the
    request's next token.
    """

    rid: str
    start: int
    token_ids: list[int]
    slot_ids: list[int]
    sample: bool
    window_slot_ids: list[int] = []  # windowed layers' slots, where they have their own
    # Recurrent layers: keep the state after this chunk as this snapshot (0: none), the
    # one a later request hitting this prompt's end starts from.
    snapshot_id: int = 0


class ForwardBatch(Message, frozen=True):
    step: int
    new_requests: list[NewRequest] = []
    prefill: list[PrefillChunk] = []
    # Decode: each request feeds its last sampled token, whose K/V goes to the given slot.
    decode_rids: list[str] = []
    decode_slots: list[int] = []
    decode_window_slots: list[int] = []  # windowed layers' slots, where they have their own
    # Requests the worker can forget (finished, aborted); sent before any reuse of their rid.
    released: list[str] = []
    # Per released request (empty: none), the snapshot id to keep its recurrent state in
    # before its row goes (0: none): a finished or preempted hybrid request's whole
    # sequence so far is cached, so a chat's next turn hits its answer too.
    released_snapshots: list[int] = []
    # The step's prefill spread over `parts` steps (SchedulerLimits.prefill_parts), each
    # running a share of the model's blocks: this step runs parts [parts_from, parts_to)
    # of the forwards of the chunks that the step with parts_from 0 carried (later steps
    # carry none); the step that runs the last part samples the chunks that end prompts.
    parts: int = 1
    parts_from: int = 0
    parts_to: int = 1
    # The worker's whole-step failures the scheduler had learnt of (StepResult.epoch) when
    # it planned this step. One planned before it learnt of the latest is not run: the
    # scheduler ends every request it names, and its prefix hits may read what a failed
    # step never wrote.
    epoch: int = 0

    @property
    def continues_prefill(self) -> bool:
        """Whether the step runs later parts of an earlier step's spread prefill."""
        return self.parts_from > 0

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode_rids or self.continues_prefill)


class SyncSteps(Message, frozen=True):
    """Finish and report every launched step: the scheduler has no next step to send."""


class Shutdown(Message, frozen=True):
    reason: str = ""


WorkerMessage = ForwardBatch | SyncSteps | Shutdown
