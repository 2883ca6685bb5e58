# Two commands do all the set-up: `make serve` (the server, with the bundled model) and `make test`.
# Each creates .venv on first use; torch is pinned to the CPU build this machine installs from local disk.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
IN ?= examples/texts.jsonl
OUT ?= embeddings.npy

.PHONY: embed serve test lint bench peers

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

embed: $(STAMP)
	$(VENV)/bin/bouquet embed $(IN) -o $(OUT)

serve: $(STAMP)
	$(VENV)/bin/bouquet serve

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

test: lint
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/offline.py

# The servers people run today, for bench/serve.py --infinity: their own environment (Infinity pins numpy < 2
# and sentence-transformers < 4), torch pinned to the same CPU build.
PEERS := .venv-peers
peers:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet torch==2.13.0
	$(PEERS)/bin/python -m pip install --quiet 'infinity-emb[server,torch]==0.0.78' 'numpy<2' onnxruntime==1.32.0 onnx==1.23.2
