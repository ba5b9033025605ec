"""bus has one error root: every error class it defines is a BusError, so a boundary that
must count and recover can catch the contract's errors as one family."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import bus
from bus.errors import BusError
from bus.events import EventError
from bus.salt import SaltError


def _bus_modules() -> list[str]:
    return [
        m.name
        for m in pkgutil.walk_packages(bus.__path__, "bus.")
        if not m.name.startswith("bus._gen")
    ]


def test_every_bus_error_derives_from_the_root() -> None:
    found = []
    for name in _bus_modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException):
                found.append(cls)
                assert issubclass(cls, BusError), f"{name}.{cls.__name__} is not a BusError"
    assert BusError in found and len(found) >= 5  # EventError, SaltError, ConfigError, ...


def test_malformed_values_stay_value_errors() -> None:
    assert issubclass(EventError, ValueError) and issubclass(SaltError, ValueError)
