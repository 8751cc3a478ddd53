"""Fine-tuning adapters (`--adapter-path`): mlx-lm's LoRA, DoRA and full fine-tunes,
applied at load as mlx_lm.load(adapter_path=...) applies them, serve mlx-lm's tokens of
the adapted model (and not the base model's), on the plain, compiled and fused paths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine, StandInKernel
from tests.families import VOCAB, write_model_dir
from tests.oracle import mlx_lm_tokens
from tests.test_families import SMALL_SERVER, served_greedy

ROOT = Path(__file__).resolve().parent.parent


def write_adapters(model_dir: Path, out: Path, kind: str, keys: list[str] | None = None,
                   seed: int = 0) -> Path:
    """An adapter directory as mlx_lm.lora writes one, for the model in model_dir: its
    config and the trainable parameters' values. mlx-lm starts LoRA's B at zero (an
    untrained adapter changes nothing), so every adapter value here is random; a full
    fine-tune replaces the last layer's weights with perturbed ones."""
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(model_dir))
    model.freeze()
    params = {"rank": 4, "scale": 2.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
    if kind != "full":
        linear_to_lora_layers(model, 2, params, use_dora=kind == "dora")
    else:
        model.model.layers[-1].unfreeze()
    rng = np.random.default_rng(seed)
    trained = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        noise = rng.standard_normal(value.shape).astype(np.float32)
        if kind == "full":
            trained[name] = value + mx.array(0.05 * noise)
        elif name.endswith((".lora_a", ".lora_b")):
            trained[name] = mx.array(0.2 * noise)
        else:  # DoRA's magnitudes: kept as made, from the weights' norms
            trained[name] = value
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), trained)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": kind, "num_layers": 2, "lora_parameters": params}))
    return out


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, VOCAB, size=n).tolist() for n in (3, 40, 70)]


