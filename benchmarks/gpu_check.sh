#!/usr/bin/env bash
# The prepared GPU check (about 3-5 minutes): benchmarks/gpu_vmap.py on the lent machine, through the `device`
# tool, only when its status shows a machine lent to the task. Before the call, from the repository root:
#   mkdir -p .gpu-data && cp ../shared/data/femnist_leaf_sf05.tar.gz .gpu-data/
#   grep -qx '/.gpu-data/' .git/info/exclude || echo /.gpu-data/ >> .git/info/exclude
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".gpu-data"], timeout_s=420), and copy the table of
# gpu_vmap.md into docs/benchmarks.md ("GPU"). The machine has torch, numpy and tqdm; hafedho runs from src/.
set -euo pipefail
out="${OUT:-/tmp/gpu_vmap}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src" HAFEDHO_CACHE_DIR=/tmp/hafedho-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/nvidia-smi.txt" || true
python3 benchmarks/gpu_vmap.py --data .gpu-data/femnist_leaf_sf05.tar.gz --budget 200 --out "$out" 2>&1 | tee "$out/log.txt"
