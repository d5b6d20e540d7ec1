#!/usr/bin/env bash
# Three ckptd replicas and an S3-compatible server on this machine, as processes
# (no docker): the same shape as docker-compose.yml. Prints "ready URL,URL,URL"
# once every replica answers, then runs until SIGINT/SIGTERM and stops them all.
#
#   deploy/compose/local-cluster.sh            # moto's server as S3 (pip install moto[server])
#   S3_ENDPOINT=http://127.0.0.1:9000 AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \
#     deploy/compose/local-cluster.sh          # an S3 you run (MinIO, Ceph RGW)
#
# Env: PORTS (three ports, default "8471 8472 8473"), S3_PORT (9000, for moto),
# BUCKET (ckptd), PREFIX (checkpoints), CKPTD_TOKEN, CKPTD_PEER_SECRET (random, one for
# all three), PYTHON (python3), LOG_DIR (made if absent).
set -euo pipefail

PYTHON=${PYTHON:-python3}
read -r -a ports <<< "${PORTS:-8471 8472 8473}"
BUCKET=${BUCKET:-ckptd}
PREFIX=${PREFIX:-checkpoints}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t ckptd-cluster.XXXXXX)}
mkdir -p "$LOG_DIR"
# One secret for every replica: the jobs' peer tokens derive from it.
export CKPTD_PEER_SECRET=${CKPTD_PEER_SECRET:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')}
pids=()
replicas=()  # PORT:PID of each ckptd serve

stop() {
    trap - EXIT INT TERM
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    echo "stopped" >&2
}
trap stop EXIT
trap 'exit 0' INT TERM

wait_http() {  # URL SECONDS PID LOG: until URL answers; fails early if PID exits
    "$PYTHON" - "$@" <<'PY'
import os, sys, time, urllib.request
url, seconds, pid, log = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
deadline = time.monotonic() + seconds
def gone(why):
    try:
        tail = open(log, errors="replace").read().splitlines()[-15:]
    except OSError:
        tail = []
    sys.exit("\n".join([f"{url} {why}; the end of {log}:", *tail]))
def exited(pid):
    try:  # (Linux: a child that exited is a zombie until the shell reaps it)
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        if os.path.isdir("/proc/self"):
            return True  # no such process
    try:  # no /proc (macOS)
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(url, timeout=1)
        sys.exit(0)
    except OSError as exc:
        if getattr(exc, "code", None):  # an HTTP answer: the server is up
            sys.exit(0)
    if exited(pid):
        gone(f"never answered: process {pid} exited")
    time.sleep(0.2)
gone(f"did not answer in {seconds:g} s")
PY
}

if [[ -z "${S3_ENDPOINT:-}" ]]; then
    S3_ENDPOINT="http://127.0.0.1:${S3_PORT:-9000}"
    export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-testing}
    export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-testing}
    "$PYTHON" -m moto.server -H 127.0.0.1 -p "${S3_PORT:-9000}" > "$LOG_DIR/s3.log" 2>&1 &
    pids+=($!)
    wait_http "$S3_ENDPOINT" 60 "$!" "$LOG_DIR/s3.log"
fi
export AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}
"$PYTHON" - "$S3_ENDPOINT" "$BUCKET" <<'PY'
import sys, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1])
if sys.argv[2] not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
    s3.create_bucket(Bucket=sys.argv[2])
PY

peers=""
for port in "${ports[@]}"; do peers+="${peers:+,}http://127.0.0.1:$port"; done
store="s3://$BUCKET/$PREFIX?endpoint=$S3_ENDPOINT"
for port in "${ports[@]}"; do
    "$PYTHON" -m ckptd serve --store "$store" --host 127.0.0.1 --port "$port" \
        --peers "$peers" --no-access-log > "$LOG_DIR/ckptd-$port.log" 2>&1 &
    pids+=($!)
    replicas+=("$port:$!")
done
for replica in "${replicas[@]}"; do
    port=${replica%%:*}
    wait_http "http://127.0.0.1:$port/healthz" 120 "${replica##*:}" "$LOG_DIR/ckptd-$port.log"
done
echo "ready $peers"
echo "logs in $LOG_DIR" >&2
while true; do sleep 1; done
