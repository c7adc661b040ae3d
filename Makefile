# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python
STAMP := .install-stamp

.PHONY: install demo test lint bench chapters clean

# torch first, from the pinned local CPU wheel where none is installed (never the CUDA wheels);
# Colab and GPU machines keep the torch they already have.
$(STAMP): pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[dev]"
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
