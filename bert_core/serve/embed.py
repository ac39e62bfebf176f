"""`bert embed`: BERT's contextual vectors for a file of texts, to Parquet (feature extraction).

The paper's feature-based approach (section 5.3): instead of fine-tuning, the activations of
one or more layers are fed, as fixed features, to another model. Its Table 7 (CoNLL-2003 NER)
compares the choices: the embeddings alone (91.0 dev F1), the second-to-last hidden layer
(95.6), the last (94.9), a weighted sum of the last four (95.9), the concatenation of the last
four (96.1, within 0.3 of fine-tuning). Those are the options here: `--layers` picks hidden
states (0 = the embeddings' output, 1..L the layers, negative counts from the end, `last4` =
-4,-3,-2,-1), `--combine` concatenates, sums or averages them, and `--pooling` says what a row
gets: `mean` (the default) one `vector`, the mean over the row's tokens ([CLS] and [SEP]
included, padding excluded), `cls` the [CLS] token's vector, `none` one vector per token
(`tokens`, `vectors`: the paper's feature-based input to a tagger).

Why mean by default: a file of texts in, one vector per text out is what most callers of an
embedding command want (search, clustering, a classifier on top), and a per-token default made
every row a [tokens x dim] matrix. Of the two sentence vectors, the mean is the better one
without fine-tuning: Sentence-BERT (Reimers and Gurevych, 2019, table 1 and section 6) found
averaged BERT token vectors ahead of the [CLS] vector, which pre-training trains only for next
sentence prediction; sentence-embedding models built on BERT (Sentence-BERT, all-MiniLM-L6-v2)
are trained to be mean-pooled. `--pooling none` keeps the per-token output of section 5.3.

Inputs are `bert predict`'s (`bert_core.serve.records`: `text` and optional `text_pair`, streamed in
chunks, length-sorted batches through `finetune.predict_batches`, a GPU when present), tokenised
and cut at `--max-seq-length` as GLUE fine-tuning does; any BERT folder works, a fine-tuned
one's head is ignored. Output: Parquet (float32), one row per input row: `row`, `id` when the
input has one, `num_tokens` ([CLS] and [SEP] included), then the vector(s). Atomic.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from typing import Any

import numpy as np
import torch

from bert_core.errors import BadValue
from bert_core.finetune import engine as finetune
from bert_core.finetune.tasks import glue as finetune_glue
from bert_core.finetune.tasks.glue_data import Example
from bert_core.serve import records
from bert_core.serve.predictors import BadInput, Predictor, Settings
from bert_core.storage import check_apart, local_copy
from bert_core.tracking import environ, start_run

LAYER_SETS = {"last4": (-4, -3, -2, -1), "last": (-1,), "second-to-last": (-2,), "embeddings": (0,)}
COMBINE = ("concat", "sum", "mean")
POOLING = ("none", "mean", "cls")


def parse_layers(spec: str) -> tuple[int, ...]:
    """`last4`, `-2`, `0,12` ... -> hidden-state indices."""
    if spec in LAYER_SETS:
        return LAYER_SETS[spec]
    try:
        layers = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise BadValue(
            f"--layers {spec!r}: integers like -1 or -4,-3,-2,-1, or one of {', '.join(LAYER_SETS)}"
        ) from None
    if len(set(layers)) < len(layers):
        raise BadValue(f"--layers {spec!r}: a layer given twice (its features would be too)")
    return layers


class _AllLayers(torch.nn.Module):
    """The encoder as `predict_batches` calls it, answering every hidden state."""

    def __init__(self, bert: torch.nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, token_type_ids, attention_mask):
        return self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states=True)


class Embedder(Predictor):
    """Vectors instead of answers: the encoder of any BERT folder, checked input columns and
    streaming shared with the predictors."""

    kind = "embedding"
    head = "BertModel"
    optional = ("text_pair",)

    def __init__(
        self, model_dir, settings: Settings, layers=(-1,), combine="concat", pooling="mean"
    ):
        if combine not in COMBINE or pooling not in POOLING:
            raise BadValue(f"--combine is one of {COMBINE}, --pooling one of {POOLING}")
        super().__init__(model_dir, settings)
        n = self.config.num_hidden_layers
        bad = [x for x in layers if not -(n + 1) <= x <= n]
        if bad or not layers:
            named = ",".join(map(str, bad)) or "none"
            raise BadValue(
                f"--layers {named}: this model has hidden states 0..{n} (or -{n + 1}..-1)"
            )
        if pooling == "cls" and self.config.is_decoder:  # its [CLS] attends to itself alone
            raise BadValue(
                f"--pooling cls: {model_dir} is a left-to-right model (is_decoder), "
                "whose [CLS] vector is the same for every text; use mean"
            )
        self.layers, self.combine, self.pooling = [x % (n + 1) for x in layers], combine, pooling
        hidden = self.config.hidden_size
        self.dim = hidden * len(layers) if combine == "concat" else hidden

    def load_model(self) -> torch.nn.Module:
        from bert_core.model.modeling import BertModel

        return BertModel.from_pretrained(self.model_dir)

    def output_schema(self, with_id: bool):
        import pyarrow as pa

        fields = [("row", pa.int64())] + ([("id", pa.string())] if with_id else [])
        fields.append(("num_tokens", pa.int64()))
        if self.pooling == "none":
            vectors = pa.list_(pa.list_(pa.float32(), self.dim))
            return pa.schema([*fields, ("tokens", pa.list_(pa.string())), ("vectors", vectors)])
        return pa.schema([*fields, ("vector", pa.list_(pa.float32(), self.dim))])

    def combined(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        chosen = [states[x].float() for x in self.layers]
        if self.combine == "concat":
            return torch.cat(chosen, dim=-1)
        total = torch.stack(chosen).sum(0)
        return total / len(chosen) if self.combine == "mean" else total

    def answer(self, columns: dict[str, list]) -> list[dict]:
        texts = columns["text"]
        pairs = columns.get("text_pair") or [None] * len(texts)
        examples = [Example(str(i), texts[i], pairs[i], None) for i in range(len(texts))]
        f = finetune_glue.featurize(None, examples, self.tokenizer, self.max_seq_length)
        out: list[dict] = [{}] * len(texts)
        batches = finetune.predict_batches(
            _AllLayers(self.model),
            [len(x) for x in f.input_ids],
            lambda i: finetune_glue.collate(f, i),
            self.device,
            self.settings.batch_size,
        )
        for index, outputs in batches:
            h = self.combined(outputs.hidden_states).cpu().numpy()
            for row, i in enumerate(index):
                n = len(f.input_ids[i])
                out[i] = {"num_tokens": n}
                if self.pooling == "none":
                    out[i]["tokens"] = [self.tokenizer.id_to_token(t) for t in f.input_ids[i]]
                    out[i]["vectors"] = h[row, :n]
                else:
                    out[i]["vector"] = h[row, 0] if self.pooling == "cls" else h[row, :n].mean(0)
        return out


def embed_file(embedder: Embedder, input, output, chunk_size=256, rename=None, id_column="id"):
    """Vectors for every row of `input` into the Parquet file `output`; returns the rows."""
    import pyarrow as pa

    records.output_format(output, (".parquet",))
    chunks = records.read_chunks(input, chunk_size, rename)
    first = next(chunks)
    with_id = id_column in first.frame.columns
    schema = embedder.output_schema(with_id)
    rows = 0
    with records.writer(output, schema) as write:
        for chunk in itertools.chain([first], chunks):
            try:
                vectors = embedder.predict(chunk.frame)
            except BadInput as e:
                raise chunk.error(e.reason, e.row) from None
            columns: dict[str, Any] = {"row": range(chunk.start, chunk.start + len(vectors))}
            if with_id:
                columns["id"] = [str(v) for v in chunk.frame[id_column]]
            for name in schema.names[len(columns) :]:
                columns[name] = [v[name] for v in vectors]
            write(pa.table({k: _array(v, schema.field(k).type) for k, v in columns.items()}))
            rows += len(vectors)
    return rows


def _array(values, type_):
    """An Arrow column from Python values, or from numpy vectors without a Python float each."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(type_) and len(values):
        flat = pa.array(np.stack(values).ravel(), type=pa.float32())
        return pa.FixedSizeListArray.from_arrays(flat, type_.list_size)
    if pa.types.is_list(type_) and pa.types.is_fixed_size_list(type_.value_type):
        lengths = np.cumsum([0, *map(len, values)]).astype(np.int32)
        inner = _array(list(itertools.chain.from_iterable(values)), type_.value_type)
        return pa.ListArray.from_arrays(pa.array(lengths), inner)
    return pa.array(list(values), type=type_)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert embed", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a BERT folder, runs:/..., models:/...")
    p.add_argument("--input", required=True, help=".txt, .tsv, .jsonl or .parquet; or s3://...")
    p.add_argument("--output", required=True, help="a .parquet file, local or s3://")
    layers = "last, last4, second-to-last, embeddings or indices: --layers=-2, --layers=0,6"
    p.add_argument("--layers", default="last", help=f"{layers} (default: last)")
    p.add_argument("--combine", choices=COMBINE, default="concat", help="of the chosen layers")
    p.add_argument(
        "--pooling",
        choices=POOLING,
        default="mean",
        help="mean (default): one vector per row, the mean of its tokens'; cls: the "
        "[CLS] token's; none: a vector per token",
    )
    p.add_argument("--column", action="append", default=[], metavar="MODEL=FILE")
    p.add_argument("--id-column", default="id", help="copied to the output when present")
    p.add_argument("--max-seq-length", type=int, default=128, help="longer text is cut")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=256, help="rows read (and held) at a time")
    p.add_argument("--device", default="auto")
    return p


