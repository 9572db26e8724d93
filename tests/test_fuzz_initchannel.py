"""Fuzz target: the wire format of a sandbox init's exec channel (corral-init.c parses what
corral/daemon/initexec.py encodes), in the manner of Cloud Hypervisor's fuzzers.

Random and mutated requests go to the channel of a REAL init in a real sandbox (the test takes
its own copy of the channel, as the daemon does). For each one the init must answer; a request
that the wire format (modelled below from initexec's docstring) rejects must get an error
answer, start nothing and leave the init's fd table as it was; one it accepts starts exactly
one child. Every few examples a valid request must still work, and at the end the daemon still
runs commands in the sandbox.

``CORRAL_FUZZ_EXAMPLES`` (default 300) sets the number of examples, e.g. 20000 for a long run.
To fuzz a new field of the request: add it to ``HEADER`` (name and struct code) with a
strategy for valid values in ``valid_header``, and its rule to ``accepted``.
"""

from __future__ import annotations

import array
import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import corral
from corral import _core
from corral.daemon import initexec

EXAMPLES = int(os.environ.get("CORRAL_FUZZ_EXAMPLES", "300"))
U32 = st.integers(0, 2**32 - 1)
ANSWER_S = 5.0

# The request header, in wire order: (name, struct code). Must match initexec._REQ.
HEADER: list[tuple[str, str]] = [
    ("magic", "I"), ("id", "I"), ("uid", "I"), ("gid", "I"), ("flags", "I"),
    ("ngroups", "I"), ("nargv", "I"), ("nenv", "I"), ("ncand", "I"),
]
HEADER_STRUCT = struct.Struct("=" + "".join(code for _, code in HEADER))
FDS_PER_CMSG_MAX = 12  # the init's control buffer holds 64 bytes: up to 12 fds in one cmsg


@dataclass
class Request:
    """One request as fields; ``encode`` gives the bytes (possibly inconsistent on purpose)."""

    header: dict[str, int]
    groups: list[int] = field(default_factory=list)
    argv: list[bytes] = field(default_factory=list)
    env: list[bytes] = field(default_factory=list)
    cands: list[bytes] = field(default_factory=list)
    cwd: bytes = b"/"

    def encode(self) -> bytes:
        strings = [*self.argv, *self.env, *self.cands, self.cwd]
        return (HEADER_STRUCT.pack(*(self.header[name] for name, _ in HEADER))
                + struct.pack(f"={len(self.groups)}I", *self.groups)
                + b"".join(s + b"\0" for s in strings))


def test_model_matches_the_encoder():
    """The model above is initexec's format: same header size, same bytes for a request."""
    assert HEADER_STRUCT.size == initexec._REQ.size
    msg, body = initexec.encode(7, ["/bin/true", "x"], {"A": "1"}, "/tmp", 1, 2, [3, 4],
                                ["/bin/true"], True)
    assert body is None  # small enough to travel inline
    req = Request(header=dict(magic=initexec.REQ_MAGIC, id=7, uid=1, gid=2,
                              flags=initexec.NULL_STDIN, ngroups=2, nargv=2, nenv=1, ncand=1),
                  groups=[3, 4], argv=[b"/bin/true", b"x"], env=[b"A=1"],
                  cands=[b"/bin/true"], cwd=b"/tmp")
    assert req.encode() == msg


def accepted(data: bytes, nfds: list[int]) -> bool:
    """Whether the init must start a child for this message with these fd groups attached
    (one SCM_RIGHTS message each): the format's rules, from initexec's docstring."""
    nfds = [n for n in nfds if n > 0]  # an empty group is not sent
    if len(data) > initexec.MAX_MSG or len(data) < HEADER_STRUCT.size:
        return False
    if len(nfds) > 1 or sum(nfds) > FDS_PER_CMSG_MAX:
        return False  # a second group, or more than the control buffer holds: truncated
    h = dict(zip((name for name, _ in HEADER), HEADER_STRUCT.unpack_from(data), strict=True))
    want_fds = 2 if h["flags"] & initexec.NULL_STDIN else 3
    if (h["magic"] != initexec.REQ_MAGIC or sum(nfds) != want_fds
            or h["ngroups"] > initexec.MAX_GROUPS or h["nargv"] == 0 or h["ncand"] == 0
            or h["nargv"] + h["nenv"] + h["ncand"] > initexec.MAX_STRINGS):
        return False
    p = HEADER_STRUCT.size + 4 * h["ngroups"]
    if p > len(data):
        return False
    need = h["nargv"] + h["nenv"] + h["ncand"] + 1  # and the cwd
    return data[p:].count(b"\0") >= need


