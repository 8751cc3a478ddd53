"""bench/step_log.py on log lines as the scheduler and worker write them at debug level."""

from __future__ import annotations

import re

from bench.step_log import read_log, read_steps, summary, table

LOG = """\
18:10:31   scheduler DEBUG   scheduler_proc: step 7: 1 prefill chunks (512 tokens, 512@1024), 32 decodes
18:10:31      worker DEBUG   worker_proc: step 7 built in 4.63 ms (and 6.37 ms starting prefill forwards, 8.98 ms waiting for them); its chunk rode in the decode forward
18:10:31   scheduler DEBUG   scheduler_proc: step 8: 2 prefill chunks (512 tokens, 1@4096, 511@0), 31 decodes
18:10:31   scheduler DEBUG   scheduler_proc: step 7: 32 tokens back after 47.6 ms
18:10:31      worker DEBUG   worker_proc: step 8 built in 26.12 ms (and 112.06 ms starting prefill forwards, 0.17 ms waiting for them)
18:10:31   scheduler DEBUG   scheduler_proc: step 9: 1 prefill chunks (511 tokens, 511@511), 32 decodes
18:10:31      worker DEBUG   worker_proc: step 9 built in 9.00 ms (and 12.00 ms starting prefill forwards, 1.00 ms waiting for them)
18:10:31   scheduler DEBUG   scheduler_proc: step 10: 0 prefill chunks (0 tokens), 33 decodes
18:10:31      worker INFO    worker_proc: 27.0 steps/s, 1078.5 decode tok/s
"""


def test_steps_are_joined_and_the_slow_ones_named():
    steps = read_steps(LOG.splitlines())
    assert [s.step for s in steps] == [7, 8, 9, 10]
    s7, s8 = steps[0], steps[1]
    assert s7.chunks == [(512, 1024)] and s7.decodes == 32 and s7.back_ms == 47.6
    assert s8.chunks == [(1, 4096), (511, 0)] and s8.host_ms == 26.12 + 112.06
    text = summary(steps, slow_ms=30, align=512)
    assert ("3 with prefill: 1 with several chunks, 1 with a chunk starting off the 512 edges, "
            "1 mixed forwards") in text
    assert s7.mixed and not s8.mixed
    assert "1 with build + prefill start >= 30 ms" in text and "step 8: 2 chunks [1@4096 511@0]" in text
    # Step 8's 26 ms build followed step 7's 32 decode rows with 31.
    assert "1 prefill steps built in >= 20 ms, 1 of them where the decode batch changed size" in text
    assert table(steps).splitlines()[2] == "8 2 512 31 26.12 112.06 0.17 None None 1@4096 511@0"


def test_a_chunks_cost_is_set_against_decode_rows_alone():
    """The chunk sizes' medians beside busy decode rows (a mixed forward's apart), and
    the rows' alone; steps of several chunks, or of few decode rows, are left out."""
    few_rows = LOG + ("18:10:32   scheduler DEBUG   scheduler_proc: step 11: 1 prefill chunks "
                      "(300 tokens, 300@0), 3 decodes\n"
                      "18:10:32      worker DEBUG   worker_proc: step 11 built in 5.00 ms (and "
                      "5.00 ms starting prefill forwards, 0.10 ms waiting for them)\n")
    steps = read_steps(few_rows.splitlines())
    steps[3].build_ms, steps[3].back_ms = 2.0, 18.0  # step 10: no chunk, 33 rows
    text = summary(steps, slow_ms=30, align=512)
    assert "no chunk (1 steps) build 2.0, tokens back 18.0" in text
    assert ("one 512-token chunk, mixed forward (1 steps): build 4.6, prefill start 6.4, "
            "tokens back 47.6") in text
    assert "one 511-token chunk (1 steps): build 9.0, prefill start 12.0, tokens back -" in text
    lines = [line for line in text.splitlines() if line.startswith("  one ")]
    assert len(lines) == 2  # not step 8's two chunks (512 tokens), nor step 11's 3 rows


