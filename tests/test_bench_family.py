"""The benchmarks' random-weight family models (bench/family_models.py) and the KV figures
bench/h200_compare.py reads from kiln's log: CPU smoke tests of what the H200 runs use."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.family_models import FAMILY_SHAPES, make_family_model, output_head
from bench.h200_compare import KVFootprint, check_model, tokenizer_info


def _weights(model_dir: Path) -> dict:
    import mlx.core as mx

    out: dict = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        out |= mx.load(str(shard))
    return out


@pytest.mark.parametrize("shape", ["qwen3_5-tiny", "qwen3_next-tiny", "moonlight-tiny",
                                   "qwen3_moe-tiny"])
def test_family_model_loads_and_its_head_never_picks_a_special_id(shape: str,
                                                                   tmp_path: Path) -> None:
    """Hybrids (their heads under language_model.), MLA (DeepSeek-V3's architecture) and
    Qwen3's MoE."""
    import mlx.core as mx

    from worker_proc.demo_model import ensure_demo_model

    model_dir = make_family_model(FAMILY_SHAPES[shape], "float32", tmp_path / shape)
    weights = _weights(model_dir)
    head = weights[output_head(list(weights))]  # Qwen3.5's sits under language_model.
    _, specials, _ = tokenizer_info(ensure_demo_model(FAMILY_SHAPES[shape].tokenizer_preset))
    assert specials and mx.all(head[mx.array(specials)] == 0).item()
    check_model(model_dir)  # mlx_lm.load and a greedy generate of ids the tokenizer knows


def test_kv_footprint_reads_the_recurrent_state_from_the_start_up_lines(tmp_path: Path) -> None:
    log = tmp_path / "kiln.log"
    log.write_text(
        "02:14:35    launcher INFO    launcher: worker: recurrent states: 3.0 MiB for 128 "
        "requests and 64 prompt-end snapshots\n"
        "02:14:35    launcher INFO    launcher: worker: KV pool: 2048 slots, 1.0 MiB (+ up to "
        "0.5 MiB of kept decode contexts)\n")
    assert KVFootprint.from_log(log) == KVFootprint(3 * 2**20 / 192)
    log.write_text("worker: KV pool: 2048 slots, 1.0 MiB\n")  # no recurrent layers
    assert KVFootprint.from_log(log) == KVFootprint(0.0)


@pytest.mark.parametrize("shape,quantize", [("gpt-oss-tiny", "affine:4:32"),
                                            ("gpt-oss-tiny", "mxfp4"),
                                            ("gemma3-tiny", "mxfp4")])
def test_a_quantized_family_model_is_what_mlx_lm_quantize_model_makes(shape: str, quantize: str,
                                                                      tmp_path: Path) -> None:
    """--quantize: the parameters (packed weights, scales, biases; GPT-OSS's router at its
    own 8 bits) and config mlx-lm's quantize_model gives, loaded by mlx_lm.load, generating
    ids the tokenizer knows."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    from bench.family_models import Quantization

    q = Quantization.parse(quantize)
    model_dir = make_family_model(FAMILY_SHAPES[shape], "float32", tmp_path / shape, quantize=q)
    weights = _weights(model_dir)
    model, _ = mlx_lm.load(str(model_dir))
    params = dict(tree_flatten(model.parameters()))
    assert set(weights) == set(params)
    assert all(weights[n].shape == params[n].shape and weights[n].dtype == params[n].dtype
               for n in weights)
    packed = [n for n in weights if n.endswith(".scales")]
    assert packed and all(weights[n[:-len("scales")] + "weight"].dtype == mx.uint32 for n in packed)
    if shape.startswith("gpt-oss"):
        router = next(n for n in packed if "router" in n)
        assert model_dir.joinpath("config.json").read_text().count('"bits": 8') >= 1, router
    check_model(model_dir)


def test_the_sweep_serves_the_quantized_model_the_session_script_made(tmp_path: Path,
                                                                        capsys) -> None:
    """h200_session.sh makes a family model with --quantize, then h200_compare.py (given
    the same QUANTIZE) reuses it as it is: the servers load the quantized model, not one
    rewritten unquantized (sessions 39-45 served bf16 GPT-OSS as 'MXFP4' that way)."""
    from bench import h200_compare
    from bench.family_models import Quantization

    model_dir = tmp_path / "gpt-oss-tiny"
    make_family_model(FAMILY_SHAPES["gpt-oss-tiny"], "float32", model_dir,
                      quantize=Quantization.parse("mxfp4"))
    made = _weights(model_dir)
    args = h200_compare.parse_args(["--family", "gpt-oss-tiny", "--quantize", "mxfp4",
                                    "--dtype", "float32", "--model-dir", str(model_dir)])
    assert h200_compare.bench_model(args) == model_dir
    assert "reusing model" in capsys.readouterr().out
    served = _weights(model_dir)
    assert set(served) == set(made) and any(n.endswith(".scales") for n in served)


def test_kiln_b_can_run_from_another_tree(tmp_path: Path, monkeypatch) -> None:
    """--kiln-b-tree starts kiln_b's launch.py in that directory (a before/after A/B in
    one sweep); every other server starts in this checkout, with kiln_b's labelled."""
    from bench import h200_compare

    started: dict[str, tuple[list[str], Path]] = {}

    def start(name, cmd, port, log, env=None, cwd=h200_compare.ROOT):  # noqa: ANN001, ANN202
        started[name] = (cmd, cwd)
        raise RuntimeError("stop here")

    monkeypatch.setattr(h200_compare, "start_server", start)
    args = h200_compare.parse_args(["--kiln-b-tree", str(tmp_path), "--out", str(tmp_path)])
    for name in ("kiln", "kiln_b"):
        with pytest.raises(RuntimeError, match="stop here"):
            h200_compare.bench_server(name, tmp_path, args, 1.0)
    assert started["kiln_b"][1] == tmp_path and started["kiln"][1] == h200_compare.ROOT
    assert started["kiln_b"][0][1] == "launch.py"
    assert str(tmp_path) in h200_compare._LABELS["kiln_b"]


