"""Tests for the random-weight demo models (worker_proc/demo_model.py)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from worker_proc.demo_model import (
    COMPLETE_MARKER,
    DEMO_PRESETS,
    EOS_TOKEN,
    IM_END_TOKEN,
    demo_model_dir,
    ensure_demo_model,
    is_demo_model,
)

TINY = "demo-tiny"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(TINY, cache_root=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def loaded(tiny_path: Path):
    import mlx_lm

    return mlx_lm.load(str(tiny_path))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_is_demo_model() -> None:
    for name in ("demo", "demo-tiny", "demo-60m"):
        assert is_demo_model(name)
        assert name in DEMO_PRESETS
    for name in ("", "Demo", "demo-1b", "mlx-community/Llama-3.2-1B-Instruct-4bit"):
        assert not is_demo_model(name)


def test_unknown_preset_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown demo model"):
        ensure_demo_model("demo-huge", cache_root=tmp_path)


def test_presets_are_frozen() -> None:
    with pytest.raises(AttributeError):
        DEMO_PRESETS[TINY].hidden_size = 1  # type: ignore[misc]


def test_60m_preset_is_about_60m_parameters() -> None:
    assert 55e6 < DEMO_PRESETS["demo-60m"].parameter_count() < 65e6


def test_layout_and_marker(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    assert tiny_path.parent.name == "models"
    assert tiny_path.name.startswith(f"{TINY}-")
    assert tiny_path == demo_model_dir(DEMO_PRESETS[TINY], tiny_path.parent.parent)
    names = {p.name for p in tiny_path.iterdir()}
    assert names >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "README.md",
        COMPLETE_MARKER,
    }
    assert "RANDOM WEIGHTS" in (tiny_path / "README.md").read_text(encoding="utf-8")
    # The temporary build directory was renamed away, not left behind.
    assert [p.name for p in tiny_path.parent.iterdir()] == [tiny_path.name]


def test_generation_is_deterministic(tiny_path: Path, tmp_path: Path) -> None:
    again = ensure_demo_model(TINY, cache_root=tmp_path)
    assert again != tiny_path
    assert again.name == tiny_path.name
    assert _file_bytes(again) == _file_bytes(tiny_path)


def test_config(tiny_path: Path) -> None:
    from tokenizers import Tokenizer

    preset = DEMO_PRESETS[TINY]
    config = _read_json(tiny_path / "config.json")
    tok = Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    eos_ids = [tok.token_to_id(EOS_TOKEN), tok.token_to_id(IM_END_TOKEN)]

    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == preset.hidden_size == 64
    assert config["num_hidden_layers"] == 2
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == 128
    assert config["max_position_embeddings"] == 4096
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    assert config["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert config["eos_token_id"] == eos_ids
    assert config["bos_token_id"] == tok.token_to_id("<|bos|>")
    assert _read_json(tiny_path / "generation_config.json")["eos_token_id"] == eos_ids


def test_weights_named_like_hf_llama(tiny_path: Path) -> None:
    import mlx.core as mx

    config = _read_json(tiny_path / "config.json")
    weights = mx.load(str(tiny_path / "model.safetensors"))
    v, h = config["vocab_size"], config["hidden_size"]
    assert weights["model.embed_tokens.weight"].shape == (v, h)
    assert weights["lm_head.weight"].shape == (v, h)
    assert weights["model.norm.weight"].shape == (h,)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, h)
    assert weights["model.layers.1.mlp.down_proj.weight"].shape == (h, 128)
    assert all(w.dtype == mx.float32 for w in weights.values())
    assert len(weights) == 3 + 9 * config["num_hidden_layers"]


def test_mlx_lm_load_and_generate(loaded) -> None:
    import mlx_lm

    model, tokenizer = loaded
    eos = set(_read_json(Path(tokenizer.name_or_path) / "config.json")["eos_token_id"])
    assert eos <= set(tokenizer.eos_token_ids)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True
    )
    text = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=12, verbose=False)
    assert isinstance(text, str) and text


def test_logits_are_not_degenerate(loaded) -> None:
    import mlx.core as mx
    import numpy as np

    model, tokenizer = loaded
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. 日本語 🙂 def f(x):")
    logits = np.array(model(mx.array(ids)[None])[0])
    assert 2.0 < float(logits.std(axis=-1).mean()) < 6.0
    top2 = np.sort(logits, axis=-1)[:, -2:]
    # Greedy decoding must not hinge on float32 noise.
    assert float((top2[:, 1] - top2[:, 0]).min()) > 1e-4


def test_auto_tokenizer_chat_template(tiny_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhéllo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert plain == text[: -len("<|im_start|>assistant\n")]
    assert tok.eos_token == EOS_TOKEN
    assert tok.pad_token == "<|pad|>"
    # Chat markup encodes as single special tokens, not as literal text.
    ids = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize(
    "text",
    ["héllo 日本語 🙂", "café naïve 👩‍💻 Ωμέγα Привет", "  x = f(1) .  \n\tend", "\x00\xff"],
)
def test_encode_decode_round_trip(tiny_path: Path, text: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    ids = tok.encode(text, add_special_tokens=True)
    assert tok.decode(ids) == text


def test_second_call_is_fast_and_same_path(tiny_path: Path) -> None:
    cache_root = tiny_path.parent.parent
    start = time.monotonic()
    again = ensure_demo_model(TINY, cache_root=cache_root)
    assert time.monotonic() - start < 0.1
    assert again == tiny_path


def test_random_weights_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker_proc.demo_model"):
        ensure_demo_model(TINY, cache_root=tmp_path)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("RANDOM WEIGHTS" in r.getMessage() for r in warnings)


def test_env_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    path = ensure_demo_model(TINY)
    assert path.parent == tmp_path / "models"


def test_concurrent_creators_agree(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            results.append(ensure_demo_model(TINY, cache_root=tmp_path))
        except BaseException as exc:  # surfaced below, threads swallow it
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert (results[0] / COMPLETE_MARKER).is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [results[0].name]


def test_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    target = demo_model_dir(DEMO_PRESETS[TINY], tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{partial", encoding="utf-8")
    path = ensure_demo_model(TINY, cache_root=tmp_path)
    assert path == target
    assert (path / COMPLETE_MARKER).is_file()
    assert _read_json(path / "config.json")["model_type"] == "llama"
