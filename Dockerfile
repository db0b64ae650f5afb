# The one specd image: `specd draft|verifier|gateway|serve` (see k8s/ for how it runs).
#
#   python scripts/make_demo_pair.py          # once: the demo pair the image ships
#   docker build -t specd:0.1.0 .             # CPU image (torch CPU wheel)
#   docker build -t specd:0.1.0-cuda \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # GPU image
#   docker run --rm -p 50051:50051 specd:0.1.0     # the whole demo in one container
#
# The GPU variant needs no CUDA base image: torch's CUDA wheels bundle the CUDA runtime;
# the NVIDIA driver comes from the node (device plugin / container toolkit).
#
# Not built or run here: the machine this was written on has no Docker engine. The
# manifests that use it are rendered and schema-checked by tests/test_k8s.py.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/tmp/hf

# The uid the manifests' securityContext runs as.
RUN groupadd --gid 10001 specd \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin specd

WORKDIR /app

# torch first, alone: the largest layer, and it changes least. An unpinned torch from
# PyPI would pull a multi-GB CUDA build into the CPU image.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX}"

# Then the other dependencies, from pyproject.toml alone, so code changes reuse this layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The code and the demo pair, models/demo (k8s/overlays/cpu-demo serves it from there);
# .dockerignore keeps the rest of the checkout out.
COPY . /app
RUN pip install --no-deps . && python -c "import specd, specd_cli, gateway, draft_service, verifier_service"

# Files stay root-owned: the service user reads, never writes (the root filesystem is
# read-only in the pods; /tmp is an emptyDir).
USER 10001:10001
EXPOSE 50051 50052 50053 8081 9400
ENTRYPOINT ["specd"]
CMD ["serve", "--host", "0.0.0.0", \
     "--target", "/app/models/demo/target", "--draft", "/app/models/demo/draft-distilled"]
