# ctxmix's dashboard on a CPU, as a shared (hosted) server:
#   docker build -t ctxmix .
#   docker run -p 8501:8501 -e CTXMIX_PASSWORD=change-me -v ctxmix-cache:/data ctxmix
# Hosted mode refuses to start without a login (CTXMIX_PASSWORD, or an [auth] section in a
# mounted /data/.streamlit/secrets.toml). Dockerfile.cuda is the same on an NVIDIA GPU.
FROM python:3.11-slim

# Chromium: kaleido's static figure export (PNG, SVG, PDF)
RUN apt-get update \
    && apt-get install -y --no-install-recommends chromium \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt requirements-nodeps.txt ./
# torch's CPU build from PyTorch's own index (PyPI's Linux wheel carries CUDA, several GB)
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir -r requirements.txt \
    && pip install --no-cache-dir --no-deps -r requirements-nodeps.txt

COPY pyproject.toml README.md ./
COPY ctxmix ctxmix
COPY ctxmix_dashboard ctxmix_dashboard
# the dashboard's top-level files, which the wheel carries as ctxmix_dashboard/toplevel/
COPY app.py ./
COPY pages pages
RUN pip install --no-cache-dir --no-deps . \
    && useradd --create-home ctxmix && mkdir -p /data && chown ctxmix /data

USER ctxmix
# built models, the results cache and benchmark results live in the volume
ENV CTXMIX_CACHE=/data/cache CTXMIX_BENCH_DIR=/data/results BROWSER_PATH=/usr/bin/chromium
WORKDIR /data
EXPOSE 8501
CMD ["ctxmix", "serve", "--hosted", "--address", "0.0.0.0"]
