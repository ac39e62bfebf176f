"""`python -m pipelines.bert_pipeline submit` against a multi-user Kubeflow's API, as the kfp SDK
(2.17) calls it: every request carries the bearer token read from `--token-file` (or from the
ServiceAccount token KFP projects into a pod), the experiment and the run go to the profile
namespace of `--namespace`.

The API here is a small HTTP server answering the four v2beta1 routes the SDK's
`create_run_from_pipeline_package` uses (kfp_server_api: HealthzService, ExperimentService list
and create, RunService create), recording what it was sent. What only a cluster shows: that
Kubeflow's auth proxy (Istio with the `pipelines.kubeflow.org` audience) accepts the token, and
that the profile's RBAC lets its ServiceAccount create runs.
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from pipelines.bert_pipeline import main

TOKEN = "eyJhbGciOiJSUzI1NiJ9.test-token"


class Api(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str, str | None, dict]] = []  # method, path, authorization, body

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
        return body

    def do_GET(self) -> None:
        self._record()
        if self.path.startswith("/apis/v2beta1/healthz"):
            self._answer({"multi_user": True})
        else:  # listing experiments by name: none yet
            self._answer({"experiments": [], "total_size": 0})

    def do_POST(self) -> None:
        body = self._record()
        if self.path == "/apis/v2beta1/experiments":
            self._answer({**body, "experiment_id": "exp-1"})
        else:
            self._answer({**body, "run_id": "run-1", "experiment_id": "exp-1"})


@pytest.fixture
def api():
    Api.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Api.seen
    server.shutdown()
    server.server_close()


def test_submit_sends_the_token_from_a_file_and_runs_in_the_profile_namespace(
    api, tmp_path, capsys, monkeypatch
):
    host, seen = api
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-such-token"))
    (tmp_path / "token").write_text(TOKEN + "\n")
    token = str(tmp_path / "token")
    argv = [
        "submit",
        "--host",
        host,
        "--namespace",
        "team-a",
        "--token-file",
        token,
        "--run-name",
        "first",
        "--set",
        "pretrain_steps=10",
        "--set",
        "instances_dupe_factor=1",  # an advanced setting: inside advanced_settings
    ]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]  # after the SDK's links
    assert json.loads(last) == {"run_id": "run-1", "run_name": "first"}
    assert seen and {auth for _, _, auth, _ in seen} == {f"Bearer {TOKEN}"}
    (experiment,) = [b for m, p, _, b in seen if m == "POST" and p.endswith("/experiments")]
    assert (experiment["display_name"], experiment["namespace"]) == ("bert-pipeline", "team-a")
    listed = [p for m, p, _, _ in seen if m == "GET" and "/experiments" in p]
    assert listed and all("namespace=team-a" in p for p in listed), listed
    (run,) = [b for m, p, _, b in seen if m == "POST" and p.endswith("/runs")]
    assert run["experiment_id"] == "exp-1" and run["display_name"] == "first"
    assert run["runtime_config"]["parameters"]["pretrain_steps"] == 10
    assert run["runtime_config"]["parameters"]["advanced_settings"] == {"instances_dupe_factor": 1}
    assert TOKEN not in " ".join(argv)  # the token travels in a file, never on the command line


def test_inside_a_pod_the_projected_service_account_token_is_used(api, tmp_path, monkeypatch):
    """No --token-file: the token KFP projects into a pod (KF_PIPELINES_SA_TOKEN_PATH), read by
    kfp's ServiceAccountTokenVolumeCredentials; no --namespace: a standalone KFP."""
    host, seen = api
    (tmp_path / "projected").write_text("projected-token")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "projected"))
    assert main(["submit", "--host", host, "--set", "pretrain_steps=10"]) == 0
    assert {auth for _, _, auth, _ in seen} == {"Bearer projected-token"}
    (experiment,) = [b for m, p, _, b in seen if m == "POST" and p.endswith("/experiments")]
    assert not experiment.get("namespace")
