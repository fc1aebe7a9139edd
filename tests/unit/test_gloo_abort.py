"""gloo_abort: tracking of group creation is installed and removed in matched pairs."""

from __future__ import annotations

import os

import pytest
from torch.distributed import distributed_c10d as c10d

from nvrx.inprocess import gloo_abort

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")


@pytest.fixture()
def original():
    factory = c10d._new_process_group_helper
    assert not gloo_abort.installed()
    yield factory
    while gloo_abort.installed():
        gloo_abort.uninstall()
    c10d._new_process_group_helper = factory


def test_nested_installs_restore_the_factory_with_the_last_uninstall(original):
    assert gloo_abort.install() and gloo_abort.install()
    patched = c10d._new_process_group_helper
    assert patched is not original and patched.__wrapped__ is original
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is patched
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is original
    assert not gloo_abort.installed()
    gloo_abort.uninstall()  # one too many: nothing happens
    assert c10d._new_process_group_helper is original


def test_tracking_block_patches_only_inside(original):
    with gloo_abort.tracking() as active:
        assert active and gloo_abort.installed()
        assert c10d._new_process_group_helper is not original
    assert c10d._new_process_group_helper is original


def test_tracking_block_restores_after_an_exception(original):
    with pytest.raises(KeyError), gloo_abort.tracking():
        raise KeyError("x")
    assert c10d._new_process_group_helper is original


def test_a_later_wrapper_of_the_factory_is_left_in_place(original):
    gloo_abort.install()

    def theirs(*args, **kwargs):
        return original(*args, **kwargs)

    c10d._new_process_group_helper = theirs
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is theirs
