# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python
STAMP := .install-stamp

.PHONY: install demo test chapters-learner chapters-bf16 lint bench chapters clean gpu-check gpu-check-t4

# torch first, from the pinned local CPU wheel where none is installed (never the CUDA wheels);
# Colab and GPU machines keep the torch they already have.
$(STAMP): pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[dev]"
	@# the C++ CPU kernels, compiled now rather than silently at the first LLM(); never fails: without a
	@# compiler it says so, and the engine runs the readable torch code
	$(PYTHON) -c "from minivllm.platforms.cpu_extension import build_ahead; build_ahead()"
	@# Chromium for tests/test_browser.py, from Debian's packages; best effort: without apt or root it is
	@# left out and those tests skip, saying why (Playwright itself comes with the dev extra above)
	-@[ -x /usr/bin/chromium ] || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y chromium || \
		  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }; }; } || \
		echo "chromium could not be installed: the browser tests will skip"
	touch $(STAMP)

# JupyterLab saves notebooks without widget views (minivllm/widgets/jupyter.py says why): the server config
# that enables the hook, rewritten whenever the module that writes it changes
JUPYTER_CONFIG := $(shell $(PYTHON) -c "import sys; print(sys.prefix)")/etc/jupyter/jupyter_server_config.json
$(JUPYTER_CONFIG): minivllm/widgets/jupyter.py | $(STAMP)
	$(PYTHON) -m minivllm.widgets.jupyter

install: $(STAMP) $(JUPYTER_CONFIG)

demo: $(STAMP)
	$(PYTHON) -m minivllm generate "Hi, my name is" "Today is a beautiful summer day" "Hello there" \
		--max-tokens 32 --journey

# ruff, then the layers of the house (import-linter's contracts in pyproject.toml)
lint: $(STAMP)
	$(PYTHON) -m ruff check minivllm
	$(PYTHON) -m ruff check --line-length 120 tests bench data chapters
	lint-imports --no-cache

# pytest exits 5 when it collects nothing: for us that is a failure, not a pass.
# HF_HUB_OFFLINE: tests never download; chapter 10 then runs its offline fallback.
# The suite and a first pass over the chapters run in float32 (tests/conftest.py pins it), the chapters beside a
# competing CPU job on one core (tests/conftest.py: their measured sentences must survive a busy machine); then the chapters
# run once more as a learner runs them: MINIVLLM_CPU_DTYPE unset, so dtype "auto" is bf16 on a CPU with
# native bf16; elsewhere it is float32, the first pass exactly, so the second is skipped and says so.
# --durations: the slowest tests, so the time CI takes can be read from its log.
test: $(STAMP) $(JUPYTER_CONFIG) lint
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests $(wildcard chapters/*.ipynb) --nbval-lax --nbval-current-env \
		-p no:cacheprovider --durations=40; \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests were collected"; exit 1; fi; [ $$rc -eq 0 ] || exit $$rc; \
	$(MAKE) --no-print-directory chapters-learner

chapters-learner: $(STAMP)
	@dtype=$$(env -u MINIVLLM_CPU_DTYPE $(PYTHON) -c "from minivllm.platforms.cpu_hardware import \
		default_cpu_dtype as d; print(str(d()).split('.')[-1])"); \
	echo "the chapters in the learner's dtype: $$dtype"; \
	if [ "$$dtype" = float32 ]; then \
		echo "float32 here: the first pass ran the chapters exactly so (MINIVLLM_CPU_DTYPE=float32): not repeated"; \
	else \
		env -u MINIVLLM_CPU_DTYPE HF_HUB_OFFLINE=1 $(PYTHON) -m pytest $(wildcard chapters/*.ipynb) --nbval-lax \
			--nbval-current-env -p no:cacheprovider -q; \
	fi

# The chapters in bf16 on any CPU (torch emulates bf16 where the CPU has no native instructions: slower,
# the same numbers a native-bf16 learner sees). Not part of `make test`: emulated bf16 is slower than float32
# and CI's time is budgeted. Run it after changing a chapter, so its prose stays true in both dtypes.
chapters-bf16: $(STAMP)
	MINIVLLM_CPU_DTYPE=bfloat16 HF_HUB_OFFLINE=1 $(PYTHON) -m pytest $(wildcard chapters/*.ipynb) --nbval-lax \
		--nbval-current-env -p no:cacheprovider -q --durations=15

bench: $(STAMP)
	$(PYTHON) bench/cpu_throughput.py

# On a GPU machine: kernels, CUDA graphs, a short throughput run, the chapters in the GPU's dtype; then,
# in a second device call, the chapters in fp16 as on a T4 (bench/gpu_check.sh says what each runs)
gpu-check:
	PYTHON=$(PYTHON) bash bench/gpu_check.sh

gpu-check-t4:
	PYTHON=$(PYTHON) bash bench/gpu_check.sh t4

clean:
	rm -rf $(STAMP) .pytest_cache .ruff_cache
