"""A MASTER_ADDR that does not resolve ends the rank with one line and exit 4 before the
rendezvous (training/environment.check_master_addr): the rendezvous would retry the name until
train.collective_timeout_s. A temporary failure of the resolver is left to the rendezvous."""

from __future__ import annotations

import socket

import pytest

from megatron_branchnorm.training import environment, stop_signals
from megatron_branchnorm.training.exit_codes import PEER_LOST_EXIT_CODE


class Stopped(Exception):
    """What the patched stop_now raises instead of ending the process."""


@pytest.fixture
def rendezvous(monkeypatch):
    """init_process_group with the process end and the rendezvous replaced by records: the
    stop line and code, and whether anything after the name check ran."""
    seen: dict = {"entered": []}

    def stop_now(line: str, code: int):
        seen["stop"] = (line, code)
        raise Stopped

    def entered(what: str):
        def record(*args, **kwargs):
            seen["entered"].append(what)
            raise Stopped

        return record

    monkeypatch.setattr(stop_signals, "stop_now", stop_now)
    monkeypatch.setattr(environment, "bind_device", entered("bind_device"))
    monkeypatch.setattr(environment, "load_shm_comm_op", entered("load_shm_comm_op"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    return seen


def test_a_name_that_does_not_resolve_is_one_line_and_exit_4(rendezvous, monkeypatch):
    def unknown(host, port, *args, **kwargs):
        assert host == "no such host!"
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    monkeypatch.setenv("MASTER_ADDR", "no such host!")
    with pytest.raises(Stopped):
        environment.init_process_group(600.0)
    assert rendezvous["entered"] == []  # neither the device, the op build nor the rendezvous
    line, code = rendezvous["stop"]
    assert code == PEER_LOST_EXIT_CODE == 4
    assert line == (
        "error: rank 1: MASTER_ADDR 'no such host!' does not resolve (Name or service not "
        "known): check MASTER_ADDR"
    )


def test_the_real_resolver_refuses_an_invalid_name(rendezvous, monkeypatch):
    """The same through the machine's resolver, with names no resolver knows (a space, an
    over-long label); skipped where the resolver itself is unavailable (EAI_AGAIN)."""
    for name, why in [("no such host!", "("), ("a" * 70 + ".example", "too long")]:
        try:
            socket.getaddrinfo(name, None)
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_AGAIN:
                pytest.skip("the resolver is unavailable on this machine")
        except UnicodeError:
            pass
        monkeypatch.setenv("MASTER_ADDR", name)
        with pytest.raises(Stopped):
            environment.init_process_group(600.0)
        line, code = rendezvous.pop("stop")
        assert code == 4 and "\n" not in line and why in line
        assert line.startswith(f"error: rank 1: MASTER_ADDR '{name}' does not resolve (")
        assert rendezvous["entered"] == []


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost"])
def test_a_name_that_resolves_goes_on_to_the_rendezvous(rendezvous, monkeypatch, name):
    monkeypatch.setenv("MASTER_ADDR", name)
    with pytest.raises(Stopped):
        environment.init_process_group(600.0)
    assert "stop" not in rendezvous and rendezvous["entered"] == ["bind_device"]


def test_a_resolver_that_fails_for_now_is_left_to_the_rendezvous(rendezvous, monkeypatch):
    def later(*args, **kwargs):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", later)
    monkeypatch.setenv("MASTER_ADDR", "head-node")
    with pytest.raises(Stopped):
        environment.init_process_group(600.0)
    assert "stop" not in rendezvous and rendezvous["entered"] == ["bind_device"]
