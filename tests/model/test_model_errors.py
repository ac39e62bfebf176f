"""A damaged or unsafe model folder is an error naming the file, never a library traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from bert_core.errors import InputError
from bert_core.model.modeling import BertConfig, BertModel


@pytest.fixture
def tiny_dir(tmp_path):
    model = BertModel(BertConfig.from_preset("tiny", vocab_size=64))
    model.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_truncated_safetensors_names_the_file(tiny_dir):
    weights = tiny_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(InputError, match=r"model\.safetensors: not a readable safetensors"):
        BertModel.from_pretrained(tiny_dir)


class Payload:
    """Anything but a tensor: weights_only refuses to unpickle it."""


def test_pickle_with_objects_is_refused_with_advice(tiny_dir):
    (tiny_dir / "model.safetensors").unlink()
    torch.save({"state": Payload()}, tiny_dir / "pytorch_model.bin")
    with pytest.raises(InputError, match=r"pytorch_model\.bin: holds objects other than tensors"):
        BertModel.from_pretrained(tiny_dir)


def test_inconsistent_config_names_config_json(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    config["num_attention_heads"] = 3  # 128 is not divisible by 3
    (tiny_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"config\.json: hidden_size 128 is not divisible"):
        BertModel.from_pretrained(tiny_dir)
    (tiny_dir / "config.json").write_text('{"hidden_size": 128,\n "vocab_size": }')
    with pytest.raises(InputError, match=r"config\.json:2: not valid JSON"):
        BertModel.from_pretrained(tiny_dir)


@pytest.mark.slow
def test_cli_reports_a_bad_checkpoint_without_traceback(minilm_dir, tmp_path, shared_data):
    model_dir = tmp_path / "minilm"
    shutil.copytree(minilm_dir, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bert_core", "finetune", "--task", "SST-2"]
        + ["--data", str(shared_data / "glue" / "SST-2"), "--model", str(model_dir)]
        + ["--output", str(out), "--max-train-examples", "8", "--max-eval-examples", "8"],
        capture_output=True,
        text=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "model.safetensors: not a readable safetensors file" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
