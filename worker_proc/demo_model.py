"""Small random-weight demo models that look exactly like real checkpoints.

No model hub is reachable from our machines, so tests, the default server
model and benchmarks use these instead. Each preset is a genuine mlx-lm
``llama`` checkpoint (``config.json`` + ``model.safetensors``) with a genuine
byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a
ChatML chat template), so every code path that loads a real model through
``mlx_lm.load`` / ``transformers.AutoTokenizer`` is exercised unchanged.

Everything is deterministic (fixed seeds, a corpus generated in code, no
dependence on hash randomisation), so two machines build byte-identical
files and tests may compare generated tokens exactly.

The weights are RANDOM: the text the model produces is meaningless.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import random
import shutil
import time
import uuid
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

# Bump whenever the output of this module changes (corpus, training, init,
# file contents): it is part of the cache directory name, so stale caches are
# never reused.
GENERATOR_VERSION = "1"

COMPLETE_MARKER = ".kiln-demo-complete"

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: specials come first in the vocab (0..4).
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
)

# Hand-written rather than taken from a library so that the template is
# stable; list-of-parts content (OpenAI multimodal style) keeps only text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class DemoPreset:
    """Shape and seed of one demo model; every field feeds the cache hash."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_target: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def parameter_count(self, vocab_size: int | None = None) -> int:
        """Exact parameter count for ``vocab_size`` (default: the target)."""
        v = self.vocab_target if vocab_size is None else vocab_size
        h, d = self.hidden_size, self.head_dim
        attn = 2 * h * self.num_attention_heads * d + 2 * h * self.num_key_value_heads * d
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        return 2 * v * h + self.num_hidden_layers * per_layer + h


DEMO_PRESETS: dict[str, DemoPreset] = {
    p.name: p
    for p in (
        DemoPreset(
            name="demo-tiny",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_target=1024,
            max_position_embeddings=4096,
        ),
        DemoPreset(
            name="demo",
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=688,
            vocab_target=4096,
            max_position_embeddings=8192,
        ),
        # ~60.4M parameters with an 8192 vocab (8.4M of them in embeddings and
        # lm_head); 12 layers rather than 8 keeps the MLP ratio a normal 4.5x.
        DemoPreset(
            name="demo-60m",
            hidden_size=512,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=2304,
            vocab_target=8192,
            max_position_embeddings=8192,
        ),
    )
}

# Scale of the output projection: final-norm outputs have RMS 1, so logits get
# a standard deviation of about this many units. A wide spread keeps the top-1
# / top-2 gap far above float32 noise, which tests comparing greedy tokens
# across different batchings rely on.
LOGIT_SCALE = 4.0

_warned_paths: set[Path] = set()


def is_demo_model(name: str) -> bool:
    """True when ``name`` names a demo preset rather than a real model."""
    return name in DEMO_PRESETS


def default_cache_root() -> Path:
    env = os.environ.get("KILN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kiln"


def preset_hash(preset: DemoPreset) -> str:
    payload = json.dumps(
        {"generator": GENERATOR_VERSION, "preset": asdict(preset)}, sort_keys=True
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:12]


def demo_model_dir(preset: DemoPreset, cache_root: Path) -> Path:
    return cache_root / "models" / f"{preset.name}-{preset_hash(preset)}"


def ensure_demo_model(name: str = "demo", cache_root: Path | None = None) -> Path:
    """Return the directory of demo model ``name``, building it on first use.

    Safe to call from several processes at once: each builds in a private
    temporary directory and renames it into place; losers of the race discard
    their copy and use the winner's.
    """
    preset = _get_preset(name)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = demo_model_dir(preset, root)
    if not _is_complete(target):
        _create(preset, target)
    _warn_random_weights(target)
    return target


def _get_preset(name: str) -> DemoPreset:
    try:
        return DEMO_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(DEMO_PRESETS))
        raise ValueError(f"unknown demo model {name!r}; known: {known}") from None


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def _warn_random_weights(path: Path) -> None:
    # Once per process and model: several components resolve the same path.
    if path in _warned_paths:
        return
    _warned_paths.add(path)
    logger.warning(
        "Demo model %s has RANDOM WEIGHTS: its output text is meaningless "
        "(it exists for tests and benchmarks only).",
        path,
    )


