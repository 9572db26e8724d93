"""Connections to a cluster node are probed while a call waits on them: a node that vanishes
without closing its connections (a machine powered off) must show as sandbox_lost within 5 s
(docs/cluster.md, "Node loss"). TCP keepalive: idle 1 s, then a probe a second, the connection
dead after 3 unanswered (~4 s); with the shorter connect timeout of a node
(``call.NODE_CONNECT_TIMEOUT``), new calls fail as soon."""

from __future__ import annotations

import socket

NODE_KEEPALIVE = ((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
                  (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1),
                  (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1),
                  (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3))


def probe(sock: socket.socket) -> None:
    """Keepalive probes on a connection to a cluster node."""
    for level, opt, value in NODE_KEEPALIVE:
        sock.setsockopt(level, opt, value)
