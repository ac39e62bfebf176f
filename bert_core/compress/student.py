"""The teacher and the student of `bert distill`: whether they fit together, and the student made.

**What must match** (checked on the folders' small files, before any data is read or a weight
loaded): the student learns from the teacher's outputs for the *same token ids*, so both must
cut text the same way, token for token: vocab.txt equal line for line and the same casing
(`do_lower_case`). Both must take `--max-seq-length` positions. The teacher must be a sequence
classifier fine-tuned on the task (its config.json's `finetuning_task` and label count). Widths
and depths may differ: only logits are matched.

**The student** (`make_student`) starts from `--student`, any HF-layout BERT folder, under the
task's head, and with `--student-layers K` keeps K of its layers, evenly spaced from the first to
the last (`pick_layers`), with its embeddings and pooler: the DistilBERT initialisation (Sanh et
al. 2019 take every other layer of the teacher), generalised to any K. From a pre-trained model
(e.g. MiniLM) this is Turc et al. 2019's "pre-trained distillation": a student pre-trained as a
language model, then distilled on the task, which they find ahead of distilling a student from
random weights. `--init random` gives that random student: the same shape, no weight read.

**Narrower** (`--student-ffn-share S`): each kept layer keeps that share of its feed-forward
neurons (intermediate_size), those whose weights weigh most (`pick_neurons`): structured pruning
of the feed-forward width, the dimension McCarley et al. 2019 prune in BERT, here by weight
magnitude so it needs no data. Depth alone cannot make a student 3x faster than a teacher three
times as deep (the embeddings, pooler and head stay); the feed-forward block is two thirds of a
layer's multiply-adds at BERT's 4x width, and what a distilled student loses with it, training
regains (docs/compress.md has the measurements).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from bert_core.data.tokenizer import read_lowercase, read_vocab
from bert_core.errors import BadValue, InputError, NotFound
from bert_core.finetune.engine import FinetuneTask, load_model
from bert_core.model.config import CONFIG_NAME, BertConfig

LAYER = re.compile(r"^bert\.encoder\.layer\.(\d+)\.(.*)$")


def _config(folder: Path, what: str) -> BertConfig:
    if not (folder / CONFIG_NAME).is_file():
        raise NotFound(f"{what} {folder}: no {CONFIG_NAME} (not a BERT model folder)")
    return BertConfig.from_json_file(folder / CONFIG_NAME)


def _tokenizer(folder: Path, what: str) -> tuple[list[str], bool]:
    """(vocab.txt's tokens in id order, lowercase) as `engine.load_tokenizer` reads them."""
    if not (folder / "vocab.txt").is_file():
        raise InputError(folder, f"{what}: no vocab.txt (the model folder must carry it)")
    vocab = read_vocab(folder / "vocab.txt")
    lowercase = read_lowercase(folder)
    return sorted(vocab, key=vocab.__getitem__), True if lowercase is None else lowercase


def check_pair(task: FinetuneTask, teacher: Path, student: Path, max_seq_length: int) -> None:
    """Refuse a teacher and student that cannot be distilled (see the module doc), naming the
    first difference; reads only config.json, vocab.txt and tokenizer_config.json."""
    import json

    t_config, s_config = _config(teacher, "--teacher"), _config(student, "--student")
    raw = json.loads((teacher / CONFIG_NAME).read_text(encoding="utf-8"))
    if "BertForSequenceClassification" not in (raw.get("architectures") or []):
        raise InputError(
            teacher / CONFIG_NAME,
            f"--teacher: architectures "
            f"{raw.get('architectures')}: not a sequence classifier fine-tuned on "
            f"{task.name} (`bert finetune --task {task.name}` it first)",
        )
    trained_on = raw.get("finetuning_task")
    if trained_on != task.name or t_config.num_labels != task.num_labels:
        raise InputError(
            teacher / CONFIG_NAME,
            f"--teacher was fine-tuned on {trained_on!r} "
            f"({t_config.num_labels} labels), not on --task {task.name} "
            f"({task.num_labels})",
        )
    t_vocab, t_lower = _tokenizer(teacher, "--teacher")
    s_vocab, s_lower = _tokenizer(student, "--student")
    if t_vocab != s_vocab:
        pairs = enumerate(zip(t_vocab, s_vocab, strict=False))
        first = next((i for i, (a, b) in pairs if a != b), min(len(t_vocab), len(s_vocab)))
        raise InputError(
            student / "vocab.txt",
            f"not the teacher's vocabulary ({len(s_vocab)} "
            f"tokens vs {len(t_vocab)}, first difference at id {first}): teacher "
            "and student must share vocab.txt token for token",
        )
    if t_lower != s_lower:
        case = lambda lower: "uncased" if lower else "cased"  # noqa: E731
        raise InputError(
            student,
            f"--student is {case(s_lower)}, --teacher {case(t_lower)}: "
            "both must cut text the same way (do_lower_case)",
        )
    for what, folder, config in (
        ("--teacher", teacher, t_config),
        ("--student", student, s_config),
    ):
        if max_seq_length > (positions := config.max_position_embeddings):
            raise InputError(
                folder / CONFIG_NAME,
                f"{what} has {positions} positions, fewer than --max-seq-length {max_seq_length}",
            )


def pick_layers(available: int, keep: int) -> list[int]:
    """`keep` of `available` layers, evenly spaced from the first to the last: 2 of 6 -> [0, 5],
    3 of 6 -> [0, 3, 5] (one layer: the first, which reads the embeddings it was trained on)."""
    if not 1 <= keep <= available:
        raise BadValue(
            f"--student-layers must be 1..{available} (the student's layers), got {keep}"
        )
    if keep == 1:
        return [0]
    return [int(i * (available - 1) / (keep - 1) + 0.5) for i in range(keep)]


def ffn_size(available: int, share: float) -> int:
    """The feed-forward neurons a layer keeps of its `available`: `share` of them, at least one."""
    return max(1, round(share * available))


def pick_neurons(w_in, w_out, keep: int):
    """The `keep` feed-forward neurons of a layer whose weights weigh most, in their order:
    neuron j's |row j of the input matrix| x |column j of the output matrix| (both L2), the
    size of what it can add to the residual stream."""
    weight = w_in.norm(dim=1) * w_out.norm(dim=0)
    return torch.topk(weight, keep).indices.sort().values


def cut(model, layers: list[int], ffn_share: float = 1.0):
    """A copy of `model` (a head over `bert`) with only encoder `layers`, renumbered 0.., each
    with `ffn_share` of its feed-forward neurons (`pick_neurons`), and every other weight
    (embeddings, pooler, head) as it was."""
    size = ffn_size(model.config.intermediate_size, ffn_share)
    config = replace(model.config, num_hidden_layers=len(layers), intermediate_size=size)
    small = type(model)(config, init_weights=False)
    full = model.state_dict()
    layer = "bert.encoder.layer.{}.{}".format
    neurons = {
        i: pick_neurons(
            full[layer(i, "intermediate.dense.weight")], full[layer(i, "output.dense.weight")], size
        )
        for i in layers
    }
    state = {}
    for key, value in full.items():
        m = LAYER.match(key)
        if m is None:
            state[key] = value
            continue
        i = int(m[1])
        if i not in layers:
            continue
        if m[2].startswith("intermediate.dense."):
            value = value[neurons[i]]
        elif m[2] == "output.dense.weight":
            value = value[:, neurons[i]]
        state[layer(layers.index(i), m[2])] = value
    small.load_state_dict(state)  # strict: every weight of the small model from `model`
    small.vocab_file = model.vocab_file
    return small


def make_student(
    task: FinetuneTask, student: Path, layers: int | None, cfg, ffn_share: float = 1.0
):
    """(student model, the source layers it kept): `student`'s weights (or random ones,
    `cfg.init == "random"`, from torch's current seed) under the task's head for `cfg`, cut to
    `layers` layers with `ffn_share` of their feed-forward neurons (`cut`)."""
    model = load_model(task, student, cfg)
    available = model.config.num_hidden_layers
    kept = list(range(available)) if layers is None else pick_layers(available, layers)
    if layers is None and ffn_share == 1.0:
        return model, kept
    return cut(model, kept, ffn_share), kept
