"""`mlflow models serve -m models:/<task>@champion --env-manager local`, started for real: each
kind of model answers /invocations as `bert predict` answers the same rows, and bad input gets a
400 with a clear message while the server stays up.

Three servers (classification, NER, question answering) start side by side on free ports, with
the tracking URI of a SQLite store holding the registered models; they are always stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import pytest

from bert_core import cli
from bert_core.serve import champion, registry
from bert_core.serve import mlflow_model as serving
from tests.serving_helpers import build, free_port, stop_server, strip_numbers, wait_until_up

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

REQUESTS = {
    # registered model: (kind, rows in the model's columns)
    "bert-sst2": (
        "classification",
        [
            {"text": "a gripping , funny and moving film"},
            {"text": "the plot is thin and the jokes fall flat ."},
            {"text": "ok"},
        ],
    ),
    "bert-conll2003": (
        "ner",
        [
            {"text": "EU rejects German call to boycott British lamb ."},
            {"text": "Peter Blackburn met officials in Brussels on Tuesday."},
        ],
    ),
    "bert-squad": (
        "question-answering",
        [
            {
                "question": "Where was the treaty signed?",
                "context": "After months of talks, the treaty was signed in Lisbon in "
                "December 2007.",
            },
            {"question": "Who wrote it?", "context": "The report was written by Ada Lovelace."},
        ],
    ),
}


def post(port: int, payload) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=payload if isinstance(payload, bytes) else json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, minilm_dir):
    """Register one champion per kind, then serve each: name -> port."""
    root = tmp_path_factory.mktemp("serve")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.delenv("BERT_PARENT_RUN_ID", raising=False)
        mp.chdir(root)
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("serving")  # not an earlier module's, of another store
        with mlflow.start_run():
            for name, (kind, _) in REQUESTS.items():
                folder = build(kind, minilm_dir, root / kind)
                info = serving.log_model(folder, {"max_chars": 2000})
                pool, result = registry.candidates_of(name), {"task": name, "score": 0.5}
                version = registry.register(info.model_uri, name, result | {"baseline_score": 0})
                champion.promote(name, pool, version.version)
        bin_dir = str(Path(sys.executable).parent)  # the server execs `uvicorn` from PATH
        env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": uri,
            "PYTHONPATH": str(ROOT),
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "OMP_NUM_THREADS": "1",
        }
        procs, ports = [], {}
        try:
            for name in REQUESTS:
                ports[name] = free_port()
                log = root / f"{name}.log"
                cmd = [
                    f"{bin_dir}/mlflow",
                    "models",
                    "serve",
                    "-m",
                    f"models:/{name}@champion",
                    "--env-manager",
                    "local",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(ports[name]),
                    "--workers",
                    "1",
                ]
                with open(log, "w") as out:  # its own session: stopped with its workers
                    proc = subprocess.Popen(
                        cmd,
                        env=env,
                        cwd=root,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                procs.append((proc, log))
            for (proc, log), port in zip(procs, ports.values(), strict=True):
                wait_until_up(proc, port, log, timeout=150)
            yield root, ports
        finally:
            for proc, _ in procs:
                stop_server(proc, timeout=15)


def test_each_kind_answers_as_bert_predict(servers, capsys):
    root, ports = servers
    for name, (kind, rows) in REQUESTS.items():
        columns = list(rows[0])
        split = {"columns": columns, "data": [[r[c] for c in columns] for r in rows]}
        payloads = [{"dataframe_split": split}, {"dataframe_records": rows}]
        answers = []
        for payload in payloads:
            status, body = post(ports[name], payload)
            assert status == 200, body
            answers.append(body["predictions"])
        assert answers[0] == answers[1] and len(answers[0]) == len(rows)

        inputs = root / f"{name}.jsonl"
        inputs.write_text("".join(json.dumps(r) + "\n" for r in rows))
        output = root / f"{name}.out.jsonl"
        argv = ["predict", "--model", f"models:/{name}@champion", "--input", str(inputs)]
        assert cli.main([*argv, "--output", str(output)]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["kind"] == kind
        batch = [json.loads(line) for line in output.read_text().splitlines()]
        assert [r.pop("row") for r in batch] == list(range(len(rows)))
        assert batch == strip_numbers(answers[0]), name
    found = answers[0][1]  # the last kind, question answering: offsets into the context
    context = REQUESTS["bert-squad"][1][1]["context"]
    assert context[found["start"] : found["end"]] == found["answer"] != ""


def test_bad_input_is_a_400_with_a_clear_message_and_the_server_stays_up(servers):
    _, ports = servers
    port = ports["bert-sst2"]
    bad = [
        ({"dataframe_records": [{"text": "fine"}, {"text": "   "}]}, "row 1: 'text' is empty"),
        (
            {"dataframe_split": {"columns": ["sentence"], "data": [["x"]]}},
            "Model is missing inputs ['text']",
        ),
        (
            {"dataframe_records": [{"text": "word " * 500}]},
            "row 0: 'text' has 2,500 characters, more than max_chars 2,000",
        ),
        (b"{not json", "Invalid input"),
    ]
    for payload, message in bad:
        status, body = post(port, payload)
        assert 400 <= status < 500, (status, body)
        assert message in body.get("message", ""), body
        good, answer = post(port, {"dataframe_records": [{"text": "still up"}]})
        assert good == 200 and answer["predictions"][0]["label"] in ("negative", "positive")
