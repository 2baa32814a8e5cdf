"""``dualpath``'s options as declared once (``dualpath.cli.options``): every option of every subcommand has help and
shows its default in ``-h``; defaults taken from the configs build exactly the configs' defaults; ``serve MODEL``
takes the model positionally, as ``vllm serve MODEL`` does."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from dualpath.cli import build_parser, engine_config
from dualpath.cli.cluster import scheduler_config
from dualpath.cli.options import shown
from dualpath.core.config import EngineProcessConfig, SchedulerConfig


def parsers(parser: argparse.ArgumentParser, prefix: str = "dualpath"):
    """Every parser under ``parser`` (itself included), with its command line."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{prefix} {name}")


COMMANDS = dict(parsers(build_parser()))


def needs_no_default(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """Required options, required positionals and the members of a required either-or group show no default."""
    either = {a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
    return action.required or action in either


def test_every_command_is_walked():
    assert len(COMMANDS) >= 22 and {"dualpath serve", "dualpath bench agentic", "dualpath abort"} <= set(COMMANDS)
    assert sum(len(p._actions) for p in COMMANDS.values()) > 400


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_help_and_shows_its_default(command):
    parser = COMMANDS[command]
    formatter = parser.formatter_class(parser.prog, width=10_000)  # one line per option: nothing wrapped
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = " ".join(formatter._format_action(action).split())  # as `-h` prints it
        assert action.help and action.help.strip(), f"{command} {name}: no help"
        if needs_no_default(parser, action):
            continue
        assert "(default: " in text and text.endswith(")"), f"{command} {name}: no default shown: {text}"
        said = text[text.rindex("(default: ") + len("(default: ") : -1]
        assert said.strip(), f"{command} {name}: an empty default"
        if action.default not in (None, "", argparse.SUPPRESS):  # else the words of its declaration
            assert said == shown(action.default), f"{command} {name}: shows {said!r}, its default is {action.default!r}"


def test_help_prints_and_imports_nothing_heavy():
    for command, parser in COMMANDS.items():
        assert parser.format_help().startswith("usage: " + command), command
    r = subprocess.run(
        [sys.executable, "-m", "dualpath.cli", "serve", "-h"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "--max-model-len" in r.stdout, r.stderr
    code = (
        "import sys, dualpath.cli; print(sorted(m for m in sys.modules if m.startswith(('torch', 'fastapi', 'grpc'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_defaults_are_the_configs_defaults():
    """No flag given, a command builds its config's own defaults: a default declared twice would show here."""
    parse = build_parser().parse_args
    engine = engine_config(parse(["engine", "--role", "decode", "--scheduler", "s:1", "--model", "/m"]))
    assert engine == EngineProcessConfig(role="decode", model="/m", scheduler="s:1")
    assert scheduler_config(parse(["scheduler"])) == SchedulerConfig(port=50051)  # its well-known port


def test_serve_takes_the_model_positionally():
    parse = build_parser().parse_args
    assert parse(["serve", "/models/llama"]).model == "/models/llama"
    assert parse(["serve", "--port", "9000", "/models/llama", "--decode", "2"]).model == "/models/llama"
    assert parse(["serve", "--model", "/models/llama"]).model == "/models/llama"  # as before
    assert parse(["serve", "/models/llama", "--model", "/models/llama"]).model == "/models/llama"
    args = parse(["serve"])
    assert args.model is None and not hasattr(args, "model_tag")  # None: the default SmolLM2 (resolve_model)
    with pytest.raises(SystemExit):
        parse(["serve", "/models/a", "--model", "/models/b"])
    usage = COMMANDS["dualpath serve"].format_usage()
    assert usage.split() == ["usage:", "dualpath", "serve", "[MODEL]", "[options]"]
