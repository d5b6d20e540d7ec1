# ckptd server image: `docker build -t ckptd . && docker run -p 8470:8470 -v ckptd:/data ckptd`
# tests/integration/test_install.py replays these steps without Docker: keep one
# instruction per line, and the wheel built in the first stage the only thing copied.

# 1. Build the wheel from the sources (the same wheel `pip install .` would build).
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY ckptd ./ckptd
COPY client ./client
COPY server ./server
RUN pip wheel --no-deps --wheel-dir /wheels .

# 2. The server image: torch's CPU build, the wheel, a non-root user.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    CKPTD_HOST=0.0.0.0 \
    CKPTD_PORT=8470 \
    CKPTD_STORE=/data
# The CPU build of torch first: a plain `pip install torch` pulls a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/ckptd-*.whl)[s3]" && rm -rf /wheels
RUN useradd --system --uid 10001 --home-dir /data --create-home ckptd && mkdir -p /data && chown ckptd /data
USER ckptd
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8470
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ['CKPTD_PORT'], timeout=2)"]
ENTRYPOINT ["ckptd", "serve"]
