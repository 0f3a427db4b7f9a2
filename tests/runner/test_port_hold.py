"""The ranks' rendezvous port is never free between its choice and its use (runner/launch.py
HeldPort, runner/ranks.py, training/environment.host_rendezvous).

A port chosen by binding port 0 and closing the socket lies in the ephemeral range, from which
every process's port-0 sockets and outgoing connections draw: in the seconds before rank 0
bound it again, another socket could take it ("MASTER_PORT 127.0.0.1:P is already in use", seen
with three runs started side by side). Now the port is held listening from its choice on, and
rank 0 hosts the store on the very socket it inherits; the ports no socket can be handed over
for (the deepspeed launcher's, the local SLURM cluster's) come from outside the ephemeral range.
"""

from __future__ import annotations

import errno
import random
import socket
import subprocess
import sys

import pytest

from megatron_branchnorm.runner import launch
from megatron_branchnorm.runner.launch import HeldPort, ephemeral_ports, quiet_ports
from megatron_branchnorm.runner.ranks import start_ranks
from tests.pipeline.conftest import ROOT
from tests.port_churn import PortChurn


def _bind(port: int) -> socket.socket | None:
    """A socket bound to 127.0.0.1:``port`` (what another program's socket can do), or None
    when the port is in use."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        assert exc.errno == errno.EADDRINUSE
        return None
    return sock


def test_a_port_chosen_and_released_can_be_taken_before_rank_0_binds_it():
    """The old way (bind port 0, close, let rank 0 bind it later): the port is an ephemeral one
    and, once released, any socket may take it; rank 0's bind then fails."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert port in ephemeral_ports()
    other = _bind(port)  # the churn's socket, given this port by the system
    assert other is not None
    try:
        assert _bind(port) is None  # rank 0: address already in use
    finally:
        other.close()


def test_a_held_port_cannot_be_taken_until_rank_0_has_it():
    with HeldPort() as held:
        assert _bind(held.port) is None
        # rank 0 inherits the socket; the launcher's copy closes, the port stays held
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
            pass_fds=(held.fileno(),),
        )
    try:
        assert _bind(held.port) is None
    finally:
        child.stdin.close()
        child.wait()


def test_quiet_ports_lie_outside_the_ephemeral_range_and_are_free():
    taken = ephemeral_ports()
    base = quiet_ports(4)
    assert base is not None and base >= 1024 and base + 3 <= 65535
    assert not any(p in taken for p in range(base, base + 4))
    socks = [_bind(p) for p in range(base, base + 4)]
    assert None not in socks
    for sock in socks:
        sock.close()


def test_quiet_ports_choose_again_after_a_port_in_use(monkeypatch):
    busy = quiet_ports(1)
    holder = _bind(busy)
    assert holder is not None
    picks: list[int] = []
    choice = random.choice

    def busy_first(starts):
        picks.append(busy if not picks else choice(starts))
        return picks[-1]

    monkeypatch.setattr(random, "choice", busy_first)
    try:
        free = quiet_ports(1)
        assert picks[0] == busy and free == picks[-1] != busy
    finally:
        holder.close()


def test_quiet_ports_follow_the_systems_range(monkeypatch, tmp_path):
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("1024\t65530\n")  # everything but 65531..65535 is ephemeral
    monkeypatch.setattr(launch, "IP_LOCAL_PORT_RANGE", str(narrow))
    assert ephemeral_ports() == range(1024, 65531)
    base = quiet_ports(2)
    assert base is None or 65531 <= base <= 65534
    assert quiet_ports(6) is None  # 5 ports outside the range: never 6 in a row


RENDEZVOUS = """
import torch
from megatron_branchnorm.training import environment

environment.setup_process_env()
rank, world = environment.init_process_group(120.0)
total = torch.ones(1)
torch.distributed.all_reduce(total)
assert (world, total.item()) == (2, 2.0), (world, total)
environment.destroy_process_group()
"""


@pytest.mark.distributed
def test_two_ranks_meet_beside_a_churn_of_ephemeral_ports(tmp_path):
    """The trainer's rendezvous (setup_process_env, init_process_group: DeepSpeed's
    init_distributed over gloo) for 2 ranks started by start_ranks, while another process keeps
    most of the ephemeral range bound and cycling. With the port chosen and released first, the
    churn took it before rank 0 bound it in 10 of 10 tries (2 s apart)."""
    with PortChurn() as churn:
        ranks = start_ranks(2, ["-c", RENDEZVOUS], tmp_path, module=None, cwd=ROOT)
        codes = ranks.wait(timeout=300)
    logs = "".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2))
    assert codes == [0, 0], logs
    assert churn.binds > churn.hold
