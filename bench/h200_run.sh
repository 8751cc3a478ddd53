#!/usr/bin/env bash
# kiln versus mlx_lm.server on a Llama-3-8B-shaped random bf16 model, on the lent H200.
#
#   bash bench/h200_run.sh [h200_compare.py flags, e.g. --smoke or --num-requests 2,8,32,64]
#
# Assumes PYTHONPATH already holds MLX's CUDA build and the repo (export PYTHONPATH=~/site:$PWD
# after ../shared/gpu/README.md's two install calls, their folders made by
# bench/device_wheels.sh with the engine's packages the device image lacks).
# Writes kiln.json, mlx_lm.json, sweep.png, summary.txt, kiln.log, mlx_lm.log and run.log to
# $OUT (default bench/results) and prints the summary table last. About 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1

# Fail in seconds, not minutes, when a package is missing on the machine.
"$PYTHON" - <<'EOF'
import importlib.util
import sys
need = ["mlx.core", "mlx_lm", "numpy", "httpx", "aiohttp", "msgspec", "zmq", "fastapi", "uvicorn",
        "psutil", "setproctitle", "transformers", "tokenizers"]
missing = [m for m in need if importlib.util.find_spec(m.split(".")[0]) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)}")
import mlx.core as mx
import mlx_lm
import transformers
print(f"python {sys.version.split()[0]}, mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, "
      f"transformers {transformers.__version__}, device {mx.default_device()}")
if importlib.util.find_spec("matplotlib") is None:
    print("matplotlib missing: no sweep.png, the JSONs and the table still come")
EOF

# In the background, so that a TERM or INT to this script (a timeout's: bench/h200_session.sh
# runs its parts' timeouts --foreground) is passed on at once to the Python, whose handler
# stops the servers; bash would hold a trap until a foreground command ended.
"$PYTHON" bench/h200_compare.py --out "$OUT" "$@" > >(tee "$OUT/run.log") 2>&1 &
compare=$!
trap 'kill -TERM "$compare" 2>/dev/null' TERM INT
rc=0
wait "$compare" || rc=$?
if [ "$rc" -gt 128 ] && kill -0 "$compare" 2>/dev/null; then
    rc=0
    wait "$compare" || rc=$?  # a signal ended the first wait: now the Python's own exit
fi
exit "$rc"
