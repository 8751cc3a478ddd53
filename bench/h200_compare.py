"""kiln versus mlx_lm.server on a Llama-3-8B-shaped random-weight bf16 model, in one command.

    bash bench/h200_run.sh                          # on the lent H200 (see the script's header)
    python bench/h200_compare.py --out /tmp/h200    # the same, flags spelled out
    python bench/h200_compare.py --smoke --out /tmp/smoke   # CPU smoke test, tiny float32 model

Steps, all in this process or its children on 127.0.0.1:
1. Make (or reuse) a random-weight llama model directory: hidden 4096, 32 layers, 32 heads,
   8 KV heads, intermediate 14336, vocab 8192, bf16, drawn with mx.random on the default
   device and saved in safetensors shards. The tokenizer is the "demo" preset's (4096 ids):
   lm_head rows of ids the tokenizer lacks, and of its special tokens, are zero, so greedy
   decoding never picks them and never stops early. A short mlx_lm.generate checks the model.
2. Start kiln (`launch.py`), warm it up, run the serving sweep, stop it; then the same for
   `mlx_lm.server --decode-concurrency 256 --prompt-concurrency 16`, started with a listen
   backlog of 1024 instead of its 5 (`--mlx-backlog`; see bench/mlx_lm_server_backlog.py).
   With `--rounds N`, every server is started first and left running, then each is swept
   N times, interleaved (bench_interleaved), so servers are compared within each round.
3. Write <out>/kiln.json, <out>/mlx_lm.json (bench/serving.py sweep documents), sweep.png,
   summary.txt and both server logs, and print the summary table last.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import serving  # noqa: E402
from ipc.process import STACKS_SIGNAL  # noqa: E402
from tests.server import free_port_pair, wait_until  # noqa: E402

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json")
_COMPLETE = ".kiln-bench-complete"
# Short names (file names, --servers) and the labels their sweeps carry.
_LABELS = {"kiln": "kiln", "kiln_eager": "kiln --eager-decode", "kiln_b": "kiln B",
           "kiln_c": "kiln C", "mlx_lm": "mlx_lm.server"}
# Output projection scale: logits get a standard deviation of about this many units.
_LOGIT_SCALE = 4.0


@dataclass(frozen=True)
class ModelShape:
    """A llama configuration to fill with random weights."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tokenizer_preset: str  # demo model whose tokenizer is copied
    max_context: int = 8192
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = ModelShape("llama3-8b-shape", 4096, 32, 32, 8, 14336, 8192, "demo")
SMOKE = ModelShape("smoke-tiny", 64, 2, 4, 2, 128, 2048, "demo-tiny")


# -- 1. the random model -------------------------------------------------------------------

def tensor_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.self_attn.q_proj.weight": (q, s.hidden),
                   f"{p}.self_attn.k_proj.weight": (kv, s.hidden),
                   f"{p}.self_attn.v_proj.weight": (kv, s.hidden),
                   f"{p}.self_attn.o_proj.weight": (s.hidden, q),
                   f"{p}.mlp.gate_proj.weight": (s.intermediate, s.hidden),
                   f"{p}.mlp.up_proj.weight": (s.intermediate, s.hidden),
                   f"{p}.mlp.down_proj.weight": (s.hidden, s.intermediate),
                   f"{p}.input_layernorm.weight": (s.hidden,),
                   f"{p}.post_attention_layernorm.weight": (s.hidden,)}
    shapes |= {"model.norm.weight": (s.hidden,), "lm_head.weight": (s.vocab, s.hidden)}
    return shapes


def init_std(name: str, shape: tuple[int, ...]) -> float:
    """Unit-scale embeddings, 1/sqrt(fan_in) projections, logits of std _LOGIT_SCALE."""
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name == "lm_head.weight":
        return _LOGIT_SCALE / shape[1] ** 0.5
    return 1.0 / shape[1] ** 0.5


