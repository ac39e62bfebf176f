"""Raw text in, answers out: one small class per kind of model, the one inference code path.

`bert predict`, the MLflow model (`bert_core.serve.mlflow_model`, also behind `mlflow models
serve`) and the benchmarks all answer through these classes, so a served answer and a batch
answer are the same computation. Each class reuses its task's fine-tuning code (featurisation,
collate, the length-sorted `engine.predict_batches` loop), so inference sees inputs exactly as
the dev set did during fine-tuning:

- `TextClassifier` (GLUE, `BertForSequenceClassification`): `text` (single-sentence tasks) or
  `text` + `text_pair` (pair tasks) -> `label` (config.json's label name: `positive`), its
  probability `score` and every label's `probabilities`; a regression head (STS-B) -> `score`.
- `EntityTagger` (CoNLL-2003, `BertForTokenClassification`): `text` -> `entities`, each with its
  type, text, character offsets and mean word probability.
- `QuestionAnswerer` (SQuAD, `BertForQuestionAnswering`): `question` + `context` -> `answer`,
  its character offsets and probability (SQuAD 2.0 models may answer "").
- `MaskFiller` (the pre-trained `BertForPreTraining`): `text` with `[MASK]`s -> the `top_k`
  tokens of every mask, and the text with each mask filled by its best token.
- `ChoiceRanker` (SWAG, `BertForMultipleChoice`): `context` [+ `start`] + `ending0..3` -> the
  chosen `label` (0-3), its probability `score` and every choice's `scores`.

A new kind is one subclass of `bert_core.serve.predictor.Predictor` (its head class, input
columns, `output_types`, `example` and `answer`) and one `PREDICTORS` entry: the head class name
that config.json's `architectures` records -> the subclass. The span-level kinds (offsets into
the input) are in `bert_core.serve.predictors_span`.

Every input is checked first (`Predictor.columns`): a missing column, a value that is not text,
empty text or text over `max_chars` is a `BadInput` naming the row, which the callers turn into
an HTTP 400 (a column) or 422 (a row's value; serving: `mlflow_model.RefusedInput`) or an
error naming the file and line (`bert predict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from bert_core.errors import InputError
from bert_core.finetune import engine as finetune
from bert_core.finetune.tasks import glue as finetune_glue
from bert_core.finetune.tasks import swag
from bert_core.finetune.tasks.glue_data import Example, get_task
from bert_core.model.config import CONFIG_NAME
from bert_core.serve.predictor import (  # noqa: F401 (re-exported: the predictors' public names)
    BadInput,
    Predictor,
    Settings,
    label_names,
    read_config,
    softmax,
)
from bert_core.serve.predictors_span import EntityTagger, FeatureTagger, QuestionAnswerer


def pair_task(config: dict) -> bool | None:
    """Whether a classifier's GLUE task (config.json's `finetuning_task`) is a sentence-pair
    one; None when the task is not a GLUE task (or not recorded)."""
    try:
        task = get_task(config.get("finetuning_task") or "")
    except ValueError:
        return None
    return task.train.layout.text_b is not None


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
    def fields(cls, config: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """A model of a known GLUE task reads `text` and `text_pair` both, in every row (a pair
        task: MRPC, QQP, STS-B, MNLI, QNLI, RTE, WNLI), or `text` only (CoLA, SST-2: a
        `text_pair` is not read); another classifier `text` and an optional `text_pair`."""
        pair = pair_task(config)
        if pair is None:
            return super().fields(config)
        return (("text", "text_pair") if pair else ("text",)), ()

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
        if pair_task(config):
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
    head = "BertForPreTraining"  # in model.modeling (load_model); MLM-only checkpoints load too
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
                # the encoder ran under autocast (bf16 states on a GPU), the head runs here
                # outside it, on the fp32 weights: states in fp32 too
                states = outputs.last_hidden_state[row, positions].float()
                probs = head(states, embeddings).float()
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
        return {
            "context": "A man fills a kettle with water.",
            "start": "He",
            **dict(zip(swag.ENDINGS, endings, strict=True)),
        }

    def answer(self, columns: dict[str, list]) -> list[dict]:
        starts = columns.get("start") or [None] * len(columns["context"])
        examples = [
            swag.SwagExample(
                str(i), c, starts[i] or "", tuple(columns[e][i] for e in swag.ENDINGS), None
            )
            for i, c in enumerate(columns["context"])
        ]
        features = swag.featurize(examples, self.tokenizer, self.max_seq_length)
        logits = swag.predict(self.model, features, self.device, self.settings.batch_size)
        out = []
        for p in softmax(logits.astype(np.float64)):
            best = int(p.argmax())
            out.append({"label": best, "score": float(p[best]), "scores": p.tolist()})
        return out


# config.json's head class -> the predictor that answers for it. A new kind is one entry here
# and one `Predictor` subclass.
PREDICTORS: dict[str, type[Predictor]] = {
    "BertForSequenceClassification": TextClassifier,
    "BertForTokenClassification": EntityTagger,
    "BertFeatureTagger": FeatureTagger,
    "BertForQuestionAnswering": QuestionAnswerer,
    "BertForMultipleChoice": ChoiceRanker,
    "BertForPreTraining": MaskFiller,
    "BertForMaskedLM": MaskFiller,
}


def predictor_class(config: dict, where: str | Path = "config.json") -> type[Predictor]:
    """The class that answers for a model, from config.json's `architectures`."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in PREDICTORS:
            return PREDICTORS[arch]
    raise InputError(
        where,
        f"architectures {archs}: no prediction head we can serve (known: "
        f"{', '.join(PREDICTORS)}); fine-tune the model first, or use `bert embed` for vectors",
    )


def load_predictor(model_dir: str | Path, settings: Settings | None = None) -> Predictor:
    """The predictor for an HF-layout model folder, chosen by its head class."""
    config = read_config(model_dir)
    return predictor_class(config, Path(model_dir) / CONFIG_NAME)(model_dir, settings)
