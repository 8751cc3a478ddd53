"""Does MLX's CPU backend let the host work while a step computes? (It mostly does not.)

    python bench/cpu_async_eval.py

Builds a chain of 320 small matmuls (64 x 512 by 512 x 512, float32) and times: mx.eval of
it; mx.async_eval of it (how long until the call returns: the host's window for building
the next step); and mx.eval of it from a second Python thread while the main one runs
Python code. This is why `--overlap auto` is off on the CPU (docs/benchmarks.md, session 9).
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx


def main() -> None:
    weights = [mx.random.normal((512, 512)) for _ in range(8)]
    x0 = mx.random.normal((64, 512))
    mx.eval(weights, x0)

    def graph() -> mx.array:
        x = x0
        for _ in range(40):
            for w in weights:
                x = mx.tanh(x @ w)
        return x

    t = time.perf_counter()
    mx.eval(graph())
    full = time.perf_counter() - t

    t = time.perf_counter()
    out = graph()
    mx.async_eval(out)
    returned = time.perf_counter() - t
    mx.eval(out)
    total = time.perf_counter() - t
    print(f"mx.eval {full * 1e3:.1f} ms; mx.async_eval returned after {returned * 1e3:.1f} ms "
          f"of {total * 1e3:.1f} ({returned / total:.0%}: the host's window is the rest)")

    out = graph()
    error: list[BaseException] = []

    def other_thread() -> None:
        try:
            mx.eval(out)
        except RuntimeError as exc:  # MLX's streams belong to the thread that made them
            error.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    print("mx.eval from a second thread: " + (f"fails ({error[0]})" if error else "works"))


if __name__ == "__main__":
    main()
