"""Batch inference in the pipelines: the DVC `predict` stage (off by default, one stage per entry
of predict.yaml) and the Kubeflow `predict` component, each run for real on a fine-tuned model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.pipeline_helpers import env_for, project_copy
from tests.serving_helpers import build

ROWS = ["a gripping , funny film", "dull and far too long", "fine"]


def write_tsv(path):
    path.write_text("sentence\tlabel\n" + "".join(f"{s}\t1\n" for s in ROWS), encoding="utf-8")
    return path


def finetuned(folder, minilm_dir):
    """A `bert finetune` output folder as the finetune stage leaves it: model/ + metrics.json."""
    build("classification", minilm_dir, folder / "model")
    (folder / "metrics.json").write_text(json.dumps({"config": {"max_seq_length": 32}}))
    return folder


@pytest.mark.slow
def test_dvc_predict_stage_is_off_by_default_and_runs_per_input(tmp_path, shared_data, minilm_dir):
    repo = project_copy(tmp_path, shared_data)
    env = env_for(repo, f"sqlite:///{tmp_path / 'mlflow.db'}")
    dvc = [sys.executable, "-m", "dvc"]

    def run(*args):
        proc = subprocess.run([*dvc, *args], cwd=repo, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    assert "predict" not in run("stage", "list")  # the default: no inputs, no stage
    finetuned(repo / "runs/dvc/glue/SST-2", minilm_dir)
    settings = yaml.safe_load((repo / "predict.yaml").read_text())
    settings["predict"]["inputs"] = {
        "sst2-dev": {
            "task": "SST-2",
            "input": str(write_tsv(tmp_path / "dev.tsv")),
            "args": "--column text=sentence --batch-size 2",
        },
    }
    (repo / "predict.yaml").write_text(yaml.safe_dump(settings))
    assert "predict@sst2-dev" in run("stage", "list")
    run("repro", "--single-item", "predict@sst2-dev")
    lines = (repo / "runs/dvc/predictions/sst2-dev.jsonl").read_text().splitlines()
    answers = [json.loads(line) for line in lines]
    assert [a["row"] for a in answers] == [0, 1, 2]
    assert all(a["label"] in ("negative", "positive") for a in answers)


@pytest.mark.slow
def test_kfp_predict_component_runs_on_a_finetuned_model(tmp_path, minilm_dir, monkeypatch):
    from kfp import local

    from components.steps import predict

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("KFP_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    model = finetuned(tmp_path / "sst2", minilm_dir)
    task = predict(
        inputs=str(write_tsv(tmp_path / "in.tsv")), model_uri=str(model), columns="text=sentence"
    )
    out = task.outputs["predictions"].path
    answers = [json.loads(line) for line in open(f"{out}/predictions.jsonl")]
    assert [a["row"] for a in answers] == [0, 1, 2]
