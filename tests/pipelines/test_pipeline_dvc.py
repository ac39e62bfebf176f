"""`make run` (dvc repro in an MLflow pipeline run) end to end, in a copy of the project.

Small settings (tests/pipeline_helpers.py): the same stages and commands as the default run.
Also: each stage depends on the code it runs (checked against an import analysis, and through
`dvc status` after a code change), and `dvc push` / `dvc pull` through the default remote of
.dvc/config against a real S3 server.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.import_graph import imports_of, module_path, parents
from tests.pipeline_helpers import env_for, local_services, project_copy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dvc_run(tmp_path_factory, shared_data):
    """The DAG run twice by `pipelines/run_dvc.py` (what `make run` runs)."""
    tmp = tmp_path_factory.mktemp("dvc")
    repo = project_copy(tmp, shared_data)
    env = env_for(repo, f"sqlite:///{tmp / 'mlflow.db'}")
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "pipelines/run_dvc.py"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs.append(proc.stdout)
    return repo, env, runs


def _dvc(repo: Path, env: dict, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_make_run_prints_glue_table_and_mlflow_command(dvc_run):
    repo, env, (first, _) = dvc_run
    results = json.loads((repo / "runs/dvc/evaluate/glue_results.json").read_text())
    assert sorted(results["tasks"]) == ["MRPC", "SST-2", "STS-B"]
    for task, row in results["tasks"].items():
        assert f"| {task} |" in first
        assert -100 <= row["score"] <= 100
    assert "GLUE score" in first
    assert f"mlflow ui --backend-store-uri {env['MLFLOW_TRACKING_URI']}" in first
    shown = json.loads(_dvc(repo, env, "metrics", "show", "--json"))
    (metrics,) = [d["data"] for d in shown.values()]
    files = {Path(k).as_posix(): v["data"] for k, v in metrics.items()}
    assert files["runs/dvc/evaluate/glue_results.json"]["glue_score"] == pytest.approx(
        results["glue_score"]
    )
    # every task's metrics.json is a DVC metric too (a copy of the one in its output folder)
    for task in ("SST-2", "MRPC", "STS-B"):
        copied = (repo / "runs/dvc/metrics" / f"{task}.json").read_text()
        assert copied == (repo / "runs/dvc/glue" / task / "metrics.json").read_text()
        assert files[f"runs/dvc/metrics/{task}.json"]["task"] == task
    assert set(files) == {"runs/dvc/evaluate/glue_results.json"} | {
        f"runs/dvc/metrics/{p}{t}.json" for t in ("SST-2", "MRPC", "STS-B") for p in ("", "random-")
    }
    # the random-init control ran beside each task and is a row of its own, with the gain
    for task in ("SST-2", "MRPC", "STS-B"):
        assert files[f"runs/dvc/metrics/random-{task}.json"]["init"] == "random"
    assert "random init" in first and set(results["systems"]) == {"BERT (ours)", "random init"}
    # the GLUE chart is a DVC plot (an image), beside the pre-training curves
    plots = json.loads(_dvc(repo, env, "plots", "show", "--json"))
    (image,) = plots["data"]["runs/dvc/evaluate/glue_scores.png"]
    assert image["type"] == "image", image


@pytest.mark.slow
def test_second_repro_is_a_no_op(dvc_run):
    repo, env, (first, second) = dvc_run
    assert "Running stage 'pretrain'" in first
    assert "Running stage" not in second
    assert "none, all cached" in second
    assert "Data and pipelines are up to date" in _dvc(repo, env, "repro")


@pytest.mark.slow
def test_params_are_wired_to_their_stages(dvc_run):
    """`dvc exp run -S model.preset=mini` works through the same params: changing a key marks
    exactly the stages reading it as changed (a whole mini run is too slow for CI)."""
    repo, env, _ = dvc_run
    original = (repo / "params.yaml").read_text()
    cases = [
        ("model", "preset", "mini", {"pretrain"}),
        ("vocab", "vocab_size", 1200, {"vocab"}),
        ("instances", "dupe_factor", 2, {"instances"}),
        ("finetune", "epochs", 2, {f"{s}@{t}" for s in FINETUNES for t in GLUE_TASKS}),
        ("finetune", "tasks", [*GLUE_TASKS, "CoLA"], {"evaluate", "finetune@CoLA"}),
        # the ablations and the control are settings, not forks (the paper's Tables 5 and 8)
        ("instances", "masking_recipe", "100/0/0", {"instances"}),
        ("pretrain", "objective", "mlm", {"pretrain"}),
        (
            "finetune", "control_tasks", [*GLUE_TASKS, "CoLA"],
            {"evaluate", "finetune-control@CoLA"},
        ),
        ("finetune", "lr_sweep", "paper", {f"{s}@{t}" for s in FINETUNES for t in GLUE_TASKS}),
    ]
    try:
        for section, key, value, stages in cases:
            params = yaml.safe_load(original)
            params[section][key] = value
            (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            changed = set(json.loads(_dvc(repo, env, "status", "--json")))
            assert changed == stages, (section, key, changed)
    finally:
        (repo / "params.yaml").write_text(original)
    assert json.loads(_dvc(repo, env, "status", "--json")) == {}


GLUE_TASKS = ("SST-2", "MRPC", "STS-B")
FINETUNES = ("finetune", "finetune-control")  # the pre-trained model and the control


@pytest.mark.slow
def test_a_code_change_marks_the_stages_running_that_code(dvc_run):
    """Editing a bert_core module makes `dvc status` report exactly the stages whose command
    imports it (the stages after them change once those re-run and their outputs change)."""
    repo, env, _ = dvc_run
    glue = {f"{s}@{t}" for s in FINETUNES for t in GLUE_TASKS}
    cases = [
        ("data/corpus.py", {"clean"}),
        ("pretrain/worker.py", {"pretrain"}),
        ("finetune/tasks/glue.py", glue),
        ("finetune/tasks/glue_data.py", glue | {"evaluate"}),
        ("errors.py", {"clean", "vocab", "instances", "pretrain", "evaluate"} | glue),
    ]
    for name, stages in cases:
        module = repo / "bert_core" / name
        original = module.read_bytes()
        try:
            module.write_bytes(original + b"\n# edited\n")
            changed = set(json.loads(_dvc(repo, env, "status", "--json")))
            assert changed == stages, (name, changed)
        finally:
            module.write_bytes(original)
    assert json.loads(_dvc(repo, env, "status", "--json")) == {}


@pytest.mark.slow
def test_mlflow_pipeline_run_with_nested_steps_and_lineage(dvc_run, monkeypatch):
    from mlflow import MlflowClient

    from bert_core.track import lineage

    repo, env, _ = dvc_run
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(lineage.PIPELINE_EXPERIMENT)
    parents = client.search_runs(
        [experiment.experiment_id],
        filter_string="tags.`bert.step` = 'pipeline'",
        order_by=["attributes.start_time ASC"],
    )
    assert len(parents) == 2
    first, second = parents
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    corpus_md5 = lock["clean"]["deps"][0]["md5"]
    assert first.data.tags["dvc.input.../shared/data/corpus/a_christmas_carol.txt"] == corpus_md5
    assert (
        first.data.tags["mlflow.source.git.commit"]
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
    )
    assert first.data.params["model.preset"] == "tiny"
    assert first.data.metrics["glue_score"] == pytest.approx(second.data.metrics["glue_score"])

    children = {r.data.tags["dvc.stage"]: r for r in lineage.child_runs(first.info.run_id)}
    assert set(children) == set(lock)  # one nested run per stage, all in this experiment
    for stage, run in children.items():
        assert run.info.experiment_id == experiment.experiment_id
        assert run.info.status == "FINISHED"
        for dep in lock[stage]["deps"]:
            assert run.data.tags[f"dvc.dep.{dep['path']}"] == dep["md5"], stage
    assert children["pretrain"].data.metrics["loss"] > 0
    assert 0 <= children["finetune@SST-2"].data.metrics["best_dev_accuracy"] <= 1
    assert children["evaluate"].data.metrics["glue_score"] == first.data.metrics["glue_score"]
    # the parent run holds the evaluate step's metrics, at its scale (fractions)
    results = {k: v for k, v in first.data.metrics.items() if k != "pipeline_seconds"}
    assert results == children["evaluate"].data.metrics
    assert {"glue_score", "SST-2.score", "SST-2.accuracy", "STS-B.pearson"} <= set(results)
    assert all(-1 <= v <= 1 for v in results.values()), results
    assert lineage.child_runs(second.info.run_id) == []  # cached: nothing re-ran

    (version,) = client.search_model_versions(f"name='{lineage.REGISTERED_MODEL}'")
    assert version.run_id == children["pretrain"].info.run_id
    from bert_core.serve.mlflow_model import local_model

    # an MLflow model (pyfunc: masked-token filling) holding the HF-layout folder
    with local_model(f"models:/{lineage.REGISTERED_MODEL}/1") as (folder, _):
        files = {f.name for f in folder.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.txt"} <= files

    table = subprocess.run(
        [sys.executable, "-m", "bert_core", "runs"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert first.info.run_id[:8] in table and second.info.run_id[:8] in table
    shown = [float(x) for x in re.findall(r"-?\d+\.\d+", table)]  # 40.20 may print as 40.2
    percent = 100 * first.data.metrics["glue_score"]  # `bert runs` shows scores in percent
    assert any(abs(x - percent) < 0.006 for x in shown), table


def test_token_tasks_are_a_foreach_stage_feeding_evaluate(tmp_path, shared_data):
    """No training: an empty `finetune.token_tasks` (the default) makes no token stage, and
    listing conll2003 adds `finetune-token@conll2003` (on the shared CoNLL folder, after
    pretrain) upstream of `evaluate`."""
    repo = project_copy(tmp_path, shared_data)
    env = env_for(repo, f"sqlite:///{tmp_path / 'mlflow.db'}")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["finetune"]["token_tasks"] == []
    assert "finetune-token" not in _dvc(repo, env, "stage", "list")
    assert '"finetune@SST-2" -> "evaluate"' in _dvc(repo, env, "dag", "--dot")

    params["finetune"]["token_tasks"] = ["conll2003"]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stages = {
        line.split()[0]: line for line in _dvc(repo, env, "stage", "list").splitlines() if line
    }
    assert "finetune-token@conll2003" in stages
    assert "Outputs runs/dvc/glue/conll2003" in stages["finetune-token@conll2003"]
    assert stages["finetune-token@conll2003"].endswith("Reports runs/dvc/metrics/conll2003.json")
    dag = _dvc(repo, env, "dag", "--dot")
    assert '"pretrain" -> "finetune-token@conll2003"' in dag
    assert '"finetune-token@conll2003" -> "evaluate"' in dag
    status = json.loads(_dvc(repo, env, "status", "--json"))  # nothing has run in this copy
    assert {"finetune-token@conll2003", "evaluate"} <= set(status)
    (deps,) = [d["changed deps"] for d in status["finetune-token@conll2003"] if "changed deps" in d]
    assert any(Path(dep).as_posix().endswith("shared/data/conll2003") for dep in deps), deps


# ---------------------------------------------------------------- the code each stage runs


def stage_code(command: str, extra: set[str] = frozenset()) -> set[str]:
    """The files of bert_core that `bert <command>` runs: the import closure (tests/import_graph)
    of the CLI's entry (module level and `main`: its other functions are the KFP and DVC
    helpers), the command's module (the CLI imports it by name) and `extra` modules, with the
    `__init__.py` of every package on the way (importing a module runs them)."""
    from bert_core.cli import COMMANDS

    seen, todo = set(), ["bert_core.cli", COMMANDS[command][0], *extra]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            entry = module == "bert_core.cli"
            todo += [*imports_of(module_path(module), entry_only=entry), *parents(module)]
    return {module_path(m).relative_to(ROOT).as_posix() for m in seen}


def write_stage_deps(path: Path = ROOT / "dvc.yaml") -> None:
    """Rewrite each stage's `bert_core/` deps in dvc.yaml as `stage_code` computes them (the
    rest of the file, comments included, as it was): `python -m tests.pipelines.test_pipeline_dvc`
    after adding, moving or removing a module."""
    stages = yaml.safe_load(path.read_text())["stages"]
    commands = {name: s.get("do", s)["cmd"].split()[1] for name, s in stages.items()}
    code = {name: sorted(stage_code(command)) for name, command in commands.items()}
    out, stage = [], None
    for line in path.read_text().splitlines():
        if re.fullmatch(r"  ([\w-]+):", line):
            stage = line.strip()[:-1]
        dep = re.fullmatch(r"(\s+)- bert_core/\S+", line)
        if dep is None:
            out.append(line)
        elif not out[-1].lstrip().startswith("- bert_core/"):  # the first of a stage's list
            out += [f"{dep.group(1)}- {f}" for f in code[stage]]
    path.write_text("\n".join(out) + "\n")


def test_every_stage_depends_on_the_code_it_runs():
    """dvc.yaml lists, for each stage, exactly the bert_core files its command runs (after a
    change of modules: `python -m tests.pipelines.test_pipeline_dvc` rewrites the lists)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        body = stage.get("do", stage)  # foreach stages
        bert, command = body["cmd"].split()[:2]
        assert bert == "bert", name
        expected = stage_code(command)
        listed = {d for d in body["deps"] if d.startswith("bert_core/")}
        assert listed == expected, (name, sorted(expected - listed), sorted(listed - expected))
    # the analysis itself: lazy imports count (the worker is imported inside a function,
    # ray_jobs at the top), the KFP and DVC helpers of the CLI do not (kfp_metrics imports
    # evaluate), packages' __init__.py do, and `bert finetune` runs every task module (its
    # TASKS table imports their classes)
    pretrain = stage_code("pretrain")
    assert {"bert_core/pretrain/worker.py", "bert_core/pretrain/ray_jobs.py"} <= pretrain
    assert "bert_core/pretrain/__init__.py" in pretrain
    assert "bert_core/report/evaluate.py" not in stage_code("clean")
    assert "bert_core/track/lineage.py" not in stage_code("clean")  # the CLI's KFP helpers only
    tasks = {f"bert_core/finetune/tasks/{t}.py" for t in ("glue", "ner", "squad", "swag")}
    assert tasks <= stage_code("finetune") and not tasks & stage_code("evaluate")


