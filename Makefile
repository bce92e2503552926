# make run   : install into .venv and start the dashboard on the embedded default model
# make test  : install into .venv and run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast bench clean

$(STAMP): requirements.txt requirements-dev.txt requirements-nodeps.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

install: $(STAMP)

run: install
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-0} $(PY) -m ctxmix serve

# pytest exits 5 when it collects nothing: not a failure of the code under test
test: install
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

test-fast: install
	$(PY) -m pytest -q -m "not slow"; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench: install
	$(PY) bench/core.py

clean:
	rm -rf $(VENV)
