#!/usr/bin/env bash
# The decode step under settings of MLX's CUDA backend that are read once per process
# (so one process each): how many ops go into one CUDA graph, how many graphs are cached,
# graphs at all. Prints bench/step_breakdown.py's table per setting.
#
#   OUT=$OUT bash bench/mlx_env_sweep.sh    # MODEL= (empty): a narrow random llama
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL-$HOME/.cache/kiln/bench/llama3-8b-shape-bfloat16}
BATCHES=${BATCHES:-1,64,128}
VARIANTS=${VARIANTS:-kiln, pipelined;mlx-lm loop, pipelined}
SETTINGS=${SETTINGS:-"default
MLX_MAX_OPS_PER_BUFFER=60
MLX_MAX_OPS_PER_BUFFER=200
MLX_CUDA_GRAPH_CACHE_SIZE=2000
MLX_MAX_OPS_PER_BUFFER=200 MLX_CUDA_GRAPH_CACHE_SIZE=2000
MLX_USE_CUDA_GRAPHS=0"}
mkdir -p "$OUT"
while IFS= read -r setting; do
    [ -n "$setting" ] || continue
    echo "== $setting" | tee -a "$OUT/mlx_env_sweep.txt"
    envs=()
    [ "$setting" = default ] || read -ra envs <<<"$setting"
    env "${envs[@]}" timeout 120 "$PYTHON" bench/step_breakdown.py --model "$MODEL" \
        --batch-sizes "$BATCHES" --steps 24 --variants "$VARIANTS" 2>&1 \
        | grep -v "RANDOM WEIGHTS" | tee -a "$OUT/mlx_env_sweep.txt"
done <<<"$SETTINGS"
