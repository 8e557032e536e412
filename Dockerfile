# The speedrun in a container, for an NVIDIA host with Docker and the NVIDIA Container Toolkit
# (a driver recent enough for the CUDA build of the PyTorch wheel). From the repository root:
#   docker build -t gpt2-speedrun .
#   docker run --rm --gpus all --ipc=host -v "$PWD/data:/workspace/data" -v "$PWD/logs:/workspace/logs" gpt2-speedrun
# Arguments after the image name go to train_gpt.py; -e NPROC=4 runs on 4 GPUs.
# Not built by this project's CI or on its development machines (they have no Docker engine).
FROM nvidia/cuda:12.6.3-devel-ubuntu24.04

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

# PyTorch: the Linux wheel brings its own CUDA runtime, cuDNN, NCCL and Triton. Then the rest.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /workspace
COPY requirements.txt requirements-hopper.txt ./
RUN pip install -r requirements.txt

# Hopper attention (README: Hopper attention): FlashAttention-4, then FlashAttention-3's kernels from
# the xformers 0.0.34 wheel with --no-deps (its torch pin would replace the torch above). Both are
# used only on sm90 GPUs, each after a start-up check; build with --build-arg HOPPER=0 to leave them out.
ARG HOPPER=1
RUN if [ "$HOPPER" = 1 ]; then pip install -r requirements-hopper.txt \
    && pip install --no-deps xformers==0.0.34 nvidia-cuda-runtime-cu12==12.8.90; fi
COPY . .

ENTRYPOINT ["./run.sh"]
