"""Docs that stay true (issue 42, point 4): what README.md and docs/*.md claim is checked against
the source, so a doc cannot go on naming a flag, a variable or a count that is not so.

Each kind of claim has a small checker that returns its problems as `file:line: what`; a test
asserts there are none, and `test_the_checkers_catch_the_drifts_of_issue_42` feeds each checker
the false claims the issue found, so none of them can pass by finding nothing.

- **Counts in prose** (`COUNTS`): a number in a named sentence (the bad-input catalogue's rows,
  the KFP pipeline's parameters, the pretrain task's retries, the default DAG's pre-training
  steps) is computed from the source and compared; the ConfigMap's and Secrets' keys listed in
  docs/cluster.md are compared with `pipelines/cluster.py`. Rewording such a sentence means
  updating its pattern here: a pattern that matches nothing fails too.
- **Commands** in fenced code blocks and in inline code spans, read as a shell reads them (a
  command is the first word of a line or the word after `;`, `&&`, `|`, `(`, `do`, ...; `VAR=x`
  before it is its environment; `B=.venv/bin/bert` then `$B` is followed within a block):
  `make TARGET VAR=...` against the Makefile (the target exists, the variable is one its recipe
  or a prerequisite's reads); `bert SUB --flag` against the sub-command's own argparse parser
  (`build_parser()`, nothing run; `bert finetune --task T` with that task's parser, any task's
  without a task name; `bert SUB: ...`, a message it prints, is no command); `dvc ...`
  against DVC's own parser, `dvc repro` targets against dvc.yaml's stages, `dvc remote add`
  against the remotes .dvc/config already has (and `modify` against those it lacks);
  `python -m pipelines.bert_pipeline SUB` against its parser (`--help`, in process), its
  `--set KEY` against the pipeline's parameters and `--preset` against presets.PRESETS.
- **Overrides**: every `-S key=value` of `dvc exp run` and of `make run ARGS="..."` names a key
  of params.yaml, is applied by DVC's own override code (`pipelines.run_dvc.resolved_params`)
  and, when its value holds a comma outside a list, is quoted: unquoted, Hydra's grammar makes
  it a sweep, which `dvc exp run` refuses.
- **Figures carry their commit**: every JSON line a bench printed (it has a `"bench"` key, or it
  is a JSON object in a section that names a `bench/` script) lies in a section, heading to
  heading, that names a commit of `git log` (7 to 40 hex digits with at least one letter a-f:
  the commit the figures were measured on or recorded with). Practical, not exact: the commit
  may sit anywhere in the section, and a clone without history (`git clone --depth 1`) fails.

Placeholders are skipped, not guessed: a word in capitals (`KEY`, `DIR`, `N1`), `<...>` (which
ends a command, as a redirection would), `...`. Whole-file reads and parser builds only: no
network, nothing trained; 5-8 s on 2 cores, most of it `bert finetune`'s parser (torch).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
if str(ROOT) not in sys.path:  # `pytest` run as a script: `pipelines` is the project's
    sys.path.insert(0, str(ROOT))
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "text"}  # fenced blocks read as commands
STARTS = {";", "&&", "||", "|", "&", "(", "{", "do", "then", "else", "!", "$"}  # a command next
ENDS = {";", "&&", "||", "|", "&", ")", "}", "<", ">", ">>", ">&", "<<", "2>", "&>"}


@dataclass(frozen=True)
class Command:
    """One command a doc shows: `tool` (make, bert, dvc, kfp for `python -m
    pipelines.bert_pipeline`) and its arguments, as the shell would pass them."""

    where: str  # file:line
    tool: str
    argv: tuple[str, ...]


# ---------------------------------------------------------------------------------------------
# reading the docs


def shown(path: Path) -> str:
    """A doc's name in a problem: relative to the project."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def fenced_blocks(text: str) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """(language, [(line number, line)]) of each fenced code block."""
    block: tuple[str, list[tuple[int, str]]] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if block is None and stripped.startswith("```"):
            block = (stripped[3:].strip(), [])
        elif block is not None and stripped == "```":
            yield block
            block = None
        elif block is not None:
            block[1].append((number, line))


