"""Our BERT tokenizer against transformers' on real sentences, and `bert vocab` end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import BertTokenizerFast

from bert_core import cli
from bert_core.data.corpus import CleanConfig, clean_file
from bert_core.data.tokenizer import SPECIAL_TOKENS, encode_lines, load_tokenizer, read_vocab
from bert_core.errors import InputError


@pytest.fixture(scope="module")
def sentences(shared_data) -> list[str]:
    """Real sentences, with accents, quotes, dashes and U+FFFD among them."""
    out: list[str] = []
    for name in ("a_study_in_scarlet.txt", "gutenberg_nltk/chesterton-ball.txt"):
        docs, _ = clean_file(shared_data / "corpus" / name, CleanConfig())
        out += [s for d in docs for s in d]
    out += ["Héllo [MASK] wörld 北京 ﬁne Σίσυφος", "x" * 150 + " hi", "tab\there", ""]
    assert len(out) > 5_000
    return out


def hf_tokenizer(vocab_file: Path) -> BertTokenizerFast:
    # transformers 5 names the argument `vocab` (a path or a dict); `vocab_file=` is ignored.
    return BertTokenizerFast(vocab=str(vocab_file))


def test_same_ids_as_transformers(minilm_dir, sentences):
    hf = hf_tokenizer(minilm_dir / "vocab.txt")
    assert len(hf.get_vocab()) == 30_522
    ours = load_tokenizer(minilm_dir / "vocab.txt")
    theirs = hf(sentences, add_special_tokens=True)["input_ids"]
    assert [e.ids for e in ours.encode_batch(sentences)] == theirs
    plain = hf(sentences, add_special_tokens=False)["input_ids"]
    assert encode_lines(ours, sentences) == plain  # the cached fast path: same ids
    assert sum(len(ids) for ids in plain) > 100_000


def test_vocab_cli_trains_a_loadable_wordpiece(shared_data, tmp_path, monkeypatch, sentences):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    corpus = tmp_path / "clean"
    corpus.mkdir()
    (corpus / "shard-00000.txt").write_text("\n".join(sentences[:4000]) + "\n")
    out = tmp_path / "vocab"
    args = ["vocab", "--input", str(corpus), "--output", str(out), "--vocab-size", "3000"]
    assert cli.main(args) == 0
    tokens = (out / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert tokens[:5] == SPECIAL_TOKENS
    assert 2_000 < len(tokens) <= 3_000 and len(set(tokens)) == len(tokens)
    assert any(t.startswith("##") for t in tokens)
    assert not any(c.isupper() for t in tokens for c in t if not t.startswith("["))
    # the same ids through tokenizer.json, our loader and transformers
    saved = Tokenizer.from_file(str(out / "tokenizer.json"))
    sample = sentences[4000:5000]
    ids = [e.ids for e in saved.encode_batch(sample)]
    assert ids == [e.ids for e in load_tokenizer(out / "vocab.txt").encode_batch(sample)]
    assert ids == hf_tokenizer(out / "vocab.txt")(sample)["input_ids"]
    unk = saved.token_to_id("[UNK]")
    assert sum(i == unk for row in ids for i in row) < 0.01 * sum(map(len, ids))


def test_cased_vocab_keeps_case(tmp_path, sentences):
    from bert_core.data.tokenizer import VocabConfig, train_vocab

    (tmp_path / "a.txt").write_text("\n".join(sentences[:2000]) + "\n")
    tok = train_vocab(tmp_path, VocabConfig(vocab_size=1000, lowercase=False))
    assert "The" in tok.get_vocab()
    assert tok.encode("The").tokens == ["[CLS]", "The", "[SEP]"]


def test_the_same_corpus_gives_the_same_vocabulary_every_time(tmp_path, sentences):
    """tokenizers 0.23 alone numbers `##` tokens in hash-map order and breaks merge ties by id:
    three trainings in one process gave up to three vocabularies, different in their tokens
    (huggingface/tokenizers#1794). Ours are equal, token for token and id for id."""
    from bert_core.data.tokenizer import VocabConfig, train_vocab

    (tmp_path / "a.txt").write_text("\n".join(sentences[:3000]) + "\n")
    runs = [train_vocab(tmp_path, VocabConfig(vocab_size=1500)).get_vocab() for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert len(runs[0]) == 1500 and sum(t.startswith("##") for t in runs[0]) > 300


def test_the_alphabet_cut_keeps_the_commonest_characters(tmp_path, sentences):
    """With more distinct characters than --limit-alphabet, the commonest are kept (ties to the
    lower code point), counted here the slow way: over the words of the tokenizer's own
    normalizer and pre-tokenizer, as the trainer counts them."""
    from collections import Counter

    from bert_core.data.tokenizer import bert_tokenizer, fixed_alphabet

    text = "\n".join(sentences[:3000] + sentences[-4:]) + "\n"
    (tmp_path / "a.txt").write_text(text)
    tok = bert_tokenizer(None)
    words = tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text))
    counts = Counter(c for w, _ in words for c in w)
    assert len(counts) > 60 and "北" in counts and "σ" in counts
    alphabet, continuations = fixed_alphabet(tmp_path, lowercase=True, limit=40)
    assert alphabet == sorted(sorted(counts, key=lambda c: (-counts[c], c))[:40])
    inner = {c for w, _ in words for c in w[1:]}
    assert continuations == [f"##{c}" for c in alphabet if c in inner]
    everything, _ = fixed_alphabet(tmp_path, lowercase=True, limit=1000)
    assert everything == sorted(counts)


