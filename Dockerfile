# The ckptd image: the server (`ckptd serve`, the default command) and the rest of
# the CLI (`ckptd restore`, `ckptd shm` for init containers and node images).
#
#   docker build -t ckptd:0.1.0 .
#   docker run -p 8470:8470 -v ckptd:/data -e CKPTD_TOKEN=... ckptd:0.1.0
#
# Build arguments (docs/operations.md, "The container image"):
#   PYTHON_IMAGE   the base image, a Debian-like one with Python >= 3.11 and pip
#                  (default python:3.11-slim)
#   TORCH_INDEX    where torch comes from: the CPU build by default; a CUDA build with
#                  e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130
#                  (its wheels carry the CUDA runtime; the host gives the driver)
#   TORCH_VERSION  2.13.0, the version the project pins
#
# Configure the server by CKPTD_* variables rather than arguments: the HEALTHCHECK
# (`ckptd healthcheck`) reads the same variables, so it follows CKPTD_PORT and
# https (CKPTD_TLS_CERT / CKPTD_TLS_KEY).
#
# tests/integration/test_install.py replays these steps without Docker: keep one
# instruction per line, and the wheel built in the first stage the only thing copied.
ARG PYTHON_IMAGE=python:3.11-slim

# 1. Build the wheel from the sources (the same wheel `pip install .` would build).
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY ckptd ./ckptd
COPY client ./client
COPY server ./server
RUN pip wheel --no-deps --wheel-dir /wheels .

# 2. The image: torch (pinned, CPU by default), the wheel, a non-root user.
FROM ${PYTHON_IMAGE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    CKPTD_HOST=0.0.0.0 \
    CKPTD_PORT=8470 \
    CKPTD_STORE=/data
# torch first, from its own index: a plain `pip install torch` pulls a multi-GB CUDA build.
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/ckptd-*.whl)[s3]" && rm -rf /wheels
# The user ckptd, uid and gid 10001, owns /data. USER names it by number: Kubernetes
# checks runAsNonRoot against a number only (deploy/kubernetes/base runs it as 10001).
RUN groupadd --system --gid 10001 ckptd && useradd --system --uid 10001 --gid 10001 --home-dir /data --create-home ckptd && mkdir -p /data && chown 10001:10001 /data
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8470
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 CMD ["ckptd", "healthcheck"]
ENTRYPOINT ["ckptd"]
CMD ["serve"]
