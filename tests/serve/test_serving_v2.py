"""`bert serve` speaks the Open Inference (V2) protocol through KServe's own server code: every
kind of model answers a V2 request (and KServe's V1 one) as its pyfunc model answers the same
rows, the metadata names the model's columns, health and readiness answer, bad requests get a
V2 error body, and MLflow's /invocations still answers beside it. Then `bert serve` for real, in
its own process: the kserve SDK's REST client gets the answers `bert predict` gives."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from starlette.testclient import TestClient

from bert_core import cli
from bert_core.serve import mlflow_model as serving
from bert_core.serve import server
from bert_core.serve.batching import BatchedModel
from tests.serving_helpers import build, free_port, stop_server, strip_numbers, wait_until_up

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

ROWS = {
    "classification": [{"text": "a gripping , funny film"}, {"text": "dull and far too long ."}],
    "pair": [{"text": "The cat sat.", "text_pair": "A cat was sitting."}],
    "regression": [{"text": "A man plays a guitar.", "text_pair": "A man plays music."}],
    "ner": [{"text": "EU rejects German call ."}, {"text": "Ada met Peter in Paris ."}],
    "question-answering": [{"question": "Who wrote it?", "context": "Ada Lovelace wrote it."}],
    "fill-mask": [{"text": "the film was [MASK] ."}],
    "multiple-choice": [
        {
            "context": "She opened the door",
            "ending0": "and left .",
            "ending1": "a cat .",
            "ending2": "to the sea .",
            "ending3": "quietly .",
        }
    ],
}


@pytest.fixture(scope="module")
def logged(tmp_path_factory, minilm_dir):
    """kind -> (logged model URI, its MLmodel), one MLflow store for the module."""
    root = tmp_path_factory.mktemp("v2")
    with pytest.MonkeyPatch.context() as mp:
        uri = f"sqlite:///{root / 'mlflow.db'}"
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        for key in ("BERT_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
            mp.delenv(key, raising=False)
        mp.chdir(root)
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("serving-v2")
        out = {}
        with mlflow.start_run():
            for kind in ROWS:
                folder = build(kind, minilm_dir, root / kind)
                info = serving.log_model(folder, {"max_seq_length": 64, "max_chars": 2000})
                out[kind] = info.model_uri
        yield root, uri, out


def _client(model_uri: str, name: str = "m"):
    """(TestClient of bert serve's app, the pyfunc model it serves)."""
    args = server.parse_args([model_uri, "--name", name, "--max-body-bytes", "20000"])
    with server.model_files(model_uri, {}) as (local, meta, config):
        pyfunc = mlflow.pyfunc.load_model(str(local), model_config=config or None)
    return TestClient(server.build_app(BatchedModel(pyfunc), args, meta)), pyfunc


def v2_request(rows: list[dict]) -> dict:
    columns = list(rows[0])
    return {
        "id": "req-1",
        "inputs": [
            {"name": c, "shape": [len(rows)], "datatype": "BYTES", "data": [r[c] for r in rows]}
            for c in columns
        ],
    }


def decoded(outputs: list[dict]) -> list[dict]:
    """A V2 response's tensors back as one answer per row (BYTES holding JSON parsed)."""
    rows = [{} for _ in range(outputs[0]["shape"][0])]
    for tensor in outputs:
        for row, value in zip(rows, tensor["data"], strict=True):
            if tensor["datatype"] == "BYTES" and value[:1] in ("[", "{"):
                value = json.loads(value)
            row[tensor["name"]] = value
    return rows


@pytest.mark.slow
def test_every_kind_answers_v2_and_v1_as_its_pyfunc_model(logged):
    _, _, uris = logged
    for kind, rows in ROWS.items():
        client, pyfunc = _client(uris[kind])
        expected = pyfunc.predict(pd.DataFrame(rows))
        signature = pyfunc.metadata.signature
        meta = client.get("/v2/models/m").json()
        assert [i["name"] for i in meta["inputs"]] == signature.inputs.input_names(), kind
        assert {i["datatype"] for i in meta["inputs"]} == {"BYTES"}
        assert [o["name"] for o in meta["outputs"]] == signature.outputs.input_names(), kind
        answer = client.post("/v2/models/m/infer", json=v2_request(rows))
        assert answer.status_code == 200, (kind, answer.text)
        body = answer.json()
        assert body["model_name"] == "m" and body["id"] == "req-1"
        assert all(t["shape"] == [len(rows)] for t in body["outputs"])
        assert decoded(body["outputs"]) == strip_numbers(expected), kind
        v1 = client.post("/v1/models/m:predict", json={"instances": rows})
        assert v1.status_code == 200 and v1.json()["predictions"] == strip_numbers(expected), kind


def test_numbers_are_typed_tensors_and_objects_are_json(logged):
    _, _, uris = logged
    client, _ = _client(uris["classification"])
    outputs = client.get("/v2/models/m").json()["outputs"]
    kinds = {o["name"]: o["datatype"] for o in outputs}
    assert kinds["label"] == "BYTES" and kinds["score"] == "FP64", kinds
    body = client.post("/v2/models/m/infer", json=v2_request(ROWS["classification"])).json()
    (score,) = [t for t in body["outputs"] if t["name"] == "score"]
    assert all(isinstance(v, float) for v in score["data"])
    ner, _ = _client(uris["ner"])
    (entities,) = ner.post("/v2/models/m/infer", json=v2_request(ROWS["ner"])).json()["outputs"]
    assert entities["datatype"] == "BYTES"
    assert all(isinstance(json.loads(v), list) for v in entities["data"])


def test_health_readiness_and_metadata_answer(logged):
    _, _, uris = logged
    client, _ = _client(uris["classification"], name="bert-sst2")
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    assert client.get("/v2/models/bert-sst2/ready").json()["ready"] is True
    assert client.get("/v2").json()["name"] == "kserve"
    assert client.get("/v2/models/other/ready").status_code == 404
    assert client.get("/ping").status_code == 200  # MLflow's, on the same server


def test_bad_requests_get_a_v2_error_body(logged):
    _, _, uris = logged
    client, _ = _client(uris["classification"])
    tensor = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}
    bad = [
        ({"inputs": [{**tensor, "name": "sentence"}]}, 400, "'sentence': not an input"),
        ({"inputs": [{**tensor, "data": ["   "]}]}, 400, "row 0: 'text' is empty"),
        ({"inputs": [{**tensor, "datatype": "FP32", "data": [1.0]}]}, 400, "expected a BYTES"),
        ({"inputs": [{**tensor, "data": ["word " * 500]}]}, 400, "more than max_chars 2,000"),
        (
            {"inputs": [{**tensor, "shape": [2], "data": ["a", "b" * 30000]}]},
            413,
            "more than the server's limit of 20,000 bytes",
        ),
        # the probe of issue #43: each was a 500 with internal text, or a crash
        ({"inputs": [{**tensor, "shape": [3]}]}, 400, "its data do not fit its shape [3]"),
        (
            {"inputs": [{**tensor, "shape": [2], "data": [1, 2]}]},
            400,
            "'text': row 0 is int, not text",
        ),
        ({"inputs": []}, 400, "missing input 'text'"),
        (
            '{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", '
            '"data": ["a\\ud800"]}]}',
            400,
            "row 0: 'text' is not Unicode text: a lone surrogate (U+D800) at character 1",
        ),
        ("[" * 5_000 + "]" * 5_000, 400, "error parsing the body"),  # past any parser's depth
        ({"instances": "not rows"}, 400, 'expected {"instances"'),
        ({"inputs": "not a list"}, 422, "inputs: Input should be a valid list"),
        ("{not json", 400, "the body is not JSON (error at character 1)"),
    ]
    for payload, status, message in bad:
        path = "/v1/models/m:predict" if "instances" in payload else "/v2/models/m/infer"
        if isinstance(payload, str):  # raw JSON text
            headers = {"content-type": "application/json"}
            answer = client.post(path, content=payload.encode(), headers=headers)
        else:
            answer = client.post(path, json=payload)
        assert answer.status_code == status, (payload, answer.text[:500])
        assert set(answer.json()) == {"error"} and message in answer.json()["error"], answer.text
        assert not re.search(r"Traceback|Error\b|Exception|File \"", answer.text), answer.text
    missing = client.post("/v2/models/nope/infer", json={"inputs": [tensor]})
    assert missing.status_code == 404 and "nope" in missing.json()["error"]
    answer = client.post("/v2/models/m/infer", json={"inputs": [tensor]})  # still serving
    assert answer.status_code == 200
    # MLflow's protocol keeps its own error body
    mlflow_error = client.post("/invocations", json={"dataframe_records": [{"text": " "}]})
    assert mlflow_error.status_code == 422 and "error_code" in mlflow_error.json()
    surrogate = b'{"dataframe_records": [{"text": "\\udfff"}]}'
    mlflow_error = client.post(
        "/invocations", content=surrogate, headers={"content-type": "application/json"}
    )
    assert mlflow_error.status_code == 422 and "lone surrogate" in mlflow_error.json()["message"]


