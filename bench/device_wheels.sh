#!/usr/bin/env bash
# The wheels a device call needs, split so each call's carry fits its 64 MiB with the tree.
#
#   bash bench/device_wheels.sh
#
# Runs ../shared/gpu/prepare.sh (MLX's CUDA wheel in two halves, .dev/gpu_a and .dev/gpu_b)
# with the wheels kiln serves with, adds llguidance (manylinux_2_31, which prepare.sh's
# platform list skips) and the CUPTI wheels bench/device_timeline.py needs, then moves them
# so that (with the ~10 MB tree):
#   .dev/gpu_a  the wheel's first half and the tests parts' pytest and pytest-xdist;
#               first call:
#               mkdir -p ~/stash && cp .dev/gpu_a/* ~/stash/
#   .dev/gpu_b  the second half and every wheel kiln serves with; second call:
#               bash .dev/gpu_b/install.sh && export PYTHONPATH=~/site:$PWD && ...
#   .dev/gpu_c  the CUPTI wheels (~20 MB): a third call, only for the timeline part:
#               python3 -m pip install -q --no-index --no-deps --target ~/site_c .dev/gpu_c/*.whl
#               (the timeline part then finds ~/site_c itself: h200_session.sh)
# and prints each folder's size against the limit.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/gpu/prepare.sh msgspec fastapi uvicorn setproctitle prometheus-client regex \
    pytest-xdist execnet > /dev/null
dl() { python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
           --no-deps "$@"; }
dl --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 -d .dev/gpu_b "llguidance>=1.7"
# The tests parts' wheels ride with the first half (its call has room; the second half's
# does not, beside a tree that grows each session); install.sh then installs what the
# stash holds too.
mv .dev/gpu_b/{pytest,pytest_xdist,execnet,iniconfig,pluggy,pygments}-*.whl .dev/gpu_a/
sed -i 's|"$HOME/stash/$name" "$here"/\*.whl|"$HOME/stash"/*.whl "$here"/*.whl|' .dev/gpu_b/install.sh
grep -q '"$HOME/stash"/\*.whl' .dev/gpu_b/install.sh || { echo "install.sh changed shape"; exit 1; }
rm -rf .dev/gpu_c && mkdir -p .dev/gpu_c
dl --platform manylinux_2_28_x86_64 --platform manylinux_2_25_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .dev/gpu_c cupti-python==13.0.1 nvidia-cuda-cupti==13.0.85 cuda-bindings \
    cuda-pathfinder pyelftools
# What travels besides: tracked files and untracked ones git does not ignore.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s \
           | awk '{n += $1} END {print n + 0}')
limit=$((64 << 20))
for d in gpu_a gpu_b gpu_c; do
    size=$(du -sb ".dev/$d" | cut -f1)
    echo ".dev/$d: $((size >> 20)) MiB + tree $((tree >> 20)) MiB of $((limit >> 20))$( \
        [ $((size + tree)) -gt $limit ] && echo '  OVER THE LIMIT')"
done