# ---- strategies -------------------------------------------------------------------------
name = st.binary(min_size=1, max_size=24).filter(lambda b: b"\0" not in b)
valid_path = st.sampled_from([b"/bin/true", b"/usr/bin/true", b"/nonexistent", b"true"])


@st.composite
def valid_header(draw: st.DrawFn, n: dict[str, int]) -> dict[str, int]:
    return dict(magic=initexec.REQ_MAGIC, id=draw(U32), uid=draw(st.sampled_from([0, 65534])),
                gid=draw(st.sampled_from([0, 65534])),
                flags=draw(st.sampled_from([0, initexec.NULL_STDIN])), **n)


@st.composite
def valid_request(draw: st.DrawFn) -> Request:
    groups = draw(st.lists(st.integers(0, 65534), max_size=4))
    argv = [draw(valid_path), *draw(st.lists(name, max_size=3))]
    env = draw(st.lists(name.map(lambda b: b"K=" + b), max_size=3))
    cands = [argv[0]] if argv[0].startswith(b"/") else [b"/usr/bin/" + argv[0]]
    n = dict(ngroups=len(groups), nargv=len(argv), nenv=len(env), ncand=len(cands))
    return Request(header=draw(valid_header(n)), groups=groups, argv=argv, env=env,
                   cands=cands, cwd=draw(st.sampled_from([b"/", b"/tmp", b"/nonexistent"])))


def right_fds(data: bytes) -> list[int]:
    flags = HEADER_STRUCT.unpack_from(data)[4] if len(data) >= HEADER_STRUCT.size else 0
    return [2 if flags & initexec.NULL_STDIN else 3]


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """A valid request with one or more mutations, and the fd groups to attach."""
    req = draw(valid_request())
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "field_big", "groups", "strings"]))
        if kind == "field":  # any header field to any value
            req.header[draw(st.sampled_from([n for n, _ in HEADER]))] = draw(U32)
        elif kind == "field_big":  # counts just past their limits
            f = draw(st.sampled_from(["ngroups", "nargv", "nenv", "ncand"]))
            req.header[f] = draw(st.sampled_from(
                [0, initexec.MAX_GROUPS + 1, initexec.MAX_STRINGS, initexec.MAX_STRINGS + 1,
                 2**31, 2**32 - 1]))
        elif kind == "groups":
            req.groups = draw(st.lists(U32, max_size=80))
        else:
            req.argv = draw(st.lists(st.binary(max_size=16), max_size=6))
    data = req.encode()
    cut = draw(st.sampled_from(["none", "truncate", "flip", "append", "drop_nul", "oversize"]))
    if cut == "truncate" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif cut == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    elif cut == "append":
        data += draw(st.binary(max_size=64))
    elif cut == "drop_nul":
        data = data.rstrip(b"\0")
    elif cut == "oversize":
        data += b"\1" * (initexec.MAX_MSG + 1 - len(data) + draw(st.integers(0, 64)))
    fds = draw(st.one_of(st.just(right_fds(data)),
                         st.lists(st.integers(0, 16), max_size=3)))
    return data, fds


raw = st.tuples(st.binary(max_size=256), st.lists(st.integers(0, 5), max_size=2))
message = st.one_of(raw, mutated(),
                    valid_request().map(lambda r: (r.encode(), right_fds(r.encode()))))


_VALID = initexec.encode(9, ["/bin/true"], {}, "/", 0, 0, [], ["/bin/true"], True)[0]


