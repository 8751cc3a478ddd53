"""The one frozen server configuration, built once from the command line.

Every process receives the same `ServerConfig`; socket endpoints are derived from it so no
process invents an address of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_NAME = "kiln"
PREFILL_CHUNK = 2048  # --chunked-prefill-size 0's value by device: mlx-lm's prefill step,
LONG_PREFILL_CHUNK = 4096  # and where long prefill attention is fused (ServerConfig.chunk_size)
# Decode first's defaults (ServerConfig.spread_parts, .decode_first_tokens): prompt tokens
# a step computes beside the streams it protects, whole or spread over several steps.
AUTO_PREFILL_SPREAD = 8
DECODE_FIRST_TOKENS = 512
SPREAD_DECODE_FIRST_TOKENS = 128
# The shortest --watchdog-timeout: well above the worker's one-second poll for plans.
MIN_WATCHDOG_SECONDS = 5.0
AUTO_WATCHDOG_SECONDS = 300.0  # on a GPU (SGLang's --watchdog-timeout has the same)
# CUDA attention paths other than the default, for --experiments (A/B runs).
DECODE_EXPERIMENTS = ("rope-in-kernel", "register-kv", "unfused-prefill",
                      "unfused-masked-prefill", "unaligned-chunks", "unpadded-tails",
                      "mixed-forward", "mma-attention", "mma-wide-tiles",
                      "cuda-core-attention", "gathered-latent", "fused-own-prefill",
                      "unfused-qk-norm", "unfused-residual-norm", "unfused-qk-rope",
                      "unpaged-prefill", "paged-short-rows", "unpadded-experts", "block-tiles", "unfused-moe",
                      "mlx-expert-matmuls", "bf16-expert-rows", "batched-quantized-rows",
                      "quantized-rows-kernel", "bf16-rows-kernel", "wide-cache",
                      "array-readback", "inline-launch")
# The decode attention kernel's two bodies: names that take one exclude the other's.
TENSOR_CORE_EXPERIMENTS = frozenset({"mma-attention", "mma-wide-tiles"})
CUDA_CORE_EXPERIMENTS = frozenset({"cuda-core-attention", "register-kv", "block-tiles"})


def kernel_body_conflict(experiments: frozenset[str]) -> str | None:
    """Why these --experiments names cannot be served together (a tensor-core path beside
    a CUDA-core one), or None."""
    tensor, cuda = experiments & TENSOR_CORE_EXPERIMENTS, experiments & CUDA_CORE_EXPERIMENTS
    if tensor and cuda:
        return (f"--experiments {', '.join(sorted(tensor))} take the tensor-core kernel, "
                f"{', '.join(sorted(cuda))} the CUDA-core one: choose one")
    return None


def _auto_on_off(help_text: str) -> Any:
    """A three-way switch: auto (the engine picks for the device), on or off."""
    return dataclasses.field(default="auto",
                             metadata={"choices": ("auto", "on", "off"), "help": help_text})


def json_object_flag(flag: str, value: str) -> dict[str, Any]:
    """A flag holding a JSON object (--chat-template-kwargs, ...): {} when empty; raises
    ValueError naming the flag otherwise."""
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return parsed


def switch_on(value: str, auto: bool) -> bool:
    """An auto/on/off switch's answer, `auto` being what the engine picks for the device."""
    return value == "on" or (value == "auto" and auto)


