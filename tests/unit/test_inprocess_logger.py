"""The ``nvrx.inprocess`` logger during Wrapper calls: set up by each call, put back after the last."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from nvrx.inprocess import Wrapper
from nvrx.inprocess.logging import LOGGER_NAME, release_logger, setup_logger


def _ours(logger: logging.Logger) -> list[logging.Handler]:
    return [h for h in logger.handlers if getattr(h, "_nvrx_inprocess", False)]


def test_the_logger_is_put_back_after_the_last_call():
    logger = logging.getLogger(LOGGER_NAME)
    user = logging.NullHandler()
    logger.addHandler(user)
    before = (logger.propagate, logger.level)
    try:
        setup_logger()
        setup_logger()  # a nested Wrapper call
        assert len(_ours(logger)) == 1 and logger.propagate is False
        release_logger()  # the inner call ends: the outer one still logs
        assert len(_ours(logger)) == 1
        release_logger()
        assert _ours(logger) == []
        assert (logger.propagate, logger.level) == before
        assert user in logger.handlers  # the user's own handler stays
        release_logger()  # one release too many changes nothing
        assert _ours(logger) == [] and user in logger.handlers
    finally:
        logger.removeHandler(user)


def test_a_call_that_cannot_start_leaves_the_logger_as_it_was(monkeypatch):
    """A wrong rank fails the call after the logger was set up; an initialized
    torch.distributed fails it before, with the reference's ``ValueError``."""
    logger = logging.getLogger(LOGGER_NAME)
    before = (list(logger.handlers), logger.propagate, logger.level)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK"):
        Wrapper()(lambda: None)()
    assert (list(logger.handlers), logger.propagate, logger.level) == before
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="already initialized"):
            Wrapper()(lambda: None)()
    finally:
        dist.destroy_process_group()
    assert (list(logger.handlers), logger.propagate, logger.level) == before