# ---------------------------------------------------------------- the default remote


@pytest.fixture(scope="module")
def s3_bucket(tmp_path_factory):
    """A real S3 server with the bucket .dvc/config names; its client environment."""
    services = local_services()
    server = services.start_s3(tmp_path_factory.mktemp("s3-dvc"), buckets=("bert",))
    yield services.client_env(server.url, {})
    server.stop()


@pytest.mark.slow
def test_dvc_push_and_pull_through_the_default_remote(dvc_run, s3_bucket):
    """`dvc push` sends every cached output to s3://bert/dvc (the endpoint and credentials from
    the environment only); after the cache and the outputs are wiped, `dvc pull` restores them
    and the pipeline is up to date again."""
    import boto3

    repo, env, _ = dvc_run
    env = {**env, **s3_bucket}
    config = [ln for ln in (repo / ".dvc" / "config").read_text().splitlines() if ln[:1] != "#"]
    assert "    url = s3://bert/dvc" in config and "    remote = store" in config
    assert not [ln for ln in config if re.search(r"endpointurl|secret|access_key", ln)], config
    _dvc(repo, env, "push")
    s3 = boto3.client(
        "s3", endpoint_url=s3_bucket["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3_bucket["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3_bucket["AWS_SECRET_ACCESS_KEY"],
    )  # fmt: skip
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="bert", Prefix="dvc/")
    pushed = [o["Key"] for page in pages for o in page.get("Contents", [])]
    cached = [p for p in (repo / ".dvc" / "cache" / "files").rglob("*") if p.is_file()]
    assert len(pushed) == len(cached) > 20, (len(pushed), len(cached))

    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    # the cached outputs; pretrain-ray (Ray's checkpoints) is `cache: false` and stays
    outs = {o["path"] for s in lock.values() for o in s["outs"]} - {"runs/dvc/pretrain-ray"}
    results = (repo / "runs/dvc/evaluate/glue_results.json").read_bytes()
    shutil.rmtree(repo / ".dvc" / "cache")
    for out in outs:
        path = repo / out
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert set(json.loads(_dvc(repo, env, "status", "--json"))) >= {"clean", "evaluate"}
    _dvc(repo, env, "pull")
    assert json.loads(_dvc(repo, env, "status", "--json")) == {}
    assert (repo / "runs/dvc/evaluate/glue_results.json").read_bytes() == results


if __name__ == "__main__":
    write_stage_deps()
