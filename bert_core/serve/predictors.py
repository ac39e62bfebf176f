"""Raw text in, answers out: one small class per kind of model, the one inference code path.

`bert predict`, the MLflow model (`bert_core.serve.mlflow_model`, also behind `mlflow models serve`) and the
benchmarks all answer through these classes, so a served answer and a batch answer are the same
computation. Each class reuses its task's fine-tuning code (featurisation, collate, the
length-sorted `finetune.predict_batches` loop), so inference sees inputs exactly as the dev set
did during fine-tuning:

- `TextClassifier` (GLUE, `BertForSequenceClassification`): `text` [+ `text_pair`] -> `label`,
  its probability `score` and every label's `probabilities`; a regression head (STS-B) -> `score`.
- `EntityTagger` (CoNLL-2003, `BertForTokenClassification`): `text` -> `entities`, each with its
  type, text, character offsets and mean word probability.
- `QuestionAnswerer` (SQuAD, `BertForQuestionAnswering`): `question` + `context` -> `answer`,
  its character offsets and probability (SQuAD 2.0 models may answer "").
- `MaskFiller` (the pre-trained `BertForPreTraining`): `text` with `[MASK]`s -> the `top_k`
  tokens of every mask, and the text with each mask filled by its best token.
- `ChoiceRanker` (SWAG, `BertForMultipleChoice`): `context` [+ `start`] + `ending0..3` -> the
  chosen `label` (0-3), its probability `score` and every choice's `scores`.

A new kind is one subclass (its head class, input columns,
`output_types`, `example` and `answer`) and one `PREDICTORS` entry: the head class name that
config.json's `architectures` records -> the subclass. The span-level kinds (offsets into the
input) are in `bert_core.serve.predictors_span`.

Every input is checked first (`Predictor.columns`): a missing column, a value that is not text,
empty text or text over `max_chars` is a `BadInput` naming the row, which the callers turn into
an HTTP 400 (serving) or an error naming the file and line (`bert predict`).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from bert_core.errors import InputError, utf8_errors
from bert_core.finetune import engine as finetune
from bert_core.finetune.tasks import glue as finetune_glue
from bert_core.finetune.tasks import swag
from bert_core.finetune.tasks.glue_data import Example, get_task
from bert_core.model import optim
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

    @classmethod
    def from_dict(cls, values: dict | None) -> Settings:
        """The known keys of `values` (a fine-tuning config has more), None values left out."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in names and v is not None})


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no {CONFIG_NAME} (not a BERT model folder)")
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
        self.device = optim.resolve_device(self.settings.device)
        self.tokenizer = finetune.load_tokenizer(model_dir)
        self.tokenizer.no_truncation()  # too long is cut or windowed by the task's code
        self.model = self.load_model().to(self.device).eval()
        self.config: BertConfig = self.model.config
        self.max_seq_length = min(
            self.settings.max_seq_length or self.default_max_seq_length,
            self.config.max_position_embeddings,
        )

    def load_model(self) -> torch.nn.Module:
        from bert_core.model import heads

        return getattr(heads, self.head).from_pretrained(self.model_dir)

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

    def columns(self, frame) -> dict[str, list]:
        """The model's columns of `frame` as lists, every value checked."""
        have = [str(c) for c in frame.columns]
        missing = [c for c in self.inputs if c not in have]
        if missing:
            want = ", ".join(self.inputs) + "".join(f", optional {c}" for c in self.optional)
            raise BadInput(
                f"missing column {', '.join(map(repr, missing))}: this {self.kind} model reads "
                f"the columns {want} (got {', '.join(have) or 'none'})"
            )
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
                if len(v) > self.settings.max_chars:
                    raise BadInput(
                        f"{name!r} has {len(v):,} characters, more than max_chars "
                        f"{self.settings.max_chars:,}", row,
                    )  # fmt: skip
            out[name] = values
        return out


