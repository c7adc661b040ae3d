# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python
STAMP := .install-stamp

.PHONY: install demo test lint bench chapters clean

# torch first, from the pinned local CPU wheel where none is installed (never the CUDA wheels);
# Colab and GPU machines keep the torch they already have.
$(STAMP): pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[dev]"
	@# Chromium for tests/test_browser.py, from Debian's packages; best effort: without apt or root it is
	@# left out and those tests skip, saying why (Playwright itself comes with the dev extra above)
	-@[ -x /usr/bin/chromium ] || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y chromium || \
		  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }; }; } || \
		echo "chromium could not be installed: the browser tests will skip"
	@# JupyterLab saves notebooks without widget views (minivllm/widgets/jupyter.py says why)
	$(PYTHON) -m minivllm.widgets.jupyter
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m minivllm generate "Hi, my name is" "Today is a beautiful summer day" "Hello there" \
		--max-tokens 32 --journey

lint: $(STAMP)
	$(PYTHON) -m ruff check minivllm tests bench data chapters

# pytest exits 5 when it collects nothing: for us that is a failure, not a pass.
# HF_HUB_OFFLINE: tests never download; chapter 10 then runs its offline fallback.
test: $(STAMP) lint
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests $(wildcard chapters/*.ipynb) --nbval-lax --nbval-current-env -p no:cacheprovider; \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(PYTHON) bench/cpu_throughput.py

clean:
	rm -rf $(STAMP) .pytest_cache .ruff_cache
