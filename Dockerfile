# The speedrun in a container, for an NVIDIA host with Docker, the NVIDIA Container Toolkit and a
# driver for CUDA 13.0 (580 or newer). From the repository root (README: Docker):
#   docker build -t gpt2-speedrun .
#   docker run --rm -it --gpus all --ipc=host \
#       -v "$PWD/data:/workspace/data" -v "$PWD/checkpoints:/workspace/checkpoints" \
#       -v "$PWD/logs:/workspace/logs" -v gpt2-speedrun-cache:/workspace/cache gpt2-speedrun
# Arguments after the image name go to train_gpt.py; -e NPROC=4 runs on 4 GPUs.
# Not yet built or run by this project: its CI has no Docker engine.

# The CUDA of this base image is the CUDA of the PyTorch build installed below (13.0 and cu130);
# tests/test_docs.py checks that they agree.
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.12 (Ubuntu 24.04's), with its headers and a C compiler: Triton and torch.compile build
# small extensions at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# PyTorch 2.11.0, the version every measurement in bench/ used, in its build for CUDA 13.0 (the
# wheel brings its CUDA runtime, cuDNN, NCCL and Triton). The constraint file keeps every later
# pip install from replacing it.
RUN pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130 \
 && echo "torch==2.11.0" > /opt/torch-constraint.txt

WORKDIR /workspace
COPY requirements.txt requirements-hopper.txt ./
RUN pip install -c /opt/torch-constraint.txt -r requirements.txt

# Hopper attention (README: Hopper attention): FlashAttention-4 (its nvidia-cutlass-dsl[cu13] fits
# the CUDA 13 torch above), then FlashAttention-3's kernels from the xformers 0.0.34 wheel with
# --no-deps (its torch pin would replace the torch above). Both are used only on sm90 GPUs, each
# after a start-up check; build with --build-arg HOPPER=0 to leave them out.
ARG HOPPER=1
RUN if [ "$HOPPER" = 1 ]; then pip install -c /opt/torch-constraint.txt -r requirements-hopper.txt \
    && pip install --no-deps xformers==0.0.34 nvidia-cuda-runtime-cu12==12.8.90; fi
COPY . .

# What a run writes goes to volumes, so that it outlives `docker run --rm` when they are mounted:
# the shards (data/), checkpoints/ (a Ctrl-C or SIGTERM writes one), logs/, and the compile cache,
# so that a second run does not compile from cold: Inductor's graphs in TORCHINDUCTOR_CACHE_DIR, every
# compiled Triton kernel (Inductor's and kernels.py's) in TRITON_CACHE_DIR. The GPT-2 tokenizer files
# the record preset loads at start (tiktoken's) are fetched at build time into TIKTOKEN_CACHE_DIR on the
# cache volume, before VOLUME (what a build step writes there after it is discarded): Docker copies them
# into a new, empty named volume, so a node without network starts and no run downloads them again (a
# cache volume made by an older image gets them from its first run with network).
ENV TORCHINDUCTOR_CACHE_DIR=/workspace/cache/inductor \
    TRITON_CACHE_DIR=/workspace/cache/triton \
    TIKTOKEN_CACHE_DIR=/workspace/cache/tiktoken
RUN mkdir -p data checkpoints logs cache/inductor cache/triton cache/tiktoken \
 && python -c "import tiktoken; tiktoken.get_encoding('gpt2')"
VOLUME ["/workspace/data", "/workspace/checkpoints", "/workspace/logs", "/workspace/cache"]

ENTRYPOINT ["./run.sh"]
