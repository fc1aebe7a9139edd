# ruff: noqa: UP006, UP007, UP035, UP037, UP045, F821 - the annotations the reference crashed on, on purpose
"""CallWrapper injection by annotation, including the annotations the reference crashed on."""

from __future__ import annotations

import typing
from typing import Dict, Optional

from nvrx.inprocess.param_utils import injected_parameters, substitute_param_value


class CallWrapper:  # stand-in type: injection matches by class, subclass or name
    pass


class Special(CallWrapper):
    pass


MARK = CallWrapper()


def test_future_annotations_and_generics_do_not_break():
    def fn(a: list[int], b: Dict[str, int], cw: CallWrapper = None, c: "int" = 3):  # noqa: UP006
        return a, b, cw, c

    args, kwargs = substitute_param_value(fn, ([1],), {"b": {}}, {CallWrapper: MARK})
    assert fn(*args, **kwargs) == ([1], {}, MARK, 3)


def test_optional_and_string_annotations_are_injected():
    def f1(cw: Optional[CallWrapper] = None):  # noqa: UP007
        return cw

    def f2(cw: "CallWrapper" = None):
        return cw

    def f3(cw: "some.module.CallWrapper | None" = None):
        return cw

    for fn in (f1, f2, f3):
        args, kwargs = substitute_param_value(fn, (), {}, {CallWrapper: MARK})
        assert fn(*args, **kwargs) is MARK, fn.__name__


def test_unresolvable_annotation_is_left_alone():
    def fn(x: NotDefinedAnywhere, cw: CallWrapper = None):  # noqa: F821
        return x, cw

    assert injected_parameters(fn, CallWrapper) == ["cw"]
    args, kwargs = substitute_param_value(fn, (5,), {}, {CallWrapper: MARK})
    assert fn(*args, **kwargs) == (5, MARK)


def test_explicit_value_is_replaced_and_other_params_untouched():
    def fn(a, cw: CallWrapper, *rest, k: int = 1, **extra):
        return a, cw, rest, k, extra

    args, kwargs = substitute_param_value(fn, (1, None, 7), {"k": 2, "z": 0}, {CallWrapper: MARK})
    assert fn(*args, **kwargs) == (1, MARK, (7,), 2, {"z": 0})


def test_subclass_annotation_matches_and_unrelated_types_do_not():
    def fn(s: Special = None, n: int = 0, t: typing.Any = None):
        return s, n, t

    assert injected_parameters(fn, CallWrapper) == []  # Special is narrower than CallWrapper
    assert injected_parameters(fn, Special) == ["s"]


def test_no_annotation_means_no_injection():
    def fn(cw=None):
        return cw

    assert substitute_param_value(fn, (), {}, {CallWrapper: MARK}) == ((), {})
