"""A busy machine's ephemeral ports, for the tests that start ranks beside it.

:class:`PortChurn` runs this file as a process that binds port 0 on 127.0.0.1 over and over,
holding ``hold`` sockets at a time and closing the oldest for each new one: the system hands
out most of its ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) and keeps
cycling through it, as other programs' sockets and outgoing connections do. A port chosen
and released before its user binds it is taken meanwhile most of the time.
"""

from __future__ import annotations

import collections
import os
import resource
import select
import socket
import subprocess
import sys

HOLD = 16_000
"""Sockets held at a time (about half of Linux's default range of 28,232 ports)."""


class PortChurn:
    """The churn process (module docstring), from ``with`` to the end of the block; entering
    waits until it holds ``hold`` sockets."""

    def __init__(self, hold: int = HOLD) -> None:
        self.hold = hold
        self.binds = 0
        """The ports the churn took, in all (read when the block has ended)."""
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> PortChurn:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(self.hold)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            self._proc.kill()
            raise RuntimeError(f"the port churn did not start: {ready!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.stdin.close()  # the churn ends when its stdin does
        self.binds = int(self._proc.stdout.read().strip() or 0)
        self._proc.wait()


def churn(hold: int) -> None:
    """Bind port 0 ``hold`` times, say "ready", then keep closing the oldest socket and binding
    a new one until stdin closes; print how many ports were bound."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hold + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, hold + 64), hard))
    held: collections.deque[socket.socket] = collections.deque()
    binds = 0
    announced = False
    while True:
        if len(held) >= hold:
            held.popleft().close()
            if not announced:
                print("ready", flush=True)
                announced = True
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", 0))
        except OSError:  # the range is exhausted for a moment: give one back
            sock.close()
            held.popleft().close()
            continue
        held.append(sock)
        binds += 1
        if announced and binds % 256 == 0 and select.select([sys.stdin], [], [], 0)[0]:
            if not os.read(sys.stdin.fileno(), 1):
                break
    print(binds, flush=True)


if __name__ == "__main__":
    churn(int(sys.argv[1]))
