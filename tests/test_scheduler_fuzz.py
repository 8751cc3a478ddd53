"""The scheduler under random schedules (tests/scheduler_fuzz.py): the real Scheduler and
SchedulerLoop against a fake worker that checks every slot, window slot and state
snapshot it reads, in every cache mode, with aborts, reused request ids, preemption,
worker refusals, whole-step failures, steps in flight and prefills spread over steps.
Then two scenarios for bugs the fuzzing found, run over many interleavings, so that they
stay covered whatever the random draw becomes.

A failure names the seed and mode and the command that replays it.
"""

from __future__ import annotations

import logging
from typing import Callable

import pytest

from scheduler_proc.scheduler import SchedulerLimits
from tests.scheduler_fuzz import (FIRST_TOKEN, VOCAB, Coverage, Mode, RequestPlan, Schedule,
                                  draw_schedule, replay_hint, run_schedule)

SEEDS = 200  # per mode: about 1 s each on one core (windows 2 s)
SCENARIO_SEEDS = 40  # interleavings of each scenario (about a third meet its hazard)


@pytest.fixture(autouse=True)
def _quiet_scheduler(caplog: pytest.LogCaptureFixture) -> None:
    # Refusals, failed steps and preemptions log a warning each: thousands per test.
    caplog.set_level(logging.ERROR, logger="scheduler_proc")


def _run_all(schedules: list[Schedule], replay: Callable[[Schedule], str]) -> Coverage:
    """Run every schedule; fail once, naming each broken one and how to replay it."""
    coverage, failures = Coverage(), []
    for schedule in schedules:
        try:
            coverage.add(run_schedule(schedule))
        except Exception as exc:  # noqa: BLE001 - the scheduler's own errors count too
            failures.append(f"{schedule.mode.value} seed {schedule.seed}: "
                            f"{type(exc).__name__}: {exc}\n    replay: {replay(schedule)}")
    assert not failures, (f"{len(failures)} of {len(schedules)} schedules broke a check:\n"
                          + "\n".join(failures[:5]))
    return coverage


@pytest.mark.parametrize("mode", list(Mode), ids=lambda mode: mode.value)
def test_random_schedules_keep_every_check(mode: Mode) -> None:
    schedules = [draw_schedule(seed, mode) for seed in range(SEEDS)]
    coverage = _run_all(schedules, lambda s: replay_hint(s.seed, s.mode))
    # The draw still reaches what the checks are there for.
    assert coverage.preemptions and coverage.aborts and coverage.step_failures, coverage
    assert coverage.reused_in_flight, coverage
    assert (coverage.cache_hit_tokens > 0) == (mode is not Mode.NO_CACHE), coverage
    assert (coverage.spread_parts > 0) == (mode is not Mode.SNAPSHOTS), coverage  # no
    # spread with recurrent layers (the worker refuses: their state mid-forward)


def _prompt(first: int, n: int) -> list[int]:
    """n tokens; prompts of different `first` (below 35) share no head."""
    return [FIRST_TOKEN + (first + 3 * i) % (VOCAB - FIRST_TOKEN) for i in range(n)]


def window_shortage(seed: int) -> Schedule:
    """A one-token prompt decodes beside a 90-token prompt's prefill in a window space
    that holds both only until the decoder's window fills (its admission reserved what
    half its max_tokens need). Nothing is finishing then, so no result gives window slots
    back: decoding once waited for them for as long as the long prompt prefilled (the
    no-stall check; fixed by Scheduler._finishing_frees). The full pool holds everything:
    each preemption here is for window slots."""
    return Schedule(
        seed=seed, mode=Mode.WINDOWS,
        requests=[RequestPlan([7], 20, refused=False),
                  RequestPlan(_prompt(0, 90), 80, refused=False),
                  RequestPlan(_prompt(3, 90), 1, refused=False)],
        limits=SchedulerLimits(capacity=1000, max_context=1024, max_running=2, chunk_size=8,
                               max_prefill_tokens=16, max_prefill_tokens_while_decoding=8,
                               chunk_align=8, windows=(("sliding", 12), ("chunked", 8)),
                               window_slots=30),
        max_in_flight=1, step_failure_rate=0.0, reuse_rate=0.0)


def reused_ids(seed: int) -> Schedule:
    """A client that sends each request under an id it saw end or just aborted, with up to
    three steps in flight: a step planned for the old request must not give the new one
    its token or its error (it did, before the admission serial of commit 6de9ddb; the
    prefix cache then keyed K/V by a token the worker never fed)."""
    return Schedule(
        seed=seed, mode=Mode.PLAIN,
        requests=[RequestPlan(_prompt(i % 7, 10 + 5 * i), 40, refused=(i == 4)) for i in range(10)],
        limits=SchedulerLimits(capacity=2000, max_context=1024, max_running=16, chunk_size=16,
                               max_prefill_tokens=64),
        max_in_flight=3, step_failure_rate=0.0, reuse_rate=1.0)


def _scenario_replay(name: str) -> Callable[[Schedule], str]:
    return lambda s: (f"python -c 'from tests.test_scheduler_fuzz import {name}; from "
                      f"tests.scheduler_fuzz import run_schedule; run_schedule({name}({s.seed}))'")


def test_decoding_never_waits_for_window_slots_nothing_gives_back() -> None:
    coverage = _run_all([window_shortage(seed) for seed in range(SCENARIO_SEEDS)],
                        _scenario_replay("window_shortage"))
    assert coverage.preemptions, "the scenario no longer meets a window-slot shortage"


def test_a_reused_request_id_never_takes_the_old_requests_results() -> None:
    coverage = _run_all([reused_ids(seed) for seed in range(SCENARIO_SEEDS)],
                        _scenario_replay("reused_ids"))
    assert coverage.reused_in_flight, "no id was reused while a step for its old request was out"