def test_broken_vocab_files(tmp_path):
    bad = tmp_path / "vocab.txt"
    bad.write_text("[PAD]\n[UNK]\nthe\nthe\n")
    with pytest.raises(InputError, match=r"vocab.txt:4: duplicate token 'the'"):
        read_vocab(bad)
    bad.write_text("[PAD]\n[UNK]\nthe\n")
    with pytest.raises(InputError, match=r"no \[MASK\] token"):
        read_vocab(bad, required=("[UNK]", "[MASK]"))
    with pytest.raises(FileNotFoundError):
        read_vocab(tmp_path / "missing.txt")
    bad.write_bytes(b"[PAD]\n[UNK]\nthe\n\xffoo\n")
    with pytest.raises(InputError, match=r"vocab.txt:4: not UTF-8"):
        read_vocab(bad)
    bad.write_text("[PAD]\n[UNK]\n\nthe\n")
    with pytest.raises(InputError, match=r"vocab.txt:3: empty token"):
        read_vocab(bad)


def test_read_vocab_goes_through_the_storage_filesystem(monkeypatch):
    """s3:// vocabularies (the instances' vocab.txt on a cluster) are read through
    `bert_core.storage.filesystem`, the one place that knows the endpoint."""
    import pyarrow.fs as pafs

    from bert_core import storage

    mock = pafs._MockFileSystem()
    mock.create_dir("bucket/instances")
    with mock.open_output_stream("bucket/instances/vocab.txt") as f:
        f.write(b"[PAD]\n[UNK]\nthe\n##s\n")
    local = storage.filesystem
    seen = []

    def fake(path):
        seen.append(str(path))
        return (mock, "/".join(storage.split_s3(path))) if storage.is_s3(path) else local(path)

    monkeypatch.setattr(storage, "filesystem", fake)
    vocab = read_vocab("s3://bucket/instances/vocab.txt")
    assert vocab == {"[PAD]": 0, "[UNK]": 1, "the": 2, "##s": 3}
    assert seen == ["s3://bucket/instances/vocab.txt"]
    with pytest.raises(FileNotFoundError, match="s3://bucket/instances/nope.txt"):
        read_vocab("s3://bucket/instances/nope.txt")
