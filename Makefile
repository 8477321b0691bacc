# `make demo` and `make test` bootstrap .venv on a fresh machine. The venv is hermetic (no
# --system-site-packages): it holds what pyproject.toml declares and nothing the machine happens to
# have. torch is pinned in the same install: an unpinned `torch` would pull a multi-GB CUDA build
# (here the pin resolves to the CPU wheel on this machine's disk).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP  := $(VENV)/.dtlab-installed

.PHONY: venv demo test test-nvme test-mlflow lint bench clean

# JIT-built C++ ops (DeepSpeed's async_io) are cached per venv: torch's build of an op names the
# venv's own paths, so clones sharing ~/.cache/torch_extensions would rebuild it for each other.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

venv: $(STAMP)

# pip would compile every module to bytecode on one core (15 of torch's 25 s); compileall does it
# on all of them. Without bytecode on disk each process would compile what it imports, every time
# where PYTHONDONTWRITEBYTECODE is set. (Writing it on first import instead would leave a user's
# own `dtlab` commands without it, and both test workers would compile the same modules at once.)
# dtlab's own src/ too: the editable install leaves it outside purelib (0.15 s of CPU per process
# that imports the CLI and the loop, measured with farm-bench: 1.98 s against 2.13 s). Left out:
# what no dtlab process imports, a fifth of the files and 40% of the time (31 s against 18 s on 2
# cores): transformers' model families but the ones dtlab and its tests build (one imported
# later is compiled then), packages that only the extras' dependencies bring, packages' own tests.
COMPILE_SKIP := /transformers/models/(?!(auto|llama|gpt2|bert|bloom|qwen3|gemma2|encoder_decoder)/)|/(sklearn|databricks|pyarrow|fontTools|narwhals|graphql|graphene|playwright/driver|tests)/
# The extras the suite tests. MLflow is left out: with pyarrow, scipy, pandas, scikit-learn and
# SQLAlchemy, none of which dtlab imports, it is a quarter of the venv (540 of 2,070 MB) for 7
# tests that skip without it; `make test-mlflow` installs it and runs them.
EXTRAS ?= dev,deepspeed,wandb,tensorboard
$(STAMP): pyproject.toml Makefile
	grep -qs '^include-system-site-packages = false' $(VENV)/pyvenv.cfg || { rm -rf $(VENV); $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --no-compile "$(TORCH_PIN)" -e '.[$(EXTRAS)]'
	$(PY) -m compileall -q -j 0 -x '$(COMPILE_SKIP)' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" src >/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dtlab compare --strategies single,ddp,fsdp,fsdp1 --nproc-per-node 2 --verify --out runs/demo
	$(VENV)/bin/dtlab report runs/demo

# lint-imports: the layers and no-cycles contracts of pyproject.toml (docs/architecture.md).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

# The doctor first: when this machine cannot run 2-rank collectives, say why instead of failing
# half the suite. The test groups start heaviest first (tests/conftest.py: COST). Three workers on
# the 2-core CI host: two leave the cores idle while tests wait on their launchers, timeouts and
# SLURM's polls (tests/conftest.py: _pin_xdist_worker has the numbers).
TEST_WORKERS ?= 3
test: lint
	$(PY) -m dtlab doctor
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25

# NVMe offload's tests that run DeepSpeed's async_io op: it is built first where it is not yet
# (needs libaio; about 170 CPU-seconds, once per venv). `make test` runs them only where it is built.
test-nvme: $(STAMP)
	DTLAB_TEST_NVME=1 $(PY) -m pytest -q tests/test_nvme_offload.py

# The MLflow tracker's tests, with the extra installed into the venv first.
test-mlflow: $(STAMP)
	$(PY) -m pip install -q "$(TORCH_PIN)" -e '.[mlflow]'
	$(PY) -m pytest -q tests/test_trackers.py

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
	find src -name __pycache__ -type d -prune -exec rm -rf {} +
