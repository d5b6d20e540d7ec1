#!/usr/bin/env bash
# The GPU checks of issue 21 (item 6) in one go, on a machine with a CUDA device:
# tests/gpu/, the GPU rows (bench/gpu.py: save() stall against a pinned D2H copy,
# restore from the local tier into CUDA tensors against a pinned H2D copy), and
# bench/restore.py's CUDA rows. Results (text and markdown) go under $OUT (the
# device runner's folder; default artifacts/gpu).
#
# Before: ../shared/gpu/prepare-wheels.sh, a script beside this checkout (not in
#         it), downloads the wheels ckptd needs for the GPU machine's Python 3.12
#         into .whl/ (kept out of git); the device tool carries .whl/ there (that
#         machine has no package registry) and device_steps.sh installs them.
#         Without the script: pip download ckptd's dependencies (pyproject.toml)
#         for Python 3.12 into .whl/, or, where they are installed, run without it.
# Run:    bash bench/gpu.sh [SIZE]          (SIZE: state size, default 4G)
#         the device tool: run(command="bash bench/gpu.sh", carry=[".whl"], timeout_s=600)
# At most 8 minutes (2G fits; 4G may not); each step has its own time limit, and a step
# that fails is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/gpu}
size=${1:-4G}
mkdir -p "$out"
# shellcheck source=bench/device_steps.sh
source bench/device_steps.sh

{ nvidia-smi || true; python3 -c 'import torch; print(torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'; nproc;
  free -g; df -h /dev/shm /tmp; uptime; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

export CKPTD_HEARTBEAT_INTERVAL=0.5
step tests-gpu 150 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/gpu
step bench-gpu 180 python3 -m bench.gpu --size "$size" --rounds 3 --markdown "$out/gpu.md"
step bench-restore-cuda 150 python3 -m bench.restore --only cuda --size "$size" --rounds 3 \
    --markdown "$out/restore-cuda.md"

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all GPU steps passed; results in $out"