def _create(preset: DemoPreset, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logger.info("Creating demo model %r (random weights) at %s", preset.name, target)
    start = time.monotonic()
    try:
        tmp.mkdir()
        write_demo_model(preset, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Demo model %r ready in %.1f s", preset.name, time.monotonic() - start)


def _publish(tmp: Path, target: Path) -> None:
    for _ in range(3):
        try:
            os.rename(tmp, target)
            return
        except OSError:
            if _is_complete(target):
                return  # another process won the race; its copy is identical
            if target.exists():
                # Not produced by us (we only rename complete dirs): someone
                # damaged the cache. Move it aside instead of deleting in place
                # so a reader holding it open is not disturbed mid-read.
                trash = target.parent / f".trash-{target.name}-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(target, trash)
                except OSError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)
                continue
            raise
    if not _is_complete(target):
        raise RuntimeError(f"could not install demo model at {target}")


def write_demo_model(preset: DemoPreset, out_dir: Path) -> None:
    """Write every file of ``preset`` into the existing directory ``out_dir``."""
    tokenizer = train_tokenizer(preset)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}

    _write_json(out_dir / "config.json", _model_config(preset, vocab_size, ids))
    _write_json(out_dir / "generation_config.json", _generation_config(ids))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(preset))
    _write_json(out_dir / "special_tokens_map.json", _special_tokens_map())
    _save_weights(out_dir / "model.safetensors", make_weights(preset, vocab_size, ids))
    (out_dir / "README.md").write_text(_readme(preset, vocab_size), encoding="utf-8")
    # Written last: its presence means the directory is whole.
    _write_json(
        out_dir / COMPLETE_MARKER,
        {"generator": GENERATOR_VERSION, "preset": asdict(preset)},
    )


def _write_json(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------
# Config files
# --------------------------------------------------------------------------


def _eos_ids(ids: dict[str, int]) -> list[int]:
    return [ids[EOS_TOKEN], ids[IM_END_TOKEN]]


def _model_config(preset: DemoPreset, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": preset.hidden_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "intermediate_size": preset.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": _eos_ids(ids),
        "pad_token_id": ids[PAD_TOKEN],
        "torch_dtype": "float32",
        "kiln_demo": {"preset": preset.name, "random_weights": True},
    }


def _generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": _eos_ids(ids),
        "pad_token_id": ids[PAD_TOKEN],
    }


def _tokenizer_config(preset: DemoPreset) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "add_bos_token": False,
        "add_eos_token": False,
        # Cleanup would rewrite " ." as "." and break exact round-trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": preset.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }


def _readme(preset: DemoPreset, vocab_size: int) -> str:
    return (
        f"# kiln demo model `{preset.name}`\n\n"
        "**RANDOM WEIGHTS.** This model was generated by `worker_proc/demo_model.py`\n"
        "for tests and benchmarks. Its text output is meaningless.\n\n"
        f"- architecture: llama, {preset.num_hidden_layers} layers, hidden "
        f"{preset.hidden_size}, {preset.num_attention_heads} heads "
        f"({preset.num_key_value_heads} kv), intermediate {preset.intermediate_size}\n"
        f"- vocab: {vocab_size} (byte-level BPE trained on a synthetic corpus)\n"
        f"- parameters: {preset.parameter_count(vocab_size):,}\n"
        f"- generator version: {GENERATOR_VERSION}\n"
    )


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


def _weight_shapes(preset: DemoPreset, vocab_size: int) -> dict[str, tuple[int, ...]]:
    h, d = preset.hidden_size, preset.head_dim
    q_out = preset.num_attention_heads * d
    kv_out = preset.num_key_value_heads * d
    inter = preset.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(preset.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (q_out, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_out, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_out, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q_out)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, inter)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab_size, h)
    return shapes


def _init_std(name: str, shape: tuple[int, ...], hidden_size: int) -> float:
    if name.endswith("embed_tokens.weight"):
        # Unit-scale embeddings keep the residual stream O(1) from the start,
        # so the token itself stays visible next to attention/MLP updates.
        return 1.0
    if name == "lm_head.weight":
        return LOGIT_SCALE / hidden_size**0.5
    # 1/sqrt(fan_in) preserves activation scale through each projection.
    return 1.0 / shape[1] ** 0.5


