# zerotrain — quick start: `make demo`, then `make test`.
# The torch build is pinned here, in one place; override it on the command line,
# e.g. `make demo TORCH=2.5.1` or `make test TORCH="2.11.0 --index-url <your index>"`.
TORCH  ?= 2.13.0
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test bench install clean

$(VENV)/.torch-$(firstword $(TORCH)):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==$(TORCH)"
	rm -f $(VENV)/.torch-* && touch $@

$(VENV)/.installed: $(VENV)/.torch-$(firstword $(TORCH)) pyproject.toml
	$(PIP) install -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/zerotrain launch --nproc_per_node 2 examples/train_llama.py

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) *.egg-info
