"""KServe's CRD schemas at the pinned release, for checking our KServe manifests offline.

Writes `infra/k8s/kserve/crd-schemas.json.gz`: the `openAPIV3Schema` of the InferenceService
(serving.kserve.io/v1beta1) and ServingRuntime (serving.kserve.io/v1alpha1) CRDs of the KServe
release `infra/versions.yaml` pins (`config/crd/full/` at its tag), descriptions dropped, with
each source file's URL and sha256. `tests/test_infra.py` validates `infra/k8s/kserve/*.yaml`
against them as the API server would with strict field validation (`crd_problems`): no cluster
and no network in CI, so the schemas are committed, and this script is how they were made:

    python infra/scripts/kserve_schemas.py                # from github.com/kserve/kserve
    python infra/scripts/kserve_schemas.py --base DIR     # from config/crd/full of a checkout
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "infra" / "k8s" / "kserve" / "crd-schemas.json.gz"
GROUP = "serving.kserve.io"
CRDS = {  # kind -> (file under config/crd/full, the served version our manifests use)
    "InferenceService": ("serving.kserve.io_inferenceservices.yaml", "v1beta1"),
    "ServingRuntime": ("serving.kserve.io_servingruntimes.yaml", "v1alpha1"),
}


def pinned_version() -> str:
    return yaml.safe_load((ROOT / "infra" / "versions.yaml").read_text())["kserve"]["version"]


def official_base(version: str) -> str:
    return f"https://raw.githubusercontent.com/kserve/kserve/v{version}/config/crd/full"


def strip(schema):
    """The schema without its descriptions (most of its size; validation never reads them)."""
    if isinstance(schema, dict):
        return {k: strip(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [strip(v) for v in schema]
    return schema


def read(base: str) -> Callable[[str], bytes]:
    """A reader of files under `base`: an http(s) URL or a local folder."""
    if base.startswith(("http://", "https://")):

        def fetch(name: str) -> bytes:
            with urllib.request.urlopen(f"{base}/{name}", timeout=60) as response:
                return response.read()

        return fetch
    return lambda name: (Path(base) / name).read_bytes()


def build(base: str, version: str) -> dict:
    """{"version", "kinds": {kind: {"apiVersion", "source", "sha256", "schema"}}}."""
    fetch, kinds = read(base), {}
    for kind, (name, served) in CRDS.items():
        raw = fetch(name)
        crd = yaml.safe_load(raw)
        if crd.get("kind") != "CustomResourceDefinition" or crd["spec"]["names"]["kind"] != kind:
            raise SystemExit(f"{base}/{name}: not the {kind} CRD")
        (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == served]
        kinds[kind] = {
            "apiVersion": f"{GROUP}/{served}",
            "source": f"{official_base(version)}/{name}",
            "sha256": hashlib.sha256(raw).hexdigest(),
            "schema": strip(entry["schema"]["openAPIV3Schema"]),
        }
    return {"version": version, "kinds": kinds}


def write(schemas: dict, output: Path = OUTPUT) -> Path:
    """Gzipped JSON, byte-stable (sorted keys, no timestamp): the same CRDs give the same file."""
    text = json.dumps(schemas, sort_keys=True, separators=(",", ":")).encode()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(gzip.compress(text, mtime=0))
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--base",
        help="URL or folder holding the CRD files (default: the "
        "pinned tag on github.com/kserve/kserve)",
    )
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    version = pinned_version()
    print(write(build(args.base or official_base(version), version), args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
