"""`make run`: the whole DAG through `dvc repro`, inside one MLflow pipeline run.

Why DVC underneath: it already knows which stages are stale (content hashes of deps, params and
outs in dvc.lock), so a second `make run` re-runs nothing, and `dvc exp run -S model.preset=mini`
works the same way. This wrapper only adds what DVC does not: it opens the parent MLflow run
first, with the settings after every `-S` override (`resolved_params`, DVC's own rules), and
exports its id (BERT_PARENT_RUN_ID), so each stage's `bert` command nests its run under it;
afterwards it records the DVC hashes of what each run read as MLflow dataset inputs, registers
the pre-trained model (when pretrain ran), puts the GLUE (and NER / SQuAD) results on the parent
run when DVC skipped a cached evaluate stage (one that ran put them there itself) and prints
the GLUE table and the command that opens the MLflow UI. Like the Kubeflow components, it uses
the library only through `bert_core.cli` (its `dvc_*` helpers).

    python pipelines/run_dvc.py                       # dvc repro
    python pipelines/run_dvc.py -S model.preset=mini  # dvc exp run -S ... (an experiment)
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bert_core.cli import (  # noqa: E402
    dvc_lineage_env,
    dvc_log_results,
    dvc_pipeline_run,
    dvc_record_lineage,
)


def load_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def resolved_params(overrides: list[str]) -> dict:
    """params.yaml after every `-S` override, applied by DVC's own code (`to_path_overrides`,
    `apply_overrides`: Hydra's grammar, `key=value`, `+key=value`, `~key`, lists) to a copy, so
    the parent run logs the settings the stages run with, not the file's defaults. Overrides of
    other files (`predict.yaml:...`) are the predict stage's, not the pipeline's settings."""
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import apply_overrides

    ours = to_path_overrides(overrides).get("params.yaml", [])
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "params.yaml"
        shutil.copyfile(ROOT / "params.yaml", copy)
        if ours:
            apply_overrides(copy, ours)
        return yaml.safe_load(copy.read_text())


def dvc_command(overrides: list[str], force: bool) -> list[str]:
    """`python -m dvc ...`: the words after `-m` also name the pipeline's MLflow run."""
    dvc = [sys.executable, "-m", "dvc"]
    if overrides:
        return [*dvc, "exp", "run", *(a for o in overrides for a in ("-S", o))]
    return [*dvc, "repro", *(["--force"] if force else [])]


def run(overrides: list[str], force: bool = False) -> dict:
    """Run the DAG; returns {"parent_run_id", "glue_results", "stages_run"}."""
    import mlflow

    params = resolved_params(overrides)
    output = ROOT / params["data"]["output"]
    tags = {"bert.runner": "dvc", "bert.dvc.overrides": " ".join(overrides)}
    cmd = dvc_command(overrides, force)
    with dvc_pipeline_run(params, tags, name=" ".join(cmd[2:])) as parent:
        parent_id = parent.info.run_id
        start = time.time()
        repro(cmd)
        mlflow.log_metric("pipeline_seconds", time.time() - start)
        stages = dvc_record_lineage(parent_id, ROOT / "dvc.lock", output)
        results = dvc_log_results(parent_id, output / "evaluate")
    return {"parent_run_id": parent_id, "glue_results": results, "stages_run": stages}


def repro(cmd: list[str]) -> None:
    """`dvc repro` (or `dvc exp run`) with the lineage environment, so each stage nests."""
    env = {
        **os.environ,
        # the `bert` console script of this environment, whatever the caller's PATH
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
    }
    print("$", " ".join(cmd[2:]), flush=True)
    code = subprocess.run(cmd, cwd=ROOT, env={**env, **dvc_lineage_env()}).returncode
    if code:
        raise SystemExit(f"dvc failed with exit code {code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make run", description=__doc__.split("\n")[0])
    parser.add_argument("-S", "--set-param", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--force", action="store_true", help="re-run every stage")
    args = parser.parse_args(argv)
    from dvc.exceptions import InvalidArgumentError

    try:  # a bad -S fails here, before any MLflow run or stage
        resolved_params(args.set_param)
    except InvalidArgumentError as e:
        cause = str(e.__cause__ or e).replace("\n", " ")
        parser.error(f"-S {' -S '.join(args.set_param)}: {cause}")
    os.chdir(ROOT)  # mlflow.db and relative paths live in the project folder
    result = run(args.set_param, args.force)
    table = ROOT / load_params()["data"]["output"] / "evaluate" / "glue_table.md"
    print()
    print(table.read_text())
    print(
        f"MLflow pipeline run {result['parent_run_id']} (stages run: "
        f"{', '.join(result['stages_run']) or 'none, all cached'})"
    )
    print("Compare runs:  bert runs")
    uri = dvc_lineage_env()["MLFLOW_TRACKING_URI"]
    print(f"Open the UI:   mlflow ui --backend-store-uri {uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
