"""bench/step_breakdown.py's steps of long prompts beside decode rows, whole or spread as a
served decode-first step spreads them (the timeline's --spread)."""

from __future__ import annotations

import mlx_lm

from bench.family_models import FAMILY_SHAPES, make_family_model
from bench.step_breakdown import _Prompts, kiln_step_ms, served_model


def test_a_spread_piece_runs_over_its_steps_and_prompts_follow_each_other():
    prompts = _Prompts(chunk=4, length=24, first_slot=100, spread=3)
    plans = [prompts.step_plan(step, ["d"], [7]) for step in range(1, 8)]
    assert [(p.parts, p.parts_from, p.parts_to) for p in plans] == [
        (3, 0, 1), (3, 1, 2), (3, 2, 3), (3, 0, 1), (3, 1, 2), (3, 2, 3), (3, 0, 1)]
    # A piece is spread * chunk tokens; the later parts carry none; the piece ending the
    # prompt samples, and the next prompt starts in the other slot range.
    first, second, third = plans[0].prefill[0], plans[3].prefill[0], plans[6].prefill[0]
    assert all(not p.prefill for i, p in enumerate(plans) if i % 3)
    assert (first.rid, first.start, len(first.token_ids), first.sample) == ("prompt0", 0, 12, False)
    assert (second.start, second.sample, second.slot_ids[-1]) == (12, True, 123)
    assert (third.rid, third.start, third.slot_ids[0]) == ("prompt1", 0, 124)
    assert plans[6].released == ["prompt0"] and all(p.decode_rids == ["d"] for p in plans)


def test_spread_steps_run_on_the_runner(tmp_path):
    """The runner refuses (RuntimeError) a part out of order, a later part with chunks or
    a piece started before the last one ended: the plans keep its protocol over two
    prompts' pieces (48 tokens in pieces of 16 over two steps each: nine steps run the
    first prompt's three, the second's first and the first part of its second)."""
    model_dir = make_family_model(FAMILY_SHAPES["gemma3-tiny"], "float32", tmp_path / "gemma")
    model = served_model(mlx_lm.load(str(model_dir))[0])
    timings = kiln_step_ms(model, 2, 16, 9, pipelined=True, chunk=8, prompt=48, spread=2)
    assert len(timings.step) == 9
