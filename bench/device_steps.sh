# Sourced by bench/gpu.sh and bench/quiet.sh (the device machine's runs): installs
# the wheels in .whl/ and ckptd, and defines ``step`` (``run_step``). Needs $out set.
failed=()

run_step() {  # run_step NAME SECONDS COMMAND...: runs it, its output into $out/NAME.txt
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

step() { run_step "$@"; }  # (bench/device.sh narrows it to $STEPS)
