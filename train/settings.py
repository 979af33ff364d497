"""What the trainers' configurations share: a frozen dataclass of settings, one flag per field,
errors that name the flag, and ``--resume``'s rule (the run's own ``config.json`` is the config;
flags that repeat it are fine, flags that change it are an error, except the class's
``RESUME_OVERRIDES``, which are applied and reported).

``train.common_config`` holds the fields both trainers share, their checks and --help texts;
``train.config`` (``train.cifar``, ``train.imagenet``) and ``train.lm_config`` (``train.lm``) add
their own. Nothing here imports JAX, so ``--help`` and flag errors answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from train import run_dir


class UsageError(ValueError):
    """A run cannot start as configured (e.g. a batch that does not divide over the devices); the
    message is meant for the user, and the CLIs print it without a traceback."""


class InvalidSetting(UsageError):
    """A settings field outside its allowed values; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check(obj: Any, checks: Mapping[str, tuple[bool, str]]) -> None:
    """Raises ``InvalidSetting`` for the first of ``obj``'s fields whose check (``(ok, allowed)``)
    fails; every float field must also be finite (inf or nan passes most comparisons and ruins a run
    silently)."""
    floats = {f.name: (False, "a finite number") for f in dataclasses.fields(obj)
              if f.type == "float" and not math.isfinite(getattr(obj, f.name))}  # fmt: skip
    for name, (ok, allowed) in {**checks, **floats}.items():
        if not ok:
            raise InvalidSetting(name, f"{name} must be {allowed}, got {getattr(obj, name)!r}")


class Settings:
    """Base of a frozen, keyword-only dataclass of a run's settings.

    Subclasses name every field in the order of their --help, ``config.json`` and messages
    (``LAYOUT``: a subclass's fields come after its base's, which would scatter each trainer's flags),
    the fields a resumed run may change (``RESUME_OVERRIDES``) and the program that writes their
    ``config.json`` (``WRITER``), and call ``check`` from ``__post_init__``. A field
    ``layer_sparsity`` (``PATTERN=VALUE`` rules) is a tuple of pairs here and a list of lists in JSON;
    a field ``block`` is a side or a ``(rows, columns)`` pair (``--block 16``, ``--block 1x128``), a
    list in JSON.
    """

    LAYOUT: ClassVar[tuple[str, ...]] = ()
    RESUME_OVERRIDES: ClassVar[tuple[str, ...]] = ()
    WRITER: ClassVar[str] = "train"

    @classmethod
    def layout(cls) -> list[dataclasses.Field]:
        """The fields in ``LAYOUT``'s order."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if sorted(cls.LAYOUT) != sorted(fields):  # a field left out would be missing from --help and config.json
            raise TypeError(f"{cls.__name__}.LAYOUT must name each field once; it differs in {sorted(set(cls.LAYOUT) ^ set(fields))}")
        return [fields[name] for name in cls.LAYOUT]

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in self.layout()}
        if "layer_sparsity" in fields:
            fields["layer_sparsity"] = [list(rule) for rule in fields["layer_sparsity"]]
        return fields

    @classmethod
    def from_json(cls, fields: dict[str, Any]):
        """The inverse of ``to_json``; unknown fields raise ``UsageError`` naming them."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(f"unknown settings {unknown} (written by another version of {cls.WRITER}?)")
        for field in cls.layout():  # a damaged value would fail in the checks as a TypeError
            if field.name in fields and not _json_type_ok(field.type, fields[field.name]):
                raise UsageError(f"setting {field.name} holds {fields[field.name]!r}, not a {field.type}: repair it, or pass another --workdir")
        if "layer_sparsity" in fields:
            fields = {**fields, "layer_sparsity": tuple(map(tuple, fields["layer_sparsity"]))}
        if isinstance(fields.get("block"), list):
            fields = {**fields, "block": tuple(fields["block"])}
        return cls(**fields)

    def resume_conflicts(self, saved: Settings) -> list[str]:
        """``--flag VALUE (the run has SAVED)`` for each setting that differs from ``saved`` and is
        not in ``RESUME_OVERRIDES``: continuing with it would mix two trainings."""
        return [
            f"{flag(f.name)} {show(getattr(self, f.name))} (the run has {show(getattr(saved, f.name))})"
            for f in self.layout()
            if f.name not in (*self.RESUME_OVERRIDES, "resume") and getattr(self, f.name) != getattr(saved, f.name)
        ]


def _json_type_ok(annotation: str, value: Any) -> bool:
    """Whether ``value`` read from JSON fits a field annotated ``annotation`` (a string, as the
    dataclasses here are written: ``int``, ``float | None``, ``Literal[...]``, layer rules)."""
    if value is None:
        return annotation.endswith("| None")
    base = annotation.split(" | ")[0]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if "tuple[int, int]" in annotation and isinstance(value, list):  # a block's (rows, columns)
        return len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if base.startswith("tuple"):  # layer rules: [[pattern, value], ...]
        return isinstance(value, list) and all(
            isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and _json_type_ok("float", r[1]) for r in value)
    return {"bool": isinstance(value, bool), "int": number and isinstance(value, int), "float": number}.get(base, isinstance(value, str))


