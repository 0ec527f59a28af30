"""Find an agent handler by name: `package.module:attr`, or an entry point's name.

Both `runtime: python` and `portico agent serve` load handlers here, so a handler
that one accepts the other accepts too. Every failure is one `PluginError` whose
message names the plugin and what is wrong (the CLI prints it, no traceback).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from importlib.metadata import entry_points
from typing import Any, cast

from portico.agent.api import Handler
from portico.agent.voice import VoiceHandler
from portico.errors import PluginError

ENTRY_POINT_GROUP = "portico.agents"


def load_handler(spec: str) -> Handler:
    """The handler `spec` names, checked to be `async def handler(turn): ... yield`."""
    spec = spec.strip()
    target = _import_target(spec) if ":" in spec else _entry_point(spec)
    check_handler(spec, target)
    return cast(Handler, target)


def load_voice_handler(spec: str) -> VoiceHandler:
    """The voice handler `spec` names, checked to be `async def voice(call): ...`."""
    spec = spec.strip()
    target = _import_target(spec) if ":" in spec else _entry_point(spec)
    if not inspect.iscoroutinefunction(target):
        raise PluginError(
            f"voice handler {spec!r}: expected a coroutine function "
            f"(async def voice(call): ...), got {_voice_shape(target)}"
        )
    try:
        inspect.signature(target).bind(object())
    except TypeError as exc:
        raise PluginError(
            f"voice handler {spec!r}: it must take exactly one argument (the call)"
        ) from exc
    return cast(VoiceHandler, target)


def _import_target(spec: str) -> Any:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise PluginError(f"plugin {spec!r}: expected module:attr, e.g. mypkg.agents:handler")
    # Like `python -m`: a module next to where the command runs is importable.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any error the module raises on import, reported in one line
        raise PluginError(
            f"plugin {spec!r}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from exc
    for name in attr_path.split("."):
        try:
            target = getattr(target, name)
        except AttributeError as exc:
            missing = f"{module_name} has no attribute {attr_path}"
            raise PluginError(f"plugin {spec!r}: {missing}") from exc
    return target


def _entry_point(name: str) -> Any:
    found = [point for point in entry_points(group=ENTRY_POINT_GROUP) if point.name == name]
    if not found:
        raise PluginError(
            f"plugin {name!r}: not module:attr, and no entry point of that name "
            f"in group {ENTRY_POINT_GROUP}"
        )
    try:
        return found[0].load()
    except Exception as exc:
        raise PluginError(
            f"plugin {name!r}: cannot load entry point {found[0].value}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def check_handler(spec: str, target: Any) -> None:
    """Refuse anything but an async generator function taking one `Turn`."""
    if not inspect.isasyncgenfunction(target):
        raise PluginError(
            f"plugin {spec!r}: expected an async generator function "
            f"(async def handler(turn): ... yield ...), got {_shape(target)}"
        )
    try:
        inspect.signature(target).bind(object())
    except TypeError as exc:
        raise PluginError(
            f"plugin {spec!r}: the handler must take exactly one argument (the turn)"
        ) from exc


def _shape(target: Any) -> str:
    if inspect.iscoroutinefunction(target):
        return "a coroutine function (use yield to stream the reply)"
    if inspect.isgeneratorfunction(target):
        return "a plain generator function (declare it async def)"
    if callable(target):
        return f"a {type(target).__name__} that is not an async generator function"
    return f"a {type(target).__name__}"


def _voice_shape(target: Any) -> str:
    if inspect.isasyncgenfunction(target):
        return "an async generator function (a voice handler sends with call.speak, not yield)"
    if callable(target):
        return f"a {type(target).__name__} that is not a coroutine function"
    return f"a {type(target).__name__}"
