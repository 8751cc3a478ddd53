"""The worker's step watchdog: a stuck step ends the worker with its stacks in the log."""
import subprocess
import sys
import textwrap
import time

import pytest

from tests.server import ROOT


class Recorder:
    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[tuple[str, float]] = []

    def watchdog(self, seconds: float):  # noqa: ANN201
        from worker_proc.watchdog import StepWatchdog

        return StepWatchdog(seconds, clock=lambda: self.now,
                            arm=lambda s: self.calls.append(("arm", s)),
                            disarm=lambda: self.calls.append(("disarm", self.now)))


def test_the_watchdog_is_armed_while_steps_come_and_disarmed_when_they_stop():
    rec = Recorder()
    dog = rec.watchdog(300)
    dog.busy()
    rec.now = 0.5
    dog.busy()  # within a second of the last arming: the timer keeps running
    assert rec.calls == [("arm", 300)]
    rec.now = 1.2
    dog.busy()
    assert rec.calls == [("arm", 300)] * 2
    dog.idle()
    dog.idle()  # disarmed once
    assert rec.calls[-1] == ("disarm", 1.2) and len(rec.calls) == 3
    rec.now = 1.3
    dog.busy()  # a new burst of steps arms at once
    assert rec.calls[-1] == ("arm", 300)
    # A short timeout re-arms at a tenth of it, so a stuck step fires within 90-100% of it.
    rec = Recorder()
    dog = rec.watchdog(5)
    for now in (0.0, 0.3, 0.6):
        rec.now = now
        dog.busy()
    assert rec.calls == [("arm", 5)] * 2
    # Off: never armed.
    rec = Recorder()
    off = rec.watchdog(0)
    off.busy()
    off.idle()
    assert rec.calls == []


def test_the_worker_loop_arms_it_for_step_messages_only():
    from ipc.messages.to_scheduler import StepResult
    from ipc.messages.to_worker import ForwardBatch, Shutdown, SyncSteps
    from worker_proc import WorkerLoop
    from worker_proc.step_stats import ForwardClock

    class Pending:
        def __init__(self, step: int) -> None:
            self.step = step
            self.needs_sampling = False

    class Runner:
        clock = ForwardClock()
        mixed_forwards = 0

        def build(self, batch):  # noqa: ANN001, ANN201
            return Pending(batch.step)

        def start(self, pending):  # noqa: ANN001, ANN201
            pass

        def finish(self, pending):  # noqa: ANN001, ANN201
            return StepResult(step=pending.step, rids=[], token_ids=[])

    class Results:
        def send(self, result):  # noqa: ANN001, ANN201
            pass

    seen: list[str] = []

    class Watchdog:
        def busy(self) -> None:
            seen.append("busy")

        def idle(self) -> None:
            seen.append("idle")

    loop = WorkerLoop(Runner(), Results(), overlap=False, watchdog=Watchdog())
    loop.handle(ForwardBatch(step=1, decode_rids=["a"], decode_slots=[1]))
    loop.handle(SyncSteps())
    loop.handle(None)  # the poll for plans timed out: nothing to run
    assert not loop.handle(Shutdown(reason="test"))
    assert seen == ["busy", "busy", "idle", "idle"]


def _run(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import time
        from worker_proc.watchdog import StepWatchdog
        dog = StepWatchdog(0.5)
        def a_step_stuck_on_the_device():
            time.sleep(20)
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_a_stuck_step_ends_the_process_with_its_stack():
    """The real timer: a step that does not return ends the process (status 1) about
    the timeout after it began, every thread's stack on stderr naming where it waits."""
    t0 = time.monotonic()
    run = _run("dog.busy()\na_step_stuck_on_the_device()\n")
    took = time.monotonic() - t0
    assert run.returncode == 1, run.stderr
    assert "a_step_stuck_on_the_device" in run.stderr
    assert took < 15, took  # not the 20-s sleep


@pytest.mark.parametrize("body", ["dog.busy()\ndog.idle()\ntime.sleep(1.5)\n",
                                  "for _ in range(30):\n    dog.busy()\n    time.sleep(0.05)\n"])
def test_steps_that_keep_coming_or_stop_do_not_fire_it(body):
    """Steps that each return (re-arming) and a worker waiting for plans (disarmed) run
    on: 1.5 s against a 0.5-s timeout."""
    run = _run(body)
    assert run.returncode == 0, run.stderr


# A llama whose embedding waits while a file beside it exists: a step stuck in the worker,
# as one waiting on a device that never answers would be.
STUCK_MODEL = '''
import time
from pathlib import Path

import mlx.nn as nn
from mlx_lm.models import llama

ModelArgs = llama.ModelArgs
TRIGGER = Path(__file__).with_name("stuck")


class StuckEmbedding(nn.Embedding):
    def __call__(self, x):
        while TRIGGER.exists():
            time.sleep(0.05)
        return super().__call__(x)


class Model(llama.Model):
    def __init__(self, args):
        super().__init__(args)
        self.model.embed_tokens = StuckEmbedding(args.vocab_size, args.hidden_size)
'''


def test_a_served_step_that_never_ends_takes_the_server_down_with_its_stack(tiny_model_dir,
                                                                             tmp_path):
    """Served: a step stuck in the worker past --watchdog-timeout ends the worker (its
    stack, naming where it waits, in the log), its request gets an error and the server
    exits 1, instead of hanging."""
    import json
    import shutil

    import httpx

    from tests.server import Server

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "stuck_llama.py").write_text(STUCK_MODEL)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_file": "stuck_llama.py"}))
    srv = Server(model, "--trust-remote-code", "--watchdog-timeout", "5",
                 log_path=tmp_path / "log").wait_ready()
    try:
        (model / "stuck").touch()
        t0 = time.monotonic()
        reply = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"model": "m", "prompt": "hello", "max_tokens": 4})
        assert reply.status_code >= 500, reply.text
        assert srv.proc.wait(30) == 1
        assert time.monotonic() - t0 < 30
        log = srv.log_tail(20000)
        assert "worker died" in log and "Timeout" in log, log[-3000:]
        assert "stuck_llama.py" in log  # the stack names the stuck call
    finally:
        srv.stop()


def test_the_timeout_is_on_by_default_on_a_gpu_only():
    """-1 (the default): 300 s on a GPU; off on the CPU, where a large model's prefill
    step may take minutes. Set, it holds on both; under 5 s (the worker's poll for plans
    is 1 s) it is refused."""
    from ipc.config import ServerConfig

    assert ServerConfig().watchdog_seconds(on_gpu=True) == 300
    assert ServerConfig().watchdog_seconds(on_gpu=False) == 0
    assert ServerConfig(watchdog_timeout=60).watchdog_seconds(on_gpu=False) == 60
    assert ServerConfig(watchdog_timeout=0).watchdog_seconds(on_gpu=True) == 0
    for bad in (1, -2):
        with pytest.raises(ValueError, match="--watchdog-timeout"):
            ServerConfig(watchdog_timeout=bad)
