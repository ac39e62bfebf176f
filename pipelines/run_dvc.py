"""`make run`: the whole DAG through `dvc repro`, inside one MLflow pipeline run.

Why DVC underneath: it already knows which stages are stale (content hashes of deps, params and
outs in dvc.lock), so a second `make run` re-runs nothing, and `dvc exp run -S model.preset=mini`
works the same way. This wrapper only adds what DVC does not: it opens the parent MLflow run
first and exports its id (BERT_PARENT_RUN_ID), so each stage's `bert` command nests its run
under it; afterwards it tags the runs with the DVC hashes of their inputs, registers the
pre-trained model (when pretrain ran), logs the GLUE (and NER / SQuAD) results on the parent run
(the evaluate step's metrics, `bert_core.report.evaluate.mlflow_metrics`) and prints the GLUE table and
the command that opens the MLflow UI.

    python pipelines/run_dvc.py                       # dvc repro
    python pipelines/run_dvc.py -S model.preset=mini  # dvc exp run -S ... (an experiment)
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bert_core.report.evaluate import mlflow_metrics  # noqa: E402
from bert_core.track import lineage  # noqa: E402
from bert_core.tracking import tracking_uri  # noqa: E402


def load_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def dvc_command(overrides: list[str], force: bool) -> list[str]:
    dvc = [sys.executable, "-m", "dvc"]
    if overrides:
        return [*dvc, "exp", "run", *(a for o in overrides for a in ("-S", o))]
    return [*dvc, "repro", *(["--force"] if force else [])]


def run(overrides: list[str], force: bool = False) -> dict:
    """Run the DAG; returns {"parent_run_id", "glue_results", "stages_run"}."""
    import mlflow

    params = load_params()
    output = ROOT / params["data"]["output"]
    tags = {"bert.runner": "dvc", "bert.dvc.overrides": " ".join(overrides)}
    with lineage.start_pipeline_run(params=params, tags=tags) as parent:
        parent_id = parent.info.run_id
        start = time.time()
        repro(overrides, force)
        mlflow.log_metric("pipeline_seconds", time.time() - start)
        stages = record_lineage(parent_id, output)
        results = log_results(output / "evaluate")
    return {"parent_run_id": parent_id, "glue_results": results, "stages_run": stages}


def repro(overrides: list[str], force: bool) -> None:
    """`dvc repro` (or `dvc exp run`) with the lineage environment, so each stage nests."""
    env = {
        **os.environ,
        # the `bert` console script of this environment, whatever the caller's PATH
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
    }
    cmd = dvc_command(overrides, force)
    print("$", " ".join(cmd[2:] if cmd[1] == "-m" else cmd), flush=True)
    code = subprocess.run(cmd, cwd=ROOT, env={**env, **_lineage_env()}).returncode
    if code:
        raise SystemExit(f"dvc failed with exit code {code}")


def record_lineage(parent_id: str, output: Path) -> list[str]:
    """DVC hashes on the runs, which stages ran, the model registered when pretrain ran."""
    import mlflow

    lineage.tag_dvc_lineage(parent_id, ROOT / "dvc.lock")
    stages = sorted({r.data.tags.get("dvc.stage", "") for r in lineage.child_runs(parent_id)})
    mlflow.set_tag("bert.stages_run", ",".join(s for s in stages if s) or "none (cached)")
    if lineage.child_runs(parent_id, "pretrain"):
        version = lineage.register_pretrained(output / "pretrain" / "model", parent_id)
        mlflow.set_tag("bert.registered_model", f"{version.name}/{version.version}")
    return stages


def log_results(evaluate_dir: Path) -> dict:
    """Log `bert evaluate`'s results on the active (parent) run, as its evaluate step logged
    them: the same names and values (fractions). Returns glue_results.json's content."""
    import mlflow

    results = json.loads((evaluate_dir / "glue_results.json").read_text())
    mlflow.log_metrics(mlflow_metrics(results))
    mlflow.log_artifact(str(evaluate_dir / "glue_table.md"))
    return results


def _lineage_env() -> dict[str, str]:
    keys = ("BERT_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TRACKING_URI")
    env = {k: os.environ[k] for k in keys if os.environ.get(k)}
    env.setdefault("MLFLOW_TRACKING_URI", tracking_uri())
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make run", description=__doc__.split("\n")[0])
    parser.add_argument("-S", "--set-param", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--force", action="store_true", help="re-run every stage")
    args = parser.parse_args(argv)
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
    print(f"Open the UI:   mlflow ui --backend-store-uri {tracking_uri()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
