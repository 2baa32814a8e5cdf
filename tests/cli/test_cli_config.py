"""``dualpath serve --config FILE.yaml``: its keys are the options' names, every option of ``serve`` is one (and
nothing else is), each key sets what its flag sets, and flags win over the file."""

from __future__ import annotations

import argparse

import pytest
import yaml

from dualpath.cli import _with_config, build_parser
from dualpath.cli.options import fields_of
from dualpath.cli.server import SERVE
from dualpath.core.errors import ConfigError
from dualpath.serving.serve import lora_modules

TEXT = {  # what a flag whose converter checks its text is given (the rest: a value of its type, or any text)
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
    "kv_events_config": '{"enable_kv_cache_events": true, "topic": "kv@h@m"}',
    "gpu_memory_utilization": "0.5",
    "cache_bytes": "1G",
    "prefill_kv_budget": "64MiB",
    "max_stored_response_bytes": "1G",
    "storage_capacity": "2G",
    "lora_modules": "sql=/adapters/sql",
    "engine_port_range": "20000-20100",
}


def serve_options() -> dict[str, argparse.Action]:
    parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def sample(action: argparse.Action) -> tuple[list[str], object]:
    """A value other than the default: as command-line words, and as a YAML value."""
    flag = action.option_strings[-1]
    if isinstance(action, argparse._StoreTrueAction):
        return [flag], True
    if action.dest in TEXT:
        text = TEXT[action.dest]
        return [flag, text], [text] if action.nargs == "+" else text
    if action.choices:
        value = next(c for c in action.choices if c != action.default)
        return [flag, str(value)], value
    if action.type in (int, float):
        value = action.type((action.default or 0) + 3)
        return [flag, str(value)], value
    if action.nargs == "+" or isinstance(action, argparse._AppendAction):
        return [flag, "a-value"], ["a-value"]
    return [flag, "a-value"], "a-value"


def same(key: str, a, b) -> bool:
    if key == "lora_modules":  # the file gives NAME=PATH text; the flag's parsed LoraModule; serving reads both
        return lora_modules(argparse.Namespace(lora_modules=a)) == lora_modules(argparse.Namespace(lora_modules=b))
    return a == b


def test_the_keys_are_the_options_fields():
    """Every flag of `serve` is a field of its option classes and the other way round: the file's keys, the flags'
    dests and the fields are one list."""
    assert set(serve_options()) == set(fields_of(*SERVE))
    assert len(fields_of(*SERVE)) == len(set(fields_of(*SERVE))) > 70  # none declared twice


@pytest.mark.parametrize("spelling", ["max_model_len", "max-model-len"])
def test_every_option_is_a_config_key_that_sets_what_its_flag_sets(tmp_path, spelling):
    options = {k: a for k, a in serve_options().items() if k != "config"}
    flags, values = [], {}
    for key, action in options.items():
        words, value = sample(action)
        flags += words
        values[key if spelling == "max_model_len" else key.replace("_", "-")] = value
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(values))
    by_flags = build_parser().parse_args(["serve", *flags])
    by_file = _with_config(build_parser(), ["serve", "--config", str(config)])
    defaults = build_parser().parse_args(["serve"])
    for key in options:
        assert not same(key, getattr(by_flags, key), getattr(defaults, key)), f"{key}: the sample is the default"
        assert same(key, getattr(by_file, key), getattr(by_flags, key)), (
            key,
            getattr(by_file, key),
            getattr(by_flags, key),
        )


def test_unknown_keys_are_refused_and_flags_win(tmp_path):
    config = tmp_path / "serve.yaml"
    for wrong in ({"max_model_length": 4096}, {"func": "x"}, {"model_tag": "/m"}):
        config.write_text(yaml.safe_dump(wrong))
        with pytest.raises(ConfigError, match="unknown options"):
            _with_config(build_parser(), ["serve", "--config", str(config)])
    config.write_text(yaml.safe_dump({"model": "/models/a", "port": 9000}))
    assert _with_config(build_parser(), ["serve", "--config", str(config)]).model == "/models/a"
    args = _with_config(build_parser(), ["serve", "/models/b", "--config", str(config), "--port", "9001"])
    assert (args.model, args.port) == ("/models/b", 9001)  # MODEL, as --model, wins over the file's
