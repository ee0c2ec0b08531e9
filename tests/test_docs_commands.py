"""The commands the documentation gives a new user are ones omnitron accepts, and do what the text says.

Every ``omnitron ...`` (or ``python -m omnitron ...``, ``torchrun ... -m omnitron.train ...``) command in README.md,
docs/*.md and examples/backend_plugin/README.md, from shell blocks and inline code, and in the header comments of
examples/*.yaml, is parsed by omnitron's own
command-line parser; every complete ``omnitron train`` command also builds its settings (the checks a launch makes
before any process starts) for the world it names; and a command that picks its backend with ``OMNITRON_BACKEND=X``
runs on X (a config file's ``backend:`` would silently win over the variable). Running them is the main-job and
command tests' business; this catches a renamed flag, a stale example or a config that contradicts its command.
The README's lines that run on a CPU in seconds (``omnitron info``, ``preprocess``, the serving ``plan``) are run
here as written (``RUN``).
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "backend_plugin" / "README.md"]
PLACEHOLDER = re.compile(r"^(\.\.\.|DIR2?|A|B|C|D|N|S|R|P)$|[|\[\]<>]|\$")
"""Words that stand for something the reader fills in: such a command is parsed, not built into settings."""


def _code(text: str) -> list[tuple[bool, str]]:
    """(whole, line) for the shell lines of ``text``: fenced bash/sh blocks (continuations joined; whole commands)
    and inline code spans (fragments in prose, which may wrap over lines in the markdown source)."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        lines += [(True, line) for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += [(False, " ".join(span.split())) for span in re.findall(r"`([^`]+)`", prose)]
    return lines


def _command(part: str) -> tuple[dict[str, str], list[str], int | None] | None:
    """(environment assignments, omnitron's argv without the program, torchrun's world or None) of one simple shell
    command, or None when it does not run omnitron."""
    try:
        words = shlex.split(part, comments=True)
    except ValueError:
        return None
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    world = None
    if words[:1] == ["torchrun"] and "-m" in words:
        at = words.index("-m")
        launcher, module = words[1:at], words[at + 1:at + 2]
        if module != ["omnitron.train"]:
            return None
        opts = dict(zip(launcher[::2], launcher[1::2]))
        world = int(opts.get("--nnodes", 1)) * int(opts.get("--nproc-per-node", 1))
        words = ["omnitron", "train", *words[at + 2:]]
    if words[:3] == ["python", "-m", "omnitron"]:
        words = ["omnitron", *words[3:]]
    if len(words) < 2 or words[0] != "omnitron" or words[1].startswith(("-", "/")) or words[1].endswith(":"):
        return None
    return env, words[1:], world


def _config_comments(text: str) -> list[tuple[bool, str]]:
    """The commands an example config's header comment gives (``#   omnitron train --config ...``): whole ones."""
    return [(True, m) for m in re.findall(r"^#\s+((?:[A-Z_]+=\S+ )*(?:python -m )?omnitron .*)$", text, re.M)]


def doc_commands() -> list[tuple[str, bool, dict[str, str], list[str], int | None]]:
    """(where, whole, env, argv, torchrun world) of every omnitron command in the documentation and in the example
    configs' headers."""
    found = []
    for doc in [*DOCS, *sorted((ROOT / "examples").glob("*.yaml"))]:
        lines = _config_comments(doc.read_text()) if doc.suffix == ".yaml" else _code(doc.read_text())
        for whole, line in lines:
            for part in re.split(r"&&|;", line):
                cmd = _command(part)
                if cmd:
                    found.append((f"{doc.relative_to(ROOT)}: {part.strip()}", whole, *cmd))
    return found


COMMANDS = doc_commands()
COMPLETE_TRAIN = [c for c in COMMANDS if c[3][0] == "train" and "--help" not in c[3]
                  and (c[1] or {"--config", "--model"} & set(c[3])) and not any(PLACEHOLDER.search(w) for w in c[3])]
"""The whole ``omnitron train`` commands: shell lines, and prose that gives a model (not ``train --backend NAME``)."""
IDS = [c[0][:100] for c in COMMANDS]


def test_the_docs_hold_the_commands_a_user_runs():
    """The extraction finds the README's main job, its 'Using it' lines and the GPU lines (else the tests below
    would pass on nothing)."""
    argvs = [" ".join(c[3]) for c in COMMANDS if c[1]]
    assert "train --config examples/moby_dick_tp2_pp2.yaml" in argvs
    assert sum(a.startswith("train --model") for a in argvs) >= 5
    assert any(c[2].get("OMNITRON_BACKEND") == "cuda" for c in COMMANDS)
    assert len(COMPLETE_TRAIN) >= 10


def _subparser(argv: list[str]):
    """(the parser of the (sub-)sub-command ``argv`` starts with, the words after its name)."""
    from omnitron.cli import build_parser

    parser, rest = build_parser(), list(argv)
    while rest and parser._subparsers is not None:
        choices = parser._subparsers._group_actions[0].choices
        if rest[0] not in choices:
            break
        parser, rest = choices[rest[0]], rest[1:]
    return parser, rest


@pytest.mark.parametrize("where,whole,env,argv,world", COMMANDS, ids=IDS)
def test_every_documented_command_parses(where, whole, env, argv, world, capsys):
    """A flag the docs give and the CLI does not take (renamed, dropped, misspelt) fails here: a whole command (a
    shell block's line) is parsed as the shell would run it, a fragment in prose (``omnitron preprocess
    --split-sentences``) must name a command and only flags that command has."""
    for name in argv[0].split("|"):  # `omnitron generate|serve ...`: both
        parser, rest = _subparser([name, *argv[1:]])
        assert parser.prog != "omnitron", f"{where}: {name!r} is no omnitron command"
        if not whole or "--help" in rest:
            unknown = [w for w in rest if w.startswith("--") and w.split("=")[0] not in parser._option_string_actions]
            assert not unknown, f"{where}: {parser.prog} has no {unknown}"
            continue
        try:
            parser.parse_args(rest)
        except SystemExit as exit_:
            pytest.fail(f"{where}\n  exit {exit_.code}: {capsys.readouterr().err.strip()}")


@pytest.mark.parametrize("where,whole,env,argv,world", COMPLETE_TRAIN, ids=[c[0][:100] for c in COMPLETE_TRAIN])
def test_every_documented_train_command_builds_its_settings(where, whole, env, argv, world, monkeypatch):
    """What `omnitron train` checks before it starts a process holds for each documented line (run from the
    clone's root, as the README's commands are), and ``OMNITRON_BACKEND=X`` in front of one means it runs on X."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training.arguments import parse_settings

    monkeypatch.chdir(ROOT)
    try:
        settings = parse_settings(argv[1:], world)
    except (ConfigError, SystemExit) as err:
        pytest.fail(f"{where}\n  {type(err).__name__}: {err}")
    if settings.backend not in (None, env.get("OMNITRON_BACKEND", settings.backend)):
        pytest.fail(f"{where}\n  runs on backend {settings.backend!r} (its config file's or flag's), not the "
                    f"OMNITRON_BACKEND={env['OMNITRON_BACKEND']} it is given: pass --backend instead")


RUN = {
    "info": lambda tmp, out: "versions: torch" in out,
    "preprocess": lambda tmp, out: all((tmp / "data" / f"corpus_text_document.{ext}").stat().st_size > 0
                                       for ext in ("bin", "idx")) and "3 documents" in out,
    "plan --model llama3_70b": lambda tmp, out: "the most requests of 4096 tokens that fit" in out,
}
"""The README's commands that run on a CPU in seconds, by how their argv begins, and what their output must show."""


@pytest.mark.parametrize("start", sorted(RUN))
def test_the_cheap_documented_commands_run(start, tmp_path):
    """Each runs as the README writes it (its first whole line starting so), in a fresh folder, and exits 0 with
    what the text promises; ``preprocess`` on a three-document ``corpus.jsonl`` written there (the reader's own
    corpus in the README)."""
    import subprocess
    import sys

    found = [c for c in COMMANDS if c[1] and c[0].startswith("README.md") and " ".join(c[3]).startswith(start)]
    assert found, f"the README no longer gives `omnitron {start} ...`"
    where, _, env, argv, _ = found[0]
    if argv[0] == "preprocess":
        docs = ['{"text": "Call me Ishmael."}', '{"text": "Some years ago."}', '{"text": "The whale."}']
        (tmp_path / "corpus.jsonl").write_text("\n".join(docs) + "\n")
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, "-m", "omnitron", *argv], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, **env, "PYTHONPATH": path}, timeout=300)
    assert proc.returncode == 0, f"{where}\n  exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert RUN[start](tmp_path, proc.stdout + proc.stderr), f"{where}\n  {proc.stdout[-2000:]}"
