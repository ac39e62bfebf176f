"""`bert promote TASK`: a better candidate becomes the champion, then takes all of the traffic.

Two moves of one decision, in the order a release makes them. First the registry: the candidate
named (a version number of the task's candidates model, the fine-tuning output folder that made
it, or by default the newest) is copied into the task's release model as its `champion` when its
dev score beats the champion's (`champion.promote`: the rule and its record). On a tracking
server with authentication only the release identity may do this (docs/cluster.md). `bert
deploy --task TASK` then serves the new champion as a canary beside the running version; `bert
promote TASK --full-traffic`, once the canary looks right, sends all traffic to it
(`deploy.full_traffic`) and leaves the registry alone.

`--best-of DIR` is the gate a pipeline ends with (`make run`'s `promote` stages): among the
fine-tuning outputs under DIR registered as the task's candidates (ours, each public start; the
random-init control registers none), scored on the same dev set, the best by dev score is the
version promoted, by the same rule. A model that does not beat its task's baseline (the best
answer that ignores the input, recorded with each version) is never champion.

A command of its own, above both: the registry knows nothing of Kubernetes, and `deploy` reads
the registry, so neither can hold the other's half.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bert_core.errors import BadValue, NotFound
from bert_core.serve.champion import promote
from bert_core.serve.deploy import cluster, full_traffic
from bert_core.serve.registry import (
    DEFAULT_NAME,
    RECORD,
    candidates_of,
    describe,
    model_name,
    release_description,
    version_of,
)
from bert_core.tracking import tracking_uri


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert promote", description=__doc__.split("\n")[0])
    p.add_argument("task", help="the task (SST-2, conll2003, ...): its registered models")
    p.add_argument(
        "version",
        nargs="?",
        help="the candidate: a version number of the task's "
        "candidates model, or the `bert finetune` output folder that made it (default: the "
        "newest)",
    )
    p.add_argument(
        "--best-of",
        type=Path,
        metavar="DIR",
        help="instead of VERSION: the best by "
        "dev score of the fine-tuning outputs under DIR registered as the task's model",
    )
    p.add_argument(
        "--registered-model",
        default=DEFAULT_NAME,
        metavar="NAME",
        help="the release model, a template with {task} as `bert finetune`'s (default: "
        "%(default)s); its candidates are NAME-candidates",
    )
    p.add_argument("--force", action="store_true", help="make it champion whatever its score")
    p.add_argument(
        "--full-traffic",
        action="store_true",
        help="instead: the task's InferenceService sends all traffic to its latest "
        "version (ends `bert deploy`'s canary); the registry is left alone",
    )
    p.add_argument("--namespace", default="bert", help="--full-traffic: the service's namespace")
    p.add_argument(
        "--inference-service",
        help="--full-traffic: the service (default: the "
        "registered model's name, as `bert deploy` names it)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = model_name(args.task, args.registered_model)
    if name is None:
        raise BadValue("--registered-model none: promote needs the release model's name")
    if args.full_traffic:
        service = args.inference_service or name
        print(json.dumps(full_traffic(cluster(), args.namespace, service)))
        return 0
    if args.best_of is not None and args.version is not None:
        raise BadValue("--best-of: give it or a VERSION, not both")
    candidates = candidates_of(name)
    version = args.version if args.best_of is None else best_of(args.best_of, candidates)
    if version is not None and not version.isdigit():
        version = version_of(Path(version), candidates)
    decision = promote(name, candidates, version, args.force)
    if decision["promoted"]:  # the copy made the release model: say what it is
        from mlflow import MlflowClient

        describe(MlflowClient(tracking_uri()), name, release_description(args.task))
    print(json.dumps(decision))
    return 0


def best_of(folder: Path, name: str) -> str:
    """The version registered as `name` by the best-scoring fine-tuning output under `folder`
    (each output's metrics.json and mlflow_model.json); all must have been scored on the same
    dev set (data and examples), or their scores do not compare."""
    if not folder.is_dir():
        raise NotFound(f"--best-of {folder}: no such folder")
    found = []
    for out in sorted(folder.iterdir()):
        if (out / RECORD).is_file() and (out / "metrics.json").is_file():
            if json.loads((out / RECORD).read_text()).get("registered_model") == name:
                found.append((json.loads((out / "metrics.json").read_text()), out))
    if not found:
        raise NotFound(f"--best-of {folder}: no fine-tuning output there is registered as {name}")
    dev_sets = {(r["data"], json.dumps(r.get("num_dev_examples"))) for r, _ in found}
    if len(dev_sets) > 1:
        raise BadValue(
            f"--best-of {folder}: {name}'s outputs were scored on different dev sets "
            f"{sorted(dev_sets)}: their scores do not compare"
        )
    _, best = max(found, key=lambda item: item[0]["score"])
    return version_of(best, name)