# ---- the real init ----------------------------------------------------------------------
class InitChannel:
    """Our own copy of a sandbox init's channel, and what we watch of the init."""

    def __init__(self, init_pid: int) -> None:
        self.init_pid = init_pid
        pidfd = os.pidfd_open(init_pid)
        try:
            self.sock = socket.socket(fileno=_core.init_channel(pidfd))
        finally:
            os.close(pidfd)
        self.sock.setblocking(False)
        self.null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        self.procs = _procs_file(init_pid)

    def close(self) -> None:
        self.sock.close()
        os.close(self.null)

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.init_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.init_pid}/fd"))

    def tasks(self) -> set[int]:
        with open(self.procs) as f:
            return {int(x) for x in f.read().split()}

    def send(self, data: bytes, nfds: list[int]) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.null] * n))
               for n in nfds if n > 0]
        self.sock.sendmsg([data], anc)

    def answer(self) -> tuple[list[tuple[int, int, int, int]], list[int]]:
        """Messages up to and including the REPLY, and the fds they carried."""
        got: list[tuple[int, int, int, int]] = []
        fds: list[int] = []
        poll = select.poll()
        poll.register(self.sock, select.POLLIN)
        while True:
            assert poll.poll(ANSWER_S * 1000), "the init did not answer"
            data, anc, _, _ = self.sock.recvmsg(64, socket.CMSG_SPACE(16),
                                                socket.MSG_CMSG_CLOEXEC)
            assert data, "the init closed its channel"
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", payload[: len(payload) - len(payload) % 4])
            assert len(data) == initexec._REPLY.size, data
            msg = initexec._REPLY.unpack(data)
            got.append(msg)
            if msg[0] == initexec.REPLY_MAGIC:
                return got, fds
            assert msg[0] == initexec.FAIL_MAGIC, msg


def _procs_file(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if "pids" in ctrls.split(","):
                return f"/sys/fs/cgroup/pids{path}/cgroup.procs"
            if ctrls == "":
                v2 = f"/sys/fs/cgroup{path}/cgroup.procs"
    return v2


def _wait_exit(pidfd: int) -> int:
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    if not poll.poll(ANSWER_S * 1000):
        os.close(pidfd)
        raise AssertionError("a started child did not finish")
    # The init reaps it; PIDFD_GET_INFO tells its status once that happened (POLLHUP).
    poll = select.poll()
    poll.register(pidfd, select.POLLHUP)
    poll.poll(ANSWER_S * 1000)
    code = initexec.exit_code(pidfd)
    os.close(pidfd)
    return -1 if code is None else code


@pytest.fixture(scope="module")
def channel(daemon):
    # Never exec'd through the daemon: nobody else reads this channel's answers.
    sb = corral.Sandbox(timeout=600)
    ch = InitChannel(sb.info().init_pid)
    try:
        yield ch
    finally:
        ch.close()
        try:
            assert sb.exec("echo still").stdout == "still\n"  # the daemon's channel works
        finally:
            sb.kill()


def check_one(ch: InitChannel, data: bytes, nfds: list[int]) -> None:
    fds_before, tasks_before = ch.fd_count(), ch.tasks()
    assert tasks_before == {ch.init_pid}
    try:
        ch.send(data, nfds)
    except OSError as e:  # the kernel refused it (EMSGSIZE...): nothing reached the init
        assert not accepted(data, nfds), e
        return
    msgs, fds = ch.answer()
    reply = msgs[-1]
    if accepted(data, nfds):
        assert reply[2] > 0 and len(fds) == 1, (msgs, fds)
        _wait_exit(fds[0])
    else:
        assert reply[2] < 0 and fds == [] and len(msgs) == 1, (msgs, fds)
        assert ch.tasks() == {ch.init_pid}, "a rejected request started something"
    assert ch.alive()
    # Every fd the request carried is closed again (the init's table does not grow); the init
    # closes them just after it answers.
    deadline = time.monotonic() + ANSWER_S
    while ch.fd_count() != fds_before and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ch.fd_count() == fds_before, (nfds, ch.fd_count(), fds_before)


def check_serves(ch: InitChannel) -> None:
    msg, body = initexec.encode(1, ["/bin/sh", "-c", "exit 7"], {}, "/", 0, 0, [], ["/bin/sh"],
                                True)
    assert body is None
    ch.send(msg, [2])
    msgs, fds = ch.answer()
    assert msgs[-1][2] > 0 and len(fds) == 1, msgs
    assert _wait_exit(fds[0]) == 7


# No shrinking: each failing step waits for an answer that does not come; the failing example
# is reported as drawn.
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(msg=message, n=st.integers(0, 15))
# Found before: an empty message went unanswered and stopped the init draining its queue; fds
# past the first four, or in a second SCM_RIGHTS group, stayed open in the init.
@example(msg=(b"", []), n=0)
@example(msg=(_VALID, [6]), n=0)
@example(msg=(_VALID, [2, 3]), n=0)
@example(msg=(_VALID, [12]), n=0)
def test_fuzz_init_channel(channel, msg, n):
    data, nfds = msg
    check_one(channel, data, nfds)
    if n == 0:  # now and then: a valid request still works
        check_serves(channel)


def test_init_serves_after_the_fuzz(channel):
    check_serves(channel)
    assert channel.alive()
