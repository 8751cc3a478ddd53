#!/usr/bin/env bash
# One H200 device call's worth of measurements (under 10 minutes), in this order:
# the CUDA kernel and worker tests, the in-process step breakdown on the 8B-shaped model, then kiln
# and mlx_lm.server side by side (bench/h200_run.sh). Each part has its own time limit,
# so a hang in one still leaves the others' results in $OUT.
#
#   OUT=$OUT bash bench/h200_session.sh
#   PARTS=tests,breakdown OUT=$OUT bash bench/h200_session.sh    # then, in a second call:
#   PARTS=sweep SERVERS=kiln,kiln_eager,mlx_lm SWEEP_SECONDS=480 OUT=$OUT bash bench/h200_session.sh
#
# Needs PYTHONPATH with MLX's CUDA build and the repo (../shared/gpu/README.md's two
# install calls, then export PYTHONPATH=~/site:$PWD).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PYTHON=${PYTHON:-python3}
FAMILY=${FAMILY:-}  # a bench/family_models.py shape (gemma3-12b, gpt-oss-20b); empty: Llama-3-8B
MODEL=${MODEL:-$HOME/.cache/kiln/bench/${FAMILY:-llama3-8b-shape}-bfloat16}
LENGTH_SPREAD=${LENGTH_SPREAD:-0.2}  # prompt lengths uniform in 100 words * (1 +- this)
KILN_ARGS=${KILN_ARGS:-}  # extra launch.py flags, e.g. "--log-level debug"
SERVERS=${SERVERS:-kiln,mlx_lm}  # or kiln,kiln_b,mlx_lm (then raise SWEEP_SECONDS)
SWEEP_SECONDS=${SWEEP_SECONDS:-270}
NUM_REQUESTS=${NUM_REQUESTS:-4,64,128}  # per concurrency level 1,64,128 (2x: two waves)
KILN_B_ARGS=${KILN_B_ARGS:-}  # server kiln_b (in SERVERS): kiln with these flags added
KILN_B_ENV=${KILN_B_ENV:-}    # ... and this environment (K=V ...), for A/B runs
ATTENTION_ARGS=${ATTENTION_ARGS:-}  # part attention: extra flags, e.g. "--stages 0,4,8"
MLX_BACKLOG=${MLX_BACKLOG:-1024}  # mlx_lm.server's listen backlog (0: its own 5; see
                               # bench/mlx_lm_server_backlog.py)
PARTS=${PARTS:-tests,breakdown,sweep}  # which parts to run (the model is made for any;
                                       # also: timeline, bench/device_timeline.py (needs
                                       # cupti-python); attention, bench/attention_kernel.py;
                                       # prefill, step_breakdown.py --prefill-steps)
BREAKDOWN_VARIANTS=${BREAKDOWN_VARIANTS:-}  # step_breakdown --variants (';'-joined; default all)
BREAKDOWN_ROUNDS=${BREAKDOWN_ROUNDS:-1}  # step_breakdown --rounds (interleaved repeats; the
                                        # host's speed drifts, so A/B runs want 3 or more)
mkdir -p "$OUT"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1

if has tests; then
echo "== kernel tests"
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_paged_attention.py tests/test_decode_block.py \
    tests/test_worker.py -k "not test_batched_chunked" 2>&1 | tail -4 | tee "$OUT/kernel_tests.txt"
fi

echo "== model"
if [ -n "$FAMILY" ]; then
timeout 240 "$PYTHON" bench/family_models.py "$FAMILY" "$MODEL" 2>&1 | grep -v "RANDOM WEIGHTS"
else
timeout 90 "$PYTHON" - "$MODEL" <<'PY' 2>&1 | grep -v "RANDOM WEIGHTS"
import sys
from pathlib import Path
from bench.h200_compare import LLAMA3_8B, make_random_model
make_random_model(LLAMA3_8B, "bfloat16", Path(sys.argv[1]), 0)
PY
fi

if has breakdown; then
echo "== step breakdown"
timeout $((150 + 90 * BREAKDOWN_ROUNDS)) "$PYTHON" bench/step_breakdown.py --model "$MODEL" --batch-sizes 1,64,128 --steps 16 \
    --prefill-batches 1,64 --profile-batch 128 --rounds "$BREAKDOWN_ROUNDS" \
    ${BREAKDOWN_VARIANTS:+--variants "$BREAKDOWN_VARIANTS"} \
    2>&1 | grep -v "RANDOM WEIGHTS" | tee "$OUT/step_breakdown.txt"
fi

if has prefill; then
echo "== prefill steps: host graph build, launch, wait (long prompts, 2048-token forwards)"
timeout 400 "$PYTHON" bench/step_breakdown.py --model "$MODEL" --batch-sizes "" \
    --prefill-steps all --prefill-runs 6 \
    2>&1 | grep -v "RANDOM WEIGHTS" | tee "$OUT/prefill_steps.txt"
fi

if has attention; then
echo "== decode attention kernel alone"
timeout 300 "$PYTHON" bench/attention_kernel.py --batch-sizes 1,64,128 ${ATTENTION_ARGS:-} \
    --json "$OUT/attention_kernel.json" \
    2>&1 | tee "$OUT/attention_kernel.txt"
fi

if has timeline; then
echo "== device timeline of the served decode step (CUPTI)"
PYTHONPATH=${PYTHONPATH:-}:$HOME/site_c LD_LIBRARY_PATH=$HOME/site_c/nvidia/cu13/lib:${LD_LIBRARY_PATH:-} \
    timeout 300 "$PYTHON" bench/device_timeline.py --model "$MODEL" --batch-sizes 1,64,128 \
    --json "$OUT/device_timeline.json" 2>&1 | grep -v "RANDOM WEIGHTS" | tee "$OUT/device_timeline.txt"
fi

if has sweep; then
echo "== serving, side by side"
OUT=$OUT timeout $((SWEEP_SECONDS + 20)) bash bench/h200_run.sh --model-dir "$MODEL" \
    --total-seconds "$SWEEP_SECONDS" --servers "$SERVERS" \
    --concurrency 1,64,128 --num-requests "$NUM_REQUESTS" --kiln-args="$KILN_ARGS" \
    ${FAMILY:+--family "$FAMILY"} --length-spread "$LENGTH_SPREAD" \
    --kiln-b-args="$KILN_B_ARGS" --kiln-b-env="$KILN_B_ENV" --mlx-backlog "$MLX_BACKLOG" \
    2>&1 | tail -18
for log in "$OUT"/kiln*.log; do
    echo "-- $(basename "$log")"; grep "steps/s" "$log" | tail -4
done
fi

# At most 8 files come back from a device call: the two short reports travel as one,
# the logs as one archive.
cat "$OUT"/kernel_tests.txt "$OUT"/step_breakdown.txt "$OUT"/attention_kernel.txt "$OUT"/device_timeline.txt \
    > "$OUT/session.txt" 2>/dev/null
rm -f "$OUT/kernel_tests.txt" "$OUT/step_breakdown.txt" "$OUT/attention_kernel.txt" "$OUT/device_timeline.txt"
[ -s "$OUT/session.txt" ] || rm -f "$OUT/session.txt"
if compgen -G "$OUT/*.log" >/dev/null; then
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log)
fi
