"""Options declared once. A command's options are the fields of frozen dataclasses (``@options`` classes, vLLM's
``EngineArgs`` pattern): a field's name is the option's dest and its key in ``--config FILE.yaml``, its annotation
the value's type, its default the flag's, and ``opt``'s metadata the rest argparse needs (help, flags, choices,
...). ``add_cli_args`` adds classes' fields to a parser (each class's ``GROUP`` an argument group of ``-h``), and
``HelpFormatter`` ends every option's help with its default. The parsed namespace keeps the fields' names, which
the commands (and ``dualpath.serving.serve``) read. Plain data and argparse only: ``dualpath --help`` imports
nothing heavy."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable, ClassVar, TypeVar

T = TypeVar("T")
_TYPES = {"int": int, "float": float}  # annotations argparse converts to; str needs no conversion


def options(cls: type[T]) -> type[T]:
    """An option class: a frozen, keyword-only dataclass whose fields are ``opt``s."""
    return dataclass(frozen=True, kw_only=True)(cls)


@options
class Options:
    """Base of the option classes. ``GROUP``: the title of their argument group in ``-h`` ("": the command's own
    options); subclasses inherit it, so a variant of a group (another help, one more option) stays in it."""

    GROUP: ClassVar[str] = ""


def opt(
    default: Any = MISSING,
    help: str = "",
    *,
    flags: tuple[str, ...] = (),
    type: Callable[[str], Any] | None = None,
    choices: Any = None,
    nargs: int | str | None = None,
    metavar: str | tuple[str, ...] | None = None,
    action: str | None = None,
    default_text: str = "",
    hidden: bool = False,
    positional: bool = False,
    one_of: str = "",
    alias_of: str = "",
) -> Any:
    """One option, as a dataclass field. ``flags``: its option strings (default ``--field-name``); no ``default``: a
    required option (or positional); ``default_text``: what the default means in words, where the value (None)
    does not say; ``one_of``: options sharing the name form a required mutually exclusive group; ``alias_of``: a
    positional that sets another option (``serve MODEL`` is ``--model``); ``type``: converts the text (default:
    the annotation's int or float; a bool is a ``store_true`` flag)."""
    meta = dict(help=help, flags=flags, type=type, choices=choices, nargs=nargs, metavar=metavar, action=action)
    meta.update(default_text=default_text, hidden=hidden, positional=positional, one_of=one_of, alias_of=alias_of)
    return dataclasses.field(
        default=default, metadata={k: v for k, v in meta.items() if v not in (None, "", (), False)}
    )


def _scalar(annotation: str) -> str:
    """``int | None`` -> ``int``, ``tuple[str, ...]`` -> ``str``: the type of one value."""
    text = annotation.replace(" ", "").replace("|None", "").replace("None|", "")
    if text.startswith(("tuple[", "list[")):
        text = text[text.index("[") + 1 :].split(",")[0].rstrip("]")
    return text


def argument(f: dataclasses.Field) -> tuple[list[str], dict[str, Any]]:
    """``add_argument``'s names and keywords for one field."""
    m = f.metadata
    scalar = _scalar(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type)))
    kw: dict[str, Any] = {k: m[k] for k in ("choices", "nargs", "metavar", "action") if k in m}
    if scalar == "bool" and "action" not in kw:
        assert f.default is False, f"--{f.name}: a flag's default is False"
        kw["action"] = "store_true"
    elif "type" in m or scalar in _TYPES:
        kw["type"] = m.get("type", _TYPES.get(scalar))
    text = m.get("help", "") + (f" (default: {m['default_text']})" if "default_text" in m else "")
    kw["help"] = argparse.SUPPRESS if m.get("hidden") else text
    required = f.default is MISSING
    if m.get("positional") or m.get("alias_of"):
        if m.get("alias_of"):  # optional; absent, it leaves the option it stands for alone
            kw.update(nargs="?", default=argparse.SUPPRESS)
        elif not required:
            kw["default"] = f.default
        return [f.name], kw
    kw["dest"] = f.name
    if required and not m.get("one_of"):
        kw["required"] = True
    else:
        kw["default"] = None if required else f.default
    return list(m.get("flags") or ["--" + f.name.replace("_", "-")]), kw


