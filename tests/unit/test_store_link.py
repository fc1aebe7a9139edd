"""The supervisor's side of its node agent (``StoreLink``): when an answer counts as late."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

from nvrx.supervisor import store_link as store_link_module
from nvrx.supervisor.store_link import StoreLink, StoreLinkError


@pytest.fixture
def link() -> Iterator[tuple[StoreLink, int]]:
    """A link whose agent is two pipes this test holds: what the link asks is drained, what
    the test writes is the agent's answer."""
    req_r, req_w = os.pipe()
    ans_r, ans_w = os.pipe()
    link = StoreLink("127.0.0.1", 1, timeout=0.0)  # every answer is past its deadline
    link._to_agent, link._from_agent = req_w, ans_r
    try:
        yield link, ans_w
    finally:
        for fd in (req_r, req_w, ans_r, ans_w):
            os.close(fd)


def test_an_answer_that_waits_past_the_deadline_is_read_not_counted_lost(
    link: tuple[StoreLink, int],
) -> None:
    # a supervisor that was itself stopped (a frozen node) finds its agent's answer waiting
    store_link, agent = link
    os.write(agent, b'{"id": 1, "value": 7}\n')
    assert store_link.add("k") == 7
    assert store_link.lost is None


def test_an_answer_written_just_after_the_deadline_is_read(
    link: tuple[StoreLink, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a frozen node thaws past the deadline: its agent writes the answer it has a moment later
    store_link, agent = link
    # a last look that outlasts the timer's 0.2 s however late a loaded machine runs it
    monkeypatch.setattr(store_link_module, "_LAST_LOOK_S", 60.0)
    late = threading.Timer(0.2, os.write, (agent, b'{"id": 1, "value": 8}\n'))
    late.start()
    try:
        assert store_link.add("k") == 8
    finally:
        late.join()


def test_no_answer_by_the_deadline_is_a_lost_store(link: tuple[StoreLink, int]) -> None:
    store_link, _agent = link
    with pytest.raises(StoreLinkError, match="no answer to add 'k' within the store timeout"):
        store_link.add("k")
    assert store_link.lost == "no answer to add 'k' within the store timeout"
    # the main loop hears of it (it fails over, else stops): a node does not go deaf
    assert store_link.has_events
    assert store_link.read_events() == [{"event": "lost", "message": store_link.lost}]
    with pytest.raises(StoreLinkError):
        store_link.add("k")
    assert store_link.read_events() == []  # said once
    os.write(_agent, b'{"event": "lost", "message": "store gone"}\n')  # the agent finds it too
    assert store_link.read_events() == []


def test_an_agent_gone_when_asked_is_a_lost_event_once() -> None:
    req_r, req_w = os.pipe()
    ans_r, ans_w = os.pipe()
    os.close(req_r)  # nobody reads the requests: writing one fails (EPIPE)
    link = StoreLink("127.0.0.1", 1, timeout=5.0)
    link._to_agent, link._from_agent = req_w, ans_r
    try:
        with pytest.raises(StoreLinkError, match="node agent is gone"):
            link.add("k")
        os.close(ans_w)  # then its answers end too: no second loss
        ans_w = -1
        assert link.read_events() == [{"event": "lost", "message": link.lost}]
        assert link.read_events() == []
    finally:
        for fd in (req_w, ans_r, ans_w):
            if fd >= 0:
                os.close(fd)


def test_events_past_the_deadline_do_not_hold_the_request_off_its_loss(
    link: tuple[StoreLink, int],
) -> None:
    # the last look past the deadline is one: events the agent keeps writing (none the
    # answer) do not renew it; the writer has far more to write than the look lasts
    store_link, agent = link
    done = threading.Event()

    def chatter() -> None:
        for _ in range(100):
            if done.wait(0.1):
                return
            os.write(agent, b'{"event": "rank_in_round", "pid": 7}\n')

    writer = threading.Thread(target=chatter)
    writer.start()
    try:
        with pytest.raises(StoreLinkError, match="no answer to add 'k'"):
            store_link.add("k")
        assert writer.is_alive()  # it still had events to write
    finally:
        done.set()
        writer.join()
    assert store_link.read_events()[0] == {"event": "rank_in_round", "pid": 7}


def test_the_link_knows_when_the_store_last_answered(link: tuple[StoreLink, int]) -> None:
    """A request's answer, and the agent's ``lost`` report, tell when the store was last
    seen alive: a loss of its host counts from there."""
    store_link, agent = link
    before = time.time()
    os.write(agent, b'{"id": 1, "value": 7}\n')
    assert store_link.add("k") == 7
    answered = store_link.answered_wall
    assert answered is not None and before <= answered <= time.time()
    os.write(agent, b'{"event": "lost", "message": "gone", "answered_wall": 1.0}\n')  # older
    store_link.read_events()
    assert store_link.lost == "gone" and store_link.answered_wall == answered
    store_link.lost, later = None, answered + 5.0
    line = {"event": "lost", "message": "gone again", "answered_wall": later}
    os.write(agent, (json.dumps(line) + "\n").encode())
    store_link.read_events()
    assert store_link.answered_wall == later
