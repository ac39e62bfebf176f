"""What every predictor is: the `Predictor` base class, its `Settings`, the `BadInput` error.

The kinds of model (`bert_core.serve.predictors`, `bert_core.serve.predictors_span`) subclass
`Predictor`; the base is apart so that both import it from below and the table of kinds
(`predictors.PREDICTORS`) can import every kind without an import loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from bert_core.errors import BadValue, InputError, NotFound, utf8_errors
from bert_core.finetune.engine import load_tokenizer
from bert_core.model import int8, optim
from bert_core.model.config import CONFIG_NAME, BertConfig


class BadInput(ValueError):
    """An input the model cannot answer; `row` (0-based) is the row it is about, if one."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message if row is None else f"row {row}: {message}")
        self.row, self.reason = row, message


@dataclass
class Settings:
    """Inference settings. Fine-tuned models keep their training run's values (the MLflow
    model's `model_config`, or the run's metrics.json), so text is cut and windowed as the dev
    set was."""

    max_seq_length: int | None = None  # None: the kind's default, at most the model's maximum
    batch_size: int = 64
    max_chars: int = 20_000  # longer text is refused, not silently cut or left to run for ever
    device: str = "auto"
    top_k: int = 5  # fill-mask: candidates per [MASK]
    doc_stride: int = 128  # question answering: run_squad.py's windows and decoding
    max_query_length: int = 64
    max_answer_length: int = 30
    n_best_size: int = 20
    null_score_diff_threshold: float = 0.0

    def __post_init__(self) -> None:
        """Counts and lengths >= 1 (`max_seq_length`: None or >= 8), each refused naming its
        option: 0 would fail deep in the model code, a negative length be taken as given."""
        for name in (
            "batch_size",
            "max_chars",
            "top_k",
            "doc_stride",
            "max_query_length",
            "max_answer_length",
            "n_best_size",
            "max_seq_length",
        ):
            value, least = getattr(self, name), 8 if name == "max_seq_length" else 1
            if value is not None and value < least:
                raise BadValue(f"--{name.replace('_', '-')} must be >= {least}, got {value}")

    @classmethod
    def from_dict(cls, values: dict | None) -> Settings:
        """The known keys of `values` (a fine-tuning config has more), None values left out."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in names and v is not None})


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise NotFound(f"{model_dir}: no {CONFIG_NAME} (not a BERT model folder)")
    try:
        with utf8_errors(path):
            return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON ({e.msg})", line=e.lineno) from None


class Predictor:
    """One model folder (HF layout, with its vocab) ready to answer; see the module doc."""

    kind: ClassVar[str]
    head: ClassVar[str]  # the `bert_core.model.heads` class it loads
    inputs: ClassVar[tuple[str, ...]] = ("text",)  # required columns
    optional: ClassVar[tuple[str, ...]] = ()
    default_max_seq_length: ClassVar[int] = 128  # the fine-tuning default

    def __init__(self, model_dir: str | Path, settings: Settings | None = None):
        self.model_dir, self.settings = Path(model_dir), settings or Settings()
        # an int8 model (`bert quantize`) runs on the CPU: "auto" picks it, another is refused
        device = int8.device(model_dir, self.settings.device)
        self.device = device or optim.resolve_device(self.settings.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.tokenizer.no_truncation()  # too long is cut or windowed by the task's code
        self.model = self.load_model().to(self.device).eval()
        self.config: BertConfig = self.model.config
        # this model's columns: a classifier of a known GLUE task narrows them (`fields`)
        self.inputs, self.optional = type(self).fields(self.config.to_dict())
        self.max_seq_length = min(
            self.settings.max_seq_length or self.default_max_seq_length,
            self.config.max_position_embeddings,
        )

    def load_model(self) -> torch.nn.Module:
        from bert_core.model import heads

        return getattr(heads, self.head).from_pretrained(self.model_dir)

    @classmethod
    def fields(cls, config: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(required, optional) input columns of the model of `config` (config.json): the
        kind's `inputs` and `optional`, unless the model's task says more (`TextClassifier`).
        The MLflow signature, `bert predict`'s checks and every answer use these."""
        return cls.inputs, cls.optional

    @classmethod
    def output_types(cls, config: dict) -> dict[str, Any]:
        """Output fields -> type: "string", "double", "long", a dict (an object) or a
        one-element list (an array of it); MLflow's signature and the Parquet schema both
        come from it."""
        raise NotImplementedError

    @classmethod
    def example(cls, config: dict) -> dict[str, str]:
        """One input row, for the MLflow model's input example and the docs."""
        return {"text": "The new film is a delight from start to finish."}

    def answer(self, columns: dict[str, list]) -> list[dict]:
        """One answer per row; `columns` are checked (`columns`), optional ones may be absent
        or hold None."""
        raise NotImplementedError

    def predict(self, frame) -> list[dict]:
        """Answers for a pandas DataFrame (or anything with `.columns` and `__getitem__`)."""
        columns = self.columns(frame)
        if not next(iter(columns.values())):
            return []
        with torch.inference_mode():
            return self.answer(columns)

    def takes(self) -> str:
        """The model's columns in words: `text, text_pair` or `text, optional text_pair`."""
        return ", ".join(self.inputs) + "".join(f", optional {c}" for c in self.optional)

    def missing(self, have: list[str]) -> BadInput | None:
        """The error for columns `have` lacking required ones, naming what the model reads (and
        the task it was fine-tuned on); None when complete."""
        missing = [c for c in self.inputs if c not in have]
        if not missing:
            return None
        want, task = self.takes(), self.config.finetuning_task
        return BadInput(
            f"missing column {', '.join(map(repr, missing))}: this {self.kind} model"
            f"{f' (fine-tuned on {task})' if task else ''} reads "
            f"the columns {want} (got {', '.join(have) or 'none'})"
        )

    def columns(self, frame) -> dict[str, list]:
        """The model's columns of `frame` as lists, every value checked."""
        have = [str(c) for c in frame.columns]
        if (error := self.missing(have)) is not None:
            raise error
        out: dict[str, list] = {}
        for name in (*self.inputs, *(c for c in self.optional if c in have)):
            values = list(frame[name])
            for row, v in enumerate(values):
                if v is None or (isinstance(v, float) and v != v):  # NaN: pandas' missing value
                    if name not in self.optional:
                        raise BadInput(f"{name!r} is missing", row)
                    values[row] = None  # absent in this row
                    continue
                if not isinstance(v, str):
                    raise BadInput(f"{name!r} must be text, got {type(v).__name__}", row)
                if not v.strip():
                    raise BadInput(f"{name!r} is empty", row)
                if not v.isascii() and (lone := _lone_surrogate(v)) is not None:
                    raise BadInput(
                        f"{name!r} is not Unicode text: a lone surrogate "
                        f"(U+{ord(v[lone]):04X}) at character {lone}",
                        row,
                    )
                if len(v) > self.settings.max_chars:
                    raise BadInput(
                        f"{name!r} has {len(v):,} characters, more than max_chars "
                        f"{self.settings.max_chars:,}",
                        row,
                    )
            out[name] = values
        return out


def _lone_surrogate(text: str) -> int | None:
    """Where `text` holds half of a UTF-16 pair (JSON's "\\ud800" decodes to one): no tokenizer
    can encode it."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def label_names(config: dict) -> list[str]:
    """The head's label names in id order (transformers' LABEL_i when it has none)."""
    id2label = config.get("id2label") or {}
    n = len(id2label) or int(config.get("num_labels", 2))
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
