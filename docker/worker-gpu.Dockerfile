# syntax=docker/dockerfile:1
#
# Kiln GPU worker: builds trtllm-engine (and CUDA aot-inductor / checkpoint) engines. Build from the repository
# root:
#
#   docker build -f docker/worker-gpu.Dockerfile -t kiln-worker-gpu:dev .
#   docker build -f docker/worker-gpu.Dockerfile --build-arg TRTLLM_TAG=1.2.1 -t kiln-worker-gpu:trtllm-1.2.1 .
#
# Why this base, and why Kiln is installed the way it is:
# - TensorRT-LLM cannot be installed from PyPI alone (the PyPI package is a stub that fetches the real wheel from
#   NVIDIA's index), so GPU workers run on NVIDIA's TensorRT-LLM release container. 1.2.x is the last line with
#   `trtllm-build` (the TensorRT-engine path that 1.3 removed), which the trtllm-engine backend drives.
# - That container already has CUDA, TensorRT, tensorrt-llm and the torch (2.9-era), ModelOpt (~0.37) and
#   transformers (4.57) that TensorRT-LLM was built and tested with. An engine loads only on the exact TensorRT /
#   TensorRT-LLM version that built it, and Kiln puts these versions into every build key, so they must stay
#   exactly as NVIDIA shipped them.
# - A plain `pip install .` would resolve Kiln's dependencies against PyPI and may replace that torch with
#   PyPI's (constraints.txt even pins torch 2.13, the CPU development pin). So:
#     1. every package the container ships is frozen into a constraints file first;
#     2. Kiln's other dependencies (docker/worker-gpu-requirements.txt: pyproject's list minus torch,
#        nvidia-modelopt and transformers, plus nvidia-ml-py) are installed under those constraints: what is
#        already there at a satisfying version is kept, what is missing is added, and a conflict fails the build
#        instead of silently swapping a package;
#     3. Kiln itself is installed with --no-deps;
#     4. the toolchain versions are compared before and after, and the build fails if any moved.

ARG TRTLLM_TAG=1.2.1
FROM nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_TAG}

# The container's Python is the system Python of its Ubuntu base; NVIDIA's images install into it with pip.
# PIP_BREAK_SYSTEM_PACKAGES is harmless where that is already allowed and needed where PEP 668's marker exists.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Pipelines below must fail when any stage fails (a grep that finds no toolchain is a wrong base image).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/kiln

# 1. Freeze what the container ships.
RUN python3 -m pip list --format=freeze > /opt/kiln/container-pins.txt \
 && grep -iE '^(torch|tensorrt|tensorrt[-_.]llm|nvidia[-_.]modelopt|transformers)==' /opt/kiln/container-pins.txt \
      | sort > /opt/kiln/toolchain-before.txt \
 && echo "container toolchain:" && cat /opt/kiln/toolchain-before.txt

# 2. Kiln's remaining dependencies, under the container's pins.
COPY docker/worker-gpu-requirements.txt /opt/kiln/requirements.txt
RUN python3 -m pip install -c /opt/kiln/container-pins.txt -r /opt/kiln/requirements.txt

# 3. Kiln itself, without dependencies.
WORKDIR /opt/kiln/src
COPY pyproject.toml README.md ./
COPY kiln/ kiln/
COPY artifacts/ artifacts/
COPY validation/ validation/
COPY builder/ builder/
COPY workers/ workers/
COPY api/ api/
COPY migrations/ migrations/
RUN python3 -m pip install --no-deps .

# 4. Nothing of the toolchain moved. (TensorRT-LLM itself is not imported here: it needs libcuda, which only
#    exists when the container runs with a GPU.)
RUN python3 -m pip list --format=freeze \
      | grep -iE '^(torch|tensorrt|tensorrt[-_.]llm|nvidia[-_.]modelopt|transformers)==' \
      | sort > /opt/kiln/toolchain-after.txt \
 && diff -u /opt/kiln/toolchain-before.txt /opt/kiln/toolchain-after.txt \
 && kiln --help >/dev/null

# CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA numbers GPUs in NVML's order, so CUDA_VISIBLE_DEVICES indices mean the same
# GPUs to Kiln's NVML detection (which honours the variable) and to CUDA (trtllm-build, the runtime; docs/gpu.md).
ENV KILN_HOME=/var/lib/kiln \
    HF_HOME=/var/lib/kiln/huggingface \
    CUDA_DEVICE_ORDER=PCI_BUS_ID

# Non-root (uid 10001 avoids the base image's uid 1000 user). The NVIDIA container runtime gives GPU access to
# any user. KILN_HOME is owned by kiln so a named volume mounted there starts out writable.
ARG KILN_UID=10001
RUN groupadd --system --gid "${KILN_UID}" kiln \
 && useradd --system --uid "${KILN_UID}" --gid kiln --home-dir /home/kiln --create-home --shell /usr/sbin/nologin kiln \
 && install -d -o kiln -g kiln /var/lib/kiln /checkpoints
# Numeric, so that runtimes can verify "not root" (Kubernetes runAsNonRoot) without reading /etc/passwd.
USER ${KILN_UID}:${KILN_UID}
WORKDIR /var/lib/kiln

# `kiln worker` by default; the entrypoint stays `kiln` so the same image also runs one-off commands
# (`docker run ... kiln-worker-gpu:dev build /checkpoints/m --backend trtllm-engine --target sm90`).
ENTRYPOINT ["kiln"]
CMD ["worker"]
