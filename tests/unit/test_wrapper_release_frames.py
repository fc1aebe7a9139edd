"""``wrap.release_frames``: an exception leaving the Wrapper stops holding nvrx's locals.

Without it the call (store connections, monitor handles, rounds) lives on in a
reference cycle with the exception until the garbage collector runs
(``tests/multiproc/test_wrapper_leaks.py`` shows it with real calls).
"""

from __future__ import annotations

import traceback

from nvrx.inprocess.compose import Compose
from nvrx.inprocess.wrap import release_frames


def _frames(exc: BaseException) -> dict[str, object]:
    found = {}
    tb = exc.__traceback__
    while tb is not None:
        found[tb.tb_frame.f_code.co_name] = tb.tb_frame
        tb = tb.tb_next
    return found


def _raise_through_nvrx(marker: object, message: str) -> BaseException:
    def user_step(value: object) -> object:
        mine = value
        raise RuntimeError(f"{message} {mine is marker}")

    try:
        Compose(user_step)(marker)  # Compose.__call__ is an nvrx frame with locals
    except RuntimeError as exc:
        return exc
    raise AssertionError("user_step did not raise")


def test_nvrx_frames_lose_their_locals_user_frames_keep_theirs():
    marker = object()
    exc = _raise_through_nvrx(marker, "user fault")
    frames = _frames(exc)
    assert frames["__call__"].f_locals  # type: ignore[attr-defined]
    release_frames(exc)
    assert frames["__call__"].f_locals == {}  # type: ignore[attr-defined]
    assert frames["user_step"].f_locals["mine"] is marker  # type: ignore[attr-defined]
    text = "".join(traceback.format_exception(exc))
    assert "compose.py" in text and "user_step" in text and "user fault True" in text


def test_the_exceptions_of_the_chain_are_released_too():
    marker = object()
    first = _raise_through_nvrx(marker, "first")
    try:
        try:
            raise first
        except RuntimeError:
            raise KeyboardInterrupt("leaving") from None
    except KeyboardInterrupt as exc:
        second = exc
    assert second.__context__ is first
    release_frames(second)
    assert _frames(first)["__call__"].f_locals == {}  # type: ignore[attr-defined]
    assert _frames(first)["user_step"].f_locals["mine"] is marker  # type: ignore[attr-defined]