def add_cli_args(parser: argparse.ArgumentParser, *classes: type[Options]) -> None:
    """Every field of ``classes`` as an option of ``parser``: a class's fields in its ``GROUP``'s argument group (one
    group per title, in the order first met), fields sharing a ``one_of`` in one required exclusive group."""
    groups: dict[str, Any] = {"": parser}
    exclusive: dict[str, Any] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            title = _owner(cls, f.name).GROUP
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            target = groups[title]
            if f.metadata.get("one_of"):
                key = f.metadata["one_of"]
                if key not in exclusive:
                    exclusive[key] = target.add_mutually_exclusive_group(required=True)
                target = exclusive[key]
            names, kw = argument(f)
            target.add_argument(*names, **kw)
            if f.metadata.get("alias_of"):
                parser.positional_aliases[f.name] = f.metadata["alias_of"]


def short_usage(parser: argparse.ArgumentParser) -> str:
    """``PROG`` with its positionals and required options, then ``[options]``: the usage line, where argparse's
    would list every option (``-h`` lists them below it)."""
    needed = [a for a in parser._actions if a.required or not a.option_strings]
    needed += [a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions]
    formatter = parser._get_formatter()
    formatter.add_usage(None, needed, [g for g in parser._mutually_exclusive_groups if g.required], "")
    return formatter.format_help().strip() + " [options]"


def _owner(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that declares field ``name`` last (its group is the field's)."""
    return next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


def fields_of(*classes: type[Options]) -> list[str]:
    """The dests (and ``--config`` keys) of ``classes``' options, positional aliases left out."""
    return [f.name for cls in classes for f in dataclasses.fields(cls) if not f.metadata.get("alias_of")]


def shown(value: Any) -> str:
    """A default as ``-h`` shows it: a list as its items (``none`` for an empty one), else the value."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    return str(value)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter: an option's help ends with ``(default: VALUE)``, except where its help already
    says the default in words (``opt``'s ``default_text``: a default of None or "" says nothing), and for required
    options and positionals."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if (
            "(default:" in help
            or "%(default)" in help
            or action.required
            or action.default is None
            or action.default == ""
            or action.default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return help
        return f"{help} (default: {shown(action.default).replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with ``HelpFormatter``; a positional ``alias_of`` an option (``serve MODEL``) sets that
    option, and giving both, differently, is an error."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
        self.positional_aliases: dict[str, str] = {}

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        for alias, target in self.positional_aliases.items():
            if hasattr(namespace, alias):
                value = getattr(namespace, alias)
                delattr(namespace, alias)
                given = getattr(namespace, target, None)
                if given not in (None, value, self.get_default(target)):
                    self.error(f"two {target}s, {value} and --{target.replace('_', '-')} {given}: give one")
                setattr(namespace, target, value)
        return namespace, rest


# Converters: what a flag's text becomes (argparse names them in its "invalid ... value" errors).


def size(text: str) -> int:
    """Bytes: ``40G``, ``512MiB`` or a number."""
    from dualpath.core.paths import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_or_auto(text: str) -> int | str:
    """``auto``, or bytes (``size``)."""
    return text if text == "auto" else size(text)


def share(text: str) -> float:
    """A share of a device, in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share of a device: in (0, 1]")
    return value


def lora_module(text: str):
    """``NAME=PATH``: a LoRA adapter served as a model of its own."""
    from dualpath.core.errors import ConfigError
    from dualpath.core.lora import LoraModule

    try:
        return LoraModule.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def speculative(text: str) -> str:
    """vLLM's ``--speculative-config`` JSON, checked (and kept as text)."""
    from dualpath.core.config import SpeculativeConfig
    from dualpath.core.errors import ConfigError

    try:
        SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def kv_events(text: str) -> str:
    """vLLM's ``--kv-events-config`` JSON, checked (and kept as text)."""
    from dualpath.core.config import KVEventsConfig
    from dualpath.core.errors import ConfigError

    try:
        KVEventsConfig.parse(text)
    except (ConfigError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def gpu_count(text: str) -> int:
    """A tensor-parallel size of the simulator: a whole number of GPUs >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a tensor-parallel size is a whole number of GPUs >= 1, got {text!r}")
    return n
