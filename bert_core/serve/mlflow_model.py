"""Our models as MLflow models: a pyfunc flavor that answers raw text, with a signature.

Why pyfunc `PythonModel` with the model folder as an artifact (not `mlflow.pytorch`): what a user
calls is not the network but tokenisation + network + decoding (labels, entity spans, answer
offsets); `mlflow.pytorch` would hand out a module that needs our tokenizer and task code beside
it. The pyfunc model carries all of it: the HF-layout folder (weights, config.json with the label
names, vocab.txt and tokenizer_config.json: the casing) as the artifact `model`, this package as
its code (`code_paths`, so loading needs no install of the project), the inference settings of
the training run as `model_config`, an input/output signature and an input example, and pinned
requirements of our model code only (no `transformers`). `mlflow.pyfunc.load_model`,
`mlflow models serve` and `bert predict` then all answer through `bert_core.serve.predictors`.

`log_model` logs one onto a run (the open one, or `run_id`'s): `bert finetune` calls it through
`bert_core.serve.registry.log_finetuned`, `registry.register_pretrained` for the pre-trained
model (masked-token filling). The MLmodel it writes names no path of the machine that logged it
(`_save_portable`): a model read elsewhere, or after `bert finetune`'s staging folder is gone,
has no stale path in it. `resolve` turns any model reference a user may hold
(a folder, `runs:/...`, `models:/name@alias`) into a local folder and its settings
(`local_model`). A fine-tuned model's settings are its run's (`inference_settings`), SQuAD
2.0's tuned null threshold included, so `bert predict` and the served model answer "" exactly
where the tuned dev score counted no answer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from bert_core.errors import BertError, NotFound, redacted
from bert_core.serve.predictors import (
    BadInput,
    Settings,
    load_predictor,
    predictor_class,
    read_config,
)
from bert_core.storage import is_uri
from bert_core.tracking import tracking_uri

ARTIFACT = "model"  # the artifacts key (and folder name) of the HF-layout model folder
# what the predictors import at inference; pinned to the versions that logged the model
REQUIREMENTS = ("mlflow", "torch", "numpy", "pandas", "pyarrow", "safetensors", "tokenizers")
# model_config = {"inference": settings}: MLflow also logs it as run parameters, flattened with
# "/", so the key keeps them apart from the training run's own (`batch_size` is both)
CONFIG_KEY = "inference"
RUNTIME = ("batch_size", "device")  # settings of where a model runs, not of the model


class RefusedInput(MlflowException):
    """Bad input as the scoring server answers it: error code `INVALID_PARAMETER_VALUE`, our
    message, and HTTP 400 when the request is not this model's input (a column missing) or 422
    when a row's value is refused (empty, not text, over `max_chars`: `BadInput.row` is set; the
    request is well formed but cannot be answered, RFC 9110 section 15.5.21).

    MLflow's scoring app (mlflow/pyfunc/scoring_server/__init__.py, 3.17) answers an
    MlflowException with `e.get_http_status_code()` (`_async_catch_mlflow_exception`), and its
    `invocations` re-raises the very object after prefixing the message, so the status holds for
    `bert serve` and `mlflow models serve` alike."""

    def __init__(self, message: str, status: int):
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)
        self.status = status

    def get_http_status_code(self) -> int:
        return self.status


class BertPyfunc(mlflow.pyfunc.PythonModel):
    """The flavor: a `bert_core.serve.predictors` predictor behind MLflow's pyfunc interface.

    Bad input raises `RefusedInput` (400 or 422 with the message; any other exception would be
    a 400 with only a generic message and a traceback)."""

    def load_context(self, context) -> None:
        settings = Settings.from_dict((context.model_config or {}).get(CONFIG_KEY))
        self.predictor = load_predictor(context.artifacts[ARTIFACT], settings)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[dict]:
        # the DataFrame hint: MLflow checks input against the signature, not the hint
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        try:
            return self.predictor.predict(frame)
        except BadInput as e:
            raise RefusedInput(str(e), 400 if e.row is None else 422) from None


def mlflow_type(t: Any):
    """`Predictor.output_types` notation -> an MLflow signature type."""
    from mlflow.types.schema import Array, Object, Property

    if isinstance(t, list):
        return Array(mlflow_type(t[0]))
    if isinstance(t, dict):
        return Object([Property(k, mlflow_type(v)) for k, v in t.items()])
    return t  # "string", "double", "long": MLflow's own names


def signature(config: dict):
    """The input columns (required and optional) and the answer's fields of a model: its own
    (`Predictor.fields`), so an SST-2 model takes `text`, an MRPC one `text` and `text_pair`,
    a classifier of no known task `text` and an optional `text_pair`."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    cls = predictor_class(config)
    required, optional = cls.fields(config)
    inputs = [ColSpec("string", c) for c in required]
    inputs += [ColSpec("string", c, required=False) for c in optional]
    outputs = [ColSpec(mlflow_type(t), k) for k, t in cls.output_types(config).items()]
    return ModelSignature(inputs=Schema(inputs), outputs=Schema(outputs))


