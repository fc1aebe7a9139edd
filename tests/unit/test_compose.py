"""Compose: right-to-left order, argument chaining, common-ancestor type."""

from __future__ import annotations

import abc
import warnings

import pytest

from nvrx.inprocess.compose import Compose
from nvrx.inprocess.finalize import Finalize
from nvrx.inprocess.initialize import Initialize, RetryController


class Append(Initialize):
    def __init__(self, tag):
        self.tag = tag

    def __call__(self, trail):
        return trail + [self.tag]


def test_last_argument_runs_first():
    assert Compose(Append("a"), Append("b"), Append("c"))([]) == ["c", "b", "a"]


def test_composed_object_is_an_instance_of_the_common_base():
    composed = Compose(Append("a"), RetryController())
    assert isinstance(composed, Initialize) and isinstance(composed, Compose)
    assert not isinstance(composed, Finalize)
    nested = Compose(composed, Append("z"))
    assert isinstance(nested, Initialize)


def test_nested_compose_keeps_order():
    inner = Compose(Append("b"), Append("c"))
    assert Compose(Append("a"), inner)([]) == ["c", "b", "a"]


def test_tuples_are_splatted_into_the_next_step():
    assert Compose(lambda a, b: a * b, lambda x: (x, x + 1))(3) == 12


def test_step_returning_none_with_arguments_warns():
    with pytest.warns(UserWarning, match="returned None"):
        Compose(lambda x: x, lambda x: None)(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Compose(lambda: None, lambda: None)() is None


def test_abstract_common_base_is_satisfied_by_compose():
    class Base(abc.ABC):
        @abc.abstractmethod
        def __call__(self, x): ...

    class Impl(Base):
        def __call__(self, x):
            return x + 1

    class Other(Base):
        def __call__(self, x):
            return x * 10

    composed = Compose(Impl(), Other())
    assert isinstance(composed, Base) and not isinstance(composed, Impl)
    assert composed(1) == 11


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="at least one"):
        Compose()
    with pytest.raises(TypeError, match="argument 1 must be callable"):
        Compose(Append("a"), 3)
