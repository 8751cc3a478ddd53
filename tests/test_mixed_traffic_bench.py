"""bench/mixed_traffic.py's report on a made-up timeline: which gaps count as before and
during the burst, and the ratio the issue's target reads off."""

from __future__ import annotations

from bench.mixed_traffic import Timeline, summarize
from bench.serving import RequestRecord


def _stream(times: list[float], sent_at: float = 0.0) -> RequestRecord:
    return RequestRecord(ttft=times[0] - sent_at, output_tokens=len(times), sent_at=sent_at,
                         chunk_at=times)


def test_gaps_are_split_at_the_burst_and_its_last_first_token():
    # Steady: a token every 10 ms until the burst is sent at 1.0 s, every 30 ms while the
    # burst's prompts are computed (its last first token at 1.3 s), every 10 ms after.
    ticks = ([i * 0.01 for i in range(1, 101)] + [1.0 + i * 0.03 for i in range(1, 11)]
             + [1.3 + i * 0.01 for i in range(1, 21)])
    steady = [_stream(ticks), _stream(ticks)]
    burst = [_stream([1.2, 1.31], sent_at=1.0), _stream([1.3, 1.32], sent_at=1.0)]
    r = summarize(Timeline(steady, burst, started=0.0, burst_sent=1.0, ended=1.5,
                           burst_prompt_tokens=600))
    assert r["itl_before_ms"]["p99"] == 10.0 and r["itl_during_ms"]["p50"] == 30.0
    assert r["gaps_during"] == 20 and r["p99_ratio"] == 3.0
    assert r["burst_ttft_ms"]["p50"] == 250.0 and r["burst_prefill_s"] == 0.3
    assert r["burst_prefill_tok_s"] == 2000  # 600 prompt tokens in 0.3 s
    assert r["steady_ended_during_burst"] == 0 and r["failed"] == 0
    assert r["output_tokens"] == 2 * 130 + 4 and r["output_tok_s"] == round(264 / 1.5, 2)


def test_burst_prompts_vary_by_the_spread(tiny_model_dir):
    from bench.mixed_traffic import prompt_ids

    fixed = prompt_ids(tiny_model_dir, 8, 100, seed=3)
    assert {len(p) for p in fixed} == {100}
    varied = prompt_ids(tiny_model_dir, 40, 100, seed=3, spread=0.5)
    assert all(50 <= len(p) <= 150 for p in varied) and len({len(p) for p in varied}) > 10


def test_every_budget_runs_under_every_variant_with_its_own_log():
    from bench.mixed_traffic import arms_of

    plain = arms_of("default,256,off", "")
    assert [(a.label, a.flags, a.log_name) for a in plain] == [
        ("default", [], "mixed_default.log"),
        ("256", ["--max-prefill-tokens-while-decoding", "256"], "mixed_256.log"),
        ("off", ["--max-prefill-tokens-while-decoding", "8192", "--prefill-spread", "1"],
         "mixed_off.log")]
    ab = arms_of("default", "; --experiments mixed-forward ;--compile-prefill")
    assert [(a.label, a.flags, a.log_name) for a in ab] == [
        ("default", [], "mixed_default.log"),
        ("default --experiments mixed-forward", ["--experiments", "mixed-forward"],
         "mixed_default_v1.log"),
        ("default --compile-prefill", ["--compile-prefill"], "mixed_default_v2.log")]
    assert [a.env for a in ab] == [{}, {}, {}]
    tuned = arms_of("256", "A=a MLX_MAX_OPS_PER_BUFFER=1000 A=b --compile-prefill --api-key K=v")
    assert tuned[0].env == {"MLX_MAX_OPS_PER_BUFFER": "1000", "A": "b"}  # the last A, as a shell
    assert tuned[0].flags == ["--max-prefill-tokens-while-decoding", "256",
                              "--compile-prefill", "--api-key", "K=v"]  # a flag's value


def test_the_fronts_gaps_are_read_off_two_reads_of_its_histogram():
    """The server's inter-token histogram read at the burst's sending and at its
    prefill's end: only what it counted between them, linear within a bucket."""
    from bench.mixed_traffic import histogram_percentiles

    inf = float("inf")
    before = {0.01: 50.0, 0.02: 100.0, 0.05: 100.0, inf: 100.0}
    # Between the reads: 100 gaps under 10 ms, 80 in (10, 20], 20 in (20, 50].
    after = {0.01: 150.0, 0.02: 280.0, 0.05: 300.0, inf: 300.0}
    got = histogram_percentiles(before, after)
    assert got == {"p50": 10.0, "p90": 20.0, "p99": 20.0 + 30.0 * 0.9}
    assert histogram_percentiles(after, after) == {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    # Past the last finite edge: that edge.
    assert histogram_percentiles({}, {0.01: 0.0, inf: 4.0})["p99"] == 10.0
