"""Every field of a typed config model, by YAML path: what the config tests walk.

A path names list items with ``[]`` (``backends[].name``); a field whose type holds a
model (``RedisConfig | None``, ``list[EventSourceConfig]``, ``Literal[...] | Markers``)
is walked into, and is a leaf of its own too when it may also hold a plain value
(``chat_template: llama3``).
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Field:
    path: str
    """``section.field``, list items as ``[]``."""
    info: FieldInfo
    leaf: bool
    """Holds a plain value (not only a model, a list of models or None)."""

    @property
    def required(self) -> bool:
        return self.info.is_required()

    @property
    def default(self) -> Any:
        """The code's default as YAML would spell it (models dumped to plain data)."""
        if self.info.default_factory is not None:
            value = self.info.default_factory()  # type: ignore[call-arg]
        else:
            value = self.info.default
        if value is PydanticUndefined:
            raise ValueError(f"{self.path} has no default")
        if isinstance(value, BaseModel):
            return value.model_dump()
        return value


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a type: ``A | B | None`` → [A, B, None]; Annotated unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        out: list[Any] = []
        for arg in typing.get_args(annotation):
            out.extend(_members(arg))
        return out
    return [annotation]


def _model(t: Any) -> type[BaseModel] | None:
    return t if isinstance(t, type) and issubclass(t, BaseModel) else None


def walk(model: type[BaseModel], prefix: str = "") -> Iterator[Field]:
    """Every field of ``model`` and of the models it holds, depth first, in field order."""
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        nested: list[tuple[type[BaseModel], str]] = []
        plain = False
        for member in _members(info.annotation):
            if member is type(None):
                continue
            sub = _model(member)
            if sub is not None:
                nested.append((sub, path))
                continue
            if typing.get_origin(member) is list:
                (item,) = typing.get_args(member) or (Any,)
                item_model = _model(item)
                if item_model is not None:
                    nested.append((item_model, f"{path}[]"))
                    continue
            plain = True
        yield Field(path, info, leaf=plain or not nested)
        for sub, sub_path in nested:
            yield from walk(sub, f"{sub_path}.")


def leaf_paths(model: type[BaseModel]) -> list[str]:
    """The paths whose values are plain data (what a reload compares)."""
    return [f.path for f in walk(model) if f.leaf]


# -- the reference examples ------------------------------------------------------------

EXAMPLE_CONVENTION = """\
Convention of the reference examples (deploy/config.example.yaml,
config.kv-listener.yaml.example): every field appears at its YAML path, live or in a
commented-out line ("# key: value", which the check reads as if uncommented; a list item's
fields in at least one item). The first time a path appears its value is the code's
default, unless the default is unset (then the value is an example) or the line's comment
starts with "default X" naming the code's default ("# default false", "# default []",
"# default unset"). Any "# default X" must name the code's default. A prose comment line
must not start with a lowercase "word:" (it would read as a setting)."""

_SETTING = re.compile(r"^(\s*)# ?(\s*(?:- )?[a-z_][a-z0-9_]*:(?:\s|$))")
_STATED = re.compile(
    r"""^default:?\s+("(?:[^"\\]|\\.)*"|'[^']*'|\[[^\]]*\]|\{[^}]*\}|[^\s;,()]+)"""
)


def uncomment(text: str) -> str:
    """``text`` with every commented-out setting line made live (same line numbers)."""
    return "\n".join(_SETTING.sub(r"\1\2", line) for line in text.split("\n"))


def _comment(line: str, after: int) -> str:
    """The comment of ``line`` starting after column ``after`` ('' if none)."""
    at = line.find("#", after)
    return line[at + 1 :].strip() if at >= 0 else ""


_UNSET = object()


def _stated(comment: str) -> Any:
    """The default a comment states ("default X ..."), or _UNSET if it states none."""
    m = _STATED.match(comment)
    if m is None:
        return _UNSET
    token = m.group(1).rstrip(":")
    return None if token == "unset" else yaml.safe_load(token)


def _value(node: yaml.Node) -> Any:
    return yaml.safe_load(yaml.serialize(node))


class _Checker:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.seen: set[str] = set()
        self.problems: list[str] = []

    def model(self, model: type[BaseModel], node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key, value in node.value:
            name = key.value
            path = f"{prefix}{name}"
            line = key.start_mark.line
            info = model.model_fields.get(name)
            if info is None:
                self.problems.append(f"{path} (line {line + 1}): not a field of {model.__name__}")
                continue
            field = Field(path, info, leaf=True)
            same_line = value.end_mark.line == line and not isinstance(value, yaml.MappingNode)
            comment = _comment(
                self.lines[line], value.end_mark.column if same_line else key.end_mark.column
            )
            self.field(field, value, comment, line)
            for member in _members(info.annotation):
                sub = _model(member)
                if sub is not None and isinstance(value, yaml.MappingNode):
                    self.model(sub, value, f"{path}.")
                if typing.get_origin(member) is list and isinstance(value, yaml.SequenceNode):
                    item = _model((typing.get_args(member) or (Any,))[0])
                    if item is not None:
                        for entry in value.value:
                            self.model(item, entry, f"{path}[].")

    def field(self, field: Field, node: yaml.Node, comment: str, line: int) -> None:
        first = field.path not in self.seen
        self.seen.add(field.path)
        if field.required:
            return
        default = field.default
        stated = _stated(comment)
        where = f"{field.path} (line {line + 1})"
        if stated is not _UNSET and stated != default:
            self.problems.append(
                f"{where}: the comment says default {_yaml(stated)}, the code's default is "
                f"{_yaml(default)}"
            )
            return
        if not first or default is None or stated is not _UNSET:
            return
        if isinstance(default, dict) and isinstance(node, yaml.MappingNode):
            return  # a section: its own fields are checked
        value = _value(node)
        if value != default:
            self.problems.append(
                f"{where}: {_yaml(value)} is not the code's default {_yaml(default)}: set "
                f"{_yaml(default)}, or keep the example and start the comment with "
                f"'# default {_yaml(default)}'"
            )


def _yaml(value: Any) -> str:
    if value is None:
        return "unset"
    return (
        yaml.safe_dump(value, default_flow_style=True, width=1 << 16)
        .strip()
        .removesuffix("\n...")
        .removesuffix(" ...")
    )


def check_example(model: type[BaseModel], text: str, not_options: Iterable[str] = ()) -> list[str]:
    """What is wrong with ``text`` as the reference example of ``model`` (EXAMPLE_CONVENTION),
    each problem naming its YAML path; [] when nothing is. ``not_options``: fields that
    exist only to reject a value with a helpful error (never documented as settings)."""
    skip = set(not_options)
    live = uncomment(text)
    try:
        root = yaml.compose(live)
    except yaml.YAMLError as exc:
        return [f"the file with its commented-out settings made live is not YAML: {exc}"]
    checker = _Checker(live.split("\n"))
    if root is not None:
        checker.model(model, root, "")
    for f in walk(model):
        if f.path not in checker.seen and f.path not in skip:
            default = "" if f.required else f" (its default: {_yaml(f.default)})"
            where = " in one of the items" if "[]" in f.path else ""
            checker.problems.append(f"{f.path}: missing{where}; document it{default}")
    return checker.problems
