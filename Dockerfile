# ckptd server image: `docker build -t ckptd . && docker run -p 8470:8470 -v ckptd:/data ckptd`
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    CKPTD_HOST=0.0.0.0 \
    CKPTD_PORT=8470 \
    CKPTD_STORE=/data

WORKDIR /app
# The CPU build of torch first: a plain `pip install torch` pulls a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY ckptd ./ckptd
COPY client ./client
COPY server ./server
RUN pip install ".[s3]"

RUN useradd --system --uid 10001 --home-dir /data --create-home ckptd \
    && mkdir -p /data && chown ckptd /data
USER ckptd
VOLUME ["/data"]
EXPOSE 8470

HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"CKPTD_PORT\"]}/healthz', timeout=2)"

ENTRYPOINT ["ckptd", "serve"]
