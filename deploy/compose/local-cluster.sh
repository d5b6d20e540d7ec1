#!/usr/bin/env bash
# Three ckptd replicas and an S3-compatible server on this machine, as processes
# (no docker): the same shape as docker-compose.yml. Prints "ready URL,URL,URL"
# once every replica's /healthz is ok (its store answers), then runs until
# SIGINT/SIGTERM and stops them all: the replicas first, then the S3 server.
#
#   deploy/compose/local-cluster.sh            # moto's server as S3 (pip install moto[server]),
#                                              # one request at a time (ckptd.testing.moto_s3)
#   S3_ENDPOINT=http://127.0.0.1:9000 AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \
#     deploy/compose/local-cluster.sh          # an S3 you run (MinIO, Ceph RGW)
#
# It needs ckptd with its S3 extra (`pip install '.[s3]'`, which brings botocore)
# and makes BUCKET when it is not there.
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
s3_pid=""   # moto's server, when this script runs it
replicas=()  # PORT:PID of each ckptd serve

stop() {
    trap - EXIT INT TERM
    # The replicas first (each drains its requests, which may still need the store),
    # then the S3 server.
    for replica in "${replicas[@]}"; do kill -TERM "${replica##*:}" 2>/dev/null || true; done
    for replica in "${replicas[@]}"; do wait "${replica##*:}" 2>/dev/null || true; done
    if [[ -n "$s3_pid" ]]; then
        kill -TERM "$s3_pid" 2>/dev/null || true
        wait "$s3_pid" 2>/dev/null || true
    fi
    echo "stopped" >&2
}
trap stop EXIT
trap 'exit 0' INT TERM

wait_http() {  # URL SECONDS PID LOG [ok]: until URL answers (with ok: a 2xx); fails early if PID exits
    "$PYTHON" - "$@" <<'PY'
import os, sys, time, urllib.request
url, seconds, pid, log = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
need_ok = sys.argv[5:] == ["ok"]  # /healthz: 503 while the store does not answer
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
last = "no answer"
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(url, timeout=3)  # (/healthz asks the store: up to 2 s)
        sys.exit(0)
    except OSError as exc:
        if getattr(exc, "code", None):  # an HTTP answer: the server is up
            if not need_ok:
                sys.exit(0)
            last = f"HTTP {exc.code}"
    if exited(pid):
        gone(f"never answered: process {pid} exited")
    time.sleep(0.2)
gone(f"did not answer {'ok ' if need_ok else ''}in {seconds:g} s (last: {last})")
PY
}

if [[ -z "${S3_ENDPOINT:-}" ]]; then
    S3_ENDPOINT="http://127.0.0.1:${S3_PORT:-9000}"
    export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-testing}
    export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-testing}
    # (moto, one request at a time: its conditional writes are atomic then, as S3's)
    "$PYTHON" -m ckptd.testing.moto_s3 --port "${S3_PORT:-9000}" > "$LOG_DIR/s3.log" 2>&1 &
    s3_pid=$!
    wait_http "$S3_ENDPOINT" 60 "$s3_pid" "$LOG_DIR/s3.log"
fi
export AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}
# The bucket, made only when it is not there (botocore: what ckptd's S3 extra brings;
# boto3 is not installed with it). A user whose key may not list buckets can still
# use one that exists.
"$PYTHON" - "$S3_ENDPOINT" "$BUCKET" <<'PY'
import sys
import botocore.session
from botocore.exceptions import BotoCoreError, ClientError
endpoint, bucket = sys.argv[1], sys.argv[2]
s3 = botocore.session.get_session().create_client("s3", endpoint_url=endpoint)
try:
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
            raise
        s3.create_bucket(Bucket=bucket)
except (BotoCoreError, ClientError) as exc:
    sys.exit(f"bucket {bucket} at {endpoint}: {exc}")
PY

peers=""
for port in "${ports[@]}"; do peers+="${peers:+,}http://127.0.0.1:$port"; done
store="s3://$BUCKET/$PREFIX?endpoint=$S3_ENDPOINT"
for port in "${ports[@]}"; do
    "$PYTHON" -m ckptd serve --store "$store" --host 127.0.0.1 --port "$port" \
        --peers "$peers" --no-access-log > "$LOG_DIR/ckptd-$port.log" 2>&1 &
    replicas+=("$port:$!")
done
for replica in "${replicas[@]}"; do
    port=${replica%%:*}
    wait_http "http://127.0.0.1:$port/healthz" 120 "${replica##*:}" "$LOG_DIR/ckptd-$port.log" ok
done
echo "ready $peers"
echo "logs in $LOG_DIR" >&2
while true; do sleep 1; done