@dataclass(frozen=True)
class ServerConfig:
    """Start-up settings shared by every process. Field docs double as `--help` text."""

    model: str = dataclasses.field(
        default="demo",
        metadata={"help": "Local model directory, Hugging Face repo id, or a built-in "
                          "random-weight demo model ('demo', 'demo-tiny', 'demo-60m')."})
    model_path: str = dataclasses.field(
        default="", metadata={"cli": False, "help": "Resolved local directory of the model."})
    adapter_path: str = dataclasses.field(
        default="", metadata={"help": "Directory of fine-tuning adapters to apply to the model "
                                      "at load, as mlx_lm.load(adapter_path=...) does: "
                                      "mlx_lm.lora's output (adapter_config.json and "
                                      "adapters.safetensors; LoRA, DoRA or full). Kept "
                                      "apart from the weights (exact; fuse them with "
                                      "mlx_lm.fuse for the fastest decode)."})
    served_model_name: str = dataclasses.field(
        default="", metadata={"help": "Model name reported by /v1/models (default: --model)."})
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "HTTP bind address."})
    port: int = dataclasses.field(default=8000, metadata={"help": "HTTP port."})
    zmq_port: int = dataclasses.field(
        default=0, metadata={"help": "TCP port of the ZMQ endpoint for programmatic clients "
                                     "(0: --port + 1)."})
    context_length: int = dataclasses.field(
        default=0, metadata={"help": "Most tokens a request may hold, prompt and output together "
                                     "(0: the model's, config.json's max_position_embeddings, "
                                     "text_config's in multimodal checkpoints). Above the "
                                     "model's only where its RoPE scaling allows it. The KV "
                                     "pool's size caps it too."})
    max_running_requests: int = dataclasses.field(
        default=128, metadata={"help": "Most requests decoding at once (the batch size cap)."})
    chunked_prefill_size: int = dataclasses.field(
        default=0, metadata={"help": "Prompts longer than this are prefilled in chunks of this "
                                     "many tokens, interleaved with decode steps (0: 4096 where "
                                     "long prefill attention runs through cuDNN at bucketed "
                                     "shapes, CUDA with heads of at most 128; 2048 "
                                     "elsewhere)."})
    max_prefill_tokens: int = dataclasses.field(
        default=8192, metadata={"help": "Most prompt tokens computed in one scheduler step "
                                        "(summed over all requests in the step)."})
    # Decode first. An 8B model prefills ~38k tokens/s on the H200 (docs/benchmarks.md):
    # 512 tokens add ~13 ms to a step, about one 32-64-row decode step, 8192 ~200 ms; a
    # 512-row GEMM is still compute-bound there, so prefill loses little per token. vLLM
    # also schedules decodes first under one step budget (max_num_batched_tokens). With a
    # spread (CUDA's default), 128 a step, 512 tokens over four steps, kept an 8B model's
    # decoding streams' p99 gap within 2x of steady while long prompts arrived on the
    # H200 (1.81x; 256 a step: 2.84x there, 1.77x on an H100; sessions 38-39).
    max_prefill_tokens_while_decoding: int = dataclasses.field(
        default=0, metadata={"help": "Most prompt tokens computed in a step while streams "
                                     "decode that were decoding well before (16 scheduler "
                                     "steps) the oldest waiting request arrived (decode "
                                     "first: long prompts arriving "
                                     "slow those streams' tokens by this much prefill a "
                                     "step). Other steps take up to --max-prefill-tokens. "
                                     "0: 128 where --prefill-spread spreads it, else 512. "
                                     "On CUDA a power of two from 128 below 512 also "
                                     "becomes the padded prefill shapes' bucket, so its "
                                     "chunks keep to shapes built at start-up."})
    prefill_spread: int = dataclasses.field(
        default=0, metadata={"help": "In a decode-first step, run its prompt chunks over "
                                     "this many steps, a share of the model's layers in each "
                                     "(it then takes this many times "
                                     "--max-prefill-tokens-while-decoding): a decoding "
                                     "stream's gap grows by a share of a prefill forward's "
                                     "launch and compute, not a whole one. 1: off; a power "
                                     "of two keeps chunks to the shapes built at start-up; "
                                     "0: 8 on CUDA, 1 elsewhere. Models whose call is a "
                                     "backbone and an output head, without recurrent layers; "
                                     "others run whole forwards."})
    fixed_decode_first_budget: bool = dataclasses.field(
        default=False, metadata={"help": "Hold every decoding stream to the decode-first "
                                         "budget. By default a step whose decoding streams "
                                         "all started after, or just before, the oldest "
                                         "waiting request arrived (a burst's own first "
                                         "requests, at a nearly idle server) prefills up to "
                                         "--max-prefill-tokens: "
                                         "the burst is prefilled in a few large steps, not "
                                         "dozens of small ones that each also decode its "
                                         "first requests."})
    mem_fraction: float = dataclasses.field(
        default=0.6, metadata={"help": "Fraction of the device memory left free after "
                                       "loading the weights that the KV pool may take."})
    max_total_tokens: int = dataclasses.field(
        default=0, metadata={"help": "KV pool size in tokens (slots); overrides the "
                                     "memory-based size when > 0."})
    disable_radix_cache: bool = dataclasses.field(
        default=False, metadata={"help": "Do not cache and share prompt prefixes."})
    prefill_padding: str = dataclasses.field(
        default="auto", metadata={"help": "Padding a shared prefill forward may carry, as a share "
                                          "of its real tokens (prompts of different lengths "
                                          "right-padded to the longest): more gives fewer, larger "
                                          "forwards a step, less host time and more device time. "
                                          "auto: 0.25 with a GPU; 0 on the CPU, whose prefill is "
                                          "compute-bound (a forward then shares only chunks of "
                                          "one length)."})
    window_ratio: float = dataclasses.field(
        default=0.5, metadata={"help": "Models with sliding-window or chunked-attention "
                                       "layers: slots of those layers' own pool per slot of "
                                       "the full-attention layers' (they keep only positions "
                                       "inside a window, plus cached prefix tails); 0 keeps "
                                       "every position for them, as for full layers."})
    state_snapshots: int = dataclasses.field(
        default=64, metadata={"help": "Models with recurrent layers: how many prompt-end "
                                      "state snapshots the prefix cache may keep (each one "
                                      "request's recurrent state); 0: no prefix cache for them."})
    snapshot_stride: int = dataclasses.field(
        default=0, metadata={"help": "Models with recurrent layers: inside a long prompt, keep "
                                     "a state snapshot at a chunk's end only once this many "
                                     "tokens have passed since the last (0: at every chunk's "
                                     "end); the prompt's end always gets one."})
    schedule_policy: str = dataclasses.field(
        default="fcfs", metadata={"choices": ("fcfs", "lpm"),
                                  "help": "Order of admission: first come first served, or "
                                          "longest cached prefix first (lpm)."})
    overlap: str = _auto_on_off(
        "Build (and on CUDA start) step N+1 while step N computes, two steps in flight. auto:"
        " on with a GPU (CUDA, Metal), off on MLX's CPU backend, where a step's launch "
        "returns only once it is nearly done, so nothing overlaps (served with it on: 1-9%% "
        "fewer tokens/s in five alternated pairs).")
    disable_overlap: bool = dataclasses.field(
        default=False, metadata={"help": "Run one step at a time: --overlap off (for A/B "
                                         "runs)."})
    steps_in_flight: int = dataclasses.field(
        default=2, metadata={"help": "With overlap, how many planned steps the scheduler keeps "
                                     "at the worker. 2: step N+1 is planned while N computes "
                                     "(the worker then waits for the scheduler's round trip "
                                     "once a step); 3: the plan after next is already queued "
                                     "when the worker finishes launching one, at the cost of "
                                     "one more discarded row when a request stops on a token "
                                     "and a step more before a new request's first forward "
                                     "(on the H200, Llama-3-8B shape: level with 2 at 1, 64 "
                                     "and 128 streams; docs/benchmarks.md, session 22)."})
    fuse_projections: str = _auto_on_off(
        "Compute each attention's q/k/v and each MLP's gate/up projections as one matmul per "
        "group: three kernel launches fewer a layer, same tokens. auto: on with MLX's CUDA "
        "backend (a decode step at 64 rows ~20%% faster on the H200), off elsewhere (no gain "
        "on the CPU).")
    fast_decode_blocks: str = _auto_on_off(
        "Decode steps of llama/qwen2, Gemma 3 and GPT-OSS blocks in fewer kernel launches: "
        "one RoPE for q and k (Gemma 3: one norm too), and on CUDA llama/qwen2's residual "
        "adds inside the o and down GEMMs (tokens may then differ from mlx-lm's at "
        "near-ties). Needs fused projections. auto: on where projections are fused and decode "
        "attention runs the CUDA kernel (llama, 64 streams: ~6%% more tokens/s on the H200), "
        "for the models that have such blocks.")
    parallel_kernel_compiles: str = _auto_on_off(
        "Before the warm-up, compile MLX's quantized GEMM kernels for each of the model's "
        "quantized layer shapes in processes of their own, one a CPU core (at most 16), "
        "instead of one after another as the warm-up meets them (25-72 s each on CUDA, once "
        "a machine: they are kept in the kernel cache). auto: on with MLX's CUDA backend for "
        "quantized models whose kernels this cache has not compiled yet.")
    experiments: str = dataclasses.field(
        default="", metadata={"help": "Comma-separated experimental CUDA decode paths to turn "
                                      "on, for A/B runs (may change or go): rope-in-kernel (the "
                                      "attention kernel rotates the fused q/k/v projection's "
                                      "output itself: less host time a step, more device "
                                      "time; see docs/benchmarks.md), register-kv (the "
                                      "CUDA-core attention kernel prefetches K/V into "
                                      "registers, as before it staged tiles through shared "
                                      "memory with cp.async; takes that kernel), "
                                      "block-tiles (the CUDA-core kernel's staged tiles "
                                      "copied by the whole block, a barrier an iteration, "
                                      "as before each warp copied its own tokens'; takes "
                                      "that kernel), "
                                      "unfused-prefill (every prefill attention as plain "
                                      "matmuls, as before prefill forwards went through "
                                      "MLX's fused cuDNN kernel at shapes padded to "
                                      "multiples of 512), unfused-masked-prefill (only "
                                      "causal forwards from a bucket-aligned start padded "
                                      "to cuDNN; masked ones of 256+ queries, rows at "
                                      "different starts or windows, as plain matmuls), "
                                      "unaligned-chunks (prompt chunks end wherever the "
                                      "step's budget does, as before they were cut back to "
                                      "the 512 edges of the bucketed prefill), "
                                      "unpadded-tails (a step's lone prompt chunk runs "
                                      "at its own length, as before it was padded to a "
                                      "multiple of 256 tokens where no bucket pads "
                                      "it), "
                                      "mixed-forward (a step's lone prompt chunk runs in "
                                      "its decode rows' forward, one weight read for both; "
                                      "llama and qwen2 blocks; slower than two forwards on "
                                      "the H200, session 24), cuda-core-attention (decode "
                                      "attention through the CUDA-core kernel, as before the "
                                      "tensor-core one became the default for heads up to "
                                      "128 wide on sm_80+), mma-attention (the tensor-core "
                                      "kernel for wider heads too: Gemma's 256, slower "
                                      "there), mma-wide-tiles (the tensor-core kernel with "
                                      "its tiles in up to 64 KiB of shared memory: more "
                                      "warps a block; every head size), gathered-latent "
                                      "(MLA layers decode over K/V gathered from the pool "
                                      "by the model's own code, as before the latent "
                                      "kernel), fused-own-prefill (prefill attention of "
                                      "layers with their own scores, MLA's, through MLX's "
                                      "fused call as before: cuDNN graphs per shape), "
                                      "unfused-qk-norm (a decode step's per-head q/k norms "
                                      "and RoPE, Gemma 3's, through MLX's norm, multiply "
                                      "and RoPE as before, not one kernel), "
                                      "unfused-residual-norm (a decode step's sandwich "
                                      "norms and residual adds, Gemma 3's, through MLX's "
                                      "norms and adds as before, not one kernel a pair), "
                                      "unfused-qk-rope (a llama, qwen2 or GPT-OSS decode "
                                      "step's RoPE of q and k through MLX's copy and RoPE "
                                      "as before, not one kernel from the fused "
                                      "projection's output), unpaged-prefill (prefill "
                                      "attention of layers whose heads cuDNN does not "
                                      "take, Gemma's 256, through MLX's matmuls and a "
                                      "score matrix as before, not the paged prefill "
                                      "kernel), paged-short-rows (also rows of at most "
                                      "256 queries over a computed context where cuDNN "
                                      "takes the heads through the paged prefill kernel; "
                                      "slower on the H200 but for many short rows), "
                                      "unpadded-experts (quantized experts' projections "
                                      "at their own output sizes, as before they were "
                                      "padded to whole 128-row tiles for MLX's grouped "
                                      "kernel), unfused-moe (a decode step's "
                                      "mixture-of-experts routing and sum of its experts' "
                                      "outputs in mlx-lm's ops, ~20 launches a layer, not "
                                      "a kernel each), mlx-expert-matmuls (a decode step's "
                                      "4-bit expert projections through MLX's gather_qmm, "
                                      "as mlx-lm calls it, not kiln's tensor-core kernel), "
                                      "bf16-expert-rows (bfloat16 experts' projections "
                                      "through that kernel too, not MLX's gather_mm), "
                                      "batched-quantized-rows (a decode step's quantized "
                                      "Linear layers take its [rows, 1, dims] input as "
                                      "mlx-lm passes it, which MLX's CUDA GEMM runs as a "
                                      "one-row problem a row, not as one problem of all "
                                      "rows), quantized-rows-kernel (4-bit Linear layers' "
                                      "steps of up to 256 rows through kiln's experts' "
                                      "kernel as one expert, not MLX's quantized GEMM), "
                                      "bf16-rows-kernel (bfloat16 Linear layers' steps of "
                                      "up to 128 rows likewise, not cuBLAS's GEMM), "
                                      "wide-cache (MLX's buffer cache capped at half "
                                      "the device memory left beside the pool, not a "
                                      "quarter), array-readback (a step's tokens read from "
                                      "their own arrays, not through the worker's ring of "
                                      "host-read buffers: MLX later frees each such array's "
                                      "buffer with cudaFree, which waits for the steps in "
                                      "flight; also launches inline), inline-launch (steps "
                                      "and prefill forwards put on the device by MLX from "
                                      "the worker's main thread between building steps, "
                                      "not from a thread of their own while the next step "
                                      "is built)."})
    eager_decode: bool = dataclasses.field(
        default=False, metadata={"help": "Run decode forwards through the model's Python code "
                                         "every step instead of replaying mx.compile traces "
                                         "(the default where decode attention runs the CUDA "
                                         "kernel; the only way elsewhere)."})
    compile_prefill: bool = dataclasses.field(
        default=False, metadata={"help": "Replay a prefill forward from an mx.compile trace once "
                                         "its shape recurs, instead of building every one through "
                                         "the model's Python code (GPU only; experimental: served "
                                         "on the H200 with varied prompt lengths it cut a hybrid "
                                         "model's tokens/s at 64 streams 2.5x, docs/benchmarks.md; "
                                         "dense models unmeasured there)."})
    log_level: str = dataclasses.field(
        default="info", metadata={"choices": ("debug", "info", "warning", "error"),
                                  "help": "Logging level of every process."})
    ready_timeout: float = dataclasses.field(
        default=900.0, metadata={"help": "Seconds each process may take to report ready "
                                         "(model download and load included)."})
    shutdown_timeout: float = dataclasses.field(
        default=10.0, metadata={"help": "Seconds in-flight requests get to finish after "
                                        "SIGINT/SIGTERM before they are aborted."})
    watchdog_timeout: float = dataclasses.field(
        default=-1.0, metadata={"help": "Seconds one step may keep the worker (building it, "
                                        "or waiting for the device) before the worker writes "
                                        "every thread's stack to its log and exits, taking "
                                        "the server down so a supervisor can restart it, "
                                        "rather than leaving its requests hanging. -1 (the "
                                        "default): 300 on a GPU, off on the CPU, where a "
                                        "large model's 8,192-token prefill step can take "
                                        "minutes; 0: off; else at least 5."})
    run_dir: str = dataclasses.field(
        default="", metadata={"cli": False, "help": "Private directory (0700) of the ipc:// "
                                                    "endpoints."})
    api_key: str = dataclasses.field(
        default="", repr=False,
        metadata={"help": "Require 'Authorization: Bearer <key>' on every HTTP route but "
                          "/health, and this key in ZMQ client requests. Empty: the "
                          "KILN_API_KEY environment variable (hidden from ps, unlike the "
                          "flag); unset too: no authentication."})
    max_request_bytes: int = dataclasses.field(
        default=8 * 2**20, metadata={"help": "Largest HTTP request body in bytes; a larger "
                                             "one is refused with 413 before parsing."})
    trust_remote_code: bool = dataclasses.field(
        default=False, metadata={"help": "Allow models that need code shipped with them "
                                         "(config.json auto_map or model_file, or a "
                                         "model_type mlx-lm lacks); it runs as this user."})

    chat_template: str = dataclasses.field(
        default="", metadata={"help": "A Jinja chat template, or a file holding one, in place "
                                      "of the model's (a model without one then serves chat "
                                      "too)."})
    chat_template_text: str = dataclasses.field(
        default="", metadata={"cli": False, "help": "--chat-template's text, read by the "
                                                   "launcher."})
    chat_template_kwargs: str = dataclasses.field(
        default="", metadata={"help": "A JSON object of chat template variables every "
                                      "request gets unless it sets them itself, e.g. "
                                      "'{\"enable_thinking\": false}'."})
    sampling_defaults: str = dataclasses.field(
        default="model", metadata={"choices": ("model", "openai"), "help": (
            "Sampling settings a request leaves out: 'model' takes the model maker's "
            "(temperature, top_p, top_k, min_p, repetition_penalty from its "
            "generation_config.json, where it sets them, and its max_new_tokens as a chat "
            "turn's length), 'openai' OpenAI's (temperature 1, no filters, no penalty).")})
    override_generation_config: str = dataclasses.field(
        default="", metadata={"help": "A JSON object of generation_config fields (temperature, "
                                      "top_p, top_k, min_p, repetition_penalty, "
                                      "max_new_tokens) that requests leaving them out get, "
                                      "over the model's own, e.g. '{\"temperature\": 0.7}'."})
    tool_parser: str = dataclasses.field(
        default="auto", metadata={"help": "The model's tool-call format: 'auto' (from the "
                                          "tokenizer config and chat template), 'none', or "
                                          "a format name (hermes, llama3_json, mistral, "
                                          "harmony, deepseek_v3, deepseek_v31, kimi_k2, "
                                          "json, or one of mlx-lm's tool parsers)."})
    reasoning_inline: bool = dataclasses.field(
        default=False, metadata={"help": "Keep a reasoning model's thinking inline in the "
                                         "answer's text instead of apart (requests may "
                                         "still choose either)."})

    def __post_init__(self) -> None:
        if self.context_length < 0:
            raise ValueError("--context-length must be >= 0 (0: the model's)")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.chunked_prefill_size < 0:
            raise ValueError("--chunked-prefill-size must be >= 0 (0: by device)")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")
        if self.max_prefill_tokens_while_decoding < 0:
            raise ValueError("--max-prefill-tokens-while-decoding must be >= 0 (0: auto)")
        if self.prefill_spread < 0:
            raise ValueError("--prefill-spread must be >= 0 (0: by device, 1: off)")
        self.prefill_padding_share  # refuses a value that is neither auto nor a share
        if not 0.0 <= self.window_ratio <= 1.0:
            raise ValueError("--window-ratio must be in [0, 1]")
        if self.watchdog_timeout not in (-1, 0) and self.watchdog_timeout < MIN_WATCHDOG_SECONDS:
            raise ValueError(f"--watchdog-timeout must be -1 (by device), 0 (off) or at least "
                             f"{MIN_WATCHDOG_SECONDS:g} s: the worker may wait a second "
                             "for the scheduler's next step while its watchdog is armed")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError("--mem-fraction must be in (0, 1]")
        if self.max_total_tokens < 0:
            raise ValueError("--max-total-tokens must be >= 0")
        if self.max_request_bytes < 1:
            raise ValueError("--max-request-bytes must be >= 1")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError("--schedule-policy must be fcfs or lpm")
        unknown = self.experiment_set - set(DECODE_EXPERIMENTS)
        if unknown:
            raise ValueError(f"--experiments: unknown {sorted(unknown)}; known: "
                             f"{', '.join(DECODE_EXPERIMENTS)}")
        if conflict := kernel_body_conflict(self.experiment_set):
            raise ValueError(conflict)
        if "rope-in-kernel" in self.experiment_set and "off" in (self.fast_decode_blocks,
                                                                 self.fuse_projections):
            raise ValueError("--experiments rope-in-kernel runs inside the fast decode blocks: "
                             "drop --fast-decode-blocks off / --fuse-projections off")
        if "mixed-forward" in self.experiment_set and self.prefill_spread > 1:
            raise ValueError("--experiments mixed-forward and --prefill-spread both decide how "
                             "a step that decodes runs its prefill (in the decode forward, "
                             "or over several steps): choose one")
        if not 1 <= self.steps_in_flight <= 4:
            raise ValueError("--steps-in-flight must be in [1, 4]")
        if self.steps_in_flight != 2 and (self.disable_overlap or self.overlap == "off"):
            raise ValueError("--steps-in-flight applies with overlap only: drop it, or "
                             "--overlap off / --disable-overlap")
        if self.disable_overlap and self.overlap == "on":
            raise ValueError("--disable-overlap contradicts --overlap on")
        if self.fast_decode_blocks == "on" and self.fuse_projections == "off":
            raise ValueError("--fast-decode-blocks needs fused projections "
                             "(drop --fuse-projections off)")

    @property
    def prefill_padding_share(self) -> float | None:
        """--prefill-padding as a number; None for auto (the backend's own)."""
        if self.prefill_padding == "auto":
            return None
        try:
            share = float(self.prefill_padding)
        except ValueError:
            share = -1.0
        if not share >= 0:  # NaN too
            raise ValueError("--prefill-padding must be auto or a number >= 0")
        return share

    @property
    def experiment_set(self) -> frozenset[str]:
        return frozenset(name.strip() for name in self.experiments.split(",") if name.strip())

    # NOTE: endpoints live in run_dir, which the launcher creates with mode 0700, so no
    # other user can connect to our internal sockets.
    def _ipc(self, name: str) -> str:
        return f"ipc://{Path(self.run_dir) / name}"

    @property
    def launcher_endpoint(self) -> str:
        return self._ipc("launcher")

    @property
    def scheduler_endpoint(self) -> str:
        """Requests from the tokenizer and step results from the worker share this pipe."""
        return self._ipc("scheduler")

    @property
    def worker_endpoint(self) -> str:
        return self._ipc("worker")

    @property
    def detokenizer_endpoint(self) -> str:
        return self._ipc("detokenizer")

    @property
    def tokenizer_endpoint(self) -> str:
        return self._ipc("tokenizer")

    @property
    def client_port(self) -> int:
        return self.zmq_port or self.port + 1

    @property
    def client_endpoint(self) -> str:
        """TCP address that programmatic clients connect to (printed at start-up)."""
        return f"tcp://{self.host}:{self.client_port}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def chunk_size(self, fused_long_prefill: bool = False) -> int:
        """Largest prefill chunk, never above the per-step prefill budget. By default
        (--chunked-prefill-size 0) twice mlx-lm's 2,048 where the worker's long prefill
        attention is fused at bucketed shapes: its scores never exist in memory, and one
        4,096 forward beat two of 2,048 on the H200 by ~11% (docs/benchmarks.md, session
        18); the worker decides (WorkerReady.chunk_size)."""
        default = LONG_PREFILL_CHUNK if fused_long_prefill else PREFILL_CHUNK
        return min(self.chunked_prefill_size or default, self.max_prefill_tokens)

    def watchdog_seconds(self, on_gpu: bool) -> float:
        """--watchdog-timeout resolved (0: off)."""
        if self.watchdog_timeout == -1:
            return AUTO_WATCHDOG_SECONDS if on_gpu else 0.0
        return self.watchdog_timeout

    def spread_parts(self, on_cuda: bool, most: int) -> int:
        """--prefill-spread resolved: `most` is how many parts this model's prefill
        forwards can take (its blocks; 1 where they run whole). By default 8 on CUDA, the
        one backend it was measured on (docs/benchmarks.md, sessions 37-39 and 53), and none
        beside --experiments mixed-forward, the other way a decode step carries prefill."""
        wanted = self.prefill_spread
        if not wanted:
            auto = on_cuda and "mixed-forward" not in self.experiment_set
            wanted = AUTO_PREFILL_SPREAD if auto else 1
        return max(1, min(wanted, most))

    def decode_first_tokens(self, parts: int) -> int:
        """--max-prefill-tokens-while-decoding resolved for a spread of `parts`."""
        if self.max_prefill_tokens_while_decoding:
            return self.max_prefill_tokens_while_decoding
        return SPREAD_DECODE_FIRST_TOKENS if parts > 1 else DECODE_FIRST_TOKENS

    def process_title(self, role: str) -> str:
        return f"{PROJECT_NAME}:{role}"


def cli_fields() -> list[dataclasses.Field]:
    """Fields exposed as command-line flags, in declaration order."""
    return [f for f in dataclasses.fields(ServerConfig) if f.metadata.get("cli", True)]


def default_run_root() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
