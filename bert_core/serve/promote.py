"""`bert promote TASK`: a better version becomes the champion, then takes all of the traffic.

Two moves of one decision, in the order a release makes them. First the registry: the version
named (a number, the fine-tuning output folder that made it, or by default the `candidate`)
becomes the task's `champion` when its dev score beats the champion's (`registry.promote`: the
rule and its record). `bert deploy --task TASK` then serves the new champion as a canary beside
the running version; `bert promote TASK --full-traffic`, once the canary looks right, sends all
traffic to it (`deploy.full_traffic`) and leaves the registry alone.

A command of its own, above both: the registry knows nothing of Kubernetes, and `deploy` reads
the registry, so neither can hold the other's half.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bert_core.errors import BadValue
from bert_core.serve.deploy import cluster, full_traffic
from bert_core.serve.registry import CANDIDATE, NAME_ENV, model_name, promote, version_of


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert promote", description=__doc__.split("\n")[0])
    p.add_argument("task", help="the task (SST-2, conll2003, ...): its registered model")
    p.add_argument("version", nargs="?", help="the version: a number, or the `bert finetune` "
                   f"output folder that made it (default: the {CANDIDATE!r} alias)")  # fmt: skip
    p.add_argument("--registered-model", help=f"the name (default: {NAME_ENV} or bert-{{task}})")
    p.add_argument("--force", action="store_true", help="make it champion whatever its score")
    p.add_argument("--full-traffic", action="store_true",
                   help="instead: the task's InferenceService sends all traffic to its latest "
                   "version (ends `bert deploy`'s canary); the registry is left alone")  # fmt: skip
    p.add_argument("--namespace", default="bert", help="--full-traffic: the service's namespace")
    p.add_argument("--inference-service", help="--full-traffic: the service (default: the "
                   "registered model's name, as `bert deploy` names it)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = args.registered_model or model_name(args.task)
    if name is None:
        raise BadValue(f"{NAME_ENV}=none: name the model with --registered-model")
    if args.full_traffic:
        service = args.inference_service or name
        print(json.dumps(full_traffic(cluster(), args.namespace, service)))
        return 0
    version = args.version
    if version is not None and not version.isdigit():
        version = version_of(Path(version), name)
    print(json.dumps(promote(name, version, args.force)))
    return 0