def make_weights(preset: DemoPreset, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """Deterministic float32 numpy weights named exactly as HF llama."""
    import numpy as np

    weights: dict[str, Any] = {}
    for name, shape in _weight_shapes(preset, vocab_size).items():
        if len(shape) == 1:
            weights[name] = np.ones(shape, dtype=np.float32)
            continue
        # Seeding per tensor name makes each tensor independent of the others'
        # order and shapes.
        rng = np.random.default_rng([preset.seed, zlib.crc32(name.encode("utf-8"))])
        std = _init_std(name, shape, preset.hidden_size)
        weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    _tame_special_rows(weights["lm_head.weight"], ids)
    return weights


def _tame_special_rows(lm_head: Any, ids: dict[str, int]) -> None:
    # With plain random rows, greedy decoding of demo-tiny (1024 tokens) hit
    # <|eos|>/<|im_end|> within 15 tokens for 2 of 8 chat prompts, so
    # generation tests and benchmarks would measure almost nothing. Halving
    # the rows of the stop and control tokens makes them practically never
    # chosen (none in 200 greedy tokens from 24 prompts for any preset;
    # softmax mass ~1e-5 per step), so a test that needs a stop must force
    # one (max_tokens, a stop string, a logits bias). Control tokens are
    # included so that chat markup does not show up in streamed text either.
    for tok in (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN):
        lm_head[ids[tok]] *= 0.5


def _save_weights(path: Path, weights: dict[str, Any]) -> None:
    import mlx.core as mx

    arrays = {name: mx.array(w) for name, w in weights.items()}
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(preset: DemoPreset) -> Any:
    """Train a byte-level BPE tokenizer on the synthetic corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_target,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is a token, so any UTF-8 (or binary) text is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = synthetic_corpus(preset.seed, _corpus_chars(preset.vocab_target))
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def _corpus_chars(vocab_target: int) -> int:
    # Enough distinct words for every merge slot to be filled, small enough
    # to build the largest preset in a couple of seconds.
    return max(200_000, 160 * vocab_target)


# The corpus uses only Random.random(): its output sequence is fixed across
# Python versions, whereas helpers such as choices() have changed before.


class _Rng:
    def __init__(self, seed: int) -> None:
        self._r = random.Random(seed)

    def uniform(self) -> float:
        return self._r.random()

    def below(self, n: int) -> int:
        return min(int(self._r.random() * n), n - 1)

    def between(self, lo: int, hi: int) -> int:
        """Integer in [lo, hi]."""
        return lo + self.below(hi - lo + 1)

    def pick(self, items: Sequence[str]) -> str:
        return items[self.below(len(items))]

    def chance(self, p: float) -> bool:
        return self._r.random() < p


class _Zipf:
    """Samples items with weight 1/(rank+1), like word frequencies."""

    def __init__(self, items: Sequence[str]) -> None:
        self.items = list(items)
        self._cum: list[float] = []
        total = 0.0
        for rank in range(len(self.items)):
            total += 1.0 / (rank + 1)
            self._cum.append(total)

    def sample(self, rng: _Rng) -> str:
        x = rng.uniform() * self._cum[-1]
        return self.items[min(bisect.bisect_right(self._cum, x), len(self.items) - 1)]


_COMMON_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at "
    "one have this from or had by not word but what some we can out other were "
    "all there when up use your how said an each she which do their time if will "
    "way about many then them write would like so these her long make thing see "
    "him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put "
    "home read hand port large spell add even land here must big high such follow "
    "act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father model server token "
    "request batch cache memory kernel thread queue latency stream"
).split()

_ONSETS = (
    "", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s",
    "t", "v", "w", "y", "z", "br", "cr", "dr", "fr", "gr", "pr", "tr", "bl", "cl",
    "fl", "gl", "pl", "sl", "sh", "ch", "th", "wh", "st", "sp", "sk", "sm", "sn",
    "str", "qu",
)
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "oo", "ou", "ie", "y")
_CODAS = (
    "", "", "", "", "n", "r", "s", "t", "l", "m", "d", "ng", "nd", "st", "ck",
    "ll", "ss", "rt", "nt", "sh", "th", "x", "ps",
)
_SUFFIXES = ("", "", "", "", "", "ing", "ed", "er", "ly", "tion", "ness", "ment", "s", "able")

_ACCENTED_WORDS = (
    "café naïve résumé über señor façade déjà vu crème brûlée garçon jalapeño "
    "piñata Zürich São Paulo Ångström smörgåsbord fiancée entrée à la carte "
    "élève être où ça Straße Müller Björk Dvořák Łódź Kraków Málaga Bogotá "
    "año niño mañana corazón canción français español português naïveté "
    "coöperation Genève Köln Düsseldorf Ærø Øresund"
).split()
_ACCENT_MAP = {
    "a": ("á", "à", "â", "ä", "å"),
    "e": ("é", "è", "ê", "ë"),
    "i": ("í", "ï", "î"),
    "o": ("ó", "ô", "ö", "ø"),
    "u": ("ú", "ü", "û"),
    "n": ("ñ",),
    "c": ("ç",),
    "s": ("š", "ß"),
}

_GREEK_CONSONANTS = "βγδζθκλμνξπρστφχψ"
_GREEK_VOWELS = ("α", "ε", "η", "ι", "ο", "υ", "ω", "ά", "έ", "ή", "ί", "ό", "ύ", "ώ", "ου", "αι")
_CYRILLIC_CONSONANTS = "бвгджзклмнпрстфхцчшщ"
_CYRILLIC_VOWELS = ("а", "е", "ё", "и", "о", "у", "ы", "э", "ю", "я", "ой", "ий", "ь")

_CJK_CHARS = (
    "日本語の文章中国人大小上下山川田口目耳手足水火木金土月年時分今何行来見言話"
    "書読食飲学生先私友家族会社電車駅道店町国英字漢東西南北前後左右長高安新古"
    "明暗白黒赤青花雨雪風空海天気心思知同自分理由問題答意味世界子女男父母"
    "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよ"
    "らりるれろわをんがぎぐげござじずぜぞだでどばびぶべぼぱぴぷぺぽっゃゅょー"
    "アイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモラリルレロン"
    "한국어안녕하세요감사합니다사람시간오늘"
)
_CJK_PHRASES = ("日本語の文章", "中国語", "東京", "こんにちは", "ありがとう", "今日は", "世界")
_CJK_PUNCT = ("。", "、", "，", "！", "？", "「", "」")

_EMOJI = (
    "🙂", "🚀", "😀", "😂", "❤️", "👍", "🎉", "🔥", "✨", "🌍", "🐍", "💡",
    "✅", "❌", "⭐", "🍕", "👩‍💻", "👋🏽", "🤖", "📦", "🇯🇵",
)
_SENTENCE_END = (".", ".", ".", ".", "!", "?", "...", ";")


def synthetic_corpus(seed: int, target_chars: int) -> list[str]:
    """Deterministic mixed-script text, one paragraph per item."""
    rng = _Rng(seed)
    words = _Zipf(_build_lexicon(rng, 6000))
    greek = _Zipf(_build_script_lexicon(rng, _GREEK_CONSONANTS, _GREEK_VOWELS, 600))
    cyrillic = _Zipf(_build_script_lexicon(rng, _CYRILLIC_CONSONANTS, _CYRILLIC_VOWELS, 600))
    makers: list[tuple[float, Callable[[], str]]] = [
        (0.50, lambda: _english_paragraph(rng, words)),
        (0.15, lambda: _code_block(rng, words)),
        (0.10, lambda: _accented_paragraph(rng, words)),
        (0.05, lambda: _script_paragraph(rng, greek)),
        (0.05, lambda: _script_paragraph(rng, cyrillic)),
        (0.10, lambda: _cjk_paragraph(rng)),
        (0.05, lambda: _emoji_paragraph(rng, words)),
    ]
    out: list[str] = []
    total = 0
    while total < target_chars:
        text = _pick_maker(rng, makers)()
        out.append(text)
        total += len(text)
    return out


def _pick_maker(rng: _Rng, makers: list[tuple[float, Callable[[], str]]]) -> Callable[[], str]:
    x = rng.uniform()
    for weight, maker in makers:
        if x < weight:
            return maker
        x -= weight
    return makers[-1][1]


def _build_lexicon(rng: _Rng, size: int) -> list[str]:
    lexicon = dict.fromkeys(_COMMON_WORDS)  # insertion-ordered set
    while len(lexicon) < size:
        lexicon.setdefault(_pseudo_word(rng))
    return list(lexicon)


def _pseudo_word(rng: _Rng) -> str:
    n = 1 + rng.below(3)
    word = "".join(rng.pick(_ONSETS) + rng.pick(_VOWELS) + rng.pick(_CODAS) for _ in range(n))
    return word + rng.pick(_SUFFIXES)


def _build_script_lexicon(rng: _Rng, consonants: str, vowels: Sequence[str], size: int) -> list[str]:
    lexicon: dict[str, None] = {}
    while len(lexicon) < size:
        n = 1 + rng.below(3)
        word = "".join(rng.pick(consonants) + rng.pick(vowels) for _ in range(n))
        lexicon.setdefault(word)
    return list(lexicon)


def _number(rng: _Rng) -> str:
    kind = rng.below(6)
    if kind == 0:
        return str(rng.below(10))
    if kind == 1:
        return str(rng.below(1000))
    if kind == 2:
        return f"{rng.below(100)}.{rng.below(100):02d}"
    if kind == 3:
        return f"{rng.between(1990, 2030)}-{rng.between(1, 12):02d}-{rng.between(1, 28):02d}"
    if kind == 4:
        return f"{rng.below(100)}%"
    return f"{rng.between(1, 999)},{rng.below(1000):03d}"


def _sentence(rng: _Rng, words: _Zipf, lo: int = 4, hi: int = 16) -> str:
    parts: list[str] = []
    for i in range(rng.between(lo, hi)):
        w = _number(rng) if rng.chance(0.06) else words.sample(rng)
        if i and rng.chance(0.03):
            w = f'"{w}"'
        elif i and rng.chance(0.02):
            w = f"({w})"
        if i + 1 < hi and rng.chance(0.08):
            w += ","
        parts.append(w)
    parts[0] = parts[0][:1].upper() + parts[0][1:]
    return " ".join(parts) + rng.pick(_SENTENCE_END)


def _english_paragraph(rng: _Rng, words: _Zipf) -> str:
    return " ".join(_sentence(rng, words) for _ in range(rng.between(1, 5))) + "\n"


def _identifier(rng: _Rng, words: _Zipf) -> str:
    a, b = words.sample(rng), words.sample(rng)
    style = rng.below(3)
    if style == 0:
        return a
    if style == 1:
        return f"{a}_{b}"
    return a + b[:1].upper() + b[1:]


def _code_line(rng: _Rng, words: _Zipf) -> str:
    a, b, c = (_identifier(rng, words) for _ in range(3))
    n = _number(rng)
    templates = (
        f"def {a}({b}, {c}):",
        f"return {b} + {n}",
        f"if ({a} == {n}) {{",
        f"{a}.{b}({c});",
        "}",
        f"import {a}",
        f"from {a}.{b} import {c}",
        f"const {a} = [{n}, {rng.below(100)}, {rng.below(10)}];",
        f'{{"{a}": {n}, "{b}": "{c}"}}',
        f"# {_sentence(rng, words, 3, 8)}",
        f"// TODO: {_sentence(rng, words, 3, 8)}",
        f"for i in range({n}):",
        f"{a} = {b}[{rng.below(64)}] * {c}",
        f"for (int i = 0; i < {a}; i++) {{",
        f"print(f\"{{{a}}} -> {{{b}!r}}\")",
        f"{a} += 1  # {words.sample(rng)}",
        f"<{a} class=\"{b}\">{c}</{a}>",
    )
    return templates[rng.below(len(templates))]


def _code_block(rng: _Rng, words: _Zipf) -> str:
    lines = []
    depth = 0
    for _ in range(rng.between(2, 10)):
        line = _code_line(rng, words)
        indent = "\t" * depth if rng.chance(0.1) else "    " * depth
        lines.append(indent + line)
        if line.endswith((":", "{")):
            depth = min(depth + 1, 4)
        elif line == "}" or rng.chance(0.2):
            depth = max(depth - 1, 0)
    return "\n".join(lines) + "\n"


def _accentuate(rng: _Rng, word: str) -> str:
    out = []
    for ch in word:
        options = _ACCENT_MAP.get(ch)
        out.append(rng.pick(options) if options and rng.chance(0.25) else ch)
    return "".join(out)


def _accented_paragraph(rng: _Rng, words: _Zipf) -> str:
    parts = []
    for _ in range(rng.between(5, 20)):
        if rng.chance(0.4):
            parts.append(rng.pick(_ACCENTED_WORDS))
        else:
            parts.append(_accentuate(rng, words.sample(rng)))
    return " ".join(parts) + rng.pick(_SENTENCE_END) + "\n"


def _script_paragraph(rng: _Rng, lexicon: _Zipf) -> str:
    sentences = []
    for _ in range(rng.between(1, 4)):
        ws = [lexicon.sample(rng) for _ in range(rng.between(3, 12))]
        ws[0] = ws[0][:1].upper() + ws[0][1:]
        sentences.append(" ".join(ws) + rng.pick(_SENTENCE_END))
    return " ".join(sentences) + "\n"


def _cjk_paragraph(rng: _Rng) -> str:
    pieces = []
    for _ in range(rng.between(5, 40)):
        if rng.chance(0.1):
            pieces.append(rng.pick(_CJK_PHRASES))
        elif rng.chance(0.08):
            pieces.append(rng.pick(_CJK_PUNCT))
        else:
            pieces.append(rng.pick(_CJK_CHARS))
    return "".join(pieces) + "。\n"


def _emoji_paragraph(rng: _Rng, words: _Zipf) -> str:
    parts = []
    for _ in range(rng.between(3, 12)):
        parts.append(rng.pick(_EMOJI) if rng.chance(0.3) else words.sample(rng))
    return " ".join(parts) + rng.pick(_EMOJI) + "\n"
