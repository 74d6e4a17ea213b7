#!/usr/bin/env bash
# The prepared GPU check (about 4 minutes on an H200 once the machine has started): benchmarks/gpu_check.py on the
# lent machine, through the `device` tool, only when its status shows a machine lent to the task. It needs the
# FEMNIST sample and a CIFAR-10 subset (10,000 test and 1,000 training images per class, 21 MB) in an ignored
# folder, and a working tree under the tool's 64 MiB (leave results/ and docs/results/ out of the index for the
# call: `git rm -r -q --cached results docs/results`, with both listed in .git/info/exclude; `git reset -q`
# after). From the repository root, before the call:
#   mkdir -p .gpu-data && cp ../shared/data/femnist_leaf_sf05.tar.gz .gpu-data/
#   python benchmarks/gpu_data.py .gpu-data/cifar10_sub.zip      # the subset, from ../shared/data/cifar10_jpeg.zip
#   grep -qx '/.gpu-data/' .git/info/exclude || echo /.gpu-data/ >> .git/info/exclude
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".gpu-data"], timeout_s=420), and here
#   python benchmarks/gpu_check.py --render FILES_AT/gpu_check.jsonl --doc docs/benchmarks.md
# The machine has torch, numpy, scikit-learn, Pillow and tqdm; hafedho runs from src/. Four files come back.
set -euo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src" HAFEDHO_CACHE_DIR=/tmp/hafedho-cache PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$out/nvidia-smi.txt" || true
python3 benchmarks/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