def shard_plan(shapes: dict[str, tuple[int, ...]], itemsize: int,
               max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most max_bytes (one tensor may exceed it)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize
        for d in shape:
            nbytes *= d
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def draw_tensor(name: str, shape: tuple[int, ...], dtype: Any, keep_rows: Any) -> Any:
    import mlx.core as mx

    if len(shape) == 1:
        return mx.ones(shape, dtype=dtype)
    w = mx.random.normal(shape, dtype=dtype) * init_std(name, shape)
    if name == "lm_head.weight":
        w = w * keep_rows[:, None]  # zero rows: logit 0, never the argmax
    return w.astype(dtype)


def tokenizer_info(tok_dir: Path) -> tuple[int, list[int], dict[str, Any]]:
    """The tokenizer's id count, its special ids, and the source model's config."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    added = tokenizer.get_added_tokens_decoder()
    specials = sorted(i for i, token in added.items() if token.special)
    config = json.loads((tok_dir / "config.json").read_text())
    return tokenizer.get_vocab_size(with_added_tokens=True), specials, config


def model_config(s: ModelShape, dtype_name: str, source: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": s.hidden, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "intermediate_size": s.intermediate, "hidden_act": "silu",
        "vocab_size": s.vocab, "max_position_embeddings": s.max_context,
        "rms_norm_eps": 1e-5, "rope_theta": s.rope_theta, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": source["bos_token_id"], "eos_token_id": source["eos_token_id"],
        "pad_token_id": source.get("pad_token_id"), "torch_dtype": dtype_name,
        "kiln_bench": {"shape": s.name, "random_weights": True},
    }


def model_fingerprint(s: ModelShape, dtype_name: str, seed: int) -> str:
    payload = json.dumps({"shape": asdict(s), "dtype": dtype_name, "seed": seed, "v": 1})
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def start_model_dir(out_dir: Path, fingerprint: str,
                    tokenizer_preset: str) -> tuple[int, list[int], dict[str, Any]] | None:
    """None when a complete model of this fingerprint is already in out_dir; else out_dir
    emptied but for the preset's tokenizer files, and that tokenizer's (id count, special
    ids, source config)."""
    from worker_proc.demo_model import ensure_demo_model

    marker = out_dir / _COMPLETE
    if marker.is_file() and marker.read_text().strip() == fingerprint:
        print(f"reusing model at {out_dir}", flush=True)
        return None
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    tok_dir = ensure_demo_model(tokenizer_preset)
    for f in _TOKENIZER_FILES:
        shutil.copy(tok_dir / f, out_dir / f)
    return tokenizer_info(tok_dir)


def make_random_model(s: ModelShape, dtype_name: str, out_dir: Path, seed: int,
                      shard_bytes: int = 4 << 30) -> Path:
    """Write the model directory unless an identical one is already complete there."""
    import mlx.core as mx

    fingerprint = model_fingerprint(s, dtype_name, seed)
    start = time.monotonic()
    tokenizer = start_model_dir(out_dir, fingerprint, s.tokenizer_preset)
    if tokenizer is None:
        return out_dir
    tok_vocab, specials, source = tokenizer
    if tok_vocab > s.vocab:
        raise ValueError(f"the tokenizer has {tok_vocab} ids, more than the vocab {s.vocab}")
    (out_dir / "config.json").write_text(
        json.dumps(model_config(s, dtype_name, source), indent=2) + "\n")
    dtype = getattr(mx, dtype_name)
    mx.random.seed(seed)
    keep = mx.concatenate([mx.ones((tok_vocab,)), mx.zeros((s.vocab - tok_vocab,))])
    keep[mx.array(specials)] = 0.0
    shapes, keep_rows = tensor_shapes(s), keep.astype(dtype)
    write_shards(shapes, dtype.size, lambda n: draw_tensor(n, shapes[n], dtype, keep_rows),
                 out_dir, shard_bytes)
    (out_dir / _COMPLETE).write_text(fingerprint + "\n")
    print(f"made {s.name} ({dtype_name}) at {out_dir} in {time.monotonic() - start:.1f}s",
          flush=True)
    return out_dir


def write_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, draw: Callable[[str], Any],
                 out_dir: Path, shard_bytes: int) -> None:
    """Safetensors shards of at most shard_bytes (and their index), each tensor drawn by
    draw(name) as its shard is written, so only one shard is ever in memory."""
    import mlx.core as mx

    plan = shard_plan(shapes, itemsize, shard_bytes)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(plan):
        file = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        arrays = {n: draw(n) for n in names}
        mx.eval(arrays)
        mx.save_safetensors(str(out_dir / file), arrays, metadata={"format": "mlx"})
        weight_map |= {n: file for n in names}
        del arrays
        mx.clear_cache()
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def check_model(model_dir: Path, max_tokens: int = 8) -> dict[str, Any]:
    """mlx_lm.load and a greedy mlx_lm.generate: the model runs, and every generated id is
    one the (smaller) tokenizer knows, so streamed text is never empty."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    start = time.monotonic()
    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = mx.array(tokenizer.encode("the model token cache batch server kernel"))
    ids = [tok for tok, _ in generate_step(prompt, model, max_tokens=max_tokens)]
    known = len(tokenizer.vocab)
    text = tokenizer.decode(ids)
    del model
    mx.clear_cache()
    if max(ids) >= known or not text:
        raise RuntimeError(f"generated ids {ids} include ids the tokenizer ({known}) lacks")
    return {"generated_ids": ids, "text": text, "tokenizer_ids": known,
            "seconds": round(time.monotonic() - start, 1)}


# -- 2. the servers ------------------------------------------------------------------------

@dataclass
class ServerRun:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path


def start_server(name: str, cmd: list[str], port: int, log: Path,
                 env: dict[str, str] | None = None, cwd: Path = ROOT) -> ServerRun:
    # A new session, so the server and any children it starts stop together.
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True)
    return ServerRun(name, f"http://127.0.0.1:{port}", proc, log)


