"""`bert instances`: statistics of the original algorithm on real corpus text, and bad input."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bert_core import cli
from bert_core.data.corpus import CleanConfig, clean_corpus
from bert_core.data.instance_sampling import truncate_pair_randomly
from bert_core.data.instance_shards import read_documents
from bert_core.data.instances import SCHEMA, InstanceConfig, create_instances
from bert_core.data.tokenizer import load_tokenizer, read_vocab
from bert_core.pretrain.shards import list_row_groups

BOOKS = [
    "a_study_in_scarlet.txt",
    "the_sign_of_the_four.txt",
    "pride_and_prejudice.txt",
    "frankenstein.txt",
    "the_valley_of_fear.txt",
]
MAX_LEN = 128


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory) -> Path:
    """About 2 MB of real books, cleaned into 4 shards."""
    src = tmp_path_factory.mktemp("books")
    for name in BOOKS:
        (src / name).symlink_to(shared_data / "corpus" / name)
    out = tmp_path_factory.mktemp("c") / "clean"
    clean_corpus(src, out, CleanConfig(num_shards=4))
    return out


@pytest.fixture(scope="module")
def vocab_file(minilm_dir) -> Path:
    return minilm_dir / "vocab.txt"


@pytest.fixture(scope="module")
def run(corpus, vocab_file, tmp_path_factory) -> Path:
    """Every document in training (no held-out split), as before the split existed."""
    out = tmp_path_factory.mktemp("i") / "instances"
    cfg = InstanceConfig(dupe_factor=2, heldout_fraction=0.0)
    create_instances(corpus, vocab_file, out, cfg, num_workers=2)
    return out


def load(out: Path) -> dict[str, list]:
    table = pq.read_table(sorted(out.glob("shard-*.parquet")))
    assert table.schema.equals(SCHEMA)
    return table.to_pydict()


def test_structure(run, vocab_file):
    vocab = read_vocab(vocab_file)
    cls_id, sep_id, mask_id = vocab["[CLS]"], vocab["[SEP]"], vocab["[MASK]"]
    data = load(run)
    stats = json.loads((run / "stats.json").read_text())
    assert (run / "vocab.txt").read_bytes() == vocab_file.read_bytes()
    n = len(data["input_ids"])
    assert n == stats["instances"] > 5_000
    for ids, types, pos, labels in zip(
        data["input_ids"],
        data["token_type_ids"],
        data["masked_lm_positions"],
        data["masked_lm_ids"],
        strict=True,
    ):
        assert len(ids) == len(types) <= MAX_LEN
        assert ids[0] == cls_id and ids[-1] == sep_id
        b_start = types.index(1)
        assert ids[b_start - 1] == sep_id and types[:b_start] == [0] * b_start
        assert types[b_start:] == [1] * (len(ids) - b_start) and len(ids) - b_start >= 2
        assert pos == sorted(set(pos)) and 1 <= len(pos) <= 20
        assert all(0 < p < len(ids) - 1 and p != b_start - 1 for p in pos)  # never [CLS]/[SEP]
        assert cls_id not in labels and sep_id not in labels and mask_id not in labels
    assert set(data["next_sentence_label"]) == {0, 1}


def test_statistics_on_real_text(run, vocab_file):
    """The issue's statistics, measured on the output itself."""
    mask_id = read_vocab(vocab_file)["[MASK]"]
    data = load(run)
    stats = json.loads((run / "stats.json").read_text())
    # NSP: the coin is fair where the original flips it (one-sentence chunks are random-next by
    # construction in the original, which puts the overall share above one half).
    assert abs(stats["random_next_share_unforced"] - 0.5) <= 0.02
    labels = np.array(data["next_sentence_label"])
    forced = stats["forced_random_next_share"] * len(labels)
    assert abs((labels.sum() - forced) / (len(labels) - forced) - 0.5) <= 0.02
    # MLM: 15 % of the non-special tokens (the cap of 20 never binds at length 128)
    masked = sum(len(p) for p in data["masked_lm_positions"])
    non_special = sum(len(ids) - 3 for ids in data["input_ids"])
    assert abs(masked / non_special - 0.15) <= 0.01
    assert masked / non_special == pytest.approx(stats["masked_share"])
    # 80 / 10 / 10
    as_mask = unchanged = 0
    for ids, pos, lab in zip(
        data["input_ids"], data["masked_lm_positions"], data["masked_lm_ids"], strict=True
    ):
        shown = [ids[p] for p in pos]
        as_mask += sum(s == mask_id for s in shown)
        unchanged += sum(s == t for s, t in zip(shown, lab, strict=True))
    assert abs(as_mask / masked - 0.8) <= 0.02
    assert abs(unchanged / masked - 0.1) <= 0.02
    assert abs((masked - as_mask - unchanged) / masked - 0.1) <= 0.02
    # short targets: drawn for ~10 % of documents (binomial, 4 sigma)
    targets = stats["documents"] * 2
    assert abs(stats["short_target_share"] - 0.1) <= 4 * (0.09 / targets) ** 0.5
    lengths = np.array([len(ids) for ids in data["input_ids"]])
    assert stats["mean_length"] == pytest.approx(lengths.mean())
    assert (lengths == MAX_LEN).mean() > 0.6  # most instances fill the sequence


