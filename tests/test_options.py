"""One generator of command-line options (`bert_core.options`) for every command with a config,
and its one rule for optional values: `X | None` takes an X, or `none` / empty text for None."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields

import pytest

from bert_core.data import corpus, instances, tokenizer
from bert_core.data.corpus import CleanConfig
from bert_core.data.instance_config import InstanceConfig
from bert_core.data.tokenizer import VocabConfig
from bert_core.finetune import command as finetune
from bert_core.finetune.config import PAPER_LEARNING_RATES, FinetuneConfig
from bert_core.options import add_options, config_from_args, option
from bert_core.pretrain import config as pretrain
from bert_core.pretrain.config import PretrainConfig

RUN = ["--data", "d", "--model", "m", "--output", "o"]
PRETRAIN = ["--instances", "i", "--output", "o"]


def commands() -> list[tuple[str, argparse.ArgumentParser, type, list[str]]]:
    """(name, parser, config class, the least argv it parses) of every command with a config."""
    squad = finetune.load_task("squad")
    return [
        ("clean", corpus.build_parser(), CleanConfig, ["--input", "i", "--output", "o"]),
        ("vocab", tokenizer.build_parser(), VocabConfig, ["--input", "i", "--output", "o"]),
        (
            "instances",
            instances.build_parser(),
            InstanceConfig,
            ["--input", "i", "--vocab", "v", "--output", "o"],
        ),
        ("pretrain", pretrain.build_parser(), PretrainConfig, PRETRAIN),
        (
            "finetune",
            finetune.build_parser(finetune.load_task("SST-2")),
            FinetuneConfig,
            ["--task", "SST-2", *RUN],
        ),
        (
            "finetune squad",
            finetune.build_parser(squad),
            squad.config_class,
            ["--task", "squad", *RUN],
        ),
    ]


@pytest.mark.parametrize("name, parser, config_class, argv", commands())
def test_every_command_parser_is_made_from_its_config_fields(name, parser, config_class, argv):
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in fields(config_class)} <= dests, name
    args = parser.parse_args(argv)
    given = {a: getattr(args, a) for a in ("instances", "output") if config_class is PretrainConfig}
    assert config_from_args(args, config_class) == config_class(**given)  # the class's defaults
    for f in fields(config_class):
        if f.default is not MISSING:
            assert parser.get_default(f.name) == f.default, (name, f.name)


def test_none_or_empty_text_is_none_for_every_optional_value():
    cfg = pretrain.parse_args([*PRETRAIN, "--warmup-steps", "none", "--dropout", "NONE"])
    assert cfg.warmup_steps is None and cfg.warmup == 10 and cfg.dropout is None
    cfg = pretrain.parse_args([*PRETRAIN, "--init-model", "", "--storage-path", " none "])
    assert cfg.init_model is None and cfg.storage_path is None
    cfg = pretrain.parse_args([*PRETRAIN, "--dropout", "0.2", "--warmup-steps", "7"])
    assert cfg.dropout == 0.2 and cfg.warmup_steps == 7
    assert pretrain.parse_args([*PRETRAIN, "--init-model", "m/"]).init_model == "m/"
    parser = finetune.build_parser(finetune.load_task("SST-2"))
    args = parser.parse_args(["--task", "SST-2", *RUN, "--max-train-examples", ""])
    assert args.max_train_examples is None
    args = parser.parse_args(["--task", "SST-2", *RUN, "--max-eval-examples", "300"])
    assert args.max_eval_examples == 300
    args = instances.build_parser().parse_args(
        [
            "--input",
            "i",
            "--vocab",
            "v",
            "--output",
            "o",
            "--heldout-documents",
            "none",
            "--preset",
            "none",
        ]
    )
    assert args.heldout_documents is None and args.preset is None


@pytest.mark.parametrize("option_, value", [("--warmup-steps", "abc"), ("--dropout", "x")])
def test_a_bad_optional_value_exits_2_naming_the_option(option_, value, capsys):
    with pytest.raises(SystemExit) as e:
        pretrain.parse_args([*PRETRAIN, option_, value])
    assert e.value.code == 2
    assert f"argument {option_}: expected" in capsys.readouterr().err


def test_aliases_name_the_same_field():
    parser = finetune.build_parser(finetune.load_task("SST-2"))
    short = parser.parse_args(["--task", "SST-2", *RUN, "--lr", "1e-4"])
    long = parser.parse_args(["--task", "SST-2", *RUN, "--learning-rate", "1e-4"])
    assert short.learning_rate == long.learning_rate == 1e-4
    assert config_from_args(short, FinetuneConfig).learning_rate == 1e-4


def test_bool_fields_are_flags():
    assert pretrain.parse_args(PRETRAIN).use_gpu is False
    assert pretrain.parse_args([*PRETRAIN, "--use-gpu", "--compile"]).compile is True
    vocab = tokenizer.build_parser()
    base = ["--input", "i", "--output", "o"]
    assert config_from_args(vocab.parse_args(base), VocabConfig).lowercase is True
    assert config_from_args(vocab.parse_args([*base, "--cased"]), VocabConfig).lowercase is False
    with pytest.raises(SystemExit):  # a flag that defaults to True: only its alias unsets it
        vocab.parse_args([*base, "--lowercase"])
    args = instances.build_parser().parse_args(
        ["--input", "i", "--vocab", "v", "--output", "o", "--cased", "--whole-word-mask"]
    )
    cfg = config_from_args(args, InstanceConfig)
    assert cfg.lowercase is False and cfg.whole_word_mask is True


def test_tuple_fields():
    cfg = pretrain.parse_args([*PRETRAIN, "--adam-betas", "0.9", "0.98"])
    assert cfg.adam_betas == (0.9, 0.98)
    assert "--adam-betas B1 B2" in pretrain.build_parser().format_help()
    with pytest.raises(SystemExit):
        pretrain.parse_args([*PRETRAIN, "--adam-betas", "0.9"])
    parser = finetune.build_parser(finetune.load_task("SST-2"))

    def sweep(text: str) -> tuple[float, ...] | None:
        return parser.parse_args(["--task", "SST-2", *RUN, "--lr-sweep", text]).lr_sweep

    assert sweep("5e-5,3e-5") == (5e-5, 3e-5) and sweep("paper") == PAPER_LEARNING_RATES
    assert sweep("") is None and sweep("none") is None
    with pytest.raises(SystemExit):
        sweep("5e-5,fast")


@dataclass
class Toy:
    """Every rule of `add_options` on one small class."""

    path: str = option(MISSING, "where")
    steps: int = option(10, "steps, 5% of them warm")
    rate: float | None = option(None, "a rate (default: the model's)")
    name: str | None = option(None, "a name")
    sizes: tuple[int, ...] = option((1, 2), "sizes")
    hidden: int = option(0, argparse.SUPPRESS)
    kind: str = option("a", "a kind", "-k", choices=("a", "b"))


def test_the_rules_on_a_class_of_their_own():
    parser = argparse.ArgumentParser()
    add_options(parser, Toy, skip=("hidden",))
    help_text = parser.format_help()
    assert "steps, 5% of them warm (default: 10)" in help_text
    assert "(default: the model's)" in help_text and "(default: None)" in help_text
    assert "--hidden" not in help_text
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --path is required
    args = parser.parse_args(["--path", "p", "--rate", "0.5", "--sizes", "3,4", "-k", "b"])
    assert config_from_args(args, Toy) == Toy("p", rate=0.5, sizes=(3, 4), kind="b")
    args = parser.parse_args(["--path", "p", "--name", "none", "--rate", ""])
    assert config_from_args(args, Toy) == Toy("p")  # `hidden` (skipped) keeps its default


def test_a_flag_that_defaults_to_true_needs_an_alias():
    @dataclass
    class Bad:
        on: bool = option(True, "on")

    with pytest.raises(TypeError, match="needs an alias"):
        add_options(argparse.ArgumentParser(), Bad)