def label_names(config: dict) -> list[str]:
    """The head's label names in id order (transformers' LABEL_i when it has none)."""
    id2label = config.get("id2label") or {}
    n = len(id2label) or int(config.get("num_labels", 2))
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class TextClassifier(Predictor):
    """Sentence (pair) classification or regression, featurised as GLUE fine-tuning does."""

    kind = "classification"
    head = "BertForSequenceClassification"
    optional = ("text_pair",)

    def __init__(self, model_dir: str | Path, settings: Settings | None = None):
        super().__init__(model_dir, settings)
        if self.config.num_labels == 1:
            self.kind = "regression"

    @classmethod
    def output_types(cls, config: dict) -> dict[str, Any]:
        names = label_names(config)
        if len(names) == 1:  # a regression head (STS-B): one score
            return {"score": "double"}
        return {
            "label": "string",
            "score": "double",
            "probabilities": dict.fromkeys(names, "double"),
        }

    @classmethod
    def example(cls, config: dict) -> dict[str, str]:
        try:
            task = get_task(config.get("finetuning_task") or "")
        except ValueError:
            task = None
        if task is not None and task.train.layout.text_b is not None:
            return {"text": "The cat sat on the mat.", "text_pair": "A cat was sitting on a mat."}
        return super().example(config)

    def answer(self, columns: dict[str, list]) -> list[dict]:
        texts = columns["text"]
        pairs = columns.get("text_pair") or [None] * len(texts)
        examples = [Example(str(i), texts[i], pairs[i], None) for i in range(len(texts))]
        # unlabelled examples: featurize never looks at the GLUE task (it only maps labels)
        features = finetune_glue.featurize(None, examples, self.tokenizer, self.max_seq_length)
        logits = finetune_glue.predict(self.model, features, self.device, self.settings.batch_size)
        if self.config.num_labels == 1:
            return [{"score": float(x)} for x in logits[:, 0]]
        names = label_names(self.config.to_dict())
        out = []
        for p in softmax(logits.astype(np.float64)):
            best = int(p.argmax())
            probs = {n: float(v) for n, v in zip(names, p, strict=True)}
            out.append({"label": names[best], "score": float(p[best]), "probabilities": probs})
        return out


class MaskFiller(Predictor):
    """The pre-trained model's own task: the masked-LM head's best tokens for each [MASK]."""

    kind = "fill-mask"
    head = "BertForPreTraining"  # in bert_core.model.modeling (load_model); MLM-only checkpoints load too
    default_max_seq_length = 512
    MASK = "[MASK]"

    @classmethod
    def output_types(cls, config: dict) -> dict[str, Any]:
        mask = {"start": "long", "tokens": ["string"], "scores": ["double"]}
        return {"filled": "string", "masks": [mask]}

    @classmethod
    def example(cls, config: dict) -> dict[str, str]:
        return {"text": "The capital of France is [MASK]."}

    def load_model(self) -> torch.nn.Module:
        from bert_core.model.modeling import BertForPreTraining

        return BertForPreTraining.from_pretrained(self.model_dir)  # MLM-only heads load too

    def answer(self, columns: dict[str, list]) -> list[dict]:
        texts, k = columns["text"], self.settings.top_k
        mask_id = self.tokenizer.token_to_id(self.MASK)
        encodings = self.tokenizer.encode_batch(texts)  # [CLS] ... [SEP]
        ids = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        for row, x in enumerate(ids):
            if len(x) > self.max_seq_length:
                raise BadInput(
                    f"'text' has {len(x)} tokens, more than max_seq_length {self.max_seq_length}",
                    row,
                )
            if mask_id is None or not (x == mask_id).any():
                raise BadInput(f"'text' has no {self.MASK} token to fill", row)
        make_batch = lambda index: {  # noqa: E731
            "input_ids": finetune.pad(ids, index),
            "attention_mask": finetune.padding_mask(ids, index),
        }
        bert, head = self.model.bert, self.model.cls.predictions
        embeddings = bert.embeddings.word_embeddings.weight
        out: list[dict] = [{}] * len(texts)
        batches = finetune.predict_batches(
            bert, [len(x) for x in ids], make_batch, self.device, self.settings.batch_size
        )
        for index, outputs in batches:
            for row, i in enumerate(index):
                positions = np.flatnonzero(ids[i] == mask_id)
                probs = head(outputs.last_hidden_state[row, positions], embeddings).float()
                top = probs.softmax(-1).topk(min(k, probs.shape[-1]))
                out[i] = self.fill(texts[i], encodings[i].offsets, positions, top)
        return out

    def fill(self, text: str, offsets, positions, top) -> dict:
        masks, filled = [], text
        values, indices = top.values.tolist(), top.indices.tolist()
        for p, scores, token_ids in zip(positions, values, indices, strict=True):
            tokens = [self.tokenizer.id_to_token(t) for t in token_ids]
            masks.append({"start": int(offsets[p][0]), "tokens": tokens, "scores": scores})
        # filled from the last mask back, so the earlier offsets still hold
        for p, m in sorted(zip(positions, masks, strict=True), key=lambda pm: -pm[0]):
            a, b = offsets[p]
            filled = filled[:a] + m["tokens"][0].removeprefix("##") + filled[b:]
        return {"filled": filled, "masks": masks}


