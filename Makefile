# make run   : install into .venv and start the dashboard on the embedded default model
# make test  : install into .venv, lint, build the docs and run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast test-precision-isas test-stored-isas lint docs bench clean

$(STAMP): requirements.txt requirements-dev.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps -e .   # the `ctxmix` command and the dashboard package, from this checkout
	touch $(STAMP)

install: $(STAMP)

run: install
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-0} $(PY) -m ctxmix serve

# pytest exits 5 when it collects nothing: not a failure of the code under test
test: install lint docs
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi
	$(MAKE) test-precision-isas

# every test that compares with stored numbers (marker stored_numbers: the shipped results, the published
# values, the precision bounds, the fine-tuned classifier's accuracy) again on the CPU kernels torch would
# pick on other machines: ATen's portable and AVX2 kernels (read at import; with AVX2 MKL's and oneDNN's GEMMs
# capped at AVX2 too, as on a CPU without AVX-512: oneDNN runs the engine's float32 products on AMD CPUs), each
# with a fresh model cache, so minilm-sentiment is fine-tuned anew under those kernels and smollm2 dequantised
# anew: a number tuned on one kernel set fails here before it fails on someone else's machine. Then the
# precision tests with oneDNN capped at AVX2 (bf16 GEMMs where torch sends them to oneDNN: CPUs with AVX-512;
# and on AMD CPUs the engine's float32 products).
STORED_ISAS := ATEN_CPU_CAPABILITY=default "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"
test-stored-isas: install
	set -e; for isa in $(STORED_ISAS); do \
	  cache=$$(mktemp -d "$${TMPDIR:-/tmp}/ctxmix-cache-XXXXXX"); \
	  echo "stored-number tests with $$isa, fresh model cache $$cache"; \
	  rc=0; env $$isa CTXMIX_CACHE=$$cache $(PY) -m pytest -q -p no:cacheprovider -m stored_numbers tests || rc=$$?; \
	  rm -rf "$$cache"; if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; \
	done

test-precision-isas: test-stored-isas
	env ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q -p no:cacheprovider tests/test_precision.py; \
	  rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

# ruff (lint and format) on the whole tree; mypy on the engine and the methods
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# the documentation site: the generated pages (methods from the registry, analyses with figures
# the code makes), then the build; --strict: a broken reference or a missing page fails
docs: install
	$(PY) docs/gen_pages.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

test-fast: install
	$(PY) -m pytest -q -m "not slow"; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench: install
	$(PY) bench/core.py

clean:
	rm -rf $(VENV)
