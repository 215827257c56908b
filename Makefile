# Everything a user runs. `make demo` and `make test` bootstrap .venv on a machine with only python3.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install install-test demo test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Re-installs only when pyproject.toml changed; pip reuses its cache, nothing is re-downloaded.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q --disable-pip-version-check $(TORCH)
	$(PIP) install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

install: $(STAMP)
install-test: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest tests

clean:
	rm -rf runs/demo .pytest_cache
