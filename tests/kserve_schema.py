"""KServe's CRD schemas (infra/k8s/kserve/crd-schemas.json.gz, the pinned release's) and a
validator with the API server's strict field validation: for infra/k8s/kserve's manifests
(tests/test_infra.py) and `bert deploy`'s (tests/serve/test_deploy.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

SCHEMAS = Path(__file__).resolve().parents[1] / "infra" / "k8s" / "kserve" / "crd-schemas.json.gz"


def kserve_schemas() -> dict:
    """The committed KServe CRD schemas (infra/scripts/kserve_schemas.py made them)."""
    return json.loads(gzip.decompress(SCHEMAS.read_bytes()))


def _strict(schema: dict) -> dict:
    """A CRD's structural schema as JSON Schema with the API server's strict field validation
    (`kubectl apply --validate=strict`): an object that lists its properties refuses any other
    field (unless x-kubernetes-preserve-unknown-fields); `nullable` admits null;
    x-kubernetes-int-or-string admits both."""
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            out[key] = _strict(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [_strict(s) for s in schema[key]]
    if schema.get("nullable") and "type" in schema:
        out["type"] = [schema["type"], "null"]
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in schema:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def crd_problems(obj: dict, schemas: dict) -> list[str]:
    """Where `obj` breaks its kind's CRD schema (served version, strict fields)."""
    import jsonschema

    entry = schemas["kinds"].get(obj.get("kind"))
    if entry is None or obj.get("apiVersion") != entry["apiVersion"]:
        return [f"{obj.get('kind')} {obj.get('apiVersion')}: no such KServe kind and version"]
    validator = jsonschema.Draft7Validator(_strict(entry["schema"]))
    return sorted(
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(obj)
    )
