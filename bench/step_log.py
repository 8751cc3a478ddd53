"""A served run's steps, read back from a kiln log at `--log-level debug`.

    python bench/step_log.py bench/results/mixed_default.log --slow-ms 30 --table steps.txt

Joins, per step, the scheduler's plan line (each prefill chunk as tokens@start, decode
rows), the worker's build line (graph building, starting the prefill forwards, waiting for
earlier ones) and the scheduler's "tokens back" line (plan sent to tokens back, with the
steps in flight). Prints how many steps held several chunks or chunks starting off the
`--align` edges, how many prefill steps' building alone took `--slow-build-ms` and how
many of those followed a change in the decode batch's size, a spread prefill's host cost
by the part each step ran (its first parts by piece size), and every step whose build
plus prefill start took `--slow-ms` or more: where mixed traffic's slow steps come from
(docs/benchmarks.md, sessions 19, 22 and 53). Where the worker's lines carry MLX's buffer
cache (since session 54), each part's line counts the steps after whose start it fell.
Where the lines carry milliseconds (since session 56), it also gives the gaps between
consecutive steps' tokens at the worker and at the scheduler, before and during prefill:
set against a client's inter-token gaps, they split its p99 into the steps' share and
the way out's (detokenizer, HTTP front, client). Where the launch line carries the host
work's CPU time and the worker logs its stalls (since session 57), it sums up the host
work a step in wall and CPU time, counts the steps that spent part of it off the CPU
(blocked or descheduled), and places garbage collections and staging buffers' growths.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_PLAN = re.compile(r"scheduler_proc: step (\d+): (\d+) prefill chunks "
                   r"\((\d+) tokens((?:, \d+@\d+)*)\), (\d+) decodes"
                   r"(?:, prefill parts (\d+)-\d+ of (\d+))?")
_BUILD = re.compile(r"worker_proc: step (\d+) built in ([\d.]+) ms \(and ([\d.]+) ms starting "
                    r"prefill forwards, ([\d.]+) ms waiting")
_BACK = re.compile(r"scheduler_proc: step (\d+): \d+ tokens back after ([\d.]+) ms")
_CACHE = re.compile(r"; MLX cache ([\d.]+) GiB")  # the build line's, after the step started
# Since session 56; since session 60 a launch thread's line (worker_proc.launcher) where
# the worker hands decode steps to one, and the worker's own line says "handed".
_LAUNCHED = re.compile(r"worker_proc(?:\.launcher)?: step (\d+) launched in ([\d.]+) ms")
_HANDED = re.compile(r"worker_proc: step (\d+) handed to the launch thread; built and "
                     r"handed over in ([\d.]+) ms, ([\d.]+) ms of it on the CPU")
_WAITED = re.compile(r"worker_proc: step (\d+): waited ([\d.]+) ms for its tokens")
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) ")  # since session 56's logs
# Since session 57: the launch line's host span and the thread's CPU time in it.
_HOST_CPU = re.compile(r"built and launched in ([\d.]+) ms, ([\d.]+) ms of it on the CPU")
# Since session 57: host stalls the worker logs, by kind.
_STALLS = {
    "garbage collection": re.compile(r"worker DEBUG +ipc\.process: garbage collection of "
                                     r"generation \d took ([\d.]+) ms"),
    "staging growth": re.compile(r"worker DEBUG +worker_proc\.staging: a staging buffer grew "
                                 r"to \d+ words in ([\d.]+) ms"),
}


@dataclass(frozen=True)
class Stall:
    """A pause of the worker's host work that it logged: when it ended (seconds of the
    day), how long it took, what it was (a _STALLS kind)."""

    at: float
    ms: float
    kind: str


@dataclass
class Step:
    step: int
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (tokens, start)
    n_chunks: int = 0
    tokens: int = 0
    decodes: int = 0
    build_ms: float | None = None
    start_ms: float | None = None
    wait_ms: float | None = None
    back_ms: float | None = None
    mixed: bool = False  # its chunk rode in the decode forward (--experiments mixed-forward)
    part: int | None = None  # the spread part it ran (--prefill-spread), of `parts`
    parts: int = 1
    cache_gib: float | None = None  # MLX's buffer cache once the step was started
    # When the step's tokens reached the worker (its wait ended) and the scheduler, in
    # seconds of the day: the gaps between steps are a stream's inter-token gaps there.
    worker_at: float | None = None
    launch_ms: float | None = None  # its decode forward's launch (start ahead: both halves)
    # Its build, prefill start and launch, less the wait for the step before, in wall
    # time and in the worker thread's CPU time: a host that computed longer against one
    # kept off its core or blocked in a call.
    host_wall_ms: float | None = None
    host_cpu_ms: float | None = None
    tokens_wait_ms: float | None = None  # the worker's wait for its tokens (the device's)
    scheduler_at: float | None = None

    @property
    def host_ms(self) -> float:
        return (self.build_ms or 0.0) + (self.start_ms or 0.0)

    def describe(self) -> str:
        chunks = " ".join(f"{n}@{s}" for n, s in self.chunks) or f"{self.tokens} tokens"
        return (f"step {self.step}: {self.n_chunks} chunks [{chunks}], {self.decodes} decodes; "
                f"build {self.build_ms} start {self.start_ms} wait {self.wait_ms} ms, "
                f"tokens back after {self.back_ms} ms"
                + (f", MLX cache {self.cache_gib} GiB" if self.cache_gib is not None else ""))


def read_steps(lines: list[str]) -> list[Step]:
    """Every step a plan line names, with what the other lines add, in step order."""
    return read_log(lines)[0]


def read_log(lines: list[str]) -> tuple[list[Step], list[Stall]]:
    """read_steps's steps, and the worker's logged stalls."""
    steps: dict[int, Step] = {}
    stalls: list[Stall] = []

    def at(n: str) -> Step:
        return steps.setdefault(int(n), Step(int(n)))

    for line in lines:
        if m := _PLAN.search(line):
            s = at(m[1])
            s.n_chunks, s.tokens, s.decodes = int(m[2]), int(m[3]), int(m[5])
            s.chunks = [(int(n), int(start)) for n, start in re.findall(r"(\d+)@(\d+)", m[4])]
            if m[6] is not None:
                s.part, s.parts = int(m[6]), int(m[7])
        elif m := _BUILD.search(line):
            s = at(m[1])
            s.build_ms, s.start_ms, s.wait_ms = float(m[2]), float(m[3]), float(m[4])
            s.mixed = "rode in the decode forward" in line
            if c := _CACHE.search(line):
                s.cache_gib = float(c[1])
        elif m := _BACK.search(line):
            at(m[1]).back_ms = float(m[2])
            at(m[1]).scheduler_at = _stamp(line)
        elif m := _LAUNCHED.search(line):
            at(m[1]).launch_ms = float(m[2])
            if c := _HOST_CPU.search(line):
                at(m[1]).host_wall_ms, at(m[1]).host_cpu_ms = float(c[1]), float(c[2])
        elif m := _HANDED.search(line):
            at(m[1]).host_wall_ms, at(m[1]).host_cpu_ms = float(m[2]), float(m[3])
        elif m := _WAITED.search(line):
            at(m[1]).worker_at = _stamp(line)
            at(m[1]).tokens_wait_ms = float(m[2])
        else:
            stalls += _stalls_in(line)
    return [steps[k] for k in sorted(steps)], stalls


def _stalls_in(line: str) -> list[Stall]:
    when = _stamp(line)
    return [Stall(when, float(m[1]), kind) for kind, pattern in _STALLS.items()
            if when is not None and (m := pattern.search(line))]


def _stamp(line: str) -> float | None:
    if m := _STAMP.match(line):
        h, mi, sec, ms = (int(g) for g in m.groups())
        return h * 3600 + mi * 60 + sec + ms / 1000
    return None


def summary(steps: list[Step], slow_ms: float, align: int, slow_build_ms: float = 20.0,
            busy_rows: int = 16, stalls: list[Stall] = ()) -> str:
    prefill = [s for s in steps if s.n_chunks and s.build_ms is not None]
    off_edge = [s for s in prefill if any(start % align for _, start in s.chunks)]
    slow = [s for s in prefill if s.host_ms >= slow_ms]
    several = sum(s.n_chunks > 1 for s in prefill)
    mixed = sum(s.mixed for s in prefill)
    lines = [f"{len(steps)} steps, {len(prefill)} with prefill: {several} with several chunks, "
             f"{len(off_edge)} with a chunk starting off the {align} edges, {mixed} mixed "
             "forwards"]
    if prefill:
        def med(key: str) -> float:
            return statistics.median(getattr(s, key) for s in prefill)
        lines.append(f"prefill steps, median ms: build {med('build_ms'):.2f}, prefill start "
                     f"{med('start_ms'):.2f}, wait {med('wait_ms'):.2f}")
    # A decode batch that changed size (a prompt's first token joining, a stream ending)
    # makes the worker gather the rows' previous tokens anew: on CUDA that once made
    # arrays from host data, which can wait for the work in flight (session 22).
    decodes_before = {s.step: p.decodes for p, s in zip(steps, steps[1:])}
    slow_builds = [s for s in prefill if (s.build_ms or 0.0) >= slow_build_ms]
    changed = sum(decodes_before.get(s.step, s.decodes) != s.decodes for s in slow_builds)
    lines.append(f"{len(slow_builds)} prefill steps built in >= {slow_build_ms:g} ms, {changed} "
                 f"of them where the decode batch changed size")
    lines += chunk_costs(steps, busy_rows)
    lines += part_costs(steps, busy_rows)
    lines += token_gaps(steps, busy_rows, stalls=stalls)
    lines.append(f"{len(slow)} with build + prefill start >= {slow_ms:g} ms:")
    lines += ["  " + s.describe() for s in slow]
    return "\n".join(lines)


def chunk_costs(steps: list[Step], busy_rows: int = 16) -> list[str]:
    """Medians of what a step costs with one chunk beside `busy_rows`+ decode rows, by the
    chunk's size (the three commonest), against such rows alone: how much a chunk adds to
    the host's build and launch and to the tokens' return, and whether that grows with the
    chunk (device-bound) or not (host-bound; session 35 in docs/benchmarks.md)."""
    def med(group: list[Step], key: str) -> str:
        values = [getattr(s, key) for s in group if getattr(s, key) is not None]
        return f"{statistics.median(values):.1f}" if values else "-"

    busy = [s for s in steps if s.decodes >= busy_rows]
    # A mixed forward's chunk starts no forward of its own: its steps are kept apart.
    by_size: dict[tuple[int, bool], list[Step]] = {}
    for s in busy:
        if s.n_chunks == 1:
            by_size.setdefault((s.tokens, s.mixed), []).append(s)
    decode_only = [s for s in busy if not s.n_chunks and s.part is None]  # no spread part
    lines = []
    if decode_only:
        lines.append(f"beside {busy_rows}+ decode rows, median ms: no chunk ({len(decode_only)} "
                     f"steps) build {med(decode_only, 'build_ms')}, tokens back "
                     f"{med(decode_only, 'back_ms')}")
    for (size, mixed), group in sorted(by_size.items(), key=lambda kv: -len(kv[1]))[:3]:
        lines.append(f"  one {size}-token chunk{', mixed forward' if mixed else ''} "
                     f"({len(group)} steps): build {med(group, 'build_ms')}, prefill start "
                     f"{med(group, 'start_ms')}, tokens back {med(group, 'back_ms')}")
    return lines


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def part_costs(steps: list[Step], busy_rows: int = 16) -> list[str]:
    """A spread's steps beside `busy_rows`+ decode rows, by the part they ran: the host's
    build plus prefill start (median, p90) and the tokens' return. The first part is
    split by its piece's size: whole pieces (the commonest size) against the others (a
    prompt's tail or a head that came alone), whose shapes recur less: on the H100 those
    started 10-30 ms slower (docs/benchmarks.md, session 53)."""
    spread = [s for s in steps if s.part is not None and s.decodes >= busy_rows
              and s.build_ms is not None]
    if not spread:
        return []
    fell = cache_falls(steps)

    def line(label: str, group: list[Step]) -> str:
        host = [s.host_ms for s in group]
        back = [s.back_ms for s in group if s.back_ms is not None]
        returned = (f", tokens back {statistics.median(back):.1f} / {_quantile(back, 0.9):.1f}"
                    if back else "")
        cache = (f", MLX cache fell in {sum(s.step in fell for s in group)}"
                 if any(s.cache_gib is not None for s in group) else "")
        return (f"  {label} ({len(group)} steps): host {statistics.median(host):.1f} / "
                f"{_quantile(host, 0.9):.1f}{returned}{cache}")

    lines = [f"spread over {spread[0].parts} steps, beside {busy_rows}+ decode rows, ms "
             "median / p90:"]
    first = [s for s in spread if s.part == 0]
    sizes = [s.tokens for s in first]
    whole = max(set(sizes), key=sizes.count) if sizes else 0
    for label, group in ((f"part 0, {whole}-token pieces", [s for s in first if s.tokens == whole]),
                         ("part 0, other sizes", [s for s in first if s.tokens != whole])):
        if group:
            lines.append(line(label, group))
    for part in sorted({s.part for s in spread} - {0}):
        lines.append(line(f"part {part}", [s for s in spread if s.part == part]))
    return lines


def token_gaps(steps: list[Step], busy_rows: int = 16, apart: int = 64,
               slowest: int = 3, stalls: list[Stall] = ()) -> list[str]:
    """Gaps between consecutive steps' tokens, at the worker (its wait for them ended) and
    at the scheduler (they arrived), for steps of `busy_rows`+ decode rows: over the
    longest run of steps with prefill beside such rows (runs split where `apart` steps
    pass without; a bench's warm-up makes a short one first), and over the busy steps
    before it, back to the run before; and the `slowest` gaps in the run with the host
    work inside them; then the host work of the run's steps (host_work). A client's
    inter-token gaps over the same span, against these, say how much of its p99 is the
    steps and how much the way out (detokenizer, HTTP front, client)."""
    busy = [s for s in steps if s.decodes >= busy_rows]
    loaded = [s.step for s in busy if s.n_chunks or s.part is not None]
    if not loaded:
        return []
    runs: list[list[int]] = [[loaded[0]]]
    for n in loaded[1:]:
        if n - runs[-1][-1] > apart:
            runs.append([])
        runs[-1].append(n)
    longest = max(range(len(runs)), key=lambda i: len(runs[i]))
    first, last = runs[longest][0], runs[longest][-1]
    quiet_from = runs[longest - 1][-1] + 1 if longest else 0
    lines = ["gaps between steps' tokens beside "
             f"{busy_rows}+ decode rows, ms p50 / p90 / p99 (count):"]
    for where in ("worker_at", "scheduler_at"):
        for label, lo, hi in (("before prefill", quiet_from, first - 1),
                              ("during prefill", first, last)):
            gaps = [gap for a, b in zip(busy, busy[1:])
                    if b.step == a.step + 1 and lo <= a.step and b.step <= hi
                    and (gap := _gap_ms(a, b, where)) is not None]
            if gaps:
                lines.append(f"  at the {where[:-3]}, {label}: {_quantile(gaps, 0.5):.0f} / "
                             f"{_quantile(gaps, 0.9):.0f} / {_quantile(gaps, 0.99):.0f} "
                             f"({len(gaps)})")
    window = [s for s in busy if first <= s.step <= last]
    return (lines + _slowest_gaps(steps, first, last, slowest, stalls)
            + host_work(window, stalls) + device_waits(steps, first, last))


def device_waits(steps: list[Step], first: int, last: int, slow_ms: float = 33.0,
                 waited_ms: float = 12.0) -> list[str]:
    """The worker's gaps of `slow_ms` or more in [first, last] split by the wait for the
    tokens that ended them: `waited_ms` or more is the device's (its step ran long while
    the host's work was typical), less the host's. For the device's, how often MLX's
    buffer cache fell at the step after (cache_falls) against every step in the span:
    session 57's lead on those spikes."""
    slow = [s for gap, s in _worker_gaps(steps, first, last)
            if gap >= slow_ms and s.tokens_wait_ms is not None]
    if not slow:
        return []
    device = [s for s in slow if s.tokens_wait_ms >= waited_ms]
    line = (f"gaps of {slow_ms:g}+ ms: {len(device)} ended by a wait of {waited_ms:g}+ ms for "
            f"the device, {len(slow) - len(device)} by less")
    fell = cache_falls(steps)
    span = [s for s in steps if first < s.step <= last]
    if device and any(s.cache_gib is not None for s in span):
        after = sum(s.step + 1 in fell for s in device) / len(device)
        every = sum(s.step + 1 in fell for s in span) / len(span)
        line += (f"; MLX's cache fell at the step after {100 * after:.0f}% of the device's "
                 f"(every step: {100 * every:.0f}%)")
    return [line]


def host_work(window: list[Step], stalls: list[Stall] = (), share: float = 0.03,
              off_cpu_ms: float = 3.0) -> list[str]:
    """The host's work a step (build, prefill start, launch: the wait for the step before
    left out) over `window`'s steps: its spread, the share of it the worker thread spent
    on the CPU in the slowest `share` of steps against the others (near 100%: it computed
    longer, a collection or a slower path; far below: kept off its core, or blocked in a
    call such as a free that waits for the device), the steps with `off_cpu_ms` or more
    of it off the CPU by spread part (session 57: a staging buffer's growth blocked a
    piece's first part early in a burst), and the worker's logged stalls in the window's
    span, by kind."""
    timed = [s for s in window if s.host_wall_ms is not None and s.host_cpu_ms is not None]
    if not timed:
        return []
    walls = [s.host_wall_ms for s in timed]
    ranked = sorted(timed, key=lambda s: -s.host_wall_ms)
    slow = ranked[:max(1, int(share * len(ranked)))]
    rest = ranked[len(slow):] or slow

    def on_cpu(group: list[Step]) -> float:
        wall = sum(s.host_wall_ms for s in group)
        return 100 * sum(s.host_cpu_ms for s in group) / max(1e-9, wall)

    lines = [f"host work a step (build, prefill start, launch), ms p50 / p90 / p99: "
             f"{_quantile(walls, 0.5):.1f} / {_quantile(walls, 0.9):.1f} / "
             f"{_quantile(walls, 0.99):.1f} ({len(timed)}); on the CPU {on_cpu(rest):.0f}% of "
             f"it, {on_cpu(slow):.0f}% in the slowest {len(slow)} (>= "
             f"{slow[-1].host_wall_ms:.1f} ms)"]
    blocked = [s for s in timed if s.host_wall_ms - s.host_cpu_ms >= off_cpu_ms]
    by_part = Counter("no part" if s.part is None else f"part {s.part}" for s in blocked)
    lines.append(f"steps with {off_cpu_ms:g}+ ms of it off the CPU: {len(blocked)}"
                 + (f" ({', '.join(f'{k}: {n}' for k, n in sorted(by_part.items()))}), steps "
                    f"{blocked[0].step} to {blocked[-1].step}" if blocked else ""))
    stamps = [s.worker_at for s in window if s.worker_at is not None]
    if stamps:
        for kind in _STALLS:
            inside = [x.ms for x in stalls
                      if x.kind == kind and _within(x.at, stamps[0], stamps[-1])]
            lines.append(f"the worker's logged {kind}s in that span: {len(inside)}"
                         + (f", {sum(inside):.1f} ms in all, the longest {max(inside):.1f} ms"
                            if inside else ""))
    return lines


def _within(at: float, start: float, end: float) -> bool:
    """Whether seconds-of-the-day `at` falls in [start, end], a span that may cross
    midnight."""
    return (at - start) % 86400 <= (end - start) % 86400


def _gap_ms(a: Step, b: Step, where: str) -> float | None:
    """Milliseconds from step a's tokens to step b's at `where` (worker_at, scheduler_at),
    across midnight too; None where a line lacks its stamp."""
    at_a, at_b = getattr(a, where), getattr(b, where)
    if at_a is None or at_b is None:
        return None
    return 1000 * ((at_b - at_a) % 86400)


def _worker_gaps(steps: list[Step], first: int, last: int) -> list[tuple[float, Step]]:
    """Each step in (first, last] with the worker's gap to its tokens from the step
    before's (ms), where both lines carry a stamp."""
    by = {s.step: s for s in steps}
    return [(gap, s) for s in steps if first < s.step <= last and s.step - 1 in by
            and (gap := _gap_ms(by[s.step - 1], s, "worker_at")) is not None]


def _slowest_gaps(steps: list[Step], first: int, last: int, count: int,
                  stalls: list[Stall] = ()) -> list[str]:
    """The worker's `count` longest gaps to a step's tokens in [first, last], with the host
    work inside each (start ahead: the rest of the step's launch, then the next step's
    build, prefill start and first half of its launch, then the wait for the tokens) and
    the logged stalls that ended in it."""
    by = {s.step: s for s in steps}
    lines = []
    for gap, s in sorted(_worker_gaps(steps, first, last), key=lambda g: -g[0])[:count]:
        nxt = by.get(s.step + 1, Step(s.step + 1))
        line = (f"  {gap:.0f} ms to step {s.step}'s tokens ({s.decodes} rows, part "
                f"{s.part}, launched in {s.launch_ms} ms); step {nxt.step} built in "
                f"{nxt.build_ms}, prefill start {nxt.start_ms}, launched in "
                f"{nxt.launch_ms} ms")
        if nxt.host_cpu_ms is not None:
            line += f", {nxt.host_cpu_ms} of its {nxt.host_wall_ms} ms on the CPU"
        start = by[s.step - 1].worker_at
        inside = [x for x in stalls if _within(x.at, start, s.worker_at)]
        if inside:
            line += "; " + ", ".join(f"{x.kind} {x.ms:.1f} ms" for x in inside)
        lines.append(line)
    return lines


def cache_falls(steps: list[Step], least_gib: float = 0.01) -> set[int]:
    """Steps after whose start MLX's buffer cache held less than after the step before:
    the start made an allocation the cache could not serve, and MLX 0.32 then empties
    the cache (worker_proc.memory.DevicePool), waiting for the device to free it."""
    known = [s for s in steps if s.cache_gib is not None]
    return {s.step for prev, s in zip(known, known[1:])
            if s.cache_gib < prev.cache_gib - least_gib}


def table(steps: list[Step]) -> str:
    rows = ["# step chunks tokens decodes build_ms prefill_start_ms prefill_wait_ms "
            "tokens_back_ms mlx_cache_gib chunks(tokens@start)"]
    rows += [f"{s.step} {s.n_chunks} {s.tokens} {s.decodes} {s.build_ms} {s.start_ms} {s.wait_ms} "
             f"{s.back_ms} {s.cache_gib} {' '.join(f'{n}@{st}' for n, st in s.chunks)}".rstrip()
             for s in steps]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path)
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument("--align", type=int, default=512, help="the prefill bucket's edge")
    p.add_argument("--slow-build-ms", type=float, default=20.0,
                   help="count prefill steps whose graph building alone took this long")
    p.add_argument("--busy-rows", type=int, default=16,
                   help="steps of this many decode rows or more count as busy (mixed "
                        "traffic: its steady streams, whose gaps the client measures)")
    p.add_argument("--table", type=Path, help="also write every step, one a line, here")
    args = p.parse_args(argv)
    steps, stalls = read_log(args.log.read_text(errors="replace").splitlines())
    if args.table:
        args.table.write_text(table(steps))
    print(summary(steps, args.slow_ms, args.align, args.slow_build_ms, args.busy_rows,
                  stalls))


if __name__ == "__main__":
    main()
