# `make demo` and `make test` bootstrap .venv on a fresh machine.
# torch is installed first, pinned to the CPU build that lies on this machine's disk, and only when
# no torch >= 2.6 is importable: an unpinned `torch` would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP  := $(VENV)/.dtlab-installed

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import sys, torch; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 6))" 2>/dev/null \
		|| $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[dev,deepspeed]'  # torch is already there: deepspeed keeps it
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dtlab compare --strategies single,ddp,fsdp,fsdp1 --nproc-per-node 2 --verify --out runs/demo
	$(VENV)/bin/dtlab report runs/demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

# The doctor first: when this machine cannot run 2-rank collectives, say why instead of failing
# half the suite. The test groups start heaviest first (tests/conftest.py: COST).
test: lint
	$(PY) -m dtlab doctor
	$(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