class ChoiceRanker(Predictor):
    """Multiple choice (SWAG, `BertForMultipleChoice`), featurised as SWAG fine-tuning does:
    `context` [+ the next sentence's `start`] and four `ending0..3` -> the chosen `label`
    (0-3), its probability `score` and every choice's `scores`."""

    kind = "multiple-choice"
    head = "BertForMultipleChoice"
    inputs = ("context", *swag.ENDINGS)
    optional = ("start",)

    @classmethod
    def output_types(cls, config: dict) -> dict[str, Any]:
        return {"label": "long", "score": "double", "scores": ["double"]}

    @classmethod
    def example(cls, config: dict) -> dict[str, str]:
        endings = ("pours it into a cup.", "eats the kettle.", "flies away.", "sings loudly.")
        return {"context": "A man fills a kettle with water.", "start": "He",
                **dict(zip(swag.ENDINGS, endings, strict=True))}  # fmt: skip

    def answer(self, columns: dict[str, list]) -> list[dict]:
        starts = columns.get("start") or [None] * len(columns["context"])
        examples = [
            swag.SwagExample(str(i), c, starts[i] or "",
                             tuple(columns[e][i] for e in swag.ENDINGS), None)
            for i, c in enumerate(columns["context"])
        ]  # fmt: skip
        features = swag.featurize(examples, self.tokenizer, self.max_seq_length)
        logits = swag.predict(self.model, features, self.device, self.settings.batch_size)
        out = []
        for p in softmax(logits.astype(np.float64)):
            best = int(p.argmax())
            out.append({"label": best, "score": float(p[best]), "scores": p.tolist()})
        return out


# config.json's head class -> "module:class" of its predictor, imported only when used. A new
# kind is one entry here and one `Predictor` subclass.
PREDICTORS: dict[str, str] = {
    "BertForSequenceClassification": "bert_core.serve.predictors:TextClassifier",
    "BertForTokenClassification": "bert_core.serve.predictors_span:EntityTagger",
    "BertForQuestionAnswering": "bert_core.serve.predictors_span:QuestionAnswerer",
    "BertForMultipleChoice": "bert_core.serve.predictors:ChoiceRanker",
    "BertForPreTraining": "bert_core.serve.predictors:MaskFiller",
    "BertForMaskedLM": "bert_core.serve.predictors:MaskFiller",
}


def predictor_class(config: dict, where: str | Path = "config.json") -> type[Predictor]:
    """The class that answers for a model, from config.json's `architectures`."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in PREDICTORS:
            module, name = PREDICTORS[arch].split(":")
            return getattr(importlib.import_module(module), name)
    raise InputError(
        where, f"architectures {archs}: no prediction head we can serve (known: "
        f"{', '.join(PREDICTORS)}); fine-tune the model first, or use `bert embed` for vectors",
    )  # fmt: skip


def load_predictor(model_dir: str | Path, settings: Settings | None = None) -> Predictor:
    """The predictor for an HF-layout model folder, chosen by its head class."""
    config = read_config(model_dir)
    return predictor_class(config, Path(model_dir) / CONFIG_NAME)(model_dir, settings)