def _layers_value(argv: list[str]) -> list[str]:
    """`--layers -4,-3,-2,-1` as `--layers=-4,-3,-2,-1`: argparse takes a value that starts with
    a dash for an option (only a single negative number passes), so the form the help shows
    would fail with "expected one argument"."""
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "--layers" and re.match(r"-\d", out[i + 1]):
            out[i : i + 2] = [f"--layers={out[i + 1]}"]
            break
    return out


def main(argv: list[str] | None = None) -> int:
    from bert_core.serve.mlflow_model import local_model
    from bert_core.serve.predict import parse_columns, tracking_env

    args = build_parser().parse_args(_layers_value(sys.argv[1:] if argv is None else argv))
    rename, layers = parse_columns(args.column), parse_layers(args.layers)
    records.output_format(args.output, (".parquet",))  # before any model is loaded
    check_apart({"--output": args.output}, {"--input": args.input, "--model": args.model})
    settings = Settings(
        max_seq_length=args.max_seq_length, batch_size=args.batch_size, device=args.device
    )
    params = {k: str(v) for k, v in vars(args).items() if k != "column"}
    env, tags = tracking_env(args.model)  # the experiment: as `bert predict`'s
    with environ(env), start_run("embed", params, tags):
        import mlflow

        with local_model(args.model) as (folder, _):
            embedder = Embedder(folder, settings, layers, args.combine, args.pooling)
        with local_copy(args.input) as path:  # an s3:// input is downloaded first
            rows = embed_file(embedder, path, args.output, args.chunk_size, rename, args.id_column)
        mlflow.log_metrics({"rows": rows, "dim": embedder.dim})
    print(json.dumps({"rows": rows, "dim": embedder.dim, "output": str(args.output)}))
    return 0
