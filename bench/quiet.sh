#!/usr/bin/env bash
# The rows whose baselines swing with other load (issue 22's export against
# safetensors.save_file, issue 21's server data plane), on a quiet many-core
# machine: the device machine when one is lent. Results under $OUT (default
# artifacts/quiet).
#
# Before: ../shared/gpu/prepare-wheels.sh, a script beside this checkout (not in
#         it), downloads the wheels ckptd needs for the GPU machine's Python 3.12
#         into .whl/ (kept out of git); the device tool carries .whl/ there (that
#         machine has no package registry) and device_steps.sh installs them.
#         Add the safetensors wheel: cp /opt/pypi/files/safetensors-*.whl .whl/
#         Without the script: pip download ckptd's dependencies (pyproject.toml)
#         for Python 3.12 into .whl/, or, where they are installed, run without it.
# Run:    the device tool: run(command="bash bench/quiet.sh", carry=[".whl"], timeout_s=400)
#         (bash bench/quiet.sh export: that row alone)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/quiet}
only=${1:-all}
mkdir -p "$out"
# shellcheck source=bench/device_steps.sh
source bench/device_steps.sh
{ nproc; free -g; uptime; python3 -c 'import torch, safetensors; print(torch.__version__,
safetensors.__version__)'; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

[ "$only" = all ] || [ "$only" = export ] && \
step export 150 python3 -m bench.export --size 1G --rounds 3 --markdown "$out/export.md"
[ "$only" = all ] || [ "$only" = dataplane ] && \
step dataplane 170 python3 -m bench.dataplane --size 1G --rounds 3 --server-only \
    --markdown "$out/dataplane.md"

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "done; results in $out"
