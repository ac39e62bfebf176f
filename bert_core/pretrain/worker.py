"""One pre-training worker: set-up, the training step, and the Ray Train loop around them.

`setup` builds what a rank trains with (model, the paper's optimiser from `bert_core.model.optim`:
by default the original's Adam without bias correction (`--optimizer adamw`: torch's AdamW), lr
1e-4, betas 0.9/0.999, weight decay 0.01 except LayerNorm and biases, linear warm-up and linear
decay; and the batches of its share of the instance shards, `bert_core.pretrain.data`), restored
from a checkpoint when there is one. `train_step` is one optimizer step (gradient accumulation,
clipping at 1.0). Both serve the Ray worker (`train_loop_per_worker`) and the bare loop of
bench/pretrain.py, so the bench measures exactly what Ray Train adds.

Every `checkpoint_every` steps rank 0 reports a Ray checkpoint (`bert_core.pretrain.state`) that
holds every rank's RNG states, so a restart continues bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bert_core.data.tokenizer import read_vocab
from bert_core.errors import BertError
from bert_core.model import optim
from bert_core.model.modeling import BertConfig, BertForPreTraining
from bert_core.model.weights import nonfinite
from bert_core.pretrain.channel import DIVERGED, MetricSink, stop_requested
from bert_core.pretrain.config import PretrainConfig
from bert_core.pretrain.data import InstanceStream, dynamic_masking, prefetch
from bert_core.pretrain.heldout import HeldOutEval
from bert_core.pretrain.shards import list_row_groups, read_instances_config
from bert_core.pretrain.state import (
    CSV_COLUMNS,
    Meter,
    Training,
    export_model,
    flops_per_token,
    gather_objects,
    load_state,
    optimizer_state_to,
    peak_flops,
    restore,
    rng_state,
    save_checkpoint,
    seed_all,
)
from bert_core.storage import local_copy


def build_model(cfg: PretrainConfig, vocab_size: int) -> torch.nn.Module:
    # --objective ltr trains (and exports) a causal model, whatever --init-model was
    overrides: dict[str, Any] = {"is_decoder": cfg.left_to_right}
    if cfg.dropout is not None:
        overrides.update(hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout)
    if cfg.init_model:  # an s3:// one (phase two on a RayCluster): each worker reads its own copy
        with local_copy(cfg.init_model) as folder:
            return BertForPreTraining.from_pretrained(folder, **overrides)
    return BertForPreTraining(BertConfig(**cfg.shape(), vocab_size=vocab_size, **overrides))


def freeze_nsp_head(model: torch.nn.Module) -> None:
    """`--objective mlm` / `ltr`, the paper's "No NSP" (Table 5): the NSP classifier and the pooler
    under it (which only NSP trains) get no gradient and stay out of the optimizer, so they
    keep their initial values; DDP skips parameters that do not require a gradient."""
    for module in (model.cls.seq_relationship, model.bert.pooler):
        module.requires_grad_(False)


def setup(
    cfg: PretrainConfig,
    rank: int = 0,
    world: int = 1,
    device: torch.device | None = None,
    *,
    state: dict[str, Any] | None = None,
    prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    start_step: int = 0,
) -> Training:
    """Model, optimizer, schedule and data stream of one rank; restored from a checkpoint's
    `state` (`state.load_state`) when given.

    `prepare` puts the model on `device` (the Ray worker passes `ray.train.torch.prepare_model`,
    which also wraps it in DDP; default `.to(device)`). `start_step` is the data position of a
    fresh run (the bench's second half); a checkpoint's step takes its place.
    """
    device = device or torch.device("cpu")
    torch.set_num_threads(max(1, cfg.cpus_per_worker))
    vocab = read_vocab(cfg.vocab_file)
    seed_all(cfg.seed)  # same initial weights on every rank
    core = build_model(cfg, len(vocab))
    if not cfg.with_nsp:
        freeze_nsp_head(core)
    optimizer, scheduler = optim.optimizer_and_schedule(
        cfg.optimizer,
        core,
        cfg.learning_rate,
        cfg.weight_decay,
        cfg.warmup,
        cfg.steps,
        eps=cfg.adam_eps,
        betas=cfg.adam_betas,
    )
    seed_all(cfg.seed + 1000 * (rank + 1))  # distinct dropout per rank
    step, history, heldout = start_step, [], []
    if state is not None:
        # checkpoints from before --optimizer were AdamW's: never switch optimiser mid-run
        saved = state.get("config", {}).get("optimizer", "adamw")
        if saved != cfg.optimizer:
            raise BertError(
                f"the checkpoint was trained with --optimizer {saved}, not {cfg.optimizer}: "
                f"resume with --optimizer {saved}"
            )
        step, history, heldout = restore(state, core, optimizer, scheduler, rank, world)
    model = prepare(core) if prepare else core.to(device)
    optimizer_state_to(optimizer, device)
    masking, masking_used = None, {}
    if cfg.dynamic_masking:
        masking, masking_used = dynamic_masking(vocab, cfg.instances, cfg.masking_options())
    stream = InstanceStream(
        list_row_groups(cfg.instances),
        cfg.micro_batch,
        rank=rank,
        world_size=world,
        seed=cfg.seed,
        start_sample=step * cfg.grad_accum * cfg.micro_batch,
        masking=masking,
        pad_id=vocab.get("[PAD]", 0),
        next_token=cfg.left_to_right,
    )
    return Training(
        model=torch.compile(model) if cfg.compile else model,
        core=core,
        optimizer=optimizer,
        scheduler=scheduler,
        stream=stream,
        step=step,
        history=history,
        heldout=heldout,
        masking=masking_used,
    )


def train_step(
    model: torch.nn.Module,
    batches,
    optimizer: torch.optim.Optimizer,
    scheduler,
    cfg: PretrainConfig,
    device: torch.device,
    meter: Meter,
    distributed: bool = False,
) -> float:
    """One optimizer step over `grad_accum` micro-batches; returns the learning rate used.

    Shared by the Ray worker and the bare loop of bench/pretrain.py, so the bench measures
    exactly what Ray Train adds.
    """
    for i in range(cfg.grad_accum):
        t0 = time.perf_counter()
        batch = next(batches)
        wait = time.perf_counter() - t0
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        sync = not distributed or i == cfg.grad_accum - 1
        # accumulation micro-steps skip DDP's gradient all-reduce; the last one syncs
        with contextlib.nullcontext() if sync else model.no_sync():
            with optim.autocast(device):
                out = model(**batch)
                # NSP's loss is computed either way (for its metrics); "mlm"/"ltr" leave it out
                loss = out.loss if cfg.with_nsp else out.mlm_loss
            (loss / cfg.grad_accum).backward()
        labels = batch["masked_lm_labels"]
        predicted = labels != -100
        meter.add(
            loss=loss,
            mlm_loss=out.mlm_loss,
            nsp_loss=out.nsp_loss,
            micro=1,
            mlm_correct=((out.mlm_logits.argmax(-1) == labels) & predicted).sum(),
            mlm_count=predicted.sum(),
            nsp_correct=(out.nsp_logits.argmax(-1) == batch["next_sentence_label"]).sum(),
            nsp_count=labels.shape[0],
            tokens=batch["attention_mask"].sum(),
            sequences=labels.shape[0],
            padded_tokens=batch["input_ids"].numel(),
            data_wait=wait,
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    meter.add(grad_norm=grad_norm, steps=1)
    return lr


# ---------------------------------------------------------------- the Ray Train worker


@dataclass
class Worker:
    """One Ray Train worker's place in the run, beside its training state: the settings, its
    rank among `world` on `device`, and its lines to the driver (rank 0's metric sink; the
    mailbox the driver's stop request arrives in), the held-out instances and where rank 0
    exports models."""

    cfg: PretrainConfig
    rank: int
    world: int
    device: torch.device
    sink: MetricSink | None = None  # rank 0's
    heldout: HeldOutEval | None = None
    mailbox: Any = None  # the Ray handle of a `channel.Mailbox` actor
    exports: str | None = None


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: restore, train to `steps` (or `stop_after`), report, checkpoint."""
    import ray.train
    import ray.train.torch

    cfg = PretrainConfig(**loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    checkpoint, state = ray.train.get_checkpoint(), None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_state(d)
    training = setup(cfg, rank, world, device, state=state, prepare=ray.train.torch.prepare_model)
    if state is not None and rank == 0:
        print(f"[pretrain] resumed from step {training.step} ({checkpoint.path})", flush=True)
    sink = MetricSink(loop_config) if rank == 0 else None
    if sink is not None:  # what the shards were made with: recipe, length, held-out share...
        config = read_instances_config(cfg.instances)
        sink.log_params({f"instances.{k}": v for k, v in config.items()})
        # what dynamic masking used, and from where: "0.15 (instances)", "100/0/0 (option)"
        sink.log_params(
            {
                f"dynamic_masking.{k}": f"{v} ({source})"
                for k, (v, source) in training.masking.items()
            }
        )
    heldout = HeldOutEval.load(cfg, rank, world, pad_id=training.stream.pad_id)
    if heldout is None and rank == 0:
        print(f"[pretrain] no held-out instances in {cfg.heldout}: no held-out evaluation")
    mailbox, exports = loop_config.get("mailbox"), loop_config.get("exports")
    _train(Worker(cfg, rank, world, device, sink, heldout, mailbox, exports), training)
    if sink is not None:
        sink.close()


def _train(w: Worker, t: Training) -> None:
    """Steps until --steps (or --stop-after): metrics every --log-every steps and with every
    checkpoint, held-out evaluation at the start and every --eval-every steps and at the end, a
    checkpoint every --checkpoint-every steps and at the end, and at the step the driver asks
    to stop (the mailbox: SIGTERM or SIGINT on the driver); a model exported by rank 0 at the
    steps --export-every / --export-steps name."""
    cfg, device = w.cfg, w.device
    batches = prefetch(t.stream)
    end = min(cfg.steps, cfg.stop_after or cfg.steps)
    peak = peak_flops(cfg, device)
    meter = Meter()
    t.model.train()
    if w.heldout is not None and t.step == 0:  # the untrained model: where the curves start
        _evaluate(w, t)
    while t.step < end:
        lr = train_step(t.model, batches, t.optimizer, t.scheduler, cfg, device, meter, w.world > 1)
        t.step += 1
        if w.exports and cfg.exports_at(t.step):  # every rank looks: their weights are the same
            if (name := nonfinite(t.core.state_dict())) is not None:
                return _diverged(w, f"weight {name} is not finite after step {t.step}", lr)
            if w.rank == 0:
                export_model(w.exports, cfg, t.core, t.step)
        _maybe_inject_failure(cfg, t.step)
        if w.heldout is not None and (t.step % cfg.eval_interval == 0 or t.step == end):
            if (bad := _evaluate(w, t)) is not None:
                return _diverged(w, f"{bad} by step {t.step}", lr)

        stop = stop_requested(w.mailbox, device, w.world)
        save = t.step % cfg.checkpoint_every == 0 or t.step == end or stop
        if t.step % cfg.log_every and not save:
            continue
        metrics = meter.values(device, w.world)  # summed over the ranks: the same on each
        if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm")):
            what = f"loss {metrics['loss']:.4g}, gradient norm {metrics['grad_norm']:.4g}"
            return _diverged(w, f"{what} by step {t.step}", lr)
        seq_len = metrics.pop("_mean_seq_len")
        metrics.update(step=t.step, learning_rate=lr)
        if peak:
            flops = metrics["tokens_per_s"] * flops_per_token(t.core, seq_len)
            metrics["mfu"] = flops / (peak * w.world)
        meter = Meter()
        if w.sink is not None:  # rank 0; a stop between log steps stays off the CSV's grid
            if not (stop and t.step % cfg.log_every):
                t.history.append({k: metrics.get(k) for k in CSV_COLUMNS})
            w.sink.put(metrics)
        if save:
            _report_checkpoint(w, t, metrics, final=t.step == cfg.steps)
        if stop:
            if w.rank == 0:
                print(f"[pretrain] stopped at step {t.step} as asked: checkpoint saved", flush=True)
            return


def _diverged(w: Worker, what: str, lr: float) -> None:
    """Every rank stops at the step (they see the same summed metrics, the same weights) and
    rank 0 tells the driver, which raises `errors.Diverged` and writes no model. Stopping, not
    raising: Ray Train would restart the workers from the last checkpoint, to diverge again.
    That checkpoint, saved while every number was finite, stays for a run with other settings."""
    message = (
        f"pre-training diverged: {what} at learning rate {lr:g} (--learning-rate "
        f"{w.cfg.learning_rate:g}); lower --learning-rate or raise --warmup-steps"
    )
    if w.sink is not None:
        w.sink.tell_driver({DIVERGED: message})


def _evaluate(w: Worker, t: Training) -> str | None:
    """Every rank evaluates its share; rank 0 keeps the row (checkpointed) and logs it. A
    non-finite value is neither kept nor logged: returned, as 'NAME VALUE', for `_diverged`."""
    assert w.heldout is not None
    row = {"step": t.step, **w.heldout.evaluate(t.core, w.device)}
    bad = [f"held-out {k} {v:.4g}" for k, v in row.items() if not math.isfinite(v)]
    if bad:
        return bad[0]
    if w.sink is not None:
        t.heldout.append(row)
        w.sink.put(row)


def _maybe_inject_failure(cfg: PretrainConfig, step: int) -> None:
    """Test hook: die once at `inject_failure_at` (a marker file makes it once per run dir)."""
    if cfg.inject_failure_at != step:
        return
    marker = Path(cfg.output) / ".injected_failure"
    if not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(step))
        raise RuntimeError(f"injected failure at step {step}")


def _report_checkpoint(w: Worker, t: Training, metrics: dict[str, float], *, final: bool) -> None:
    """Every rank hands in its RNG state; rank 0 writes the checkpoint and reports it."""
    import ray.train

    rngs = gather_objects(rng_state())
    if w.rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="bert-ckpt-") as tmp:
        save_checkpoint(Path(tmp), w.cfg, t, rngs, final=final)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=f"checkpoint_{t.step:08d}",
        )
