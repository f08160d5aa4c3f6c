# Two entry points, both install what they need on a fresh machine into ./.venv:
#   make demo   install, then train SSoG and its MHA twin on the embedded digits data (the main job)
#   make test   install, then run the test suite (one pytest-xdist worker per core; a test file stays on one worker, so
#               its module fixtures are built once)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ssogvit-installed

.PHONY: install demo test

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/ssogvit main

test: install
	$(PY) -m pytest -q -n auto --dist loadfile
