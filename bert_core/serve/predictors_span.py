"""The span-level predictors (listed in `bert_core.serve.predictors`): named entities and extractive
answers.

Both answer with character offsets into the raw input: entities through the tokenizer's word
split (BERT's whitespace and punctuation rule after its normaliser; offsets in the raw text),
answers through the context's offset mapping, as SQuAD fine-tuning decodes them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bert_core.errors import InputError
from bert_core.finetune import engine as finetune
from bert_core.finetune.tasks import ner, squad
from bert_core.serve.predictor import BadInput, Predictor, label_names


class EntityTagger(Predictor):
    """Named entities, tagged as NER fine-tuning does: BERT's words, the first sub-token's tag."""

    kind = "ner"
    head = "BertForTokenClassification"
    ENTITY = {
        "entity": "string",
        "text": "string",
        "start": "long",
        "end": "long",
        "score": "double",
    }

    @classmethod
    def output_types(cls, config: dict) -> dict[str, Any]:
        return {"entities": [cls.ENTITY]}

    @classmethod
    def example(cls, config: dict) -> dict[str, str]:
        return {"text": "Angela Merkel met Emmanuel Macron in Paris on Tuesday."}

    def words(self, texts: list[str]) -> list[list[tuple[int, int]]]:
        """Each text's words as character spans: the tokenizer's own word split (BERT's
        whitespace and punctuation rule, after its normaliser), offsets in the raw text."""
        spans = []
        for enc in self.tokenizer.encode_batch(texts, add_special_tokens=False):
            words: dict[int, list[int]] = {}
            for w, (a, b) in zip(enc.word_ids, enc.offsets, strict=True):
                if w is not None:
                    words.setdefault(w, [a, b])[1] = b
            spans.append([tuple(words[w]) for w in sorted(words)])
        return spans

    def answer(self, columns: dict[str, list]) -> list[dict]:
        texts = columns["text"]
        spans = self.words(texts)
        sentences = []
        for i, (text, sp) in enumerate(zip(texts, spans, strict=True)):
            n = len(sp)
            sentences.append(
                ner.Sentence([text[a:b] for a, b in sp], ["-"] * n, ["-"] * n, ["O"] * n, i)
            )
        windows = ner.featurize(sentences, self.tokenizer, self.max_seq_length)
        names = label_names(self.config.to_dict())
        tags = [["O"] * len(s) for s in spans]
        scores = [[0.0] * len(s) for s in spans]
        lengths = [len(x) for x in windows.input_ids]
        batches = finetune.predict_batches(
            self.model,
            lengths,
            lambda i: ner.collate(windows, i),
            self.device,
            self.settings.batch_size,
        )
        for index, outputs in batches:
            probs = outputs.logits.float().softmax(-1).cpu().numpy()
            for row, i in enumerate(index):
                p = probs[row, windows.first[i]]
                for (si, wi), best, score in zip(
                    windows.words[i], p.argmax(-1), p.max(-1), strict=True
                ):
                    tags[si][wi], scores[si][wi] = names[best], float(score)
        return [
            {"entities": entities(t, tags[i], scores[i], spans[i])} for i, t in enumerate(texts)
        ]


def entities(
    text: str, tags: list[str], scores: list[float], spans: list[tuple[int, int]]
) -> list[dict]:
    """IOB2 word tags -> entities: B-X starts one, I-X continues an X (and starts one after O
    or another type, as conlleval reads IOB1); tags without a B-/I- prefix join equal
    neighbours. Score: the mean of its words' tag probabilities."""
    out: list[dict] = []
    words: list[int] = []
    kind = None

    def close() -> None:
        if words:
            start, end = spans[words[0]][0], spans[words[-1]][1]
            score = float(np.mean([scores[w] for w in words]))
            out.append(
                {
                    "entity": kind,
                    "text": text[start:end],
                    "start": start,
                    "end": end,
                    "score": score,
                }
            )
            words.clear()

    for w, tag in enumerate(tags):
        prefix, typ = (tag[:2], tag[2:]) if tag[:2] in ("B-", "I-") else ("", tag)
        if tag == "O" or prefix == "B-" or typ != kind:
            close()
            kind = None if tag == "O" else typ
        if tag != "O":
            words.append(w)
    close()
    return out