def _served_in_process(model, prompts: list[list[int]], n: int, **engine_args) -> list[list[int]]:
    engine = InProcessEngine(model, chunk_size=16, **engine_args)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, n, [])
    results = engine.run_until_idle()
    return [results[f"r{i}"].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("family,kind,path", [
    ("llama", "lora", "plain"), ("llama", "dora", "plain"), ("llama", "full", "plain"),
    ("llama", "lora", "compiled"), ("llama", "lora", "fused"),
    ("qwen3_moe", "lora", "plain"), ("gemma3_text", "lora", "compiled")])
def test_adapted_models_serve_mlx_lm_tokens(tiny_model_dir, tmp_path, family, kind, path):
    """Three prompts at once (chunked, the last across Gemma's 16-token window) give
    mlx_lm.generate's tokens of the adapted model, which differ from the base model's.
    `fused`: projections fused and the fast decode call, the adapter on o_proj and
    down_proj only (the blocks stay eligible; those two projections keep their own call)."""
    import mlx_lm

    from worker_proc.row_positions import give_rows_their_positions

    base_dir = write_model_dir(family, tiny_model_dir, tmp_path / "base")
    keys = ["self_attn.o_proj", "mlp.down_proj"] if path == "fused" else None
    adapters = write_adapters(base_dir, tmp_path / "adapters", kind, keys)
    model, _ = mlx_lm.load(str(base_dir), adapter_path=str(adapters))
    base, _ = mlx_lm.load(str(base_dir))
    prompts = _prompts(seed=40 + len(family))
    want = [mlx_lm_tokens(model, p, 12) for p in prompts]
    assert want != [mlx_lm_tokens(base, p, 12) for p in prompts]  # the adapter matters
    give_rows_their_positions(model)
    if path == "fused":
        from worker_proc.decode_block import speed_up_decode_blocks
        from worker_proc.fused_projections import fuse_projections

        fuse_projections(model)
        # Every block takes the fast call (an adapter's projection keeps its own).
        assert speed_up_decode_blocks(model, residual_in_gemm=True) == len(model.model.layers)
    compiled = path == "compiled"  # the CUDA kernel's decode path, its meaning stood in
    assert _served_in_process(model, prompts, 12, compile_decode=compiled,
                              backend=StandInKernel() if compiled else None) == want


@pytest.mark.timeout(300)
def test_the_server_applies_adapters_and_refuses_a_directory_without_them(tiny_model_dir,
                                                                          tmp_path):
    """`--adapter-path` through every process: concurrent requests get the adapted
    model's tokens and start-up names the adapters; a directory that holds none stops the
    launcher with the reason as its last line, before any child starts."""
    import mlx_lm

    from tests.server import Server

    base_dir = write_model_dir("qwen3", tiny_model_dir, tmp_path / "base")
    adapters = write_adapters(base_dir, tmp_path / "adapters", "lora")
    model, _ = mlx_lm.load(str(base_dir), adapter_path=str(adapters))
    prompts = _prompts(seed=7)
    srv = Server(base_dir, *SMALL_SERVER, "--adapter-path", str(adapters),
                 log_path=tmp_path / "log").wait_ready()
    try:
        assert served_greedy(srv, prompts, 12) == [mlx_lm_tokens(model, p, 12) for p in prompts]
        assert "14 LoRALinear" in srv.log_tail(20000)  # 7 projections x 2 layers
    finally:
        assert srv.stop() == 0, srv.log_tail()

    assert _launcher_last_line(base_dir, base_dir) == (
        f"error: --adapter-path {base_dir}: no adapter_config.json or adapters.safetensors "
        "there (a directory mlx_lm.lora wrote, as mlx_lm.load reads it)")
    # Adapters made for another shape: the worker refuses them, naming the tensor.
    weights = mx.load(str(adapters / "adapters.safetensors"))
    name = sorted(weights)[0]
    weights[name] = mx.zeros((3, 3))
    mx.save_safetensors(str(adapters / "adapters.safetensors"), weights)
    last = _launcher_last_line(base_dir, adapters)
    assert last.endswith(f"launcher: cannot serve {base_dir}: --adapter-path {adapters}: "
                         f"ValueError: Adapter at {adapters} contains incompatible tensors:"), last


def _launcher_last_line(model_dir: Path, adapters: Path) -> str:
    """The first line of the launcher's last message, once it has exited (non-zero)."""
    from tests.server import free_port_pair

    run = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--model", str(model_dir),
                          "--adapter-path", str(adapters), "--port", str(free_port_pair())],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    lines = (run.stdout + run.stderr).rstrip().splitlines()
    starts = [i for i, ln in enumerate(lines) if "launcher" in ln or ln.startswith("error:")]
    return lines[starts[-1]] if starts else lines[-1]


def test_an_adapter_directory_that_fails_to_load_is_refused_naming_the_flag(tiny_model_dir,
                                                                             tmp_path):
    """Any failure of mlx-lm's load_adapters (a config missing a key, a file that is no
    safetensors) is the directory's: refused as a model the server cannot serve, which
    the launcher shows as its last line."""
    import mlx_lm

    from worker_proc import apply_adapters
    from worker_proc.layer_kinds import UnsupportedModelError

    base_dir = write_model_dir("llama", tiny_model_dir, tmp_path / "base")
    model, _ = mlx_lm.load(str(base_dir))
    adapters = write_adapters(base_dir, tmp_path / "adapters", "lora")
    (adapters / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora"}))
    with pytest.raises(UnsupportedModelError, match=f"--adapter-path {adapters}: "
                       "AttributeError: .*num_layers"):
        apply_adapters(model, str(adapters))
    write_adapters(base_dir, tmp_path / "other", "lora")
    (tmp_path / "other" / "adapters.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UnsupportedModelError, match=f"--adapter-path {tmp_path / 'other'}: "):
        apply_adapters(model, str(tmp_path / "other"))
