# Set-up and the two README commands. Everything installs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: a local CPU build of torch (an unpinned torch would pull a multi-GB CUDA build)
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test bench clean-venv

$(VENV)/.installed: pyproject.toml
	@# Mooncake's library loads libibverbs even for TCP
	@ldconfig -p | grep -q libibverbs.so.1 || { apt-get update -qq && apt-get install -y -qq libibverbs1; } \
	  || echo "warning: could not install libibverbs1 (needed by Mooncake); run as root or install it" >&2
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[serve,mooncake-cpu,test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/dspark-pd demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/model_cpu.py

clean-venv:
	rm -rf $(VENV)