class Parser(argparse.ArgumentParser):
    """Errors are one line (``PROG: argument --flag: why (see --help)``), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description keeps its lines (example commands stay one per line); flags show their defaults."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):  # a block's (rows, columns)
        return "x".join(map(str, value))
    if isinstance(value, tuple):  # layer rules
        return " ".join(f"{pattern}={sparsity}" for pattern, sparsity in value) or "none"
    return str(value)


def layer_rule(text: str) -> tuple[str, float]:
    pattern, sep, value = text.rpartition("=")
    try:
        sparsity = float(value)
    except ValueError:
        sparsity = None
    if not sep or not pattern or sparsity is None:
        raise argparse.ArgumentTypeError(f"expected PATTERN=VALUE (e.g. 'block*/fc2=0.9'), got {text!r}")
    return pattern, sparsity


def block_shape(text: str) -> int | tuple[int, int]:
    """``--block``'s value: a square side (``16``) or rows x columns (``1x128``)."""
    sides = text.lower().split("x")
    if len(sides) > 2 or not all(side.strip().isdigit() for side in sides):
        raise argparse.ArgumentTypeError(f"expected a side N or ROWSxCOLUMNS (e.g. 16 or 1x128), got {text!r}")
    return int(sides[0]) if len(sides) == 1 else (int(sides[0]), int(sides[1]))


def build_parser(prog: str, description: str, defaults: Settings, help: Mapping[str, str],
                 choices: Mapping[str, Sequence[str]], workdir: str) -> Parser:  # fmt: skip
    """One flag per field of ``defaults``' class (its default from ``defaults``) plus ``--workdir``."""
    parser = Parser(prog=prog, description=description, formatter_class=HelpFormatter)
    parser.add_argument("--workdir", default=workdir, help="where metrics, config and checkpoints go")
    for field in type(defaults).layout():
        name, default, text = flag(field.name), getattr(defaults, field.name), help[field.name]
        if field.name == "layer_sparsity":
            parser.add_argument(name, type=layer_rule, action="append", default=list(default), metavar="PATTERN=VALUE", help=text)
        elif field.name == "block":
            parser.add_argument(name, type=block_shape, default=default, metavar="N|RxC", help=text)
        elif field.type == "bool":
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            kind = {"int": int, "float": float}.get(field.type.split(" ")[0], str)  # "int | None" -> int
            allowed = choices.get(field.name)
            if allowed and all(c == c.lower() for c in allowed):
                kind = str.lower  # --target H100 is h100: every choice is lower case, so case means nothing
            parser.add_argument(name, type=kind, default=default, choices=allowed, help=text)
    return parser


_NOT_GIVEN = object()


def parse(parser: Parser, defaults: Settings, argv: Sequence[str] | None) -> tuple[Any, str, list[str]]:
    """``argv`` as ``(config, workdir, notes)``, with ``parser`` from ``build_parser`` (flags it
    takes beyond the settings' are left to their own parsers).

    With ``--resume`` and a ``config.json`` in the workdir, the config is the saved one with the
    flags given applied; ``notes`` says which ``RESUME_OVERRIDES`` changed. Bad values, and flags
    that would change a resumed run's settings, exit with argparse's usage error (code 2).
    """
    cls = type(defaults)
    names = [f.name for f in dataclasses.fields(cls)]
    # Parsed into a namespace that already holds every field, so it ends up holding only the flags
    # given (argparse fills in defaults only for names it does not find); layer rules accumulate.
    given = vars(parser.parse_args(argv, argparse.Namespace(**{n: _NOT_GIVEN for n in names} | {"layer_sparsity": []})))
    workdir = given.pop("workdir")
    given = {n: tuple(v) if n == "layer_sparsity" else v for n, v in given.items()
             if n in names and v is not _NOT_GIVEN and v != []}  # fmt: skip
    try:
        saved = run_dir.read_saved(workdir) if given.get("resume") else None
    except run_dir.DamagedConfig as error:  # the file, not a flag: no "(see --help)"
        parser.exit(2, f"{parser.prog}: {error}\n")
    if given.get("resume") and saved is None:  # a mistyped --workdir would otherwise train from step 0
        parser.error(f"argument --resume: nothing to resume in {workdir}: it has no config.json; "
                     "pass the --workdir of an earlier run, or drop --resume")  # fmt: skip
    try:
        if saved is None:
            return dataclasses.replace(defaults, **given), workdir, []
        saved_config = cls.from_json(saved["config"])
        config = dataclasses.replace(saved_config, **given)
    except InvalidSetting as error:
        where = f"{run_dir.config_path(workdir)}: " if saved else f"argument {flag(error.field)}: "
        parser.error(where + str(error))
    except UsageError as error:  # the file's content, not a flag: no "(see --help)"
        parser.exit(2, f"{parser.prog}: {run_dir.config_path(workdir)}: {error}\n")
    conflicts = config.resume_conflicts(saved_config)
    if conflicts:
        parser.error(f"{workdir} was trained with other settings; to resume it, drop {'; '.join(conflicts)}. "
                     "To train these settings, pass another --workdir")  # fmt: skip
    notes = [f"{flag(n)} {show(getattr(saved_config, n))} -> {show(getattr(config, n))}"
             for n in cls.RESUME_OVERRIDES if getattr(config, n) != getattr(saved_config, n)]  # fmt: skip
    return config, workdir, notes


def check_workdir(config: Settings, workdir: str, saved: dict[str, Any] | None, finished_at: Callable[[], int | None]) -> int | None:
    """Whether ``config`` may train in ``workdir`` (``saved``: its ``run_dir.read_saved``): the step a
    resumed run had already finished at (``finished_at()``), or None when there is training to do.

    Raises ``UsageError`` where the workdir holds checkpoints but ``config.resume`` is off, or a
    resumed run's settings differ from ``saved``'s beyond ``RESUME_OVERRIDES``.
    """
    if not config.resume and run_dir.latest_checkpoint_step(workdir) is not None:
        raise UsageError(f"{workdir} already holds checkpoints: pass --resume to continue, or another --workdir")
    if not config.resume or saved is None:
        return None
    done = finished_at()
    if done is None:
        conflicts = config.resume_conflicts(type(config).from_json(saved["config"]))
        if conflicts:
            raise UsageError(f"{workdir} was trained with other settings: {'; '.join(conflicts)}")
    return done
