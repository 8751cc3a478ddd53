#!/usr/bin/env bash
# One H200 device call's worth of measurements (under 10 minutes), in this order:
# the CUDA kernel and worker tests, the in-process step breakdown on the 8B-shaped model, then kiln
# and mlx_lm.server side by side (bench/h200_run.sh). Each part has its own time limit,
# so a hang in one still leaves the others' results in $OUT.
#
#   OUT=$OUT bash bench/h200_session.sh
#   PARTS=tests,breakdown OUT=$OUT bash bench/h200_session.sh    # then, in a second call:
#   PARTS=sweep SERVERS=kiln,kiln_eager,mlx_lm SWEEP_SECONDS=480 OUT=$OUT bash bench/h200_session.sh
#   PARTS=mixed OUT=$OUT bash bench/h200_session.sh    # decode first against one budget, ~6 min
#   MIXED_STEADY=0 MIXED_ARMS=default PARTS=mixed OUT=$OUT bash bench/h200_session.sh  # a wave's prefill rate
#   (MIXED_BURST_OUTPUT=1: the prefill rate with no decode-first bound in play)
#   FAMILY=qwen3_5-9b PARTS=prefix OUT=$OUT bash bench/h200_session.sh    # one call each:
#   FAMILY=qwen3_5-9b PARTS=longctx OUT=$OUT bash bench/h200_session.sh
#
# prefix: bench/prefix_cache.py, kiln alone: TTFT of a PREFIX_TOKENS prompt cold and of a
# follow-up extending it (a hybrid model hits only at a previous prompt's end), the cached
# tokens each read, and a shared system prompt with the radix cache on and off.
# longctx: LONGCTX_STREAMS streams of LONGCTX_WORDS-word prompts (~1.06 tokens a word with
# the demo tokenizer: 7,400 words ~7,800 tokens, which with 256 output tokens fits the
# Llama shape's 8,192 context), kiln and mlx_lm.server side by side, kiln's KV memory per
# request polled from /get_server_info (bench/h200_compare.py --kv-probe); in $OUT/longctx.
# mlx-lm's Gated DeltaNet kernel is Metal-only: on CUDA mlx_lm.server prefills those layers
# through its ops fallback, one recurrent step per token (kiln runs its own CUDA kernel,
# worker_proc/gated_delta_cuda.py), so hybrids' 8k prompts are slow there.
# CPU smoke test of a part: FAMILY=qwen3_5-tiny (DTYPE=float32 for MoE shapes), the sizes
# below made small.
#
# Needs PYTHONPATH with MLX's CUDA build and the repo (../shared/gpu/README.md's two
# install calls, then export PYTHONPATH=~/site:$PWD). `bash bench/device_wheels.sh` makes
# the folders those calls carry, with every wheel kiln needs there, each under a call's
# 64 MiB (the timeline part's CUPTI wheels need a third call: its header says how).
# With pytest-xdist the tests parts run in TEST_WORKERS processes: on a fresh machine most
# of their time is the kernels' first compiles (NVRTC), which then run side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PYTHON=${PYTHON:-python3}
FAMILY=${FAMILY:-}  # a bench/family_models.py shape (gemma3-12b, gpt-oss-20b, qwen3_5-9b,
                    # qwen3_next-64e, moonlight-16b: MLA, qwen3-8b, qwen3_moe-32e);
                    # empty: Llama-3-8B
DTYPE=${DTYPE:-bfloat16}  # float32 for CPU smoke tests of MoE shapes (MLX's CPU gather_mm)
QUANTIZE=${QUANTIZE:-}  # a family model quantized as mlx_lm.convert -q would: MODE[:BITS[:GROUP]],
                        # e.g. mxfp4 (GPT-OSS as it ships) or affine:4:64
