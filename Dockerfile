# dspark-pd serving image: one image for both halves of the pair.
#   docker build -t dspark-pd:0.1.0 .
#   docker run --gpus all ... dspark-pd:0.1.0 serve-prefill --model /models/model ...
#   docker run --gpus all ... dspark-pd:0.1.0 serve-decode  --model /models/model --prefill HOST:50051 ...
# Every flag can be given as DSPARK_<FLAG> in the environment instead (see deploy/README.md).
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python3.12-dev + gcc + libc6-dev: triton compiles small C launchers at run time.
# libibverbs1 + ibverbs-providers + libnl: Mooncake's library links libibverbs even for the tcp protocol, and the
# providers are what the rdma protocol talks to the NICs through. libnuma1 and curl (libcurl) are Mooncake's too.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3.12=3.12.3-* \
      python3.12-venv=3.12.3-* \
      python3.12-dev=3.12.3-* \
      gcc=4:13.2.0-* \
      libc6-dev=2.39-* \
      libibverbs1=50.0-* \
      ibverbs-providers=50.0-* \
      libnl-3-200=3.7.0-* \
      libnl-route-3-200=3.7.0-* \
      libnuma1=2.0.18-* \
      curl=8.5.0-* \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3.12 -m venv /opt/venv

# torch built for CUDA 13 (its CUDA libraries come as wheels); triton is the version this torch pins.
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cu130 "torch==${TORCH_VERSION}"

# The project with its serving and Mooncake (CUDA 13) extras, versions pinned by deploy/constraints.txt.
WORKDIR /opt/dspark
COPY deploy/constraints.txt deploy/healthcheck.py /opt/dspark/
COPY pyproject.toml README.md /opt/dspark/src/
COPY model /opt/dspark/src/model
COPY kernels /opt/dspark/src/kernels
COPY engine /opt/dspark/src/engine
COPY cli /opt/dspark/src/cli
COPY transfer /opt/dspark/src/transfer
COPY proto /opt/dspark/src/proto
COPY prefill_service /opt/dspark/src/prefill_service
COPY decode_service /opt/dspark/src/decode_service
RUN pip install --no-cache-dir -c /opt/dspark/constraints.txt "/opt/dspark/src[serve,mooncake-cuda13]" \
 && rm -rf /opt/dspark/src \
 && dspark-pd serve-prefill --help > /dev/null \
 && dspark-pd serve-decode --help > /dev/null

# NCCL between pipeline stages: NVLink SHARP (NVLS) stays off (H200 machines need it so).
# Mooncake picks its handshake and TCP data ports from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT: a fixed range to open.
ENV NCCL_NVLS_ENABLE=0 \
    MC_MIN_RPC_PORT=15000 \
    MC_MAX_RPC_PORT=15099

RUN groupadd --gid 10001 dspark \
 && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin dspark
USER 10001:10001
WORKDIR /home/dspark

# 50051: prefill gRPC, 8000: decode HTTP (API, /health, /ready, /metrics), 9090: prefill metrics,
# 29512: torch.distributed rendezvous between prefill stages, 15000-15099: Mooncake.
EXPOSE 50051 8000 9090 29512 15000-15099

# Finds the serve-prefill / serve-decode process in the container and probes its real endpoint:
# decode GET /health, prefill (rank 0) grpc.health.v1 Check. Loading a large checkpoint takes minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=900s --retries=3 \
  CMD ["python", "/opt/dspark/healthcheck.py"]

ENTRYPOINT ["dspark-pd"]
CMD ["--help"]
