#!/usr/bin/env bash
# MLX's CUDA graph budgets against kiln's served decode step: one process per arm (MLX reads
# these variables once), arms interleaved over rounds because the H200 host's speed drifts.
#
#   OUT=$OUT bash bench/graph_limits.sh                # needs MODEL (h200_session.sh makes it)
#
# MLX's CUDA backend records kernels into a CUDA graph and launches it once the graph holds
# MLX_MAX_OPS_PER_BUFFER nodes or its inputs MLX_MAX_MB_PER_BUFFER million elements (not
# bytes); MLX_USE_CUDA_GRAPHS=0 launches each kernel directly. A served pool's layer
# (--pool-slots: the H200 server's size) is over the default element budget by itself.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-$HOME/.cache/kiln/bench/llama3-8b-shape-bfloat16}
ROUNDS=${ROUNDS:-2}
POOL_SLOTS=${POOL_SLOTS:-530000}  # > 512k: one layer's K/V over MLX's 1000M-element budget
BATCHES=${BATCHES:-1,64,128}
VARIANT=${VARIANT:-kiln, compiled, fused, fast blocks}
DEADLINE=${DEADLINE:-480}  # seconds after which no new arm starts
ARMS=${ARMS:-"default;MLX_MAX_MB_PER_BUFFER=100000;MLX_MAX_MB_PER_BUFFER=100000 MLX_MAX_OPS_PER_BUFFER=250;MLX_USE_CUDA_GRAPHS=0"}
mkdir -p "$OUT"
report="$OUT/graph_limits.txt"
start=$SECONDS
IFS=';' read -ra arms <<<"$ARMS"
for round in $(seq 1 "$ROUNDS"); do
    for arm in "${arms[@]}"; do
        if (( SECONDS - start > DEADLINE )); then
            echo "deadline: stopped before round $round, arm '$arm'" | tee -a "$report"
            exit 0
        fi
        settings=()
        [[ "$arm" != default ]] && read -ra settings <<<"$arm"
        echo "== round $round: $arm" | tee -a "$report"
        env "${settings[@]}" timeout 150 "$PYTHON" bench/step_breakdown.py --model "$MODEL" \
            --batch-sizes "$BATCHES" --steps 16 --pool-slots "$POOL_SLOTS" --variants "$VARIANT" \
            2>&1 | grep -E "^ +[0-9]+ |Error|error" | tee -a "$report"
    done
done
