"""A re-formed process group forms on the last group's TCPStore (engine/runtime._group_base): no new connection.

Each connection torch opens looks its peer's address up in reverse DNS; a resolver that drops some of
many such queries held a 32-rank re-form 5 s. These tests use a real TCPStore on loopback (one rank).
"""

import datetime
import os
import socket

import pytest
import torch.distributed as dist

from distnb.engine.process import abort, runtime

TIMEOUT = datetime.timedelta(seconds=5)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rank0(monkeypatch):
    monkeypatch.setattr(runtime.STATE, "rank", 0)
    monkeypatch.setattr(runtime.STATE, "world_size", 1)
    yield
    runtime._BASE.update(key=None, store=None, count=[0])
    abort.forget_store()


def test_a_kept_connection_answers_in_step_until_a_reply_is_out_of_step(rank0):
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, TIMEOUT)
    client, count = server.clone(), [0]
    assert all(abort.answers(client, count, 7) for _ in range(3)) and count == [3]
    other = server.clone()  # a stale reply would show as a counter that is not the one expected
    other.add(f"distnb/alive/7/{os.getpid()}", 5)
    assert not abort.answers(client, count, 7)


def test_a_connection_to_a_store_that_is_gone_does_not_answer(rank0):
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, TIMEOUT)
    client = server.clone()
    client.set_timeout(datetime.timedelta(seconds=1))
    del server  # rank 0 stopped serving it
    assert not abort.answers(client, [0], 0)


def test_a_re_form_on_the_same_port_reuses_the_store_and_a_new_port_does_not(rank0):
    port = _free_port()
    first = runtime._group_base("127.0.0.1", port, TIMEOUT, reuse=False)
    assert runtime._group_base("127.0.0.1", port, TIMEOUT, reuse=True) is first  # a re-form: no new store
    first.set("left-by-the-last-group", "1")
    del first  # nothing else holds it: the new one can bind the port again
    again = runtime._group_base("127.0.0.1", port, TIMEOUT, reuse=False)  # a start: a new store, same port
    assert again.port == port and not again.check(["left-by-the-last-group"])
    elsewhere = runtime._group_base("127.0.0.1", _free_port(), TIMEOUT, reuse=True)
    assert elsewhere is not again and elsewhere.port != port