def test_device_timeline_report_on_made_up_kernels(capsys) -> None:
    """bench/device_timeline.py's per-step arithmetic (busy time, gaps by size, kinds, the
    kernels that run once a step) on records of known times, as --check runs it."""
    from bench import device_timeline

    device_timeline._check()
    assert "once a step" in capsys.readouterr().out


def test_interleaved_rounds_rotate_the_servers_and_compare_within_a_round(tmp_path: Path,
                                                                         monkeypatch) -> None:
    """--rounds: every server up at once (kiln's with the shared memory fraction), sweeps
    interleaved with the order rotated and round r's prompts seeded r, each server's
    median round kept with all rounds, every server stopped, ratios given per round."""
    from bench import h200_compare

    launched, swept, stopped = {}, [], []

    def launch(name, model_dir, args, extra=()):  # noqa: ANN001, ANN202
        launched[name] = extra
        return h200_compare.ServerRun(name, f"http://{name}", None, tmp_path / f"{name}.log")

    rates = {"kiln": [300.0, 100.0, 200.0], "mlx_lm": [50.0, 40.0, 100.0]}

    def measure(server, model_dir, args, seconds, seed=0):  # noqa: ANN001, ANN202
        swept.append((server.name, seed))
        p50 = {"p50": 1.0}
        return {"label": server.name, "results": [
            {"concurrency": 64, "num_requests": 64, "output_tok_s": rates[server.name][seed],
             "ttft_ms": p50, "itl_ms": p50, "tpot_ms": p50, "e2e_ms": p50, "failed": 0}]}

    monkeypatch.setattr(h200_compare, "launch", launch)
    monkeypatch.setattr(h200_compare, "measure", measure)
    monkeypatch.setattr(h200_compare, "wait_ready", lambda server, model, timeout: 1.0)
    monkeypatch.setattr(h200_compare, "stop_server", lambda server: stopped.append(server.name))
    args = h200_compare.parse_args(["--rounds", "3", "--out", str(tmp_path)])
    sweeps = h200_compare.bench_interleaved(["kiln", "mlx_lm"], tmp_path, args,
                                            deadline=1e12)

    assert launched == {"kiln": ("--mem-fraction", "0.25"), "mlx_lm": ()}
    assert swept == [("kiln", 0), ("mlx_lm", 0), ("mlx_lm", 1), ("kiln", 1),
                     ("kiln", 2), ("mlx_lm", 2)]
    assert sorted(stopped) == ["kiln", "mlx_lm"]
    assert sweeps["kiln"]["results"][0]["output_tok_s"] == 200.0  # the median round
    assert sweeps["mlx_lm"]["results"][0]["output_tok_s"] == 50.0
    assert len(sweeps["kiln"]["rounds"]) == 3
    table = h200_compare.summary_table(sweeps)
    assert "kiln at 64, rounds: 300.0 / 100.0 / 200.0" in table
    assert "round 1: kiln / mlx_lm.server (backlog 1024) output tok/s at 64: 6.00x" in table
    assert "round 3: kiln / mlx_lm.server (backlog 1024) output tok/s at 64: 2.00x" in table
    assert "output tok/s at 64: 4.00x" in table  # the medians' ratio