SPREAD_LOG = """\
09:00:01   scheduler DEBUG   scheduler_proc: step 20: 1 prefill chunks (1024 tokens, 1024@0), 32 decodes, prefill parts 0-1 of 2
09:00:01      worker DEBUG   worker_proc: step 20 built in 6.00 ms (and 2.00 ms starting prefill forwards, 0.00 ms waiting for them)
09:00:01   scheduler DEBUG   scheduler_proc: step 21: 0 prefill chunks (0 tokens), 32 decodes, prefill parts 1-2 of 2
09:00:01      worker DEBUG   worker_proc: step 21 built in 5.00 ms (and 1.00 ms starting prefill forwards, 0.00 ms waiting for them)
09:00:01   scheduler DEBUG   scheduler_proc: step 20: 32 tokens back after 44.0 ms
09:00:01   scheduler DEBUG   scheduler_proc: step 22: 1 prefill chunks (1024 tokens, 1024@1024), 32 decodes, prefill parts 0-1 of 2
09:00:01      worker DEBUG   worker_proc: step 22 built in 7.00 ms (and 3.00 ms starting prefill forwards, 0.00 ms waiting for them)
09:00:01   scheduler DEBUG   scheduler_proc: step 23: 1 prefill chunks (700 tokens, 700@2048), 32 decodes, prefill parts 0-1 of 2
09:00:01      worker DEBUG   worker_proc: step 23 built in 8.00 ms (and 20.00 ms starting prefill forwards, 0.00 ms waiting for them)
09:00:01   scheduler DEBUG   scheduler_proc: step 24: 0 prefill chunks (0 tokens), 32 decodes
09:00:01      worker DEBUG   worker_proc: step 24 built in 2.00 ms (and 0.00 ms starting prefill forwards, 0.00 ms waiting for them)
"""


def test_a_spreads_steps_are_told_by_part_and_first_parts_by_piece_size():
    """Steps of a spread prefill (--prefill-spread) are grouped by the part they ran; the
    first parts by their piece's size (whole pieces, the commonest, against the others);
    a later part is no decode-only step though it carries no chunk."""
    steps = read_steps(SPREAD_LOG.splitlines())
    assert [(s.step, s.part, s.parts) for s in steps] == [
        (20, 0, 2), (21, 1, 2), (22, 0, 2), (23, 0, 2), (24, None, 1)]
    text = summary(steps, slow_ms=30, align=1024)
    assert "spread over 2 steps, beside 16+ decode rows, ms median / p90:" in text
    assert "part 0, 1024-token pieces (2 steps): host 9.0 / 10.0, tokens back 44.0 / 44.0" in text
    assert "part 0, other sizes (1 steps): host 28.0 / 28.0" in text
    assert "part 1 (1 steps): host 6.0 / 6.0" in text
    assert "no chunk (1 steps) build 2.0" in text  # step 24 alone, not step 21


def test_a_start_after_which_mlxs_cache_fell_is_counted_by_part():
    """The worker's build lines carry MLX's buffer cache once the step started: a first
    part after whose start the cache fell (MLX emptied it for an allocation) is counted
    in its group's line, and named among the slow steps."""
    with_cache = "\n".join(
        line + (f"; MLX cache {cache} GiB" if "built in" in line else "")
        for line, cache in zip(SPREAD_LOG.splitlines(), [0, 5.0, 0, 5.0, 0, 0, 5.1, 0, 2.0, 0, 4.0]))
    steps = read_steps(with_cache.splitlines())
    assert [s.cache_gib for s in steps] == [5.0, 5.0, 5.1, 2.0, 4.0]
    text = summary(steps, slow_ms=25, align=1024)
    assert "part 0, 1024-token pieces (2 steps): host 9.0 / 10.0, tokens back 44.0 / 44.0, " \
           "MLX cache fell in 0" in text
    assert "part 0, other sizes (1 steps): host 28.0 / 28.0, MLX cache fell in 1" in text
    assert "step 23: 1 chunks [700@2048]" in text and "MLX cache 2.0 GiB" in text
    assert table(steps).splitlines()[4].split()[8] == "2.0"


