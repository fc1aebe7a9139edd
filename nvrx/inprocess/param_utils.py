"""Passing the ``CallWrapper`` to the wrapped function.

A parameter receives the ``CallWrapper`` when its annotation names it:
``CallWrapper``, ``Optional[CallWrapper]``, the string ``"CallWrapper"`` (also
under ``from __future__ import annotations``) or a dotted name ending in it.
Other annotations, including generics such as ``list[int]`` and names that
cannot be resolved, are left alone instead of breaking the call.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any


def _names_type(annotation: Any, target: type) -> bool:
    """Whether ``annotation`` (resolved or a string) designates exactly ``target``."""
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        return _string_names_type(annotation, target.__name__)
    if typing.get_origin(annotation) is not None:
        return any(_names_type(arg, target) for arg in typing.get_args(annotation))
    return annotation is target


def _string_names_type(text: str, name: str) -> bool:
    """Whether an unresolved annotation string is ``name`` (possibly dotted, Optional or ``| None``)."""
    text = text.strip().strip("'\"")
    for prefix in ("typing.Optional[", "Optional[", "typing.Union[", "Union["):
        if text.startswith(prefix) and text.endswith("]"):
            text = text[len(prefix) : -1]
            break
    parts = [p.strip() for p in text.replace("|", ",").split(",")]
    parts = [p for p in parts if p and p != "None"]
    return len(parts) == 1 and (parts[0] == name or parts[0].endswith("." + name))


def _resolved_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """Annotations of ``fn`` evaluated where possible; unresolvable ones stay strings."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # a name that does not resolve: fall back to the raw annotations
        return dict(getattr(inspect.unwrap(fn), "__annotations__", {}) or {})


def injected_parameters(fn: Callable[..., Any], target: type) -> list[str]:
    """Names of the parameters of ``fn`` that should receive an instance of ``target``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    hints = _resolved_hints(fn)
    return [
        name
        for name, param in signature.parameters.items()
        if _names_type(hints.get(name, param.annotation), target)
    ]


def substitute_param_value(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    substitutes: dict[type, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` for ``fn`` with each parameter annotated as a key of ``substitutes`` replaced."""
    targets = {
        name: value for cls, value in substitutes.items() for name in injected_parameters(fn, cls)
    }
    if not targets:
        return args, kwargs
    signature = inspect.signature(fn)
    bound = signature.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    for name, value in targets.items():
        param = signature.parameters[name]
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        bound.arguments[name] = value
    return bound.args, bound.kwargs