def test_worker_digest_reads_sizing_memory_and_failed_steps(tmp_path: Path) -> None:
    """The compare harness records how each kiln worker sized itself, its highest memory
    figures and the steps that failed whole, from the server's log."""
    from bench.h200_compare import _worker_lines, worker_digest

    log = tmp_path / "kiln.log"
    log.write_text(
        "21:45:40    launcher INFO    launcher: worker: MLX buffer cache capped at 5.1 GiB\n"
        "21:45:40    launcher INFO    launcher: worker: KV pool: 252936 slots, 31617.1 MiB\n"
        "21:45:52    launcher INFO    launcher: worker: prefill forwards of up to 1216 tokens, "
        "two within 24.9 GiB (probes: 10.2 MiB a token shared, 2.7 lone)\n"
        "21:46:43      worker INFO    worker_proc: 133.3 steps/s ...; memory GiB: active 44.2, "
        "peak 64.3, cache 5.1\n"
        "21:46:44      worker INFO    worker_proc: 98.0 steps/s ...; memory GiB: active 45.0, "
        "peak 61.0, cache 5.1\n"
        "21:46:00      worker ERROR   worker_proc: a step failed; ending every request the "
        "worker holds\n"
        "21:46:01    launcher ERROR   launcher: worker died (exit code 1): DeviceLost\n")
    digest = worker_digest(log)
    assert digest["sizing"] == [
        "MLX buffer cache capped at 5.1 GiB", "KV pool: 252936 slots, 31617.1 MiB",
        "prefill forwards of up to 1216 tokens, two within 24.9 GiB (probes: 10.2 MiB a "
        "token shared, 2.7 lone)"]
    assert (digest["active_gib"], digest["peak_gib"], digest["failed_steps"]) == (45.0, 64.3, 1)
    lines = _worker_lines({"kiln": {"worker": digest}, "mlx_lm": {}})
    assert lines[-1] == ("kiln worker: memory GiB active 45.0, peak 64.3; 1 steps failed whole; "
                         "worker died (exit code 1): DeviceLost")
    missing = worker_digest(tmp_path / "missing.log")
    assert missing["failed_steps"] == 0 and missing["died"] is None
    assert _worker_lines({"kiln": {"worker": missing}}) == [
        "kiln worker: no memory summary logged; 0 steps failed whole"]


def test_the_session_scripts_gpu_sampler_sums_up_clock_caps(tmp_path: Path) -> None:
    """GPU_SAMPLE_MS polls nvidia-smi through the call (under the older field name where
    the driver lacks the newer) and ends with the SM clock and the samples that named
    each clock-event reason."""
    import os
    import stat
    import subprocess

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/usr/bin/env bash\n"
                    "case \"$*\" in *clocks_event_reasons*) exit 2;; esac\n"
                    "i=0; while true; do i=$((i+1)); r=0x0; c=1980\n"
                    "[ $((i % 3)) = 0 ] && { r=0x0000000000000004; c=1785; }\n"
                    "echo \"2026/12/07 16:41:27.364, $c MHz, 600.1 W, 45, $r\"; sleep 0.05; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "GPU_SAMPLE_MS": "50",
           "PARTS": "none", "OUT": str(tmp_path / "out")}
    script = Path(__file__).resolve().parent.parent / "bench" / "h200_session.sh"
    out = subprocess.run(["bash", str(script)], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = (tmp_path / "out" / "gpu_samples.csv").read_text().splitlines()
    caps = sum(line.endswith("0x0000000000000004") for line in lines)
    assert caps >= 1 and "SM clock lowest 1785, median 1980 MHz" in out, out
    assert f"software power cap: {caps} samples" in out, out