MODEL=${MODEL:-$HOME/.cache/kiln/bench/${FAMILY:-llama3-8b-shape}-$DTYPE${QUANTIZE:+-${QUANTIZE//:/-}}}
LENGTH_SPREAD=${LENGTH_SPREAD:-0.5}  # prompt lengths uniform in 100 words * (1 +- this): the
                                    # issues' +-50% (sessions 15-21 ran 0.2)
KILN_ARGS=${KILN_ARGS:-}  # extra launch.py flags, e.g. "--log-level debug"
KILN_WATCHDOG=${KILN_WATCHDOG:-90}  # kiln's --watchdog-timeout here: a hung step ends its
                                   # server (stacks in its log) within a part's time, not
                                   # the call's (session 54 lost 7 minutes to one); 0: the
                                   # flag left out (a KILN_B_TREE from before session 54)
[ "$KILN_WATCHDOG" = 0 ] || KILN_ARGS="--watchdog-timeout $KILN_WATCHDOG $KILN_ARGS"
SERVERS=${SERVERS:-kiln,mlx_lm}  # or kiln,kiln_b,mlx_lm (then raise SWEEP_SECONDS)
SWEEP_SECONDS=${SWEEP_SECONDS:-270}
CONCURRENCY=${CONCURRENCY:-1,64,128}  # sweep: the streams of each level
NUM_REQUESTS=${NUM_REQUESTS:-4,64,128}  # per concurrency level (2x: two waves)
READY_TIMEOUT=${READY_TIMEOUT:-300}  # sweep and longctx: seconds a server may take to answer
                                    # (kiln's processes' stacks go to its log at the limit)
KILN_B_ARGS=${KILN_B_ARGS:-}  # server kiln_b (in SERVERS): kiln with these flags added
KILN_B_ENV=${KILN_B_ENV:-}    # ... and this environment (K=V ...), for A/B runs
KILN_B_TREE=${KILN_B_TREE:-}  # ... run from this directory's kiln (another commit's files:
                              # bench/h200_compare.py --kiln-b-tree), e.g. a before/after A/B
KILN_C_ARGS=${KILN_C_ARGS:-}  # server kiln_c (in SERVERS): a second variant's flags
ROUNDS=${ROUNDS:-1}  # sweep: above 1, every server up at once and this many interleaved
                    # sweeps of each (bench/h200_compare.py --rounds), for A/B figures
                    # on a host whose speed drifts (session 29: one tree 3,082-4,300 tok/s);
                    # every server must fit the card at once (two 12B ones do not on an H100)
PRIME=${PRIME:-1}  # sweep and mixed: a kiln server started (and used) and stopped first,
                   # unmeasured (the first on a fresh machine runs slower;
                   # bench/h200_compare.py prime)
ATTENTION_ARGS=${ATTENTION_ARGS:-}  # part attention: extra flags, e.g. "--stages 0,4,8"
TIMELINE_ARGS=${TIMELINE_ARGS:-}  # part timeline: its flags (default --batch-sizes 1,64,128);
                                  # mixed steps: "--batch-sizes 36 --context 2048 --chunks 0,256,512"
MLX_BACKLOG=${MLX_BACKLOG:-1024}  # mlx_lm.server's listen backlog (0: its own 5; see
                               # bench/mlx_lm_server_backlog.py)
TEST_WORKERS=${TEST_WORKERS:-4}  # tests and families parts: processes (pytest-xdist, if there)
MOE_EXPERTS=${MOE_EXPERTS:-bf16}  # part moe: bench/moe_layers.py --experts (bf16, mxfp4)
MOE_ROWS=${MOE_ROWS:-64,128,8}     # ... and its --rows
PARTS=${PARTS:-tests,breakdown,sweep}  # which parts to run (the model is made for any;
                                       # also: families, tests/test_gpu_families.py;
                                       # timeline, bench/device_timeline.py (needs
                                       # cupti-python); attention, bench/attention_kernel.py;
                                       # prefix; longctx; mixed, bench/mixed_traffic.py;
                                       # prefill, step_breakdown.py --prefill-steps;
                                       # moe, the experts' kernel tests,
                                       # bench/moe_layers.py, bench/skinny_gemm.py)
BREAKDOWN_VARIANTS=${BREAKDOWN_VARIANTS:-}  # step_breakdown --variants (';'-joined; default all)
BREAKDOWN_ROUNDS=${BREAKDOWN_ROUNDS:-1}  # step_breakdown --rounds (interleaved repeats; the
                                        # host's speed drifts, so A/B runs want 3 or more)
PREFILL_SCENARIOS=${PREFILL_SCENARIOS:-all}  # part prefill: step_breakdown.py's PREFILL_STEPS names
PREFILL_VARIANTS=${PREFILL_VARIANTS:-}  # ... and its variants (';'-joined; default all)
PREFILL_RUNS=${PREFILL_RUNS:-6}
PREFIX_TOKENS=${PREFIX_TOKENS:-4000}  # part prefix: the cold prompt's tokens
PREFIX_ARGS=${PREFIX_ARGS:-}  # ... more bench/prefix_cache.py flags, e.g. "--num-requests 16"
LONGCTX_WORDS=${LONGCTX_WORDS:-7400}
LONGCTX_STREAMS=${LONGCTX_STREAMS:-32}
LONGCTX_REQUESTS=${LONGCTX_REQUESTS:-32}  # one wave (after an unmeasured warm-up wave); a
                                         # hybrid's prefill is slow on CUDA (above)
LONGCTX_OUTPUT=${LONGCTX_OUTPUT:-256}
LONGCTX_SECONDS=${LONGCTX_SECONDS:-360}  # the part stops at this + 60 s (the prefix part at 420)
LONGCTX_SERVERS=${LONGCTX_SERVERS:-kiln,mlx_lm}
# part mixed (bench/mixed_traffic.py): one server per arm, a --max-prefill-tokens-while-decoding
# value each ("default": the server's own; off: one budget for every step, no spread)
MIXED_ARMS=${MIXED_ARMS:-default,off}
MIXED_STEADY=${MIXED_STEADY:-32}  # streams decoding through the burst; 0: the burst alone,
                                  # whose "prefill t/s" is a wave's prefill rate (issue 20)
MIXED_STEADY_SECONDS=${MIXED_STEADY_SECONDS:-15}  # measured before the burst: its p99 is
                                  # set by the slowest 1% of its steps (all streams share
                                  # each), ~4 of 5 s's ~400 on Gemma-3-12B, which moved
                                  # the ratio's denominator 15.3-19.3 ms between runs of
                                  # one tree (sessions 55-56); 15 s, ~1,200 steps
MIXED_STEADY_OUTPUT=${MIXED_STEADY_OUTPUT:-3000}  # the streams' tokens: through most of
                                  # the burst (their end is steady_ended_during_burst)
MIXED_BURST_OUTPUT=${MIXED_BURST_OUTPUT:-64}  # the burst's output tokens; 1: no burst
                                  # request decodes, so no decode-first bound slows its prefill
MIXED_BURST_REQUESTS=${MIXED_BURST_REQUESTS:-64}  # the burst's prompts (of 4,096 tokens)
MIXED_BURST_SPREAD=${MIXED_BURST_SPREAD:-0}  # ... each 4,096 * (1 +- this) tokens
MIXED_VARIANTS=${MIXED_VARIANTS:-}  # ';'-joined launch flags, each arm run under each
                                    # (A/B on one machine: ";--experiments mixed-forward")
GPU_SAMPLE_MS=${GPU_SAMPLE_MS:-0}  # above 0: the card's SM clock, power and clock-event
                                   # reasons (nvidia-smi) every this many ms, for the whole
                                   # call, into $OUT/gpu_samples.csv, summed up at its end:
                                   # whether the card capped its clocks during a part
                                   # (session 57: a software power cap for ~3 s at each
                                   # burst's start, SM clock 1,770-1,860 against 1,980 MHz).
                                   # The polling may slow the host: leave it off for A/B
if [ -n "$QUANTIZE" ] && [ -z "$FAMILY" ]; then
    echo "QUANTIZE needs FAMILY (bench/family_models.py makes quantized models)" >&2
    exit 2
fi
mkdir -p "$OUT"
has() { [[ ",$PARTS," == *",$1,"* ]]; }

# GPU_SAMPLE_MS's summary: samples, the SM clock's lowest and median, and how many samples
# named each clock-event reason (nvidia-smi's bits; idle apart).
gpu_summary() {
    echo "== the card's clocks ($OUT/gpu_samples.csv)"
    "$PYTHON" - "$OUT/gpu_samples.csv" <<'PY'
import statistics, sys
names = {2: "applications clocks", 4: "software power cap", 8: "hardware slowdown",
         16: "sync boost", 32: "software thermal", 64: "hardware thermal",
         128: "hardware power brake"}
clocks, hits = [], dict.fromkeys(names, 0)
for line in open(sys.argv[1], errors="replace"):
    fields = [f.strip() for f in line.split(",")]
    if len(fields) < 5 or not fields[1].endswith("MHz"):
        continue
    clocks.append(int(fields[1].split()[0]))
    for bit in names:
        hits[bit] += bool(int(fields[4], 16) & bit)
if not clocks:
    print("no samples")
else:
    print(f"{len(clocks)} samples, SM clock lowest {min(clocks)}, median "
          f"{statistics.median_low(clocks)} MHz")
    for bit, n in hits.items():
        if n:
            print(f"  {names[bit]}: {n} samples")
PY
}
if [ "$GPU_SAMPLE_MS" -gt 0 ]; then
    # Drivers before 535 name the reasons clocks_throttle_reasons.
    for reasons in clocks_event_reasons clocks_throttle_reasons; do
        nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,$reasons.active \
            --format=csv,noheader -lms "$GPU_SAMPLE_MS" > "$OUT/gpu_samples.csv" 2>&1 &
        SAMPLER=$!
        sleep 1
        kill -0 "$SAMPLER" 2>/dev/null && break
    done
    trap 'kill "$SAMPLER" 2>/dev/null; gpu_summary' EXIT
fi
# Every part's `timeout` runs --foreground: in this script's process group, so a timeout
# around the whole script (a device call's) reaches the Python under it, whose SIGTERM
# handler stops its servers (h200_run.sh passes it on to its own). Without it each part's
# timeout made a group of its own, and a server outlived the call, holding the GPU's
# memory (session 36: the next servers ran out of memory). The price: a part's own
# timeout signals only its direct child (pytest's -k KILL reaches its xdist workers
# only through their parent's exit).
export PYTHONUNBUFFERED=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1

# pytest-xdist's workers where it is installed (the tests compile kernels in parallel).
XDIST=()
if "$PYTHON" -c "import xdist" 2>/dev/null && [ "$TEST_WORKERS" -gt 1 ]; then
    XDIST=(-n "$TEST_WORKERS")
fi

if has tests; then
echo "== kernel tests"
# The CUDA paths' tests (the GPU-only ones and the worker's in-place, compiled and staging
# ones); failures are listed one a line, and a run at its time limit gets SIGINT first
# (pytest then prints what passed and failed so far: a plain kill loses its piped output).
# On a fresh machine the kernels' first compiles make this ~4x its warm 105 s (session 19:
# 330 s were not enough), so run it first in a call of its own.
timeout --foreground -s INT -k 15 540 "$PYTHON" -m pytest -q -p no:cacheprovider -rf --tb=line --durations=8 "${XDIST[@]}" tests/test_paged_attention.py \
    tests/test_decode_block.py tests/test_gated_delta_cuda.py tests/test_worker.py \
    tests/test_fused_moe.py \
    -k "kernel or in_place or staging or state or attention or block or cuda" > "$OUT/kernel_tests.txt" 2>&1
tail -22 "$OUT/kernel_tests.txt"
fi

if has families; then
echo "== every architecture family on the CUDA path, against mlx-lm's forward"
timeout --foreground -s INT -k 15 540 "$PYTHON" -m pytest -q -p no:cacheprovider -rf --tb=line "${XDIST[@]}" tests/test_gpu_families.py \
    > "$OUT/family_tests.txt" 2>&1
tail -12 "$OUT/family_tests.txt"
fi

if has moe; then
echo "== experts' kernel: its CUDA tests, then GPT-OSS-20B's MoE layers alone ($MOE_EXPERTS)"
timeout --foreground -s INT -k 15 240 "$PYTHON" -m pytest -q -p no:cacheprovider -rf --tb=line \
    tests/test_fused_moe.py -k "cuda_expert_rows or cuda_bf16_expert_rows or cuda_linear_rows" > "$OUT/moe_tests.txt" 2>&1
tail -6 "$OUT/moe_tests.txt"
timeout --foreground 300 "$PYTHON" bench/moe_layers.py --experts "$MOE_EXPERTS" --rows "$MOE_ROWS" \
    2>&1 | tee "$OUT/moe_layers.txt"
echo "== the same kernel as one projection against MLX's bf16 and 4-bit matmuls (bench/skinny_gemm.py)"
timeout --foreground 150 "$PYTHON" bench/skinny_gemm.py --rows 1,8,64,128,256 --weights affine:64 \
    --layers 8 2>&1 | tee "$OUT/skinny_gemm.txt"
timeout --foreground 150 "$PYTHON" bench/skinny_gemm.py --rows 64,128 --weights bf16,mxfp4:32 \
    --layers 8 2>&1 | tee -a "$OUT/skinny_gemm.txt"
fi

# The parts that serve or run the model (tests, families and attention need none).
if has breakdown || has prefill || has timeline || has mixed || has sweep || has prefix || has longctx; then
echo "== model"
if [ -n "$FAMILY" ]; then
timeout --foreground 240 "$PYTHON" bench/family_models.py "$FAMILY" "$MODEL" --dtype "$DTYPE" \
    ${QUANTIZE:+--quantize "$QUANTIZE"} 2>&1 | grep -v "RANDOM WEIGHTS"
else
timeout --foreground 90 "$PYTHON" - "$MODEL" "$DTYPE" <<'PY' 2>&1 | grep -v "RANDOM WEIGHTS"
import sys
from pathlib import Path
from bench.h200_compare import LLAMA3_8B, make_random_model
make_random_model(LLAMA3_8B, sys.argv[2], Path(sys.argv[1]), 0)
PY
fi
fi

if has breakdown; then
echo "== step breakdown"
timeout --foreground $((150 + 90 * BREAKDOWN_ROUNDS)) "$PYTHON" bench/step_breakdown.py --model "$MODEL" --batch-sizes 1,64,128 --steps 16 \
    --prefill-batches 1,64 --profile-batch 128 --rounds "$BREAKDOWN_ROUNDS" \
    ${BREAKDOWN_VARIANTS:+--variants "$BREAKDOWN_VARIANTS"} \
    2>&1 | grep -v "RANDOM WEIGHTS" | tee "$OUT/step_breakdown.txt"
fi

if has prefill; then
echo "== prefill steps: host graph build, launch, wait (long prompts, 2048-token forwards)"
timeout --foreground 400 "$PYTHON" bench/step_breakdown.py --model "$MODEL" --batch-sizes "" \
    --prefill-steps "$PREFILL_SCENARIOS" --prefill-runs "$PREFILL_RUNS" \
    ${PREFILL_VARIANTS:+--prefill-variants "$PREFILL_VARIANTS"} \
    2>&1 | grep -v "RANDOM WEIGHTS" | tee "$OUT/prefill_steps.txt"
fi

if has attention; then
echo "== decode attention kernel alone"
timeout --foreground 300 "$PYTHON" bench/attention_kernel.py --batch-sizes 1,64,128 ${ATTENTION_ARGS:-} \
    --json "$OUT/attention_kernel.json" \
    2>&1 | tee "$OUT/attention_kernel.txt"
fi

if has timeline; then
echo "== device timeline of the served decode step (CUPTI)"
# At its limit the part is stopped by SIGABRT, on which Python's faulthandler prints every
# thread's stack: a step that never ends says where. Unbuffered (-u): what was printed
# before a kill reaches the log.
PYTHONPATH=${PYTHONPATH:-}:$HOME/site_c LD_LIBRARY_PATH=$HOME/site_c/nvidia/cu13/lib:${LD_LIBRARY_PATH:-} \
    timeout --foreground -s ABRT 300 "$PYTHON" -u -X faulthandler bench/device_timeline.py --model "$MODEL" ${TIMELINE_ARGS:---batch-sizes 1,64,128} \
    --json "$OUT/device_timeline.json" 2>&1 | grep --line-buffered -v "RANDOM WEIGHTS" | tee "$OUT/device_timeline.txt"
fi

if has mixed; then
echo "== mixed traffic: $MIXED_STEADY streams decoding, $MIXED_BURST_REQUESTS x 4096-token prompts arrive"
# Each arm (start, warm-up, ~60 s of traffic, stop) should take ~2 minutes, 4 at most; the
# part stops after 520 s (a device call has 600), keeping the arms done in mixed.json.
arms=$(( $(tr ',' '\n' <<<"$MIXED_ARMS" | wc -l) * $(tr ';' '\n' <<<"${MIXED_VARIANTS:-x}" | wc -l) ))
timeout --foreground $((arms * 240 < 520 ? arms * 240 : 520)) "$PYTHON" bench/mixed_traffic.py \
    --model "$MODEL" --arms "$MIXED_ARMS" --kiln-args="$KILN_ARGS" --out "$OUT" \
    --steady-streams "$MIXED_STEADY" --steady-prompt-tokens 128 --steady-output-tokens "$MIXED_STEADY_OUTPUT" \
    --steady-seconds "$MIXED_STEADY_SECONDS" --burst-requests "$MIXED_BURST_REQUESTS" --burst-prompt-tokens 4096 --burst-output-tokens "$MIXED_BURST_OUTPUT" \
    --burst-length-spread "$MIXED_BURST_SPREAD" --variants "$MIXED_VARIANTS" \
    --json "$OUT/mixed.json" $( [ "$PRIME" = 1 ] && echo --prime ) 2>&1 \
    | grep -v "RANDOM WEIGHTS" | tee "$OUT/mixed.txt"
# With KILN_ARGS="--log-level debug": each arm's steps, and its slow ones (step_log.py).
for log in "$OUT"/mixed_*.log; do
    grep -q "DEBUG.*scheduler_proc: step" "$log" 2>/dev/null || continue
    echo "-- $(basename "$log")"
    "$PYTHON" bench/step_log.py "$log" --busy-rows $(( MIXED_STEADY > 16 ? MIXED_STEADY : 16 )) --table "${log%.log}_steps.txt" | head -40
done
fi

if has sweep; then
echo "== serving, side by side"
OUT=$OUT timeout --foreground $((SWEEP_SECONDS + 20)) bash bench/h200_run.sh --model-dir "$MODEL" \
    --total-seconds "$SWEEP_SECONDS" --servers "$SERVERS" \
    --concurrency "$CONCURRENCY" --num-requests "$NUM_REQUESTS" --kiln-args="$KILN_ARGS" \
    ${FAMILY:+--family "$FAMILY"} ${QUANTIZE:+--quantize "$QUANTIZE"} --dtype "$DTYPE" \
    --length-spread "$LENGTH_SPREAD" --ready-timeout "$READY_TIMEOUT" \
    --kiln-b-args="$KILN_B_ARGS" --kiln-b-env="$KILN_B_ENV" --kiln-c-args="$KILN_C_ARGS" \
    ${KILN_B_TREE:+--kiln-b-tree "$KILN_B_TREE"} --rounds "$ROUNDS" \
    --mlx-backlog "$MLX_BACKLOG" $( [ "$PRIME" = 1 ] && echo --prime ) 2>&1 | tail -40
for log in "$OUT"/kiln*.log; do
    echo "-- $(basename "$log")"; grep "steps/s" "$log" | tail -4
done
fi

if has prefix; then
echo "== prefix cache: a cached prompt's follow-up against cold (kiln)"
timeout --foreground 420 "$PYTHON" bench/prefix_cache.py --model "$MODEL" --prefix-tokens "$PREFIX_TOKENS" \
    --kiln-args="$KILN_ARGS" --out "$OUT" --json "$OUT/prefix_cache.json" $PREFIX_ARGS \
    2>&1 | grep -v "RANDOM WEIGHTS" | tail -4
fi

if has longctx; then
echo "== long context, side by side: $LONGCTX_STREAMS streams, $LONGCTX_WORDS-word prompts"
OUT=$OUT/longctx timeout --foreground $((LONGCTX_SECONDS + 60)) bash bench/h200_run.sh --model-dir "$MODEL" \
    ${FAMILY:+--family "$FAMILY"} ${QUANTIZE:+--quantize "$QUANTIZE"} --dtype "$DTYPE" --servers "$LONGCTX_SERVERS" \
    --ready-timeout "$READY_TIMEOUT" \
    --no-check --kv-probe --concurrency "$LONGCTX_STREAMS" --num-requests "$LONGCTX_REQUESTS" \
    --input-words "$LONGCTX_WORDS" --length-spread 0 --output-tokens "$LONGCTX_OUTPUT" \
    --total-seconds "$LONGCTX_SECONDS" --sweep-seconds "$LONGCTX_SECONDS" --request-timeout 400 \
    --kiln-args="$KILN_ARGS" --mlx-backlog "$MLX_BACKLOG" 2>&1 | tail -8
fi

# MLX's JIT-compiled CUDA kernels (its quantized GEMMs among them: CuTe sources through
# NVRTC, one module per tile size and format) land in its PTX cache, a file a module: their
# names and times say which compiles a start-up paid, and when. kiln's worker keeps its own
# under kiln's cache (worker_proc/kernel_cache.py); mlx_lm.server uses MLX's default.
ptx=${MLX_PTX_CACHE_DIR:-$("$PYTHON" -c 'import tempfile; print(tempfile.gettempdir())')/mlx}
find "$ptx" "${KILN_CACHE_DIR:-$HOME/.cache/kiln}/mlx-kernels" -name '*.ptx' \
    -printf '%TT %s %p\n' 2>/dev/null | sort > "$OUT/ptx_cache.log"
[ -s "$OUT/ptx_cache.log" ] || rm -f "$OUT/ptx_cache.log"

# At most 8 files come back from a device call: the two short reports travel as one,
# the logs as one archive.
cat "$OUT"/kernel_tests.txt "$OUT"/family_tests.txt "$OUT"/step_breakdown.txt "$OUT"/attention_kernel.txt "$OUT"/device_timeline.txt \
    "$OUT"/mixed.txt > "$OUT/session.txt" 2>/dev/null
rm -f "$OUT/kernel_tests.txt" "$OUT/family_tests.txt" "$OUT/step_breakdown.txt" "$OUT/attention_kernel.txt" "$OUT/device_timeline.txt" \
    "$OUT/mixed.txt"
[ -s "$OUT/session.txt" ] || rm -f "$OUT/session.txt"
if compgen -G "$OUT/*.log" >/dev/null; then
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log)
fi
if [ -d "$OUT/longctx" ]; then
    (cd "$OUT" && tar -czf longctx.tar.gz longctx && rm -rf longctx)
fi