def _stamped(steps: list[tuple[int, int, int]], at: float) -> list[str]:
    """Debug lines of steps (prefill tokens, decode rows, ms since the step before), the
    first at `at` seconds of the day."""
    lines = []
    for step, (chunk, rows, gap) in enumerate(steps):
        at = (at + gap / 1000) % 86400
        ms = round(at * 1000)
        stamp = f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"
        chunks = (f"1 prefill chunks ({chunk} tokens, {chunk}@0)" if chunk
                  else "0 prefill chunks (0 tokens)")
        lines += [f"{stamp}   scheduler DEBUG   scheduler_proc: step {step}: {chunks}, "
                  f"{rows} decodes",
                  f"{stamp}      worker DEBUG   worker_proc: step {step} launched in "
                  f"{gap / 10:.2f} ms (0.50 ms before the last step's report)",
                  f"{stamp}      worker DEBUG   worker_proc: step {step}: waited 3.00 ms for "
                  "its tokens",
                  f"{stamp}   scheduler DEBUG   scheduler_proc: step {step}: {rows} tokens "
                  "back after 30.0 ms"]
    return lines


def test_gaps_between_steps_tokens_are_read_from_the_lines_stamps():
    """With millisecond stamps (since session 56), the gaps between consecutive steps'
    tokens at the worker and at the scheduler are told apart before the first step with
    prefill beside busy rows and from it to the last; a step of few rows breaks the
    chain, and a gap across midnight counts as its milliseconds."""
    lines = _stamped([(0, 32, 0), (0, 32, 12), (0, 32, 14), (512, 32, 20), (512, 32, 24),
                      (512, 32, 20), (0, 4, 5), (0, 32, 30)], at=86399.980)  # 23:59:59.980
    steps = read_steps(lines)
    assert steps[1].worker_at == 86399.992 and steps[2].scheduler_at == 0.006
    text = summary(steps, slow_ms=30, align=512)
    # Before: steps 0-1-2 (12 ms, 14 across midnight); during: steps 3-4-5 (24, 20 ms).
    for where in ("worker", "scheduler"):
        assert f"at the {where}, before prefill: 14 / 14 / 14 (2)" in text
        assert f"at the {where}, during prefill: 24 / 24 / 24 (2)" in text


def test_the_gaps_window_is_the_longest_run_of_prefill_steps():
    """A bench's warm-up sends a short burst first: the window is the longest run of
    steps with prefill (runs split by 64 steps without), and "before" the busy steps
    between the run before it and it."""
    warm = [(0, 32, 10), (512, 32, 50), (512, 32, 50)]
    quiet = [(0, 32, 10)] * 70
    burst = [(512, 32, 25), (512, 32, 25), (512, 32, 40), (512, 32, 25), (512, 32, 25)]
    text = summary(read_steps(_stamped(warm + quiet + burst, at=3600.0)), slow_ms=30, align=512)
    # Before: steps 3-72's 69 gaps of 10 ms; during: steps 73-77, gaps 25, 40, 25, 25.
    assert "at the worker, before prefill: 10 / 10 / 10 (69)" in text
    assert "at the worker, during prefill: 25 / 40 / 40 (4)" in text
    # The slowest first, with the host work in it (each step "launched" in a tenth of
    # its gap here).
    slowest = [line for line in text.splitlines() if " ms to step " in line]
    assert slowest[0] == ("  40 ms to step 75's tokens (32 rows, part None, launched in 4.0 ms); "
                          "step 76 built in None, prefill start None, launched in 2.5 ms")
    assert len(slowest) == 3