class FeatureTagger(EntityTagger):
    """Entities from a feature-based tagger (`bert finetune --feature-based`): the same
    inputs, words and answers, another head."""

    head = "BertFeatureTagger"


class QuestionAnswerer(Predictor):
    """Extractive question answering, windowed and decoded as SQuAD fine-tuning does."""

    kind = "question-answering"
    head = "BertForQuestionAnswering"
    inputs = ("question", "context")
    default_max_seq_length = 384

    @classmethod
    def output_types(cls, config: dict) -> dict[str, Any]:
        return {"answer": "string", "start": "long", "end": "long", "score": "double"}

    @classmethod
    def example(cls, config: dict) -> dict[str, str]:
        return {
            "question": "Where was the treaty signed?",
            "context": "After months of talks, the treaty was signed in Lisbon in December 2007.",
        }

    def answer(self, columns: dict[str, list]) -> list[dict]:
        s = self.settings
        cfg = squad.SquadConfig(
            max_seq_length=self.max_seq_length,
            doc_stride=s.doc_stride,
            max_query_length=s.max_query_length,
            max_answer_length=s.max_answer_length,
            n_best_size=s.n_best_size,
            null_score_diff_threshold=s.null_score_diff_threshold,
        )
        questions, contexts = columns["question"], columns["context"]
        encoded = self.tokenizer.encode_batch(questions, add_special_tokens=False)
        for row, q in enumerate(encoded):
            if len(q.ids) > cfg.max_query_length:
                raise BadInput(
                    f"'question' has {len(q.ids)} tokens, more than max_query_length "
                    f"{cfg.max_query_length}",
                    row,
                )
        examples = [squad.Example(str(i), q, contexts[i], []) for i, q in enumerate(questions)]
        try:
            features = squad.featurize(examples, self.tokenizer, cfg, "input")
        except InputError as e:  # a context of nothing but characters the normaliser drops
            raise BadInput(str(e).removeprefix("input: ")) from None
        logits = squad.predict_logits(self.model, features, self.device, s.batch_size)
        version_2 = self.config.finetuning_task == "squad_v2"
        return best_spans(contexts, features, logits, cfg, version_2)


def best_spans(
    contexts: list[str], f: squad.Features, logits: list, cfg: squad.SquadConfig, version_2: bool
) -> list[dict]:
    """`squad.decode`'s search (the n-best starts and ends of each window, valid spans, the
    best start + end logit over the windows), keeping what an answer needs besides its text:
    character offsets and a probability (softmax of the start times that of the end, in the
    window it came from). SQuAD 2.0: "" at offset 0 when the null answer wins."""
    best: dict[int, tuple[float, int, int, float]] = {}
    null: dict[int, tuple[float, float]] = {}
    for w, (sl, el) in enumerate(logits):
        i = int(f.example_index[w])
        log_z = _logsumexp(sl) + _logsumexp(el)
        if i not in null or sl[0] + el[0] < null[i][0]:
            null[i] = (float(sl[0] + el[0]), math.exp(sl[0] + el[0] - log_z))
        span = squad.best_span(sl, el, f.offsets[w], f.max_context[w], cfg)
        if span is None:
            continue
        score, s, e = span
        if i not in best or score > best[i][0]:
            start, end = int(f.offsets[w][s, 0]), int(f.offsets[w][e, 1])
            best[i] = (score, start, end, math.exp(sl[s] + el[e] - log_z))
    out = []
    for i, context in enumerate(contexts):
        score, start, end, prob = best.get(i, (-math.inf, 0, 0, 0.0))
        if version_2 and null[i][0] - score > cfg.null_score_diff_threshold:
            start, end, prob = 0, 0, null[i][1]
        out.append({"answer": context[start:end], "start": start, "end": end, "score": prob})
    return out


def _logsumexp(x: np.ndarray) -> float:
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum()))
