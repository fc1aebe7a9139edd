"""Functional composition of plug-ins: ``Compose(a, b, c)(x) == a(b(c(x)))``.

The LAST argument runs FIRST, as in mathematical composition and in the
reference API. A composed object is also an instance of the most specific
class that all its parts share (``isinstance(Compose(i1, i2), Initialize)``),
so it can be passed wherever one plug-in of that kind is expected.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any


def find_common_ancestor(*instances: object) -> type:
    """Most specific class in the MRO of the first instance that every instance derives from."""
    if not instances:
        raise ValueError("find_common_ancestor needs at least one instance, got none")
    for cls in type(instances[0]).__mro__:
        if all(isinstance(other, cls) for other in instances[1:]):
            return cls
    return object  # unreachable: every instance is an object


@functools.cache
def _compose_class(ancestor: type) -> type:
    """The Compose subclass that is also an ``ancestor`` (one class per ancestor, cached)."""
    if ancestor is object:
        return Compose
    if issubclass(ancestor, Compose):
        return ancestor
    name = f"Compose[{ancestor.__qualname__}]"
    try:
        return type(name, (Compose, ancestor), {"__module__": __name__})
    except TypeError:  # e.g. functions or bool: not subclassable, nothing to mark
        return Compose


class Compose:
    """Chain callables right to left: the output of one is the input of the next.

    A step that returns a tuple has it unpacked into the next step's arguments;
    any other value is passed as the single argument. A step that returns None
    although it was given arguments breaks the chain: a warning names it.
    """

    instances: tuple[Callable[..., Any], ...]

    def __new__(cls, *instances: Callable[..., Any]) -> Compose:
        if not instances:
            raise ValueError("Compose needs at least one callable, got none")
        for position, instance in enumerate(instances):
            if not callable(instance):
                raise TypeError(
                    f"Compose argument {position} must be callable, got {type(instance).__name__}: "
                    f"{instance!r}"
                )
        target = _compose_class(find_common_ancestor(*instances))
        return object.__new__(target)

    def __init__(self, *instances: Callable[..., Any]) -> None:
        # Deliberately no super().__init__(): the shared ancestor is only a type
        # marker here; the parts were constructed by the caller.
        self.instances = tuple(instances)

    def __call__(self, *args: Any) -> Any:
        ret: Any = None
        for instance in reversed(self.instances):
            ret = instance(*args)
            if ret is None and args and args != (None,):
                warnings.warn(
                    f"Compose: {instance!r} returned None when called with {len(args)} "
                    "argument(s); the next step receives None instead of the chained value",
                    stacklevel=2,
                )
            if isinstance(ret, tuple):
                args = ret
            elif ret is None and not args:
                args = ()
            else:
                args = (ret,)
        return ret

    def __repr__(self) -> str:
        parts = ", ".join(repr(i) for i in self.instances)
        return f"Compose({parts})"

    def __iter__(self):
        """The parts, in the order they were given (the reverse of the order they run)."""
        return iter(self.instances)


__all__ = ["Compose", "find_common_ancestor"]