def logical_lines(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """A block's lines with backslash continuations joined; a `$ ` prompt dropped."""
    start, parts = None, []
    for number, line in lines:
        start = number if start is None else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        text = " ".join([*parts, line]).strip()
        yield start, text[2:] if text.startswith("$ ") else text
        start, parts = None, []


def inline_spans(text: str) -> Iterator[tuple[int, str]]:
    """(line number, code) of each inline code span outside fenced blocks (a span may wrap)."""
    lines = text.splitlines()
    for _, block in fenced_blocks(text):
        for number, _ in block:
            lines[number - 1] = ""
    prose = "\n".join(lines)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        yield prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())


def words(line: str) -> list[str]:
    """A shell line's words and operators (`#` comments dropped); raises ValueError on an
    unclosed quote."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)


def tool_of(word: str, rest: list[str], variables: dict[str, str]) -> tuple[str, int] | None:
    """(tool, how many words its name takes) when `word` starts a command we check: `bert`,
    `.venv/bin/bert`, `$B` after `B=.venv/bin/bert`; `python -m bert_core` is `bert` too."""
    word = variables.get(word[1:].strip("{}"), word) if word.startswith("$") else word
    for tool in ("make", "bert", "dvc"):
        if word == tool or word.endswith(f"bin/{tool}"):
            return tool, 1
    if re.fullmatch(r"(\S*bin/)?python3?", word) and rest[:1] == ["-m"] and len(rest) > 1:
        return {"bert_core": ("bert", 3), "pipelines.bert_pipeline": ("kfp", 3)}.get(rest[1])
    return None


def commands_in(line: str, where: str, variables: dict[str, str]) -> list[Command]:
    """The checked commands of one shell line, each with its arguments up to the next operator;
    `variables` collects `NAME=value` statements (so `$B` can be a `bert`)."""
    try:
        ws = words(line)
    except ValueError:
        if re.search(r"(^|[;&|(]\s*)(\S*/)?(bert|make|dvc)\s", line):
            raise AssertionError(f"{where}: cannot read as a shell line: {line}") from None
        return []
    found, at_start, i = [], True, 0
    while i < len(ws):
        word = ws[i]
        if word in STARTS:
            at_start = True
        elif at_start and re.fullmatch(r"[A-Za-z_]\w*=.*", word):
            name, _, value = word.partition("=")
            variables[name] = value  # an assignment, or the environment of what follows
        elif at_start:
            at_start = False
            tool = tool_of(word, ws[i + 1 :], variables)
            if tool is not None:
                end = i + tool[1]
                while end < len(ws) and ws[end] not in ENDS | STARTS:
                    end += 1
                found.append(Command(where, tool[0], tuple(ws[i + tool[1] : end])))
                i = end - 1
        i += 1
    return found


def doc_commands(path: Path, text: str | None = None) -> list[Command]:
    """Every checked command of a doc: fenced shell blocks line by line, and inline code spans
    that start with a command."""
    text = path.read_text(encoding="utf-8") if text is None else text
    name, found = shown(path), []
    for lang, block in fenced_blocks(text):
        if lang in SHELL_BLOCKS:
            variables: dict[str, str] = {}
            for number, line in logical_lines(block):
                found += commands_in(line, f"{name}:{number}", variables)
    for number, code in inline_spans(text):
        with contextlib.suppress(AssertionError):  # prose in backticks need not be shell
            found += commands_in(code, f"{name}:{number}", {})
    return found


@functools.cache
def all_commands() -> tuple[Command, ...]:
    return tuple(c for doc in DOCS for c in doc_commands(doc))


def placeholder(word: str) -> bool:
    """A word standing for the reader's value: capitals (KEY, DIR, N1) or `...` (a `<...>` ends
    the command before it, as a redirection would)."""
    word = word.strip("[]")
    return word in {"...", "…"} or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", word))


def flags(argv: tuple[str, ...]) -> list[str]:
    """The option words of `argv` (`--x=1` as `--x`; `[--x]` as `--x`; numbers are values)."""
    out = []
    for word in argv:
        word = word.strip("[]")
        if word.startswith("-") and len(word) > 1 and not re.fullmatch(r"-[\d.e,+-]+", word):
            out.append(word.split("=", 1)[0])
    return out


# ---------------------------------------------------------------------------------------------
# make


@functools.cache
def makefile() -> tuple[dict[str, tuple[str, str]], dict[str, str], frozenset[str]]:
    """(target -> (prerequisites, recipe), variable -> value, exported variables)."""
    rules, variables, exported, target = {}, {}, set(), None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith("\t") and target is not None:
            for name in target:
                rules[name] = (rules[name][0], rules[name][1] + line + "\n")
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        var = re.match(r"(export\s+)?([A-Za-z_]\w*)\s*(?::=|\?=|\+=|=)\s*(.*)$", line)
        rule = re.match(r"([^:=#\t][^:=#]*):(?!=)(.*)$", line)
        if var:
            variables[var[2]] = var[3]
            exported |= {var[2]} if var[1] else set()
            target = None
        elif rule and not rule[1].startswith("."):
            target = rule[1].split()
            for name in target:
                rules[name] = (rule[2].split(";")[0], "")
        else:
            target = None
    return rules, variables, frozenset(exported)


def make_reads(target: str) -> set[str]:
    """The variables `make TARGET` reads: its rule's and its prerequisites' references, through
    the variables they use, and the exported ones (every recipe's environment)."""
    rules, variables, exported = makefile()
    seen, texts, names = set(), list(rules.get(target, ("", ""))), set(exported)
    while texts:
        text = texts.pop()
        for name in re.findall(r"\$[({]([A-Za-z_]\w*)[)}]", text):
            if name not in names:
                names.add(name)
                texts.append(variables.get(name, ""))
        for prerequisite in text.split():
            if prerequisite in rules and prerequisite not in seen:
                seen.add(prerequisite)
                texts.extend(rules[prerequisite])
    return names


def check_make(command: Command) -> list[str]:
    rules, _, _ = makefile()
    targets = [w for w in command.argv if "=" not in w and not w.startswith("-")]
    problems = [
        f"{command.where}: `make {t}`: no such target in the Makefile ({', '.join(rules)})"
        for t in targets
        if t not in rules
    ]
    goal = targets or list(rules)[:1]  # no target: the Makefile's first
    reads = set().union(*(make_reads(t) for t in goal if t in rules))
    for word in command.argv:
        name, sep, value = word.partition("=")
        if not sep:
            continue
        if name not in reads:
            problems.append(
                f"{command.where}: `make {' '.join(targets)} {name}=`: no recipe of it reads {name}"
            )
        elif name == "ARGS" and "run" in targets:
            problems += check_overrides(command.where, set_params(tuple(shlex.split(value))))
    return problems


# ---------------------------------------------------------------------------------------------
# params.yaml overrides (-S), as `dvc exp run` and `make run ARGS=` take them


@functools.cache
def params_keys() -> frozenset[str]:
    """params.yaml's keys, `section.key` and deeper (`public.minilm.steps`), sections too."""
    keys, todo = set(), [("", yaml.safe_load((ROOT / "params.yaml").read_text()))]
    while todo:
        prefix, value = todo.pop()
        if prefix:
            keys.add(prefix)
        if isinstance(value, dict):
            todo += [(f"{prefix}.{k}".lstrip("."), v) for k, v in value.items()]
    return frozenset(keys)


def set_params(argv: tuple[str, ...]) -> list[str]:
    """The values of `-S` / `--set-param` in `argv`."""
    out = []
    for i, word in enumerate(argv):
        if word in {"-S", "--set-param"} and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif word.startswith("--set-param="):
            out.append(word.split("=", 1)[1])
    return out


def check_overrides(where: str, overrides: list[str]) -> list[str]:
    """Each `-S` names a params.yaml key, is no sweep, and DVC's own code applies it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from pipelines.run_dvc import resolved_params

    problems, parser, ours = [], OverridesParser.create(), []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if ":" in key or placeholder(key):  # another file's (predict.yaml:...), or KEY=VALUE
            continue
        if key not in params_keys():
            problems.append(f"{where}: -S {override}: params.yaml has no key {key}")
            continue
        parsed = parser.parse_overrides([override])[0]
        if parsed.is_sweep_override():
            problems.append(
                f"{where}: -S {override}: DVC reads a comma list as a sweep and "
                "`dvc exp run` refuses it: quote the value, e.g. "
                f"""-S '{key}="{override.split("=", 1)[1]}"'"""
            )
            continue
        ours.append(override)
    try:
        resolved_params(ours)
    except Exception as e:  # DVC's own InvalidArgumentError
        problems.append(f"{where}: -S {' -S '.join(ours)}: {e} {e.__cause__ or ''}".strip())
    return problems


# ---------------------------------------------------------------------------------------------
# dvc


@functools.cache
def dvc_stages() -> frozenset[str]:
    return frozenset(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])


def dvc_remotes() -> set[str]:
    return set(
        re.findall(
            r"""^\[\s*'?remote\s+"([^"]+)"'?\s*\]""",
            (ROOT / ".dvc" / "config").read_text(),
            flags=re.M,
        )
    )


def check_dvc(command: Command) -> list[str]:
    from dvc.cli import parse_args

    argv, shown = list(command.argv), f"`dvc {' '.join(command.argv)}`"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parse_args(argv)
    except (SystemExit, Exception) as e:
        return [f"{command.where}: {shown}: DVC's parser refuses it ({type(e).__name__})"]
    problems = check_overrides(command.where, set_params(command.argv))
    if argv[:1] == ["repro"]:
        for target in getattr(args, "targets", None) or []:
            if target.split("@")[0] not in dvc_stages() and not placeholder(target):
                problems.append(f"{command.where}: {shown}: dvc.yaml has no stage {target}")
    if argv[:2] == ["remote", "add"] and not getattr(args, "force", False):
        if args.name in dvc_remotes():
            problems.append(
                f"{command.where}: {shown}: .dvc/config already has the remote "
                f"{args.name!r}: this fails (`dvc remote modify` it instead)"
            )
    if argv[:2] == ["remote", "modify"] and args.name not in dvc_remotes():
        problems.append(f"{command.where}: {shown}: .dvc/config has no remote {args.name!r}")
    return problems


# ---------------------------------------------------------------------------------------------
# bert


def parser_module(name: str) -> str:
    """The module whose `build_parser` the command module `name` has: itself, or the one its
    source imports it from (read with ast), so `bert pretrain`'s parser (pretrain.config) is
    built without importing torch."""
    tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            if any(a.name == "build_parser" and a.asname is None for a in node.names):
                return node.module
    return name


@functools.cache
def bert_options(sub: str, task: str | None = None) -> frozenset[str]:
    """The option strings of `bert SUB`'s parser; for finetune, of `--task TASK`'s (without a
    task name, `$T` or none, those of any task)."""
    from bert_core.cli import COMMANDS

    module = importlib.import_module(parser_module(COMMANDS[sub][0]))
    if sub != "finetune":
        return frozenset(module.build_parser()._option_string_actions)
    with contextlib.suppress(Exception):  # a task name: its parser
        return frozenset(module.build_parser(module.load_task(task))._option_string_actions)
    tasks = [module.load_task(name) for name in module.TASKS]  # else the options of any task
    return frozenset(o for task in tasks for o in module.build_parser(task)._option_string_actions)


def check_bert(command: Command) -> list[str]:
    from bert_core.cli import COMMANDS

    argv = command.argv
    if not argv or argv[0] in {"-h", "--help"} or placeholder(argv[0]):
        return []
    if argv[0].endswith(":"):  # a message it prints: `bert finetune: error: ...`, `bert STEP:`
        return []
    sub, shown = argv[0], f"`bert {' '.join(argv)}`"
    if sub not in COMMANDS:
        return [f"{command.where}: {shown}: no sub-command {sub!r} ({', '.join(COMMANDS)})"]
    task = argv[argv.index("--task") + 1] if "--task" in argv[:-1] else None
    known = bert_options(sub, task if sub == "finetune" else None)
    return [
        f"{command.where}: {shown}: `bert {sub}` has no option {flag}"
        for flag in flags(argv[1:])
        if flag not in known
    ]


# ---------------------------------------------------------------------------------------------
# python -m pipelines.bert_pipeline


@functools.cache
def kfp_help(*argv: str) -> str:
    """`python -m pipelines.bert_pipeline ARGV --help`, in process: the parser is built and
    prints its help before anything runs."""
    from pipelines import bert_pipeline

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        bert_pipeline.main([*argv, "--help"])
    return out.getvalue()


def check_kfp(command: Command) -> list[str]:
    from pipelines import bert_pipeline, presets

    argv, shown = command.argv, f"`python -m pipelines.bert_pipeline {' '.join(command.argv)}`"
    subs = re.search(r"\{([\w,-]+)\}", kfp_help())
    subs = subs[1].split(",") if subs else []
    if not argv or argv[0] not in subs:
        return [f"{command.where}: {shown}: no sub-command (one of {', '.join(subs)})"]
    known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", kfp_help(argv[0])))
    problems = [
        f"{command.where}: {shown}: `{argv[0]}` has no option {flag}"
        for flag in flags(argv[1:])
        if flag not in known
    ]
    for i, word in enumerate(argv[:-1]):
        value = argv[i + 1]
        key = value.split("=", 1)[0]
        if word == "--set" and not placeholder(key) and key not in bert_pipeline.PARAMETERS:
            problems.append(f"{command.where}: {shown}: the pipeline has no parameter {key}")
        if word == "--preset" and not placeholder(value) and value not in presets.PRESETS:
            problems.append(f"{command.where}: {shown}: no preset {value!r}")
    return problems


CHECKS: dict[str, Callable[[Command], list[str]]] = {
    "make": check_make,
    "bert": check_bert,
    "dvc": check_dvc,
    "kfp": check_kfp,
}


def command_problems(tool: str) -> list[str]:
    return [p for c in all_commands() if c.tool == tool for p in CHECKS[tool](c)]


# ---------------------------------------------------------------------------------------------
# counts in prose


def bad_input_cases() -> int:
    """The rows of the bad-input catalogue: `Case(...)` calls in tests/test_bad_inputs.py's
    CASES, read with ast (importing it would build its fixtures' world)."""
    tree = ast.parse((ROOT / "tests" / "test_bad_inputs.py").read_text())
    (cases,) = [
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "CASES" for t in n.targets)
    ]
    return sum(
        isinstance(c, ast.Call) and getattr(c.func, "id", "") == "Case" for c in ast.walk(cases)
    )


def reliability_rows() -> int:
    """The rows of docs/reliability.md's bad-input table (between its markers)."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    table = text.split("<!-- bad-inputs:begin -->", 1)[1].split("<!-- bad-inputs:end -->", 1)[0]
    return len(re.findall(r"^\| `", table, flags=re.M))


def kfp_parameters() -> tuple[int, int]:
    """(the pipeline's parameters, those named after a params.yaml key)."""
    from pipelines import bert_pipeline

    return len(bert_pipeline.PARAMETERS), len(set(bert_pipeline.PARAMETERS) & set(bert_pipeline.P))


def kfp_form() -> tuple[int, int, int]:
    """(the run form's fields, the settings shown as fields, those in advanced_settings)."""
    from pipelines import bert_pipeline

    return len(bert_pipeline.FORM), len(bert_pipeline.SHOWN), len(bert_pipeline.ADVANCED)


def params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def pretrain_retries() -> int:
    from pipelines import bert_pipeline

    return bert_pipeline.PRETRAIN_RETRY["num_retries"]


# (doc, a pattern whose group is the number, what the source says it is)
COUNTS: list[tuple[str, str, Callable[[], int]]] = [
    ("README.md", r"from (\d+) bad inputs", bad_input_cases),
    ("README.md", r"from (\d+) bad inputs", reliability_rows),
    ("docs/pipeline.md", r"takes (\d+) settings", lambda: kfp_parameters()[0]),
    ("docs/pipeline.md", r"run form shows (\d+) fields", lambda: kfp_form()[0]),
    ("docs/pipeline.md", r"the (\d+) settings a first run", lambda: kfp_form()[1]),
    ("docs/pipeline.md", r"holding the other (\d+) with", lambda: kfp_form()[2]),
    ("docs/pipeline.md", r"(\d+) named\s+after this file's keys", lambda: kfp_parameters()[1]),
    (
        "docs/pipeline.md",
        r"and (\d+) of its\s+own",
        lambda: kfp_parameters()[0] - kfp_parameters()[1],
    ),
    ("docs/pipeline.md", r"is retried (\d+) times", pretrain_retries),
    ("docs/cluster.md", r"pretrain is retried (\d+) times", pretrain_retries),
    ("README.md", r"(\d+) pre-training steps of `tiny`", lambda: params()["pretrain"]["steps"]),
    ("README.md", r"(\d+) steps of continued MLM", lambda: params()["public"]["minilm"]["steps"]),
]


def count_problems(counts=COUNTS) -> list[str]:
    problems = []
    for doc, pattern, actual in counts:
        text = (ROOT / doc).read_text()
        matches = list(re.finditer(pattern, text))
        if not matches:
            problems.append(f"{doc}: no sentence matches {pattern!r} (reworded? update COUNTS)")
        for m in matches:
            if int(m[1]) != actual():
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{doc}:{line}: says {m[0]!r}; the source says {actual()}")
    return problems


def key_list_problems(doc: str = "docs/cluster.md") -> list[str]:
    """docs/cluster.md's table of what a pod loads: each ConfigMap / Secret row lists exactly the
    keys of pipelines/cluster.py."""
    from pipelines import cluster

    wanted = {
        cluster.CONFIG_MAP: cluster.CONFIG_KEYS,
        cluster.SECRET: cluster.SECRET_KEYS,
        cluster.AUTH_SECRET: cluster.AUTH_KEYS,
        cluster.RELEASE_SECRET: cluster.AUTH_KEYS,
        cluster.RAY_AUTH_SECRET: cluster.RAY_AUTH_KEYS,
    }
    problems, seen = [], set()
    for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        m = re.match(r"\| (?:ConfigMap|Secret) `([\w-]+)`[^|]*\| ([^|]*)\|", line)
        if m and m[1] in wanted:
            seen.add(m[1])
            listed = re.findall(r"`([A-Z][A-Z0-9_]+)`", m[2])
            if sorted(listed) != sorted(wanted[m[1]]):
                problems.append(
                    f"{doc}:{number}: {m[1]} lists {len(listed)} keys {listed}; "
                    f"pipelines/cluster.py has {len(wanted[m[1]])}: "
                    f"{list(wanted[m[1]])}"
                )
    problems += [
        f"{doc}: no table row lists the keys of {name}" for name in wanted if name not in seen
    ]
    return problems


# ---------------------------------------------------------------------------------------------
# figures and their commit


@functools.cache
def commits() -> tuple[str, ...]:
    out = subprocess.run(
        ["git", "log", "--format=%H"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return tuple(out.stdout.split())


def named_commits(text: str) -> list[str]:
    """The words of `text` that are commits of `git log` (7-40 hex digits, a letter among them)."""
    return [
        w
        for w in re.findall(r"\b[0-9a-f]{7,40}\b", text)
        if re.search("[a-f]", w) and any(c.startswith(w) for c in commits())
    ]


def sections(text: str) -> Iterator[tuple[int, list[str]]]:
    """(first line number, lines) from each heading to the next (fenced blocks are not split)."""
    lines, start, fenced = text.splitlines(), 0, False
    for i, line in enumerate(lines):
        fenced ^= line.strip().startswith("```")
        if not fenced and line.startswith("#") and i > start:
            yield start + 1, lines[start:i]
            start = i
    yield start + 1, lines[start:]


def bench_lines(lines: list[str]) -> list[int]:
    """Indexes of the lines of a section that are a bench's JSON: in a fenced block, a JSON
    object (after an optional label) with a "bench" key, or any JSON object when the section
    names a `bench/` script."""
    names_bench, found, fenced = "bench/" in "\n".join(lines), [], False
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced and "{" in line:
            try:
                value = json.loads(line[line.index("{") :])
            except ValueError:
                continue
            if isinstance(value, dict) and ("bench" in value or names_bench):
                found.append(i)
    return found


def figure_problems(docs=DOCS) -> list[str]:
    problems = []
    for doc in docs:
        name = shown(doc)
        for start, lines in sections(doc.read_text(encoding="utf-8")):
            bench = bench_lines(lines)
            if bench and not named_commits("\n".join(lines)):
                problems.append(
                    f"{name}:{start + bench[0]}: bench figures in a section "
                    f"({lines[0][:60]!r}) that names no commit of git log"
                )
    return problems


# ---------------------------------------------------------------------------------------------
# the tests


def test_the_docs_show_commands_of_each_kind():
    """The readers below find the commands (so the checks are not vacuous)."""
    tools = [c.tool for c in all_commands()]
    assert {
        t: tools.count(t) >= n for t, n in (("make", 8), ("bert", 40), ("dvc", 15), ("kfp", 8))
    } == dict.fromkeys(CHECKS, True)


def test_make_lines_name_targets_and_variables_the_makefile_has():
    assert command_problems("make") == []


def test_bert_lines_name_sub_commands_and_options_their_parsers_take():
    assert command_problems("bert") == []


def test_dvc_lines_parse_and_name_stages_params_and_remotes_that_exist():
    assert command_problems("dvc") == []


def test_pipeline_command_lines_name_its_options_parameters_and_presets():
    assert command_problems("kfp") == []


def test_counts_in_the_docs_are_the_sources():
    assert count_problems() == []


def test_cluster_doc_lists_the_configmap_and_secret_keys_a_pod_loads():
    assert key_list_problems() == []


def test_bench_figures_name_the_commit_they_were_measured_at():
    assert figure_problems() == []


def test_the_checkers_catch_the_drifts_of_issue_42(tmp_path):
    """Each checker fed the false claims issue 42 found in the docs reports each of them."""
    doc = ROOT / "docs" / "_drift.md"
    text = "\n".join(
        [
            "Override with `make run DATA=/path/to/data`.",  # no such variable
            "```bash",
            "make runn",  # no such target
            'make run ARGS="-S finetune.lr_sweep=3e-4,1e-4"',  # a sweep
            "dvc exp run -S finetune.lr_sweep=3e-4,1e-4,5e-5",  # a sweep
            "dvc exp run -S finetune.no_such_key=1",
            "dvc remote add -d store s3://bert/dvc",  # the remote exists
            "dvc repro finetune-nope@SST-2",
            "dvc exp ran",
            "bert finetune --task squad --data D --model M --output O --learn-rate 1e-4",
            "bert finetune --task SST-2 --data D --model M --output O --doc-stride 64",  # squad's
            "bert cleen --input x",
            "B=.venv/bin/bert; $B pretrain --instances I --output O --no-such-flag",
            "python -m pipelines.bert_pipeline submit --host H --set model_presett=mini",
            "python -m pipelines.bert_pipeline submit --host H --preset table9 --sett x=1",
            "```",
        ]
    )
    problems = [p for c in doc_commands(doc, text) for p in CHECKS[c.tool](c)]
    expected = [
        "DATA",
        "runn",
        "lr_sweep=3e-4,1e-4",
        "lr_sweep=3e-4,1e-4,5e-5",
        "no_such_key",
        "already has the remote",
        "finetune-nope",
        "dvc exp ran",
        "option --learn-rate",
        "option --doc-stride",
        "cleen",
        "option --no-such-flag",
        "model_presett",
        "table9",
        "option --sett",
    ]
    assert [e for e in expected if not any(e in p for p in problems)] == []
    assert len(problems) == len(expected), problems
    said = tmp_path / "said.md"
    wrong = kfp_parameters()[0] + 1
    said.write_text(f"from 107 bad inputs; takes {wrong} parameters, plus four of its own\n")
    drifted = [
        (str(said), r"from (\d+) bad inputs", bad_input_cases),
        (str(said), r"takes (\d+) parameters", lambda: kfp_parameters()[0]),
        (str(said), r"and (\d+) of its\s+own", lambda: 7),  # reworded: matches nothing
    ]
    assert len(count_problems(drifted)) == 3
    cluster_md = tmp_path / "cluster.md"
    cluster_md.write_text("| ConfigMap `bert-pipeline-env` | `MLFLOW_TRACKING_URI` | x |\n")
    assert len(key_list_problems(str(cluster_md))) == 5  # 1 key of 9; four Secrets unlisted
    assert not any(c.startswith("0123abc") for c in commits())
    bench = tmp_path / "bench.md"
    bench.write_text(
        '## A\n\nat 0123abc\n\n```json\n{"bench": "x", "s": 1}\n```\n'
        f'## B\n\nat {commits()[-1][:7]}\n\n```json\n{{"bench": 1}}\n```\n'
    )
    assert [p.split(": ", 1)[1][:40] for p in figure_problems([bench])] == [
        "bench figures in a section ('## A') that"
    ]


def _paper_table_drifts(text: str) -> list[str]:
    """docs/architecture.md's "The paper in the code": each row's files exist, and each name
    its `where` column gives in backticks (a function, a class, a field, a module, a path) is
    defined in bert_core (a dotted name by its last part), or is a library the project installs
    (`tokenizers`): a rename that leaves the row behind is a drift."""
    section = text.split("## The paper in the code", 1)[1].split("\n## ", 1)[0]
    sources = {p: p.read_text() for p in (ROOT / "bert_core").rglob("*.py")}
    drifts = []
    for line in section.splitlines()[3:]:
        if not line.startswith("|"):
            continue
        _, files, where, _ = line.rsplit("|", 3)
        for name in re.findall(r"`([^`]+)`", files):
            if not (ROOT / name).is_file():
                drifts.append(f"no file {name}")
        for name in re.findall(r"`([^`]+)`", where):
            if name.startswith("--"):
                continue  # an option: test_bert_lines_name_sub_commands_and_options... checks
            if name.endswith(".py"):
                if not (ROOT / "bert_core" / name).is_file():
                    drifts.append(f"no file bert_core/{name}")
                continue
            last = name.rsplit(".", 1)[-1]
            defined = re.compile(rf"^\s*(def |class )?{re.escape(last)}\b\s*[(:=]", re.M)
            module = any(path.stem == last for path in sources) or (
                "." not in name and importlib.util.find_spec(name) is not None
            )
            if not module and not any(defined.search(source) for source in sources.values()):
                drifts.append(f"{name}: defined nowhere in bert_core")
    return drifts


def test_the_paper_table_names_files_and_definitions_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert _paper_table_drifts(text) == []
    drifted = text.replace("`bert_schedule`", "`bert_schedules`")  # the checker sees a rename
    assert _paper_table_drifts(drifted) == ["bert_schedules: defined nowhere in bert_core"]
