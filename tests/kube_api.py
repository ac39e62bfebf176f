"""A Kubernetes API server for one resource, KServe's InferenceService, by the API's own rules,
for `bert deploy` / `bert promote --full-traffic` to talk to through the real Kubernetes client
(no cluster here). What it enforces, from the API conventions and the server-side apply docs
(kubernetes.io/docs/reference/using-api/server-side-apply/, api-concepts/#patch-and-apply):

- a bearer token on every request (401 otherwise), JSON answers, a `Status` body on errors;
- GET of a missing object: 404, reason NotFound;
- PATCH `application/apply-patch+yaml` (server-side apply): `fieldManager` is required;
  creates the object when missing; the body's apiVersion, kind, name and namespace must match the
  URL; the object is validated against the CRD's schema with strict fields (422 Invalid); one
  field manager owns everything it applied, so the stored object is the applied one (a field it
  stops applying is removed) with the server's metadata (uid, generation, resourceVersion);
- PATCH `application/json-patch+json` (RFC 6902): `test`, `remove`, `add`, `replace` on the
  stored object, a failed `test` or a missing path is 422 and changes nothing; `force` is only
  for apply.

What it cannot show: admission webhooks (KServe's validating webhook), RBAC, the controller
acting on the object: only a cluster shows those.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import yaml

from tests.kserve_schema import crd_problems, kserve_schemas

PREFIX = "/apis/serving.kserve.io/v1beta1/namespaces/"


class KubeApi:
    """The server in a thread: `objects` by (namespace, name), `requests` as they came."""

    def __init__(self, token: str = "test-token") -> None:
        self.token, self.objects, self.requests = token, {}, []
        self.schemas = kserve_schemas()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, folder: Path) -> Path:
        """A kubeconfig naming this server and its token (what `kubectl config` writes)."""
        path = folder / "kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "test",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "test", "user": {"token": self.token}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                }
            )
        )
        return path

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                status = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
                self._answer(code, status | {"reason": reason, "message": message, "code": code})

            def _request(self, method: str) -> None:
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length).decode() if length else ""
                kind = self.headers.get("Content-Type", "")
                api.requests.append(
                    {
                        "method": method,
                        "path": url.path,
                        "query": query,
                        "content_type": kind,
                        "body": raw,
                    }
                )
                if self.headers.get("Authorization") != f"Bearer {api.token}":
                    return self._status(401, "Unauthorized", "Unauthorized")
                parts = url.path.removeprefix(PREFIX).split("/")
                if (
                    not url.path.startswith(PREFIX)
                    or len(parts) != 3
                    or parts[1] != ("inferenceservices")
                ):
                    return self._status(404, "NotFound", f"the server could not find {url.path}")
                key = (parts[0], parts[2])
                what = f'inferenceservices.serving.kserve.io "{key[1]}"'
                if method == "GET":
                    if key not in api.objects:
                        return self._status(404, "NotFound", f"{what} not found")
                    return self._answer(200, api.objects[key])
                if "force" in query and kind != "application/apply-patch+yaml":
                    return self._status(400, "BadRequest", "force is only allowed for apply")
                if kind == "application/apply-patch+yaml":
                    return self._apply(key, what, yaml.safe_load(raw), query)
                if kind == "application/json-patch+json":
                    return self._json_patch(key, what, json.loads(raw))
                return self._status(415, "UnsupportedMediaType", f"the body of {kind}")

            def _apply(self, key, what, body: dict, query: dict) -> None:
                if not query.get("fieldManager"):
                    return self._status(
                        400, "BadRequest", "fieldManager is required for apply requests"
                    )
                meta = body.get("metadata", {})
                if (meta.get("namespace", key[0]), meta.get("name")) != key:
                    return self._status(
                        400,
                        "BadRequest",
                        "the name or namespace of the object does not match the URL",
                    )
                problems = crd_problems(body, api.schemas)
                if problems:
                    return self._status(422, "Invalid", f"{what} is invalid: {problems}")
                old = api.objects.get(key)
                stored = copy.deepcopy(body)
                server = (old or {}).get("metadata", {})
                stored["metadata"] |= {
                    "uid": server.get("uid", str(uuid.uuid4())),
                    "generation": server.get("generation", 0)
                    + (old is None or old["spec"] != body["spec"]),
                    "resourceVersion": str(len(api.requests)),
                    "managedFields": [{"manager": query["fieldManager"], "operation": "Apply"}],
                }
                api.objects[key] = stored
                self._answer(201 if old is None else 200, stored)

            def _json_patch(self, key, what, ops: list) -> None:
                if key not in api.objects:
                    return self._status(404, "NotFound", f"{what} not found")
                obj = copy.deepcopy(api.objects[key])
                for op in ops:
                    *parents, leaf = op["path"].strip("/").split("/")
                    node = obj
                    for part in parents:
                        node = node.get(part) if isinstance(node, dict) else None
                    if not isinstance(node, dict) or (op["op"] != "add" and leaf not in node):
                        return self._status(422, "Invalid", f"{op['path']}: no such path")
                    if op["op"] == "test" and node[leaf] != op["value"]:
                        return self._status(422, "Invalid", f"test of {op['path']} failed")
                    if op["op"] == "remove":
                        del node[leaf]
                    elif op["op"] in ("add", "replace"):
                        node[leaf] = op["value"]
                obj["metadata"]["generation"] += obj["spec"] != api.objects[key]["spec"]
                api.objects[key] = obj
                self._answer(200, obj)

            def do_GET(self) -> None:  # noqa: N802
                self._request("GET")

            def do_PATCH(self) -> None:  # noqa: N802
                self._request("PATCH")

        return Handler