def wait_ready(server: ServerRun, model: str, timeout: float) -> float:
    """Poll until one short completion succeeds; returns the seconds it took. A kiln server
    still starting at the timeout is told to write its processes' stacks to its log first
    (SIGUSR2), so the log says where its start-up waited."""
    body = {"model": model, "prompt": "the model", "max_tokens": 4, "temperature": 0.0}
    try:
        return wait_until(
            lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200,
            server.proc, timeout, f"{server.name} (see {server.log})", interval=1.0)
    except RuntimeError:
        if server.name.startswith("kiln") and server.proc.poll() is None:
            _signal_group(server.proc.pid, STACKS_SIGNAL)
            time.sleep(2)  # for the dumps to reach the log
        raise


def stop_server(server: ServerRun, grace: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after `grace` seconds, and
    wait until every process of the group is gone, so its device memory is free again."""
    group = server.proc.pid
    _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_alive(group) and time.monotonic() < deadline:
        server.proc.poll()  # reap the leader so the group can empty
        time.sleep(0.2)
    if _group_alive(group):
        _signal_group(group, signal.SIGKILL)
    server.proc.wait(10)
    for _ in range(50):
        if not _group_alive(group):
            return
        time.sleep(0.2)


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def server_command(name: str, model_dir: Path, port: int, args: argparse.Namespace) -> list[str]:
    common = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    if name in ("kiln", "kiln_eager", "kiln_b", "kiln_c"):
        extra = {"kiln": [], "kiln_eager": ["--eager-decode"],
                 "kiln_b": args.kiln_b_args.split(), "kiln_c": args.kiln_c_args.split()}[name]
        return [sys.executable, "launch.py", *common, *extra, *args.kiln_args.split()]
    launch = ([sys.executable, "bench/mlx_lm_server_backlog.py", str(args.mlx_backlog)]
              if args.mlx_backlog else [sys.executable, "-m", "mlx_lm", "server"])
    return [*launch, *common, "--decode-concurrency", "256", "--prompt-concurrency", "16",
            *args.mlx_args.split()]


# -- 3. the sweep --------------------------------------------------------------------------

def sweep_args(url: str, label: str, model_dir: Path, args: argparse.Namespace,
               seconds: float, seed: int = 0) -> argparse.Namespace:
    return serving.parse_args([
        "--url", url, "--model", str(model_dir), "--label", label,
        "--concurrency", args.concurrency, "--num-requests", args.num_requests,
        "--input-words", str(args.input_words), "--length-spread", str(args.length_spread),
        "--output-tokens", str(args.output_tokens),
        "--warmup-tokens", str(args.warmup_tokens), "--timeout", str(args.request_timeout),
        "--max-seconds", str(seconds), "--seed", str(seed)])


def launch(name: str, model_dir: Path, args: argparse.Namespace,
           extra: tuple[str, ...] = ()) -> ServerRun:
    """Start one server (kiln_b from --kiln-b-tree where given); `extra`: more of its flags."""
    port = free_port_pair()
    cmd = [*server_command(name, model_dir, port, args), *extra]
    print(f"starting {name}: {' '.join(cmd)}", flush=True)
    env = dict(kv.split("=", 1) for kv in args.kiln_b_env.split()) if name == "kiln_b" else None
    # kiln_b from another tree: its launch.py, whose directory heads its processes' path.
    cwd = args.kiln_b_tree if name == "kiln_b" and args.kiln_b_tree else ROOT
    return start_server(name, cmd, port, args.out / f"{name}.log", env, cwd)


def measure(server: ServerRun, model_dir: Path, args: argparse.Namespace,
            sweep_seconds: float, seed: int = 0) -> dict[str, Any]:
    """One sweep of a running server: its document (with --kv-probe, a kiln's KV memory
    per request under "kv")."""
    probe = KVProbe(server.url) if args.kv_probe and server.name.startswith("kiln") else None
    sargs = sweep_args(server.url, _LABELS[server.name], model_dir, args, sweep_seconds, seed)
    with probe or nullcontext():
        doc = serving.sweep_document(asyncio.run(serving.run_sweep(sargs)), sargs)
    if probe is not None:
        doc["kv"] = probe.report(KVFootprint.from_log(server.log))
    return doc


def bench_server(name: str, model_dir: Path, args: argparse.Namespace,
                 sweep_seconds: float) -> dict[str, Any]:
    """Start one server, wait for it, sweep it, stop it; returns the sweep document."""
    server = launch(name, model_dir, args)
    try:
        ready_s = wait_ready(server, str(model_dir), args.ready_timeout)
        print(f"{name} answered after {ready_s:.1f}s", flush=True)
        doc = measure(server, model_dir, args, sweep_seconds) | {"ready_s": round(ready_s, 1)}
    finally:
        stop_server(server)
    if name.startswith("kiln"):
        doc["worker"] = worker_digest(server.log)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def bench_interleaved(names: list[str], model_dir: Path, args: argparse.Namespace,
                      deadline: float) -> dict[str, dict[str, Any]]:
    """--rounds: every server started and left running side by side (kiln's servers with
    --mem-fraction --shared-mem-fraction, so their pools fit together), then `rounds`
    sweeps of each, one server after another, the order rotated each round so none is
    always first; round r's prompts are drawn with seed r, the same for every server and
    new to each server's prefix cache. A server's document is its median round (by the
    last level's output tokens/s) with every round under "rounds", and each round's
    ratios stand beside the medians': servers measured minutes apart on a host whose
    speed drifts (session 29 in docs/benchmarks.md) are compared within a round."""
    servers: list[ServerRun] = []
    try:
        ready = {}
        for name in names:
            extra = (("--mem-fraction", str(args.shared_mem_fraction))
                     if name.startswith("kiln") else ())
            servers.append(launch(name, model_dir, args, extra))
            ready[name] = wait_ready(servers[-1], str(model_dir), args.ready_timeout)
            print(f"{name} answered after {ready[name]:.1f}s", flush=True)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for r in range(args.rounds):
            order = servers[r % len(servers):] + servers[:r % len(servers)]
            for i, server in enumerate(order):
                left = (args.rounds - r) * len(servers) - i
                seconds = max(1.0, min(args.sweep_seconds,
                                       (deadline - time.monotonic()) / left - 10.0))
                print(f"round {r + 1}: {server.name}", flush=True)
                rounds[server.name].append(measure(server, model_dir, args, seconds, seed=r))
    finally:
        for server in servers:
            stop_server(server)
    sweeps = {}
    for name in names:
        doc = median_round(rounds[name]) | {"ready_s": round(ready[name], 1),
                                            "rounds": rounds[name]}
        if name.startswith("kiln"):
            doc["worker"] = worker_digest(args.out / f"{name}.log")
        (args.out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        sweeps[name] = doc
    return sweeps


def median_round(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose last measured level's output tokens/s is the median (the lower of
    the two middle ones for an even count)."""
    def last_rate(doc: dict[str, Any]) -> float:
        rates = [r["output_tok_s"] for r in doc["results"] if "skipped" not in r]
        return rates[-1] if rates else 0.0

    ranked = sorted(docs, key=last_rate)
    return dict(ranked[(len(ranked) - 1) // 2])


# -- KV memory per request (kiln) -----------------------------------------------------------

_STATES_LINE = re.compile(r"recurrent states: ([\d.]+) MiB for (\d+) requests and (\d+) prompt-end")


@dataclass(frozen=True)
class KVFootprint:
    """One request's recurrent state (0 without recurrent layers), from the worker's
    start-up line (/get_server_info gives K/V bytes per slot, not state bytes); the line
    gives MiB to 0.1, so small pools read inexactly."""

    state_bytes_per_request: float

    @classmethod
    def from_log(cls, log: Path) -> KVFootprint:
        states = _STATES_LINE.search(log.read_text(errors="replace"))
        # The state memory is one row per running request and one per prompt-end snapshot.
        return cls(float(states[1]) * 2**20 / (int(states[2]) + int(states[3]))
                   if states else 0.0)


# The worker's start-up lines that say how it sized itself, its periodic memory figures, and
# its failed steps (a step failing as a whole ends every request it held: session 40's
# out-of-memory read as a throughput of 3.5 tok/s until its log was opened).
_SIZING_LINE = re.compile(r"worker: ((?:KV pool|MLX buffer cache capped|prefill forwards of "
                          r"up to|prefill chunks of up to|decode first|windowed layers|"
                          r"recurrent states)[^\n]*)")
_MEMORY_LINE = re.compile(r"memory GiB: active ([\d.]+), peak ([\d.]+)")
_FAILED_STEP = "a step failed; ending every request the worker holds"
_DIED_LINE = re.compile(r"launcher: (worker died[^\n]*)")


def worker_digest(log: Path) -> dict[str, Any]:
    """What a kiln server's log says of its worker: the sizing lines, the highest active
    and peak memory of its periodic summaries (GiB), how many steps failed whole, and the
    launcher's line if the worker died."""
    text = log.read_text(errors="replace") if log.exists() else ""
    figures = [(float(a), float(p)) for a, p in _MEMORY_LINE.findall(text)]
    died = _DIED_LINE.search(text)
    return {"sizing": _SIZING_LINE.findall(text),
            "active_gib": max((a for a, _ in figures), default=None),
            "peak_gib": max((p for _, p in figures), default=None),
            "failed_steps": text.count(_FAILED_STEP),
            "died": died[1] if died else None}


class KVProbe:
    """Polls a kiln server's /get_server_info in a thread while a sweep runs and keeps the
    sample with the most running requests (of those, the most slots held). Held slots are
    used less evictable ones: slots the running requests read or wrote, not cached
    prefixes no request reads; likewise window slots (sliding and chunked layers' own space,
    where the model has one) held are those the running requests' queries see."""

    def __init__(self, url: str, interval: float = 0.5) -> None:
        self.url = url
        self.interval = interval
        self.running = 0
        self.held_slots = 0
        self.window_slots = 0
        self.bytes_per_slot = 0
        self.window_bytes_per_slot = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kv-probe", daemon=True)

    def __enter__(self) -> KVProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.wait(self.interval):
                try:
                    stats = http.get(self.url + "/get_server_info").json()["scheduler"]
                except (httpx.HTTPError, ValueError, KeyError):
                    continue  # a busy server may miss one poll; the next counts
                sample = (stats["running_requests"],
                          stats["used_slots"] - stats["evictable_slots"])
                if sample > (self.running, self.held_slots):
                    self.running, self.held_slots = sample
                    self.window_slots = stats.get("window_held_slots", 0)
                    self.bytes_per_slot = stats.get("kv_bytes_per_slot", 0)
                    self.window_bytes_per_slot = stats.get("window_kv_bytes_per_slot", 0)

    def report(self, footprint: KVFootprint) -> dict[str, Any]:
        out: dict[str, Any] = {"at_running_requests": self.running,
                               "held_slots": self.held_slots, "window_slots": self.window_slots}
        if not self.running:
            return out
        out["slots_per_request"] = round(self.held_slots / self.running, 1)
        out["window_slots_per_request"] = round(self.window_slots / self.running, 1)
        kv = (self.held_slots * self.bytes_per_slot
              + self.window_slots * self.window_bytes_per_slot) / self.running
        return out | {"bytes_per_slot": self.bytes_per_slot,
                      "window_bytes_per_slot": self.window_bytes_per_slot,
                      "state_bytes_per_request": round(footprint.state_bytes_per_request),
                      "kv_bytes_per_request": round(kv + footprint.state_bytes_per_request)}


def sweep_budget(deadline: float, servers_left: int, cap: float) -> float:
    """Seconds in which this server's sweep may start levels: a fair share of what is left
    of --total-seconds, less a minute for the server's start and its last level."""
    share = (deadline - time.monotonic()) / servers_left - 60.0
    return max(1.0, min(cap, share))


def summary_table(sweeps: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'server':<8}{'conc':>6}{'reqs':>6}{'out tok/s':>11}{'TTFT p50':>11}"
             f"{'ITL p50':>10}{'TPOT p50':>10}{'e2e p50':>10}{'failed':>8}{'retries':>9}"]
    for name, doc in sweeps.items():
        for r in doc["results"]:
            if "skipped" in r:
                lines.append(f"{name:<8}{r['concurrency']:>6}{r['num_requests']:>6}  skipped")
                continue
            lines.append(f"{name:<8}{r['concurrency']:>6}{r['num_requests']:>6}"
                         f"{r['output_tok_s']:>11.1f}{r['ttft_ms']['p50'] / 1e3:>10.2f}s"
                         f"{r['itl_ms']['p50']:>8.1f}ms{r['tpot_ms']['p50']:>8.1f}ms"
                         f"{r['e2e_ms']['p50'] / 1e3:>9.1f}s"
                         f"{r['failed']:>8}{r.get('retries', 0):>9}")
    lines += _ratios(sweeps) + _round_lines(sweeps) + _kv_lines(sweeps) + _worker_lines(sweeps)
    return "\n".join(lines)


def _worker_lines(sweeps: dict[str, dict[str, Any]]) -> list[str]:
    """Each kiln server's worker digest (worker_digest), where recorded."""
    out = []
    for name, doc in sweeps.items():
        w = doc.get("worker")
        if w is None:
            continue
        out += [f"{name} worker: {line}" for line in w["sizing"]]
        memory = (f"memory GiB active {w['active_gib']}, peak {w['peak_gib']}"
                  if w["peak_gib"] is not None else "no memory summary logged")
        out.append(f"{name} worker: {memory}; {w['failed_steps']} steps failed whole"
                   + (f"; {w['died']}" if w.get("died") else ""))
    return out


def _round_lines(sweeps: dict[str, dict[str, Any]]) -> list[str]:
    """--rounds: each server's output tokens/s a level in every round, and each round's
    ratios to mlx_lm.server (same round)."""
    if not all("rounds" in doc for doc in sweeps.values()):
        return []
    out = []
    for name, doc in sweeps.items():
        for level, r in enumerate(doc["results"]):
            rates = [d["results"][level].get("output_tok_s") for d in doc["rounds"]]
            text = " / ".join(f"{x:.1f}" if x is not None else "skipped" for x in rates)
            out.append(f"{name} at {r['concurrency']}, rounds: {text}")
    if "mlx_lm" in sweeps:
        for i in range(len(sweeps["mlx_lm"]["rounds"])):
            one = {n: doc["rounds"][i] for n, doc in sweeps.items() if i < len(doc["rounds"])}
            out += [f"round {i + 1}: {line}" for line in _ratios(one)]
    return out


def _kv_lines(sweeps: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for name, doc in sweeps.items():
        kv = doc.get("kv", {})
        if "kv_bytes_per_request" in kv:
            out.append(f"{_LABELS[name]} KV per request at {kv['at_running_requests']} running: "
                       f"{kv['kv_bytes_per_request'] / 2**20:.1f} MiB ({kv['slots_per_request']} "
                       f"slots x {kv['bytes_per_slot']} B + {kv['window_slots_per_request']} "
                       f"window slots x {kv['window_bytes_per_slot']} B + state "
                       f"{kv['state_bytes_per_request'] / 2**20:.2f} MiB)")
    return out


def _ratios(sweeps: dict[str, dict[str, Any]]) -> list[str]:
    if "mlx_lm" not in sweeps:
        return []
    theirs = {r["concurrency"]: r for r in sweeps["mlx_lm"]["results"] if "skipped" not in r}
    out = []
    for name in (n for n in sweeps if n != "mlx_lm"):
        for r in sweeps[name]["results"]:
            other = theirs.get(r["concurrency"])
            if "skipped" not in r and other and other["output_tok_s"] > 0:
                out.append(f"{_LABELS[name]} / {_LABELS['mlx_lm']} output tok/s at {r['concurrency']}: "
                           f"{r['output_tok_s'] / other['output_tok_s']:.2f}x")
    return out


def write_plot(sweeps: dict[str, dict[str, Any]], out: Path, title: str) -> None:
    try:
        from bench.plot import plot_sweeps
    except ImportError as exc:  # matplotlib missing: the JSONs and the table still stand
        print(f"no plot: {exc}", flush=True)
        return
    try:
        plot_sweeps(list(sweeps.values()), out / "sweep.png", title)
    except ImportError as exc:
        print(f"no plot: {exc}", flush=True)


# -- the command line ----------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke test: tiny float32 model, 2 levels, few requests")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench/results")),
                   help="where JSONs, PNG, table and logs go (default $OUT or bench/results)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the random model is made or reused "
                        "(default ~/.cache/kiln/bench/<shape>-<dtype>)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default) or float32 (--smoke)")
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    p.add_argument("--servers", default="kiln,mlx_lm",
                   help="which to run, in this order (kiln, kiln_eager, kiln_b, kiln_c, mlx_lm)")
    p.add_argument("--kiln-b-args", default="",
                   help="kiln_b, an A/B variant of kiln: launch.py flags added to --kiln-args")
    p.add_argument("--kiln-b-env", default="",
                   help="kiln_b's extra environment, K=V separated by spaces")
    p.add_argument("--kiln-b-tree", type=Path, default=None,
                   help="kiln_b from another checkout's files (its launch.py and packages), "
                        "e.g. a before-tree: git archive <commit> launch.py ipc kiln_common "
                        "*_proc bench | tar -x -C DIR (untracked, so the device call "
                        "carries it)")
    p.add_argument("--kiln-c-args", default="",
                   help="kiln_c, a second variant: launch.py flags added to --kiln-args")
    p.add_argument("--concurrency", default=None, help="levels (default 1,16,64,128)")
    p.add_argument("--num-requests", default=None,
                   help="requests per level, one or one per level (default 4,16,64,128)")
    p.add_argument("--input-words", type=int, default=None, help="default 100")
    p.add_argument("--length-spread", type=float, default=0.2,
                   help="prompt lengths uniform in input-words * (1 +- this)")
    p.add_argument("--family", default=None,
                   help="a bench/family_models.py shape (gemma3-12b, gpt-oss-20b, ...) "
                        "instead of the Llama-3-8B shape")
    p.add_argument("--quantize", default=None,
                   help="with --family: MODE[:BITS[:GROUP]] as bench/family_models.py takes it "
                        "(without it a quantized model of the same family in --model-dir is "
                        "rewritten unquantized)")
    p.add_argument("--output-tokens", type=int, default=None, help="default 256")
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=180.0, help="seconds per request")
    p.add_argument("--sweep-seconds", type=float, default=180.0,
                   help="per server: levels not started by then are skipped")
    p.add_argument("--total-seconds", type=float, default=480.0,
                   help="whole run; each server's sweep gets a share of what is left")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds a server may take to load and answer")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="load the model with mlx_lm and generate a few tokens first")
    p.add_argument("--kiln-args", default="", help="extra launch.py flags")
    p.add_argument("--mlx-args", default="", help="extra mlx_lm.server flags")
    p.add_argument("--kv-probe", action="store_true",
                   help="poll kiln's /get_server_info during the sweep (every 0.5 s) for its "
                        "KV memory per request at the busiest moment")
    p.add_argument("--rounds", type=int, default=1,
                   help="above 1: every server started at once, then this many sweeps of "
                        "each, interleaved (bench_interleaved); 1: one server at a time")
    p.add_argument("--shared-mem-fraction", type=float, default=0.25,
                   help="with --rounds: each kiln server's --mem-fraction (of the memory "
                        "free when it loads), so the servers fit side by side")
    p.add_argument("--prime", action="store_true",
                   help="first start, use and stop a kiln server that is not measured "
                        "(see prime())")
    p.add_argument("--mlx-backlog", type=int, default=1024,
                   help="start mlx_lm.server with this listen backlog instead of its 5 "
                        "(bench/mlx_lm_server_backlog.py); 0: as shipped")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return apply_defaults(args)


def apply_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from the full (H200) or the --smoke preset."""
    full = {"dtype": "bfloat16", "concurrency": "1,16,64,128", "num_requests": "4,16,64,128",
            "input_words": 100, "output_tokens": 256}
    smoke = {"dtype": "float32", "concurrency": "1,4", "num_requests": "2,4",
             "input_words": 30, "output_tokens": 16}
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shape = SMOKE if args.smoke else LLAMA3_8B
    if args.family:
        from bench.family_models import FAMILY_SHAPES

        args.shape = FAMILY_SHAPES[args.family]
    elif args.quantize:
        raise SystemExit("--quantize needs --family (bench/family_models.py quantizes)")
    if args.model_dir is None:
        args.model_dir = Path.home() / ".cache/kiln/bench" / f"{args.shape.name}-{args.dtype}"
    _LABELS["kiln_b"] = " ".join(["kiln B", args.kiln_b_args, args.kiln_b_env]
                                 + ([f"tree {args.kiln_b_tree}"] if args.kiln_b_tree else [])
                                 ).strip()
    _LABELS["kiln_c"] = " ".join(["kiln C", args.kiln_c_args]).strip()
    if args.mlx_backlog:
        _LABELS["mlx_lm"] = f"mlx_lm.server (backlog {args.mlx_backlog})"
    return args


def exit_on_sigterm(signum: int, _frame: object) -> None:
    # A timeout's SIGTERM must still run the `finally` that stops the servers: they live in their
    # own session and would otherwise keep the GPU's memory (seen: 89 GB left held).
    raise SystemExit(128 + signum)


def prime(model_dir: Path, args: argparse.Namespace) -> None:
    """Start kiln once, serve a few requests and stop it, measuring nothing: on a fresh
    machine the first kiln server warmed up 2.5x slower (NVRTC filling an empty kernel
    cache) and ran its host phases ~30% slower through its whole sweep (session 22 in
    docs/benchmarks.md), which every later server, mlx_lm.server too, was spared."""
    port = free_port_pair()
    cmd = server_command("kiln", model_dir, port, args)
    t0 = time.monotonic()
    server = start_server("prime", cmd, port, args.out / "prime.log")
    try:
        wait_ready(server, str(model_dir), args.ready_timeout)
        body = {"model": str(model_dir), "prompt": "the model " * 60, "max_tokens": 64,
                "temperature": 0.0, "ignore_eos": True}
        for _ in range(4):
            httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    finally:
        stop_server(server)
    print(f"primed the machine with a kiln server in {time.monotonic() - t0:.1f}s", flush=True)


def bench_model(args: argparse.Namespace) -> Path:
    """The model the servers load: made in args.model_dir, or the one already there if it
    is the same (a family model's quantization included)."""
    if args.family:
        from bench.family_models import Quantization, make_family_model

        quantize = Quantization.parse(args.quantize) if args.quantize else None
        return make_family_model(args.shape, args.dtype, args.model_dir, args.seed,
                                 quantize=quantize)
    return make_random_model(args.shape, args.dtype, args.model_dir, args.seed)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    args = parse_args(argv)
    import mlx.core as mx

    deadline = time.monotonic() + args.total_seconds
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"device {mx.default_device()}, model {args.shape.name} {args.dtype}"
          f"{' ' + args.quantize if args.quantize else ''}", flush=True)
    model_dir = bench_model(args)
    if args.check:
        print(f"mlx_lm check: {check_model(model_dir)}", flush=True)
    sweeps = {}
    names = args.servers.split(",")
    if args.prime:
        prime(model_dir, args)
    if args.rounds > 1:
        sweeps = bench_interleaved(names, model_dir, args, deadline)
    else:
        for i, name in enumerate(names):
            budget = sweep_budget(deadline, len(names) - i, args.sweep_seconds)
            sweeps[name] = bench_server(name, model_dir, args, budget)
    title = (f"{args.shape.name} {args.dtype}, {args.input_words}-word prompts "
             f"(+-{args.length_spread:.0%}), "
             f"{args.output_tokens} output tokens, {mx.default_device()}")
    write_plot(sweeps, args.out, title)
    table = f"{title}\n{summary_table(sweeps)}"
    (args.out / "summary.txt").write_text(table + "\n")
    print("\n" + table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
