"""`bert pretrain` on real Ray (local, 2 CPUs), real MLflow, real instances from the shared corpus.

Ray start-up and each `TorchTrainer.fit` cost tens of seconds on 2 cores, so one Ray instance is
shared by the module and one 2-worker run serves both the learning and the fault test.
"""

from __future__ import annotations

import csv
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from bert_core import pretrain as pt
from bert_core.errors import BertError
from bert_core.pretrain_config import PretrainConfig, build_parser, parse_args
from bert_core.pretrain_data import InstanceStream, list_row_groups, masking_config_from_vocab
from bert_core.pretrain_state import seed_all
from bert_core.pretrain_worker import build_model, setup
from bert_core.tokenizer import read_vocab
from tests.pipeline_helpers import pretraining_instances


@pytest.fixture(scope="module")
def instances(tmp_path_factory, shared_data) -> Path:
    """The real pipeline (`bert clean`, `bert vocab`, `bert instances`) on a 40k-character slice
    of a shared-corpus book: about 230 sequences of <= 48 tokens over 4 shards, with a
    1000-piece vocabulary, small enough that a tiny BERT learns it within 200 steps on 2 CPUs."""
    return pretraining_instances(
        tmp_path_factory.mktemp("pt"), shared_data, chars=40_000, num_shards=4,
        vocab_size=1000, max_seq_length=48,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    torch.set_num_threads(1)
    pt.init_local_ray(2)
    yield
    ray.shutdown()


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch) -> str:
    """MLflow in tmp_path; the cwd too, since a sqlite store puts artifacts under ./mlruns."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BERT_PARENT_RUN_ID", raising=False)
    return uri


def small_config(instances: Path, output: Path, **kw) -> PretrainConfig:
    base = dict(
        instances=str(instances),
        output=str(output),
        preset="tiny",
        batch_size=32,
        learning_rate=5e-3,
        warmup_steps=20,
        log_every=10,
        seed=7,
    )
    return PretrainConfig(**{**base, **kw})


# ---------------------------------------------------------------- no Ray


def test_stream_is_resumable_and_ranks_are_disjoint(instances):
    groups = list_row_groups(instances)
    assert len(groups) >= 4
    full = InstanceStream(groups, batch_size=8, seed=3)
    it = iter(full)
    batches = [next(it) for _ in range(6)]
    resumed = next(iter(InstanceStream(groups, batch_size=8, seed=3, start_sample=8 * 4)))
    for key, value in batches[4].items():
        assert torch.equal(value, resumed[key]), key

    def first_ids(rank: int) -> set[tuple[int, ...]]:
        b = next(iter(InstanceStream(groups, batch_size=16, rank=rank, world_size=2, seed=3)))
        return {
            tuple(row[m.bool()].tolist())
            for row, m in zip(b["input_ids"], b["attention_mask"], strict=True)
        }

    assert not first_ids(0) & first_ids(1)


def test_batches_are_padded_and_dynamic_masking_remasks(instances):
    vocab = read_vocab(instances / "vocab.txt")
    masking = masking_config_from_vocab(vocab)
    static = next(iter(InstanceStream(list_row_groups(instances), batch_size=16, seed=1)))
    dynamic = next(
        iter(InstanceStream(list_row_groups(instances), batch_size=16, seed=1, masking=masking))
    )
    lengths = static["attention_mask"].sum(1)
    assert static["input_ids"].shape[1] == lengths.max()
    assert (static["input_ids"][static["attention_mask"] == 0] == vocab["[PAD]"]).all()
    assert not torch.equal(static["masked_lm_positions"], dynamic["masked_lm_positions"])
    # the original tokens are restored before re-masking: labels agree with the static tokens
    # wherever the static batch left the token visible
    pos, lab = dynamic["masked_lm_positions"], dynamic["masked_lm_labels"]
    visible = static["input_ids"].gather(1, pos)
    static_masked = torch.zeros_like(static["input_ids"], dtype=torch.bool)
    sp = static["masked_lm_positions"]
    static_masked.scatter_(1, sp, static["masked_lm_labels"] != -100)
    check = (lab != -100) & ~static_masked.gather(1, pos)
    assert check.sum() > 20 and torch.equal(visible[check], lab[check])
    specials = {vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]")}
    assert not set(lab[lab != -100].tolist()) & specials


def test_optimizer_excludes_layernorm_and_bias_from_weight_decay(instances, tmp_path):
    """The worker's set-up (also the bench's): the paper's AdamW and warm-up/decay schedule."""
    cfg = PretrainConfig(instances=str(instances), output=str(tmp_path), steps=1000)
    t = setup(cfg)
    decay, no_decay = t.optimizer.param_groups
    names = {id(p): n for n, p in t.core.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(
        "LayerNorm" in names[id(p)] or names[id(p)].endswith("bias") for p in no_decay["params"]
    )
    assert any("LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert decay["initial_lr"] == 1e-4 and decay["betas"] == (0.9, 0.999)
    assert decay["eps"] == 1e-6
    # linear warm-up over 1% of the steps (step / warmup, transformers' rule), then linear decay
    assert t.scheduler.get_last_lr() == [0.0, 0.0]  # the first step runs at lr 0
    lrs = [t.scheduler.lr_lambdas[0](step) * 1e-4 for step in range(1000)]
    assert lrs[0] == 0 and lrs[5] == pytest.approx(0.5e-4) and lrs[10] == pytest.approx(1e-4)
    assert lrs[505] == pytest.approx(0.5e-4) and lrs[999] == pytest.approx(1e-4 / 990)
    assert t.step == 0 and t.stream.masking is None and t.stream.batch_size == 256


# the options of `bert pretrain` before the CLI was generated from PretrainConfig (DVC and KFP
# call these): each keeps its name and its default
OPTIONS = {
    "--instances": None, "--output": None, "--preset": "tiny", "--steps": 1000,
    "--batch-size": 256, "--num-workers": 1, "--use-gpu": False, "--cpus-per-worker": 1,
    "--grad-accum": 1, "--learning-rate": 1e-4, "--warmup-steps": None, "--weight-decay": 0.01,
    "--max-grad-norm": 1.0, "--dropout": None, "--dynamic-masking": False,
    "--masked-lm-prob": 0.15, "--max-predictions-per-seq": 20, "--init-model": None,
    "--compile": False, "--seed": 12345, "--log-every": 50, "--checkpoint-every": 500,
    "--keep-checkpoints": 3, "--max-failures": 3, "--storage-path": None,
    "--run-name": "pretrain", "--stop-after": None, "--peak-tflops": None,
    "--inject-failure-at": None,
}  # fmt: skip


def test_cli_is_generated_from_the_config():
    parser = build_parser()
    actions = {a.option_strings[0]: a for a in parser._actions if a.dest != "help"}
    defaults = PretrainConfig(instances="i", output="o")
    for option, default in OPTIONS.items():
        assert option in actions, option
        assert actions[option].default == default, option
    fields = vars(defaults)
    assert {o.removeprefix("--").replace("-", "_") for o in actions} == set(fields)
    assert actions["--instances"].required and actions["--output"].required
    help_text = parser.format_help()
    assert "--inject-failure-at" not in help_text and "1% of --steps" in help_text
    assert "(default: 80/10/10)" in help_text and "--adam-betas B1 B2" in help_text

    cfg = parse_args(["--instances", "i", "--output", "o"])
    assert cfg == defaults
    cfg = parse_args(
        ["--instances", "i", "--output", "o", "--use-gpu", "--adam-betas", "0.9", "0.98",
         "--steps", "7", "--learning-rate", "5e-3", "--warmup-steps", "3", "--dropout", "0",
         "--masking-recipe", "100/0/0", "--inject-failure-at", "4"]
    )  # fmt: skip
    assert cfg.use_gpu and cfg.adam_betas == (0.9, 0.98) and cfg.steps == 7
    assert cfg.learning_rate == 5e-3 and cfg.warmup == 3 and cfg.dropout == 0.0
    assert cfg.masking_recipe == "100/0/0" and cfg.inject_failure_at == 4
    assert PretrainConfig(instances="i", output="o", steps=250).warmup == 2  # 1% of the steps


def test_masking_recipe_reaches_dynamic_masking(instances, tmp_path):
    """`--dynamic-masking --masking-recipe 100/0/0`: the worker's stream shows every prediction
    as [MASK]; 0/0/100 leaves every token as it was."""
    vocab = read_vocab(instances / "vocab.txt")
    for recipe in ("100/0/0", "0/0/100"):
        args = ["--instances", str(instances), "--output", str(tmp_path), "--batch-size", "64",
                "--dynamic-masking", "--masking-recipe", recipe]  # fmt: skip
        batch = next(iter(setup(parse_args(args)).stream))
        shown = batch["input_ids"].gather(1, batch["masked_lm_positions"])
        labels = batch["masked_lm_labels"]
        predicted = labels != -100
        assert predicted.sum() > 100
        if recipe == "100/0/0":
            assert (shown[predicted] == vocab["[MASK]"]).all()
        else:
            assert torch.equal(shown[predicted], labels[predicted])
    with pytest.raises(ValueError, match="--masking-recipe must be"):
        pt.main(["--instances", str(instances), "--output", str(tmp_path), "--masking-recipe", "1"])


def test_bad_instances_fail_clearly(tmp_path, instances):
    bad = tmp_path / "bad"
    shutil.copytree(instances, bad)
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), bad / "shard-00000.parquet")
    with pytest.raises(ValueError, match=r"shard-00000.parquet: missing columns"):
        pt.main(["--instances", str(bad), "--output", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    with pytest.raises(BertError, match="not divisible"):
        pt.main(
            [
                "--instances",
                str(instances),
                "--output",
                str(tmp_path / "o"),
                "--batch-size",
                "3",
                "--num-workers",
                "2",
            ]
        )


# ---------------------------------------------------------------- real Ray Train


def most_frequent_label_share(instances: Path) -> float:
    counts: Counter = Counter()
    for shard in sorted(instances.glob("shard-*.parquet")):
        counts.update(
            pq.read_table(shard, columns=["masked_lm_ids"])
            .column(0)
            .combine_chunks()
            .values.to_numpy()
            .tolist()
        )
    return counts.most_common(1)[0][1] / sum(counts.values())


@pytest.mark.slow
def test_two_workers_learn_and_survive_a_worker_failure(
    ray_cluster, instances, tmp_path, mlflow_uri
):
    """200 steps on 2 workers; rank 0 raises at step 130 once. The run must restart from the
    step-100 checkpoint, finish all steps and have learned."""
    out = tmp_path / "run"
    rc = pt.main(
        [
            "--instances", str(instances), "--output", str(out), "--steps", "200",
            "--batch-size", "32", "--num-workers", "2", "--learning-rate", "5e-3",
            "--warmup-steps", "20", "--log-every", "10", "--checkpoint-every", "100",
            "--seed", "7", "--inject-failure-at", "130",
        ]
    )  # fmt: skip
    assert rc == 0
    assert (out / ".injected_failure").read_text() == "130"
    rows = list(csv.DictReader((out / "pretrain_metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(10, 201, 10))
    first, last = rows[0], rows[-1]
    # learned: MLM loss far below the start, accuracy above always guessing the commonest token
    assert float(last["mlm_loss"]) < 0.75 * float(first["mlm_loss"])
    baseline = most_frequent_label_share(instances)
    assert float(last["mlm_accuracy"]) > baseline + 0.05, (last["mlm_accuracy"], baseline)
    assert 0 < float(last["learning_rate"]) < 5e-3 and float(last["grad_norm"]) > 0

    # restored from the last checkpoint (step 100), not from scratch: MLflow got steps 110, 120
    # twice (before the failure and again after the restore) and every other step once
    import mlflow

    client = mlflow.tracking.MlflowClient(mlflow_uri)
    (run,) = client.search_runs(client.get_experiment_by_name("bert").experiment_id)
    assert run.data.params["num_workers"] == "2" and run.data.params["learning_rate"] == "0.005"
    steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, "mlm_loss"))
    assert {s for s, n in steps.items() if n > 1} == {110, 120}
    assert set(steps) == set(range(10, 201, 10))

    # the final model is in the Hugging Face layout with its vocabulary, and loads
    from bert_core.model import BertForPreTraining

    model = BertForPreTraining.from_pretrained(out / "model")
    assert (out / "model" / "vocab.txt").read_bytes() == (instances / "vocab.txt").read_bytes()
    assert model.config.vocab_size == len(read_vocab(instances / "vocab.txt"))


@pytest.mark.slow
def test_stop_and_resume_equals_one_go(ray_cluster, instances, tmp_path, mlflow_uri):
    """K steps in one go == K/2, stop, restart the same command (resumes by itself), K/2 more."""
    kw = dict(steps=8, num_workers=2, checkpoint_every=4, log_every=2)
    pt.pretrain(small_config(instances, tmp_path / "one", **kw))
    half = pt.pretrain(small_config(instances, tmp_path / "two", stop_after=4, **kw))
    assert half["step"] == 4 and not half["finished"] and not (tmp_path / "two" / "model").exists()
    done = pt.pretrain(small_config(instances, tmp_path / "two", **kw))
    assert done["step"] == 8 and done["finished"]

    from safetensors.torch import load_file

    a = load_file(tmp_path / "one" / "model" / "model.safetensors")
    b = load_file(tmp_path / "two" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    seed_all(7)
    init = build_model(
        small_config(instances, tmp_path), len(read_vocab(instances / "vocab.txt"))
    )
    moved = [n for n, p in init.state_dict().items() if not torch.allclose(p, a[n])]
    assert len(moved) > len(a) // 2  # the weights trained, so equality is not trivial
    rows_one = list(csv.DictReader((tmp_path / "one" / "pretrain_metrics.csv").open()))
    rows_two = list(csv.DictReader((tmp_path / "two" / "pretrain_metrics.csv").open()))
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == ["2", "4", "6", "8"]
    assert np.allclose([float(r["loss"]) for r in rows_one], [float(r["loss"]) for r in rows_two])
