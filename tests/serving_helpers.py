"""Model folders of every kind `bert_core.serve.predictors` serves, built in seconds.

Each is the real 6-layer MiniLM encoder (`minilm_dir`) under a freshly initialised (seeded) head,
saved as `bert finetune` saves its model: label names and task in config.json, the vocab and
tokenizer_config.json beside it. The heads are untrained, so answers are arbitrary but
deterministic, which is what comparing two code paths needs; a real encoder spreads the logits
so that no two candidates tie.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from bert_core.finetune.tasks import ner
from bert_core.model import heads
from bert_core.model.modeling import BertForPreTraining
from tests.pipeline_helpers import local_services

KINDS = {
    # kind: (head class, config overrides)
    "classification": (
        heads.BertForSequenceClassification,
        {"num_labels": 2, "id2label": {0: "negative", 1: "positive"}, "finetuning_task": "SST-2"},
    ),
    "pair": (
        heads.BertForSequenceClassification,
        {"num_labels": 2, "id2label": {0: "0", 1: "1"}, "finetuning_task": "MRPC"},
    ),
    "regression": (
        heads.BertForSequenceClassification,
        {"num_labels": 1, "finetuning_task": "STS-B"},
    ),
    "ner": (
        heads.BertForTokenClassification,
        {
            "num_labels": len(ner.LABELS),
            "id2label": dict(enumerate(ner.LABELS)),
            "finetuning_task": "conll2003",
        },
    ),
    "question-answering": (
        heads.BertForQuestionAnswering,
        {"num_labels": 2, "finetuning_task": "squad"},
    ),
    "fill-mask": (BertForPreTraining, {}),
    "multiple-choice": (heads.BertForMultipleChoice, {"num_labels": 1, "finetuning_task": "swag"}),
}


def build(kind: str, minilm_dir: Path, dest: Path, seed: int = 0) -> Path:
    """A model folder of `kind` (a key of KINDS) at `dest`."""
    cls, overrides = KINDS[kind]
    torch.manual_seed(seed)
    model = cls.from_pretrained(minilm_dir, **overrides)
    if kind == "fill-mask":  # MiniLM has no MLM head: a visible one, not one near zero
        torch.nn.init.normal_(model.cls.predictions.transform.dense.weight, std=0.2)
    model.save_pretrained(dest, vocab_file=minilm_dir / "vocab.txt")
    return dest


# ---------------------------------------------------------------- a model server in a subprocess
# (`bert serve` and `mlflow models serve`, started in their own session by the serving tests and
# bench/serve_load.py)


def free_port() -> int:
    """infra/scripts/local_services.py's: one home for how a test picks a port."""
    return local_services().free_port()


def wait_until_up(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    """Until the server on `port` answers /ping with 200; an AssertionError with the end of
    its `log` when it exits first or is not up within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:  # URLError, a refused or reset connection, a timeout
            pass
        time.sleep(0.5)
    raise AssertionError(f"server not up after {timeout} s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM to the server's process group (it and its uvicorn workers), SIGKILL after
    `timeout` seconds; returns its exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def strip_numbers(value):
    """Answers with every float replaced by pytest.approx: two processes (or a joined batch,
    padded to another length) may round the last bits of a float differently."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-4, abs=1e-6)
    if isinstance(value, dict):
        return {k: strip_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_numbers(v) for v in value]
    return value
