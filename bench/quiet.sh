#!/usr/bin/env bash
# The rows whose baselines swing with other load (issue 22's export against
# safetensors.save_file, issue 21's server data plane), on a quiet many-core
# machine: the device machine when one is lent. Results under $OUT (default
# artifacts/quiet).
#
# Before: ../shared/gpu/prepare-wheels.sh (fills .whl/), plus the safetensors wheel
#         (cp /opt/pypi/files/safetensors-*.whl .whl/).
# Run:    the device tool: run(command="bash bench/quiet.sh", carry=[".whl"], timeout_s=400)
#         (bash bench/quiet.sh export: that row alone)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/quiet}
only=${1:-all}
mkdir -p "$out"
failed=()

step() {  # step NAME SECONDS COMMAND...: runs it, its output into $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S))"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        failed+=("$name")
        echo "   FAILED (exit $rc$([ $rc -eq 124 ] && echo ': out of time')); last lines:"
    fi
    tail -n 30 "$out/$name.txt"
}

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    || { echo "cannot install ckptd here"; exit 1; }
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