def test_an_unexpected_failure_is_a_500_without_internal_text(logged):
    """A model that fails in a way no check foresaw: V2 answers 500 in its shape with no
    exception type or text (KServe's own handler puts both in the body); the log has them."""

    def exploding(frame, params=None):
        raise RuntimeError("internal state at /opt/bert/secret.py:42")

    _, _, uris = logged
    args = server.parse_args([uris["classification"], "--name", "m"])
    with server.model_files(uris["classification"], {}) as (local, meta, config):
        pyfunc = mlflow.pyfunc.load_model(str(local), model_config=config or None)
    pyfunc.predict = exploding
    app = server.build_app(BatchedModel(pyfunc), args, meta)
    client = TestClient(app, raise_server_exceptions=False)
    tensor = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}
    answer = client.post("/v2/models/m/infer", json={"inputs": [tensor]})
    assert answer.status_code == 500, answer.text
    assert answer.json() == {"error": "internal error (the server's log has the details)"}


@pytest.mark.slow
def test_bert_serve_answers_the_kserve_client_as_bert_predict(logged, tmp_path, capsys):
    """`bert serve` in its own process: KServe's REST client (kserve.InferenceRESTClient, V2)
    sends the request docs/serving.md shows and gets `bert predict`'s answers."""
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    root, uri, uris = logged
    rows = ROWS["classification"]
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "bert_core",
        "serve",
        uris["classification"],
        "--name",
        "bert-sst2",
        "--port",
        str(port),
    ]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_until_up(proc, port, log, timeout=120)

        async def infer():
            client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
            tensor = InferInput("text", [len(rows)], "BYTES", [r["text"] for r in rows])
            request = InferRequest(model_name="bert-sst2", infer_inputs=[tensor])
            base = f"http://127.0.0.1:{port}"
            try:
                ready = await client.is_model_ready(base, "bert-sst2")
                return ready, await client.infer(base, request, model_name="bert-sst2")
            finally:
                await client.close()

        ready, response = asyncio.run(infer())
        assert ready is True
        answers = {t.name: t.data for t in response.outputs}
    finally:
        assert stop_server(proc) in (0, 128 + 15), log.read_text()[-2000:]
    inputs, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["predict", "--model", uris["classification"], "--input", str(inputs)]
    assert cli.main([*argv, "--output", str(output)]) == 0
    predicted = [json.loads(line) for line in output.read_text().splitlines()]
    assert answers["label"] == [p["label"] for p in predicted]
    assert answers["score"] == strip_numbers([p["score"] for p in predicted])
    assert "/v2/models/bert-sst2" in log.read_text()  # the banner names the V2 path
