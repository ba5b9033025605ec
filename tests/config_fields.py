"""Every field of a typed config model, by YAML path: what the config tests walk.

A path names list items with ``[]`` (``backends[].name``); a field whose type holds a
model (``RedisConfig | None``, ``list[EventSourceConfig]``, ``Literal[...] | Markers``)
is walked into, and is a leaf of its own too when it may also hold a plain value
(``chat_template: llama3``).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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