def requirements() -> list[str]:
    """Pinned requirements (local version labels such as `+cpu` dropped: pip cannot resolve
    them from an index)."""
    return [f"{p}=={version(p).split('+')[0]}" for p in REQUIREMENTS]


def inference_settings(result: dict) -> dict:
    """A `bert finetune` run's inference settings, from its metrics.json content: its config
    (how text was cut, windowed and decoded) less where it ran (`RUNTIME`), and for SQuAD 2.0
    the null threshold tuned on dev (`best_f1_thresh`: "tau is selected on the dev set to
    maximize F1", section 4.3) in place of the configured `null_score_diff_threshold`."""
    settings = {k: v for k, v in (result.get("config") or {}).items() if k not in RUNTIME}
    tuned = (result.get("metrics") or {}).get("best_f1_thresh")
    if tuned is not None:
        settings["null_score_diff_threshold"] = float(tuned)
    return settings


def quiet_progress() -> None:
    """MLflow's artifact upload/download bars (tqdm) only on a terminal: in a log (a KFP pod,
    CI) each update is more text, not a redrawn bar. The environment wins when it says."""
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def log_model(
    model_dir: str | os.PathLike,
    settings: dict | None = None,
    run_id: str | None = None,
    name: str = "model",
):
    """Log an HF-layout model folder as an MLflow pyfunc model on the open run (or `run_id`'s);
    returns MLflow's ModelInfo (`.model_uri` to register or load it). Its MLmodel names no path
    of this machine (`_PORTABLE`). A model logged on `run_id` outside any open run belongs to
    that run's experiment (`in_experiment_of`)."""
    import mlflow
    from mlflow.models import Model

    import bert_core

    quiet_progress()
    model_id = None
    if run_id is not None and mlflow.active_run() is None:
        model_id = in_experiment_of(run_id, name)
    config = read_config(model_dir)
    cls = predictor_class(config, Path(model_dir) / "config.json")
    # how text is cut, windowed and decoded; batch size and device are the server's business
    kept = {k: v for k, v in vars(Settings.from_dict(settings)).items() if k not in RUNTIME}
    return Model.log(
        artifact_path=None,
        name=name,
        flavor=_PORTABLE,
        run_id=run_id,
        python_model=str(Path(__file__).with_name("pyfunc_model.py")),  # no pickle
        artifacts={ARTIFACT: str(model_dir)},
        code_paths=[str(Path(bert_core.__file__).parent)],
        signature=signature(config),
        input_example=pd.DataFrame([cls.example(config)]),
        pip_requirements=requirements(),
        model_config={CONFIG_KEY: kept},
        metadata={"bert_kind": cls.kind, "bert_task": config.get("finetuning_task") or ""},
        model_id=model_id,
    )


def in_experiment_of(run_id: str, name: str) -> str:
    """A new logged model (its id) in `run_id`'s experiment, made from it, for `Model.log` to
    fill (MLflow's `initialize_logged_model`). Without it MLflow files a model logged on a run
    that is not open under this process's default experiment (`Default`), which a tracking
    server with authentication lets the pipeline's identity read but not write."""
    import mlflow

    run = mlflow.MlflowClient(tracking_uri()).get_run(run_id)
    model = mlflow.initialize_logged_model(
        name=name,
        source_run_id=run_id,
        params=dict(run.data.params),
        experiment_id=run.info.experiment_id,
    )
    return model.model_id


