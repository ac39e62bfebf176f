"""Held-out evaluation during pre-training: how well the model predicts text it never trained on.

Why: the training MLM accuracy also rises when a model memorises its corpus, so it cannot show
that pre-training generalises. `bert instances` keeps whole documents out of training
(`INSTANCES/heldout/`, seeded, 2 % of the documents by default) and masks them once, so the
held-out predictions are fixed. At step 0 (the untrained model), every `--eval-every` steps
(default: with every checkpoint) and at the end, every rank evaluates its share of the first
`--eval-sequences` held-out instances with the model in eval mode (no dropout) and the sums are
all-reduced: the same weights always give the same numbers. A left-to-right run (`--objective
ltr`) is scored on the next token of the same held-out text, under the same metric names.

Metrics (`pretrain_state.HELDOUT_COLUMNS`: MLflow metric history and `OUTPUT/heldout_metrics.csv`):
`heldout_mlm_loss` (cross-entropy per predicted token), `heldout_perplexity` (its exp),
`heldout_mlm_accuracy`, `heldout_nsp_loss`, `heldout_nsp_accuracy`; and the baselines to read
them against, on the same held-out predictions: `baseline_mlm_accuracy` (always predict the most
frequent masked-token label of the training instances: a unigram guess, the plateau where a
model sits before it uses context; for a left-to-right run the most frequent next token of the
training text, [SEP] included, as its labels are) and `baseline_nsp_accuracy` (always predict
the training instances' more frequent NSP label: about 0.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from bert_core.model import optim
from bert_core.pretrain.config import PretrainConfig
from bert_core.pretrain.data import collate
from bert_core.pretrain.shards import RowGroup, list_row_groups, open_parquet, read_rows
from bert_core.pretrain.state import all_reduce_sum
from bert_core.storage import exists

# Training labels counted for the baselines (from the first row groups: enough to rank the
# frequent tokens, and cheap whatever the corpus size).
BASELINE_LABELS = 200_000
# What `evaluate` sums on each rank and all-reduces.
SUMS = (
    "mlm_loss",
    "mlm_correct",
    "mlm_count",
    "nsp_loss",
    "nsp_correct",
    "nsp_count",
    "baseline_mlm_correct",
    "baseline_nsp_correct",
)


@dataclass(frozen=True)
class Baseline:
    """The constant guesses: the most frequent masked-token label and NSP label of training."""

    mlm_label: int
    nsp_label: int


def training_baseline(
    groups: list[RowGroup], max_labels: int = BASELINE_LABELS, next_token: bool = False
) -> Baseline:
    """Count the labels of the training row groups, in order, up to about `max_labels`: the
    stored masked-token labels, or with `next_token` (Table 5's left-to-right LM) the next token
    of each position of the unmasked text, the labels that objective is scored on."""
    if next_token:
        rows = read_rows(groups, max(1, max_labels // 64))  # 64+ tokens a row, mostly
        labels = collate(rows, next_token=True)["masked_lm_labels"]
        nsp_labels = [int(row[4]) for row in rows]
        most = int(np.bincount(labels[labels >= 0].numpy()).argmax())
        return Baseline(most, int(np.bincount(nsp_labels).argmax()))
    mlm, nsp, n = [], [], 0
    for group in groups:
        table = open_parquet(group.path).read_row_group(
            group.index, columns=["masked_lm_ids", "next_sentence_label"]
        )
        mlm.append(table.column(0).combine_chunks().values.to_numpy())
        nsp.append(table.column(1).to_numpy())
        n += len(mlm[-1])
        if n >= max_labels:
            break
    labels = np.concatenate(mlm)
    # unmasked shards (dynamic masking only) have no stored labels: then nothing is guessed
    most = int(np.bincount(labels).argmax()) if labels.size else -1
    return Baseline(most, int(np.bincount(np.concatenate(nsp)).argmax()))


class HeldOutEval:
    """One rank's share of the held-out instances, as padded batches made once, and the sums
    of the baselines' correct guesses on them (they do not depend on the model)."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], baseline: Baseline):
        self.batches = batches
        self.baseline_correct = [
            sum(int((b["masked_lm_labels"] == baseline.mlm_label).sum()) for b in batches),
            sum(int((b["next_sentence_label"] == baseline.nsp_label).sum()) for b in batches),
        ]

    @classmethod
    def load(
        cls, cfg: PretrainConfig, rank: int = 0, world: int = 1, pad_id: int = 0
    ) -> HeldOutEval | None:
        """Rows `rank::world` of the first `eval_sequences` held-out instances; None when the
        instances have no held-out split (made with --heldout-fraction 0, or before it)."""
        if not exists(cfg.heldout):
            return None
        rows = read_rows(list_row_groups(cfg.heldout), cfg.eval_sequences)[rank::world]
        size = cfg.micro_batch
        batches = [
            collate(rows[i : i + size], pad_id, next_token=cfg.left_to_right)
            for i in range(0, len(rows), size)
        ]
        baseline = training_baseline(list_row_groups(cfg.instances), next_token=cfg.left_to_right)
        return cls(batches, baseline)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """The held-out metrics of `model` (the bare BertForPreTraining, not the DDP wrapper:
        no gradient sync), summed over all ranks; every rank must call it at the same step."""
        was_training = model.training
        model.eval()
        sums = torch.zeros(6, dtype=torch.float64, device=device)
        for batch in self.batches:
            b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with optim.autocast(device):
                out = model(
                    input_ids=b["input_ids"],
                    token_type_ids=b["token_type_ids"],
                    attention_mask=b["attention_mask"],
                    masked_lm_positions=b["masked_lm_positions"],
                )
            labels, nsp = b["masked_lm_labels"], b["next_sentence_label"]
            predicted = labels != -100
            mlm_logits, nsp_logits = out.mlm_logits.float(), out.nsp_logits.float()
            part = [
                F.cross_entropy(mlm_logits.flatten(0, 1), labels.flatten(), reduction="sum"),
                ((mlm_logits.argmax(-1) == labels) & predicted).sum(),
                predicted.sum(),
                F.cross_entropy(nsp_logits, nsp, reduction="sum"),
                (nsp_logits.argmax(-1) == nsp).sum(),
                torch.tensor(nsp.numel(), device=device),
            ]
            sums += torch.stack([x.double() for x in part])
        model.train(was_training)
        totals = all_reduce_sum([*sums.tolist(), *self.baseline_correct], device)
        s = dict(zip(SUMS, totals, strict=True))
        mlm_loss = s["mlm_loss"] / max(s["mlm_count"], 1)
        return {
            "heldout_mlm_loss": mlm_loss,
            "heldout_perplexity": math.exp(mlm_loss) if mlm_loss < 700 else math.inf,
            "heldout_mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1),
            "heldout_nsp_loss": s["nsp_loss"] / max(s["nsp_count"], 1),
            "heldout_nsp_accuracy": s["nsp_correct"] / max(s["nsp_count"], 1),
            "baseline_mlm_accuracy": s["baseline_mlm_correct"] / max(s["mlm_count"], 1),
            "baseline_nsp_accuracy": s["baseline_nsp_correct"] / max(s["nsp_count"], 1),
        }
