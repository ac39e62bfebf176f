"""Two `bert finetune` processes at the same time on one new SQLite store: both succeed, with
their own runs and registry versions (`tracking.ready_sqlite_store` is the fix: both processes
created the new store's tables at once, and one died in the schema migration).

Two whole pipeline runs at once against one MLflow server and one bucket, and the search of
their outputs for planted credentials (issue #18, points 5 and 6), share the compiled
pipeline's run with the cluster harness's tests: tests/pipelines/test_cluster_harness.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.pipeline_helpers import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---------------------------------------------------------- two fine-tunings, one new SQLite store


@pytest.mark.slow
def test_two_finetunes_at_once_on_one_new_sqlite_store(tmp_path, shared_data, tiny_dir):
    from mlflow import MlflowClient

    db = tmp_path / "store" / "mlflow.db"  # new: the tables are made by whichever comes first
    uri = f"sqlite:///{db}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERT_", "KFP_", "MLFLOW_"))}
    env |= {"PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    seeds = (1, 2)

    def argv(seed: int) -> list[str]:
        out, data = str(tmp_path / f"seed-{seed}"), str(shared_data / "glue" / "SST-2")
        return [
            *(sys.executable, "-m", "bert_core", "finetune", "--task", "SST-2", "--data", data),
            *("--model", str(tiny_dir), "--output", out, "--epochs", "1", "--seed", str(seed)),
            *("--max-train-examples", "64", "--max-eval-examples", "64", "--max-seq-length", "32"),
        ]

    procs = {
        seed: subprocess.Popen(
            argv(seed),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed in seeds
    }
    logs = {seed: p.communicate(timeout=600)[0] for seed, p in procs.items()}
    for seed, p in procs.items():
        assert p.returncode == 0, logs[seed][-3000:]

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("bert").experiment_id])
    by_seed = {int(r.data.params["seed"]): r for r in runs}
    assert sorted(by_seed) == list(seeds) and len(runs) == len(seeds)
    versions = {v.run_id: v for v in client.search_model_versions("name='bert-sst2-candidates'")}
    assert sorted(int(v.version) for v in versions.values()) == [1, 2]  # none clobbered
    for seed, run in by_seed.items():
        out = tmp_path / f"seed-{seed}"
        result = json.loads((out / "metrics.json").read_text())
        assert run.info.status == "FINISHED" and result["config"]["seed"] == seed
        accuracy = 100 * result["metrics"]["accuracy"]
        assert run.data.metrics["dev/accuracy"] == pytest.approx(accuracy)
        record = json.loads((out / "mlflow_model.json").read_text())
        assert record["run_id"] == run.info.run_id  # its own run's model, its own version
        assert run.data.tags["bert.model_version"] == str(versions[run.info.run_id].version)
