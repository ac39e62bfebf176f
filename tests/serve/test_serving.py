"""The MLflow flavor (`bert_core.serve.mlflow_model`) and the registry (`bert_core.serve.registry`):
logged models load with `mlflow.pyfunc`, answer as the predictors do, need neither transformers nor
the project installed; `bert finetune` registers its model as a candidate, described and linked to
the pre-trained version it came from; `bert promote` alone makes a candidate `champion` of the
release model (a copy), only a better one and never one below its baseline; a logged MLmodel
names no path of the machine that logged it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient
from mlflow.models import Model

from bert_core import cli
from bert_core.errors import BadValue
from bert_core.serve import champion, registry
from bert_core.serve import mlflow_model as serving
from bert_core.serve.predictors import load_predictor
from bert_core.tracking import RUN_RECORD, start_run
from tests.serving_helpers import build

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    """One MLflow database for the module (creating its tables takes seconds)."""
    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        uri = f"sqlite:///{root / 'mlflow.db'}"
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        for key in ("BERT_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
            mp.delenv(key, raising=False)
        mp.chdir(root)  # the sqlite store keeps artifacts under the cwd
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("serving")  # not an earlier module's, of another store
        yield root


@pytest.fixture(scope="module")
def logged(tracking, minilm_dir):
    """One logged MLflow model per kind: kind -> (model folder, ModelInfo)."""
    out = {}
    with mlflow.start_run():
        for kind in ("classification", "ner", "question-answering", "fill-mask", "multiple-choice"):
            folder = build(kind, minilm_dir, tracking / "folders" / kind)
            out[kind] = folder, serving.log_model(folder, {"max_seq_length": 64, "epochs": 3})
    return out


@pytest.mark.slow
def test_every_kind_loads_with_pyfunc_and_answers_as_its_predictor(logged):
    for kind, (folder, info) in logged.items():
        model = mlflow.pyfunc.load_model(info.model_uri)
        assert model.metadata.metadata["bert_kind"] == kind
        signature = model.metadata.signature
        local = mlflow.artifacts.download_artifacts(info.model_uri)
        example = Model.load(local).load_input_example(local)
        assert isinstance(example, pd.DataFrame) and len(example) == 1
        assert set(example.columns) <= set(signature.inputs.input_names())
        answers = model.predict(example)
        assert set(answers[0]) == set(signature.outputs.input_names())
        # the logged settings reach the predictor: max_seq_length 64, not the default
        assert model.unwrap_python_model().predictor.max_seq_length == 64
        assert answers == load_predictor(folder, serving.Settings(max_seq_length=64)).predict(
            example
        )
    reqs = serving.requirements()
    assert not any(r.startswith("transformers") for r in reqs)
    assert {r.split("==")[0] for r in reqs} >= {"torch", "tokenizers", "safetensors", "mlflow"}


def test_model_needs_neither_transformers_nor_the_project_installed(logged, tmp_path):
    """A fresh process that cannot import transformers, and no PYTHONPATH: the model's own
    copy of bert_core (code_paths) answers."""
    _, info = logged["question-answering"]
    local = mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp_path))
    script = (
        "import json, sys; sys.modules['transformers'] = None\n"
        "import mlflow, pandas as pd\n"
        f"m = mlflow.pyfunc.load_model({local!r})\n"
        "a = m.predict(pd.DataFrame({'question': ['Who?'], 'context': ['Ada wrote it.']}))\n"
        "import bert_core\n"
        "print(json.dumps({'answer': a[0], 'code': bert_core.__file__}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["code"].startswith(str(local)), out["code"]  # the model's copy, not ours
    assert out["answer"]["answer"] == "Ada wrote it."[out["answer"]["start"] : out["answer"]["end"]]


def test_bad_input_is_an_invalid_parameter_error(logged):
    from mlflow.exceptions import MlflowException

    model = mlflow.pyfunc.load_model(logged["classification"][1].model_uri)
    with pytest.raises(MlflowException, match="row 1: 'text' is empty") as e:
        model.predict(pd.DataFrame({"text": ["fine", ""]}))
    assert e.value.error_code == "INVALID_PARAMETER_VALUE"
    with pytest.raises(MlflowException, match="missing inputs \\['text'\\]"):
        model.predict(pd.DataFrame({"sentence": ["fine"]}))


def pretrain_output(minilm_dir: Path, dest: Path) -> tuple[Path, str]:
    """A `bert pretrain` model folder as the command leaves it: a fill-mask model naming its
    FINISHED pretrain run (`RUN_RECORD`)."""
    folder = build("fill-mask", minilm_dir, dest)
    with start_run("pretrain", {"steps": 1}) as run:
        pass
    (folder / RUN_RECORD).write_text(json.dumps({"run_id": run.info.run_id}))
    return folder, run.info.run_id


def strings(tree) -> list[str]:
    """Every string in a parsed YAML file (keys and values), however deep."""
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in (*strings(k), *strings(v))]
    if isinstance(tree, list):
        return [x for v in tree for x in strings(v)]
    return [tree] if isinstance(tree, str) else []


def machine_paths(model_uri: str, dest: Path) -> list[str]:
    """The strings of a registered model's MLmodel that name a path of this machine: absolute
    paths, and anything under the temporary folders (the staging folder) or this checkout."""
    local = mlflow.artifacts.download_artifacts(model_uri, dst_path=str(dest))
    mlmodel = yaml.safe_load((Path(local) / "MLmodel").read_text())
    roots = ("/tmp", str(Path(__file__).resolve().parents[2]), str(Path.home()))
    return [x for x in strings(mlmodel) if os.path.isabs(x) or any(r in x for r in roots)]


@pytest.mark.slow
def test_finetune_registers_a_candidate_linked_to_the_pretrained_one_and_promote_copies_it(
    tracking, shared_data, minilm_dir, capsys
):
    pretrained, pretrain_run = pretrain_output(minilm_dir, tracking / "pretrain" / "model")
    out = tracking / "sst2"
    argv = ["finetune", "--task", "SST-2", "--data", str(shared_data / "glue" / "SST-2")]
    argv += ["--model", str(pretrained), "--output", str(out), "--epochs", "1"]
    assert (
        cli.main(
            [*argv, "--batch-size", "8", "--max-train-examples", "8", "--max-eval-examples", "16"]
        )
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["registered_model"] == "bert-sst2-candidates/1"
    record = json.loads((out / registry.RECORD).read_text())
    assert record["registered_model"] == "bert-sst2-candidates"
    client = MlflowClient()

    # the pre-trained model: registered from its FINISHED run before the fine-tuned version
    # named it, described, once (asking again finds the same version)
    (pre,) = client.search_model_versions(f"name='{registry.PRETRAINED}'")
    assert pre.run_id == pretrain_run and pretrain_run in pre.description
    assert "fills [MASK]" in client.get_registered_model(registry.PRETRAINED).description
    link = f"models:/{registry.PRETRAINED}/{pre.version}"
    assert registry.pretrained_source(pretrained, "unused") == link
    assert len(client.search_model_versions(f"name='{registry.PRETRAINED}'")) == 1

    (v1,) = client.search_model_versions("name='bert-sst2-candidates'")
    metrics = json.loads((out / "metrics.json").read_text())
    assert str(v1.version) == "1" and v1.run_id == record["run_id"]
    # registered after the run ended: the version points at a FINISHED run
    assert client.get_run(v1.run_id).info.status == "FINISHED"
    assert float(v1.tags[champion.SCORE_TAG]) == metrics["score"]
    assert v1.tags[registry.TASK_TAG] == "SST-2"
    assert v1.tags[registry.METRIC_TAG] == "accuracy" == metrics["score_metric"]
    assert v1.tags[registry.SOURCE_TAG] == link == metrics["pretrained_model"]
    for text in (record["run_id"], "SST-2 dev accuracy", f"{metrics['score']:.2f}", link):
        assert text in v1.description, (text, v1.description)
    described = client.get_registered_model("bert-sst2-candidates").description
    assert all(w in described for w in ("SST-2", "accuracy", "champion", "bert promote"))
    assert client.search_registered_models("name='bert-sst2'") == []  # promote makes it
    run = client.get_run(record["run_id"])
    assert run.data.tags["bert.registered_model"] == "bert-sst2-candidates"
    assert run.data.tags[registry.SOURCE_TAG] == link
    # the model's inference settings beside, not over, the run's training parameters
    assert (run.data.params["batch_size"], run.data.params["inference/max_seq_length"]) == (
        "8",
        "128",
    )

    # the task's baseline on the same dev set travels with the version: SST-2's majority label.
    # `bert promote` (default: the newest candidate) copies a sound one into bert-sst2 as its
    # champion, and says why; one that does not beat it (a few examples' fine-tuning may not)
    # is marked when registered and never copied
    assert metrics["baseline"].endswith("(the most frequent in training)")
    assert float(v1.tags[champion.BASELINE_TAG]) == metrics["baseline_score"] > 0
    sound = metrics["score"] > metrics["baseline_score"]
    assert (champion.PROMOTION_TAG in v1.tags) == (not sound)
    assert cli.main(["promote", "sst2"]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["promoted"] is sound and decision["candidate"] == "bert-sst2-candidates/1"
    served = champion.by_alias(client, "bert-sst2", "champion")
    if sound:
        assert served.source == "models:/bert-sst2-candidates/1" and served.run_id == v1.run_id
        assert served.tags[champion.SCORE_TAG] == v1.tags[champion.SCORE_TAG]  # the candidate's
        assert served.tags[champion.PROMOTION_TAG].startswith("champion: first champion (dev")
        assert "bert promote" in client.get_registered_model("bert-sst2").description
        assert cli.main(["promote", "sst2", str(out)]) == 0  # by its output folder: the same
        assert json.loads(capsys.readouterr().out)["reason"] == "already the champion"
    else:
        assert served is None and "does not beat the task's" in decision["reason"]

    # the rule on candidates of known scores: at the baseline, not champion, not even forced;
    # the first above it champion; after that, only a better one moves it, or --force; each
    # promotion a new version of the release model, copied from its candidate
    floor = {"task": "SST-2", "score": 50.0, "baseline_score": 50.0, "score_metric": "accuracy"}
    floor["pretrained_model"] = link
    pool = registry.candidates_of("bert-gate")

    def version(score: float) -> str:
        return registry.register(record["model_uri"], "bert-gate", floor | {"score": score}).version

    def promote(v: str, force: bool = False) -> dict:
        return champion.promote("bert-gate", pool, v, force)

    def served() -> str | None:  # the candidate the champion was copied from
        now = champion.by_alias(client, "bert-gate", "champion")
        return None if now is None else now.source.removeprefix(f"models:/{pool}/")

    low = version(50.0)
    assert client.get_model_version(pool, low).tags[champion.PROMOTION_TAG] == (
        "not champion: dev score 50 does not beat the task's baseline 50 (the best answer that "
        "ignores the input, on the same dev set)"
    )
    assert promote(low, force=True)["promoted"] is False
    assert served() is None and client.search_registered_models("name='bert-gate'") == []
    first = version(60.0)
    assert served() is None  # registering promotes nothing
    assert promote(first)["reason"].startswith("champion: first champion (dev score 60)")
    assert served() == str(first)
    worse, better = version(59.0), version(61.0)
    refused = promote(worse)
    assert (refused["promoted"], refused["champion"]) == (False, 1)
    assert refused["reason"] == "not promoted: dev score 59 <= champion version 1's 60"
    assert promote(better)["champion"] == 2 and served() == str(better)
    assert promote(better)["reason"] == "already the champion"
    forced = promote(worse, force=True)
    assert forced["champion"] == 3 and forced["reason"].endswith(
        f"(forced) (from {pool} version {worse})"
    )
    assert served() == str(worse)
    copies = client.search_model_versions("name='bert-gate'")
    want = sorted(f"models:/{pool}/{v}" for v in (first, better, worse))
    assert sorted(v.source for v in copies) == want

    # MLmodel names no path of this machine: not the staging folder `bert finetune` logged
    # from, not this checkout's code file; and the models load with the folders all gone
    texts = pd.DataFrame({"text": ["a gripping , funny film", "dull"]})
    expected = load_predictor(out / "model").predict(texts)
    for uri in ("models:/bert-gate@champion", link):
        assert machine_paths(uri, tracking / "downloads" / uri.split("/")[1]) == [], uri
    shutil.rmtree(out)
    shutil.rmtree(pretrained)
    assert mlflow.pyfunc.load_model("models:/bert-gate@champion").predict(texts) == expected
    (filled,) = mlflow.pyfunc.load_model(link).predict(pd.DataFrame({"text": ["a [MASK] film"]}))
    assert len(filled["masks"]) == 1


def test_a_folder_that_names_no_finished_pretrain_run_is_linked_by_its_path(tracking, minilm_dir):
    """A public checkpoint or a folder made by hand (no run named), one whose pretrain run
    failed, or one from another tracking store: nothing is registered, the link is the path."""
    folder = build("fill-mask", minilm_dir, tracking / "hand-made")
    assert registry.pretrained_source(folder, "s3://bucket/hand-made") == "s3://bucket/hand-made"
    with pytest.raises(RuntimeError), start_run("pretrain", {}) as run:
        raise RuntimeError("the pre-training failed")
    for run_id in (run.info.run_id, "f" * 32):  # FAILED; not in this store
        (folder / RUN_RECORD).write_text(json.dumps({"run_id": run_id}))
        assert registry.pretrained_source(folder, str(folder)) == str(folder)
        assert MlflowClient().search_model_versions(f"run_id = '{run_id}'") == []


def test_a_step_that_fails_after_logging_its_model_registers_nothing(
    tracking, shared_data, minilm_dir, monkeypatch, capsys
):
    """#26: the model is logged in the run, then the step fails before its output is complete
    (here: right after `finish`, as a full disk or a lost bucket would): no registry version, no
    alias moved, no output, the run FAILED."""
    from bert_core.errors import BertError
    from bert_core.finetune import command

    tiny = build("classification", minilm_dir, tracking / "failing-init")
    finish = command.finish

    def finish_then_fail(out, result, release):
        record = finish(out, result, release)  # the model is now logged on the run
        raise BertError(f"cannot write the output: injected after logging {record['model_uri']}")

    monkeypatch.setattr(command, "finish", finish_then_fail)
    out = tracking / "failing"
    argv = ["finetune", "--task", "SST-2", "--data", str(shared_data / "glue" / "SST-2")]
    argv += ["--model", str(tiny), "--output", str(out), "--epochs", "1", "--batch-size", "8"]
    argv += ["--registered-model", "failing-{task}"]
    assert cli.main([*argv, "--max-train-examples", "8", "--max-eval-examples", "8"]) == 2
    assert "injected after logging" in capsys.readouterr().err
    client = MlflowClient()
    assert client.search_model_versions("name='failing-sst2-candidates'") == []
    assert client.search_registered_models("name LIKE 'failing-sst2%'") == []
    assert not out.exists()
    runs = mlflow.search_runs(
        search_all_experiments=True,
        output_format="list",
        filter_string="tags.`bert.step` = 'finetune-SST-2'",
    )
    failed = [r for r in runs if r.data.params.get("model") == str(tiny)]
    assert [r.info.status for r in failed] == ["FAILED"]
    assert "bert.model_version" not in failed[0].data.tags


def test_registered_model_names():
    assert registry.model_name("SST-2") == "bert-sst2"
    assert registry.model_name("squad_v2") == "bert-squadv2"
    assert registry.model_name("STS-B", "team-{task}-bert") == "team-stsb-bert"
    assert registry.model_name("SST-2", "none") is None
    with pytest.raises(BadValue, match="--registered-model 'bert-{name}'"):
        registry.model_name("SST-2", "bert-{name}")


SINGLE, PAIR = ("CoLA", "SST-2"), ("MRPC", "QQP", "STS-B", "MNLI", "QNLI", "RTE", "WNLI")


@pytest.mark.parametrize(
    "head,task,required,optional",
    [("BertForSequenceClassification", t, ("text",), ()) for t in SINGLE]
    + [("BertForSequenceClassification", t, ("text", "text_pair"), ()) for t in PAIR]
    + [
        ("BertForSequenceClassification", None, ("text",), ("text_pair",)),  # no known task
        ("BertForTokenClassification", "conll2003", ("text",), ()),
        ("BertForQuestionAnswering", "squad_v2", ("question", "context"), ()),
        (
            "BertForMultipleChoice",
            "swag",
            ("context", *(f"ending{i}" for i in range(4))),
            ("start",),
        ),
        ("BertForPreTraining", None, ("text",), ()),
    ],
)
def test_each_model_signature_and_example_are_its_tasks(head, task, required, optional):
    """A single-sentence task's model takes `text` only, a pair task's `text` and `text_pair`
    both required; the input example has exactly the required columns (and SWAG's `start`)."""
    config = {"architectures": [head], "finetuning_task": task}
    inputs = serving.signature(config).inputs
    assert tuple(c.name for c in inputs.inputs if c.required) == required
    assert tuple(c.name for c in inputs.inputs if not c.required) == optional
    example = serving.predictor_class(config).example(config)
    assert set(required) <= set(example) <= set(required) | set(optional)


def squad_v2_output(root, minilm_dir, threshold):
    """A `bert finetune --task squad_v2` output whose model answers every question with null
    odds 0 (its head all zeros: the null and every span score 0): the default threshold 0
    answers a span (odds 0 is not > 0), a tuned threshold below 0 answers ""."""
    import torch

    from bert_core.model import heads

    model = heads.BertForQuestionAnswering.from_pretrained(
        minilm_dir, num_labels=2, finetuning_task="squad_v2"
    )
    torch.nn.init.zeros_(model.qa_outputs.weight)
    torch.nn.init.zeros_(model.qa_outputs.bias)
    model.save_pretrained(root / "model", vocab_file=minilm_dir / "vocab.txt")
    result = {
        "task": "squad_v2",
        "config": {"max_seq_length": 64, "doc_stride": 32, "null_score_diff_threshold": 0.0},
        "metrics": {"f1": 0.5, "best_f1": 0.6, "best_f1_thresh": threshold},
        "score": 0.5,
    }
    (root / "metrics.json").write_text(json.dumps(result))
    return root, result


@pytest.mark.slow
def test_squad_v2_tuned_threshold_travels_with_the_model(tracking, minilm_dir, capsys):
    """best_f1_thresh of metrics.json is the threshold `bert predict` and the MLflow model
    answer with: "" where the model folder alone (threshold 0) answers a span."""
    out, result = squad_v2_output(tracking / "squad_v2", minilm_dir, -1.0)
    row = {
        "question": "Where was the treaty signed?",
        "context": "After months of talks, the treaty was signed in Lisbon.",
    }
    (span,) = load_predictor(out / "model").predict(pd.DataFrame([row]))
    assert span["answer"] != "" and row["context"][span["start"] : span["end"]] == span["answer"]
    assert serving.inference_settings(result)["null_score_diff_threshold"] == -1.0

    (tracking / "qa.jsonl").write_text(json.dumps(row) + "\n")
    argv = ["predict", "--model", str(out), "--input", str(tracking / "qa.jsonl")]
    for extra, want in (([], ""), (["--null-score-diff-threshold", "0"], span["answer"])):
        target = tracking / f"qa-{len(extra)}.jsonl"
        assert cli.main([*argv, "--output", str(target), *extra]) == 0
        assert json.loads(target.read_text())["answer"] == want
    capsys.readouterr()

    with mlflow.start_run(experiment_id=mlflow.set_experiment("serving").experiment_id) as run:
        record = registry.log_finetuned(out, result, None)
    model = mlflow.pyfunc.load_model(record["model_uri"])
    assert model.predict(pd.DataFrame([row]))[0]["answer"] == ""
    params = MlflowClient().get_run(run.info.run_id).data.params
    assert float(params["inference/null_score_diff_threshold"]) == -1.0


@pytest.mark.slow
def test_predict_logs_where_its_model_was_logged(tracking, minilm_dir, monkeypatch, capsys):
    """`bert predict`'s run goes where `tracking.start_run` says (MLFLOW_EXPERIMENT_NAME, the
    parent run's), and where neither is set, into the experiment of the run that logged the
    model, tagged with that run: not into the catch-all `bert`. Every way to name the model."""
    import shutil

    client = MlflowClient()
    folder = build("classification", minilm_dir, tracking / "exp" / "model")
    with mlflow.start_run(experiment_id=mlflow.set_experiment("models").experiment_id) as run:
        info = serving.log_model(folder, {})
    result = {"task": "SST-2", "score": 1.0, "baseline_score": 0.5}
    version = registry.register(info.model_uri, "exp-sst2", result)
    champion.promote("exp-sst2", "exp-sst2-candidates", version.version)
    output = tracking / "exp-output"  # a `bert finetune` output: model/, metrics.json, record
    shutil.copytree(folder, output / "model")
    (output / "metrics.json").write_text(json.dumps({"config": {}}))
    (output / registry.RECORD).write_text(json.dumps({"run_id": run.info.run_id}))
    (tracking / "in.txt").write_text("a gripping , funny film\n")

    def predict_run(model):
        out = tracking / "pred.jsonl"
        out.unlink(missing_ok=True)
        argv = ["predict", "--model", model, "--input", str(tracking / "in.txt")]
        assert cli.main([*argv, "--output", str(out)]) == 0
        capsys.readouterr()
        (run,) = mlflow.search_runs(
            search_all_experiments=True,
            output_format="list",
            filter_string="tags.`bert.step` = 'predict'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return client.get_experiment(run.info.experiment_id).name, run.data.tags

    models = [
        info.model_uri,
        f"runs:/{run.info.run_id}/model",
        str(output),
        "models:/exp-sst2@champion",
        f"models:/exp-sst2-candidates/{version.version}",
    ]
    try:
        for model in models:
            name, tags = predict_run(model)
            assert (name, tags["bert.model_run_id"]) == ("models", run.info.run_id), model
        assert predict_run(str(folder))[0] == "bert"  # a bare folder: no run to follow
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "my-project")
        assert predict_run(info.model_uri)[0] == "my-project"  # the environment says
    finally:
        mlflow.set_experiment("serving")


def test_artifact_progress_bars_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    serving.quiet_progress()  # pytest's stderr is no terminal, as a KFP pod's log
    assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")
    serving.quiet_progress()  # the environment wins
    assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "true"