def test_short_seq_prob_makes_short_sequences(corpus, vocab_file, tmp_path):
    shard = corpus / "shard-00000.txt"
    share = {}
    for p in (0.0, 0.5):
        out = tmp_path / f"p{p}"
        create_instances(shard, vocab_file, out, InstanceConfig(dupe_factor=2, short_seq_prob=p))
        lengths = np.array([len(x) for x in load(out)["input_ids"]])
        share[p] = (lengths < MAX_LEN // 2).mean()
    assert share[0.0] < 0.05 and share[0.5] > share[0.0] + 0.2


def test_byte_identical_whatever_the_workers(corpus, vocab_file, run, tmp_path):
    cfg = InstanceConfig(dupe_factor=2, heldout_fraction=0.0)
    create_instances(corpus, vocab_file, tmp_path / "one", cfg, num_workers=1)
    shards = sorted(p.name for p in run.glob("shard-*.parquet"))
    assert len(shards) == 4
    for name in shards:
        assert (tmp_path / "one" / name).read_bytes() == (run / name).read_bytes()
    other = InstanceConfig(dupe_factor=2, random_seed=7, heldout_fraction=0.0)
    create_instances(corpus, vocab_file, tmp_path / "seed7", other, num_workers=1)
    assert (tmp_path / "seed7" / shards[0]).read_bytes() != (run / shards[0]).read_bytes()


def test_whole_word_mask(corpus, vocab_file, tmp_path):
    vocab = {i: t for t, i in read_vocab(vocab_file).items()}
    cfg = InstanceConfig(dupe_factor=1, whole_word_mask=True)
    stats = create_instances(corpus / "shard-00001.txt", vocab_file, tmp_path / "w", cfg)
    assert abs(stats["masked_share"] - 0.15) <= 0.02
    data = load(tmp_path / "w")
    pieces = 0
    for ids, pos, lab in zip(
        data["input_ids"], data["masked_lm_positions"], data["masked_lm_ids"], strict=True
    ):
        original = list(ids)
        for p, t in zip(pos, lab, strict=True):
            original[p] = t
        masked = set(pos)
        for p in pos:  # a masked word is masked whole: its pieces, and the word it continues
            if vocab[original[p]].startswith("##") and vocab[original[p - 1]][0] != "[":
                pieces += 1
                assert p - 1 in masked, (p, [vocab[t] for t in original])
            if p + 1 < len(ids) - 1 and vocab[original[p + 1]].startswith("##"):
                assert p + 1 in masked
    assert pieces > 100


def test_truncate_pair_randomly_matches_the_original_loop():
    def original(a, b, max_num_tokens, rng):
        while len(a) + len(b) > max_num_tokens:
            trunc = a if len(a) > len(b) else b
            if rng.random() < 0.5:
                del trunc[0]
            else:
                trunc.pop()
        return a, b

    r = random.Random(0)
    front = 0
    for _ in range(3000):
        la, lb, m = r.randint(1, 200), r.randint(1, 200), r.randint(5, 125)
        a, b = list(range(la)), list(range(1000, 1000 + lb))
        want = original(list(a), list(b), m, random.Random(1))
        got = truncate_pair_randomly(a, b, m, random.Random(r.random()))
        assert (len(got[0]), len(got[1])) == (len(want[0]), len(want[1]))
        # contiguous slices of the inputs
        assert got[0] == a[got[0][0] : got[0][0] + len(got[0])] if got[0] else True
        assert got[1] == b[got[1][0] - 1000 : got[1][0] - 1000 + len(got[1])]
        front += got[0][0] if got[0] else 0
        front -= la - (got[0][-1] + 1) if got[0] else 0
    assert abs(front) < 0.05 * 3000 * 20  # front and back cuts balance


@pytest.fixture()
def tracked(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")


def cli_instances(inp: Path, vocab: Path, out: Path, *extra: str) -> int:
    args = ["instances", "--input", str(inp), "--vocab", str(vocab), "--output", str(out)]
    return cli.main([*args, "--dupe-factor", "1", *extra])


def test_bad_inputs_fail_cleanly(corpus, vocab_file, tmp_path, capsys, tracked):
    out = tmp_path / "out"
    # a corpus of one document
    one = tmp_path / "one.txt"
    one.write_text("A single document.\nWith two sentences.\n")
    assert cli_instances(one, vocab_file, out) == 2
    assert "at least 2 documents" in capsys.readouterr().err
    # an empty corpus
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "shard-00000.txt").write_text("\n\n")
    assert cli_instances(empty, vocab_file, out) == 2
    # a vocab.txt without [MASK]
    no_mask = tmp_path / "vocab.txt"
    no_mask.write_text(
        "".join(t for t in vocab_file.read_text().splitlines(True) if t != "[MASK]\n")
    )
    assert cli_instances(corpus, no_mask, out) == 2
    assert f"{no_mask}: vocabulary has no [MASK] token" in capsys.readouterr().err
    # --max-seq-length below 8
    assert cli_instances(corpus, vocab_file, out, "--max-seq-length", "7") == 2
    assert "--max-seq-length must be >= 8" in capsys.readouterr().err
    # a masking recipe that does not add up
    assert cli_instances(corpus, vocab_file, out, "--masking-recipe", "80/10/20") == 2
    assert "--masking-recipe must be MASK/RANDOM/KEEP" in capsys.readouterr().err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp left


def test_cli_end_to_end(corpus, vocab_file, tmp_path, capsys, tracked):
    out = tmp_path / "inst"
    shard = corpus / "shard-00002.txt"
    assert (
        cli_instances(shard, vocab_file, out, "--max-seq-length", "64", "--num-workers", "1") == 0
    )
    assert "instances" in capsys.readouterr().out
    lengths = [len(x) for x in load(out)["input_ids"]]
    assert max(lengths) == 64
    assert sorted(p.name for p in out.iterdir()) == [
        "heldout",
        "shard-00000.parquet",
        "special_tokens_map.json",
        "stats.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]
    # the vocabulary folder says uncased: so do the instances (and later the model)
    assert json.loads((out / "tokenizer_config.json").read_text())["do_lower_case"] is True


@pytest.mark.parametrize("recipe", ["100/0/0", "0/0/100"])
def test_masking_recipe_reaches_the_shards_and_stats(corpus, vocab_file, tmp_path, recipe, tracked):
    """`--masking-recipe` (the paper's Table 8 ablation): 100/0/0 shows every prediction as
    [MASK], 0/0/100 leaves every token as it was; stats.json records the recipe."""
    out = tmp_path / "inst"
    shard = corpus / "shard-00003.txt"
    args = ("--max-seq-length", "64", "--num-workers", "1", "--masking-recipe", recipe)
    assert cli_instances(shard, vocab_file, out, *args) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["config"]["masking_recipe"] == recipe
    mask_id = read_vocab(vocab_file)["[MASK]"]
    data = load(out)
    shown, labels = [], []
    for ids, pos, lab in zip(
        data["input_ids"], data["masked_lm_positions"], data["masked_lm_ids"], strict=True
    ):
        shown += [ids[p] for p in pos]
        labels += lab
    assert len(shown) > 1000
    if recipe == "100/0/0":
        assert set(shown) == {mask_id} and stats["mask_token_share"] == 1.0
    else:
        assert shown == labels and stats["unchanged_share"] == 1.0


# ---------------------------------------------------------------- held-out split

# Digest of the shards' content (every column's offsets and values) that `run` wrote before the
# held-out split existed (commit 620d64b): with --heldout-fraction 0 nothing may change.
CONTENT_BEFORE_HELDOUT = "181b4d7b4e43bf8887cc9bb565c08fbe02b7effc80558f8f681dcfd393645020"


def content_digest(out: Path) -> str:
    digest = hashlib.sha256()
    for shard in sorted(out.glob("shard-*.parquet")):
        table = pq.read_table(shard)
        for name in table.column_names:
            column = table.column(name).combine_chunks()
            if hasattr(column, "offsets"):
                digest.update(column.offsets.to_numpy().tobytes())
                digest.update(column.values.to_numpy().tobytes())
            else:
                digest.update(column.to_numpy().tobytes())
    return digest.hexdigest()


def test_no_heldout_split_leaves_the_shards_as_they_were(run):
    assert content_digest(run) == CONTENT_BEFORE_HELDOUT
    assert not (run / "heldout").exists()
    stats = json.loads((run / "stats.json").read_text())
    assert stats["heldout"] == {"documents": 0, "instances": 0}


@pytest.fixture(scope="module")
def split(corpus, vocab_file, tmp_path_factory) -> Path:
    """The default split (2 % of the documents, at least 2) of the same books."""
    out = tmp_path_factory.mktemp("h") / "instances"
    create_instances(corpus, vocab_file, out, InstanceConfig(dupe_factor=1), num_workers=2)
    return out


def unmasked_text(data: dict[str, list]) -> str:
    """All instances' original token ids as one searchable string, ` 12 7 9 |` per instance."""
    rows = []
    for ids, pos, lab in zip(
        data["input_ids"], data["masked_lm_positions"], data["masked_lm_ids"], strict=True
    ):
        ids = list(ids)
        for p, t in zip(pos, lab, strict=True):
            ids[p] = t
        rows.append(" " + " ".join(map(str, ids)) + " |")
    return "".join(rows)


def test_heldout_documents_never_reach_training(split, corpus, vocab_file):
    stats = json.loads((split / "stats.json").read_text())
    lines = (split / "heldout" / "documents.tsv").read_text().splitlines()
    assert lines[0] == "shard\tdocument"
    named = [(name, int(n)) for name, n in (line.split("\t") for line in lines[1:])]
    documents = {f.name: read_documents(f) for f in sorted(corpus.glob("*.txt"))}
    total = sum(map(len, documents.values()))
    assert len(named) == len(set(named)) == max(2, round(0.02 * total)) == 5
    assert stats["heldout"]["documents"] == len(named) and stats["heldout"]["instances"] > 20
    assert stats["documents"] == total - len(named)
    # held-out shards are beside the training shards, out of the trainer's sight
    assert {Path(g.path).parent for g in list_row_groups(split)} == {split}
    assert len(list_row_groups(split / "heldout")) >= 1

    # By content: no long sentence that occurs once in the corpus shows up on the other side
    # (held-out vs training); and such sentences do show up on their own side (all held-out
    # ones are checked, and the first of each training document: the training text is large).
    tokenizer = load_tokenizer(vocab_file)
    sentences: dict[tuple[str, int], list[str]] = {}
    for name, docs in documents.items():
        for k, doc in enumerate(docs):
            ids = [e.ids[1:-1] for e in tokenizer.encode_batch(doc)]
            sentences[name, k] = [" " + " ".join(map(str, s)) + " " for s in ids if len(s) >= 20]
    counts = Counter(s for ss in sentences.values() for s in ss)
    heldout_shard = split / "heldout" / "shard-00000.parquet"
    heldout_text = unmasked_text(pq.read_table(heldout_shard).to_pydict())
    training_text = unmasked_text(load(split))
    held, seen = set(named), {"heldout": 0, "training": 0}
    for key, ss in sentences.items():
        side = "heldout" if key in held else "training"
        mine, other = (
            (heldout_text, training_text) if key in held else (training_text, heldout_text)
        )
        unique = [s for s in ss if counts[s] == 1]
        for s in unique:
            assert s not in other, key
        seen[side] += sum(s in mine for s in (unique if key in held else unique[:1]))
    assert seen["heldout"] > 20 and seen["training"] > 150, seen


def test_heldout_split_is_reproducible_for_a_seed(split, corpus, vocab_file, tmp_path):
    create_instances(corpus, vocab_file, tmp_path / "again", InstanceConfig(dupe_factor=1))
    for name in ("heldout/shard-00000.parquet", "heldout/documents.tsv", "shard-00002.parquet"):
        assert (tmp_path / "again" / name).read_bytes() == (split / name).read_bytes(), name
    other = InstanceConfig(dupe_factor=1, random_seed=99)
    create_instances(corpus, vocab_file, tmp_path / "seed99", other, num_workers=2)
    docs = [(p / "heldout" / "documents.tsv").read_text() for p in (split, tmp_path / "seed99")]
    assert docs[0] != docs[1]
    # --heldout-documents: exactly that many; more than the corpus can spare is an error
    exact = InstanceConfig(dupe_factor=1, heldout_documents=7)
    stats = create_instances(corpus, vocab_file, tmp_path / "seven", exact, num_workers=2)
    assert stats["heldout"]["documents"] == 7
    with pytest.raises(ValueError, match="--heldout-documents 100000: the corpus has"):
        too_many = InstanceConfig(dupe_factor=1, heldout_documents=100_000)
        create_instances(corpus, vocab_file, tmp_path / "x", too_many)
    assert not (tmp_path / "x").exists()


def test_casing_comes_from_the_vocabulary_folder(corpus, vocab_file, tmp_path, capsys, tracked):
    """The bert-base-uncased folder says do_lower_case true: `--cased` contradicts it."""
    assert cli_instances(corpus / "shard-00001.txt", vocab_file, tmp_path / "o", "--cased") == 2
    assert "tokenizer_config.json: the vocabulary is uncased" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