def _save_portable(path: str, mlflow_model, **kwargs) -> None:
    """`mlflow.pyfunc.save_model`, then MLmodel rewritten to name no path of the machine that
    logged it: MLflow records where the artifact and the code file came from (`uri`: `bert
    finetune`'s staging folder, deleted once the output is complete; `model_code_path`: this
    checkout's file) and where its store kept the model (`artifact_path`). A copy read elsewhere,
    or after the staging folder is gone, would name paths that are not there. Loading needs
    none of them: it reads the artifact's `path` inside the model and the code file by its name
    (mlflow.pyfunc.model._load_context_model_and_signature), and the store knows where the model
    is (its LoggedModel). So: `uri` = `path`, the code file by name, no `artifact_path` (as
    `mlflow.pyfunc.save_model` writes for a model saved, not logged)."""
    from mlflow.models.model import MLMODEL_FILE_NAME, MODEL_CODE_PATH

    mlflow.pyfunc.save_model(path=path, mlflow_model=mlflow_model, **kwargs)
    flavor = mlflow_model.flavors[mlflow.pyfunc.FLAVOR_NAME]
    for artifact in (flavor.get("artifacts") or {}).values():
        artifact["uri"] = artifact["path"]
    if flavor.get(MODEL_CODE_PATH):
        flavor[MODEL_CODE_PATH] = Path(flavor[MODEL_CODE_PATH]).name
    mlflow_model.artifact_path = None
    mlflow_model.save(os.path.join(path, MLMODEL_FILE_NAME))


# the "flavor module" `Model.log` saves with (it needs only `save_model` and a name)
_PORTABLE = SimpleNamespace(__name__=mlflow.pyfunc.__name__, save_model=_save_portable)


@contextmanager
def local_model(source: str | os.PathLike) -> Iterator[tuple[Path, dict]]:
    """(local HF-layout model folder, settings) for a model reference: a `bert finetune`
    output folder (model/ + metrics.json: the run's settings), a model folder, an MLflow model
    folder (MLmodel) or URI (`runs:/<id>/model`, `models:/<name>@<alias>`: downloaded, and
    removed again when the block ends, so load what you need inside it)."""
    if not is_uri(source):
        yield _layout(Path(source))
        return

    quiet_progress()
    mlflow.set_tracking_uri(tracking_uri())
    tmp = tempfile.mkdtemp(prefix="bert-model-")
    try:
        try:
            local = mlflow.artifacts.download_artifacts(str(source), dst_path=tmp)
        except MlflowException as e:  # no such model, version or alias: the user's to fix
            where = redacted(tracking_uri())
            raise BertError(f"{source}: {e.message} (tracking URI {where})") from None
        yield _layout(Path(local))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _layout(path: Path) -> tuple[Path, dict]:
    if (path / "MLmodel").is_file():
        from mlflow.models import Model

        flavor = Model.load(str(path / "MLmodel")).flavors.get("python_function", {})
        artifact = (flavor.get("artifacts") or {}).get(ARTIFACT)
        if artifact is None:
            raise NotFound(
                f"{path}: an MLflow model, but not one of `bert_core.serve.mlflow_model`"
            )
        return path / artifact["path"], dict((flavor.get("config") or {}).get(CONFIG_KEY) or {})
    if (path / "model" / "config.json").is_file() and (path / "metrics.json").is_file():
        return path / "model", inference_settings(json.loads((path / "metrics.json").read_text()))
    if not path.is_dir():
        what = "a file, not a model folder" if path.exists() else "no such model folder"
        raise NotFound(f"{path}: {what}")
    if not (path / "config.json").is_file() and (path / "model" / "config.json").is_file():
        raise NotFound(
            f"{path}: not a model folder (a `bert pretrain` output?); its model is {path / 'model'}"
        )
    return path, {}
