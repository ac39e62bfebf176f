"""The distillation loss, and the student wrapper that lets the fine-tuning loop train with it.

Hinton et al. 2015 ("Distilling the Knowledge in a Neural Network", section 2): the student
matches the teacher's class probabilities softened by a temperature T, plus the ordinary loss on
the true labels, as a weighted average:

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))
         + (1 - alpha) * cross_entropy(student, labels)

The soft term is multiplied by T^2 because its gradients scale as 1/T^2 (section 2.1): without
it, changing T would change the weight of the two terms too. A regression head (STS-B) has no
distribution to soften: its soft term is the squared error to the teacher's prediction (as
Hinton et al.'s section 2.1 shows matching logits is the high-temperature limit of the same
objective), T plays no part, and the hard term is the head's own MSE.

`Distiller` wraps a student `BertForSequenceClassification` so that `forward(**batch).loss` is
this loss, with the teacher's logits arriving in the batch (`teacher_logits`, computed once for
the training set by `bert_core.compress.distill`): the engine's `fit` trains it unchanged, and its
state dict is the student's under `student.` (the best epoch is restored as for any model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bert_core.model.heads import ClassifierOutput


def distillation_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    alpha: float,
) -> torch.Tensor:
    """The batch's mean loss (see the module doc) for logits [B, C]; C == 1 is a regression."""
    student, teacher = student.float(), teacher.float()
    if student.shape[-1] == 1:  # regression: squared error to the teacher, then to the label
        prediction = student.squeeze(-1)
        soft = F.mse_loss(prediction, teacher.squeeze(-1))
        hard = F.mse_loss(prediction, labels.float())
    else:
        t = temperature
        soft = F.kl_div(
            F.log_softmax(student / t, dim=-1),
            F.log_softmax(teacher / t, dim=-1),
            reduction="batchmean",
            log_target=True,
        ) * (t * t)
        hard = F.cross_entropy(student, labels.long())
    return alpha * soft + (1.0 - alpha) * hard


class Distiller(nn.Module):
    """A student whose loss is `distillation_loss` against the batch's `teacher_logits`."""

    def __init__(self, student: nn.Module, temperature: float, alpha: float):
        super().__init__()
        self.student = student
        self.temperature, self.alpha = temperature, alpha

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        teacher_logits: torch.Tensor | None = None,
    ) -> ClassifierOutput:
        logits = self.student(input_ids, token_type_ids, attention_mask).logits
        loss = None
        if labels is not None and teacher_logits is not None:
            loss = distillation_loss(logits, teacher_logits, labels, self.temperature, self.alpha)
        return ClassifierOutput(loss, logits)