def test_host_work_is_split_by_cpu_time_and_collections_are_placed():
    """Since session 57 the launch line carries the step's host work in wall and CPU
    time, and the worker logs its slow garbage collections and staging buffers' growths:
    the window's host work is summed up, its slowest steps' CPU share set against the
    others', and a stall that ended inside a slow gap named on that gap's line."""
    lines = _stamped([(0, 32, 10)] * 3 + [(512, 32, 20)] * 40 + [(512, 32, 45)]
                     + [(512, 32, 20)] * 2, at=7200.0)
    out = []
    for line in lines:
        if " launched in " in line:
            step = int(re.search(r"step (\d+) launched", line)[1])
            slow = step == 44  # the step after the slow gap: its host work is the gap's
            wall, cpu = (40.0, 12.0) if slow else (15.0, 14.0)
            line += f"; built and launched in {wall:.2f} ms, {cpu:.2f} ms of it on the CPU"
        out.append(line)
        if "step 43: waited" in line:  # a collection ending inside the gap to step 43
            out[-1:-1] = [line[:13] + "      worker DEBUG   ipc.process: garbage collection "
                          "of generation 2 took 6.50 ms (10 objects freed)",
                          line[:13] + "      worker DEBUG   worker_proc.staging: a staging "
                          "buffer grew to 131072 words in 14.20 ms"]
    steps, stalls = read_log(out)
    assert steps[44].host_wall_ms == 40.0 and steps[44].host_cpu_ms == 12.0
    assert [(x.kind, x.ms) for x in stalls] == [("garbage collection", 6.5),
                                                ("staging growth", 14.2)]
    text = summary(steps, slow_ms=30, align=512, stalls=stalls)
    assert "45 ms to step 43's tokens" in text
    gap = next(line for line in text.splitlines() if "45 ms to step 43's tokens" in line)
    assert gap.endswith("12.0 of its 40.0 ms on the CPU; garbage collection 6.5 ms, staging "
                        "growth 14.2 ms"), gap
    host = next(line for line in text.splitlines() if line.startswith("host work a step"))
    assert host.startswith("host work a step (build, prefill start, launch), ms p50 / p90 / "
                           "p99: 15.0 / 15.0 / 40.0 (43)"), host
    assert host.endswith("on the CPU 93% of it, 30% in the slowest 1 (>= 40.0 ms)"), host
    assert "steps with 3+ ms of it off the CPU: 1 (no part: 1), steps 44 to 44" in text
    assert ("the worker's logged garbage collections in that span: 1, 6.5 ms in all, the "
            "longest 6.5 ms") in text
    assert "the worker's logged staging growths in that span: 1, 14.2 ms in all" in text


def test_slow_gaps_are_split_by_the_device_wait_that_ended_them():
    """A gap of 33+ ms ended by a long wait for the tokens is the device's; a short wait,
    the host's. For the device's, how often MLX's cache fell at the step after is set
    against every step's rate (session 57's lead on device-side spikes)."""
    lines = _stamped([(0, 32, 10)] * 2 + [(512, 32, 20)] * 10 + [(512, 32, 40)]
                     + [(512, 32, 20)] * 3 + [(512, 32, 40)] + [(512, 32, 20)] * 3, at=7200.0)
    out = []
    cache = 4.0
    for line in lines:
        if m := re.search(r"worker_proc: step (\d+): waited", line):
            step = int(m[1])
            if step == 12:  # the device's: its wait was long
                line = line.replace("waited 3.00 ms", "waited 20.00 ms")
            # MLX's cache, read at each step's build: it falls after step 12 alone.
            cache = cache - 1.0 if step == 13 else cache + 0.001
            out.append(line[:13] + f"      worker DEBUG   worker_proc: step {step} built in "
                       f"5.00 ms (and 1.00 ms starting prefill forwards, 0.00 ms waiting for "
                       f"them); MLX cache {cache:.3f} GiB")
        out.append(line)
    text = summary(read_steps(out), slow_ms=30, align=512)
    assert ("gaps of 33+ ms: 1 ended by a wait of 12+ ms for the device, 1 by less; MLX's "
            "cache fell at the step after 100% of the device's (every step: 6%)") in text, text


def test_a_launch_threads_lines_give_each_step_its_launch_and_host_work():
    """Since session 60 a worker that hands decode steps to its launch thread logs the
    hand-over on its own line and the launch on the thread's (worker_proc.launcher)."""
    lines = ["12:00:00.010      worker DEBUG   worker_proc: step 7 handed to the launch thread; "
             "built and handed over in 2.40 ms, 2.10 ms of it on the CPU",
             "12:00:00.013      worker DEBUG   worker_proc.launcher: step 7 launched in 3.60 ms"]
    steps, _ = read_log(lines)
    assert (steps[0].step, steps[0].launch_ms) == (7, 3.6)
    assert (steps[0].host_wall_ms, steps[0].host_cpu_ms) == (2.4, 2.1)
