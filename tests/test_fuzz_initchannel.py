"""Fuzz target: the wire format of a sandbox init's exec channel (corral-init.c's
``serve_one`` parses what corral/daemon/initexec.py encodes), in the manner of Cloud
Hypervisor's fuzzers.

Random and mutated requests go to the channel of a REAL init in a real sandbox (the test takes
its own copy of the channel, as the daemon does), inline or with their body in a memfd (sealed
or not, of any size, anywhere among the fds). For each one the init must answer; a request
that the wire format (modelled below from ``serve_one``) rejects must get exactly the errno the
model gives, start nothing and leave the init's fd table and memory map as they were; one it
accepts starts exactly one child. Every few examples a valid request (inline or memfd) must
still work, and at the end the daemon still runs commands in the sandbox.

``CORRAL_FUZZ_EXAMPLES`` (default 1000; a fifth of it for queued bursts) sets the number of
examples, e.g. 20000 for a long run.
To fuzz a new field of the request: add it to ``HEADER`` (name and struct code) with a
strategy for valid values in ``valid_header``, and its rule to ``expected_errno``.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

import corral
from corral import _core
from corral.daemon import initexec

EXAMPLES = int(os.environ.get("CORRAL_FUZZ_EXAMPLES", "1000"))
U32 = st.integers(0, 2**32 - 1)
ANSWER_S = 5.0

# The request header, in wire order: (name, struct code). Must match initexec._REQ.
HEADER: list[tuple[str, str]] = [
    ("magic", "I"), ("id", "I"), ("uid", "I"), ("gid", "I"), ("flags", "I"),
    ("ngroups", "I"), ("nargv", "I"), ("nenv", "I"), ("ncand", "I"),
]
HEADER_STRUCT = struct.Struct("=" + "".join(code for _, code in HEADER))
KNOWN_FLAGS = initexec.NULL_STDIN | initexec.SCOPE_UNIX | initexec.MEMFD
MAX_FDS = 12  # the init's control buffer holds 64 bytes: up to 12 fds, more is MSG_CTRUNC
# memfd seals (fcntl's F_SEAL_*; Python names only some)
SEAL, SHRINK, GROW, WRITE, FUTURE_WRITE, EXEC = 1, 2, 4, 8, 16, 32
SEALED = SEAL | SHRINK | GROW | WRITE  # what initexec.sealed_memfd sets, and the init needs
F_ADD_SEALS, F_GET_SEALS = 1033, 1034


@dataclass
class Fd:
    """One fd to attach: /dev/null, the read end of a pipe nobody writes to, or a memfd with
    ``body`` (then cut or grown to ``size``), ``seals`` and opened ``mode``: rw, wronly (not
    mappable) or path (O_PATH: no seals to read)."""

    kind: str = "null"
    body: bytes = b""
    seals: int = SEALED
    size: int | None = None
    mode: str = "rw"

    def length(self) -> int:
        return len(self.body) if self.size is None else self.size

    def content(self) -> bytes:
        if self.size is None:
            return self.body
        return self.body[:self.size] + bytes(max(0, self.size - len(self.body)))

    def _repr_pretty_(self, p: object, cycle: bool) -> None:  # hypothesis's printer
        p.text(repr(self))  # type: ignore[attr-defined]

    def __repr__(self) -> str:  # a failing example with a 4 MiB body stays readable
        if self.kind != "memfd":
            return f"Fd({self.kind!r})"
        body = self.body if len(self.body) <= 80 else self.body[:80] + b"..."
        return (f"Fd('memfd', body={body!r} ({len(self.body)} bytes), seals={self.seals}, "
                f"size={self.size}, mode={self.mode!r})")


def null_fds(n: int) -> list[Fd]:
    return [Fd() for _ in range(n)]


@dataclass
class Request:
    """One request as fields; ``head``, ``body`` and ``encode`` give the bytes (possibly
    inconsistent on purpose)."""

    header: dict[str, int]
    groups: list[int] = field(default_factory=list)
    argv: list[bytes] = field(default_factory=list)
    env: list[bytes] = field(default_factory=list)
    cands: list[bytes] = field(default_factory=list)
    cwd: bytes = b"/"

    def head(self) -> bytes:
        return HEADER_STRUCT.pack(*(self.header[name] for name, _ in HEADER))

    def body(self) -> bytes:
        """The groups and strings: after the header inline, or in the memfd."""
        strings = [*self.argv, *self.env, *self.cands, self.cwd]
        return (struct.pack(f"={len(self.groups)}I", *self.groups)
                + b"".join(s + b"\0" for s in strings))

    def encode(self) -> tuple[bytes, Fd | None]:
        """The message, and the memfd (last fd) if the MEMFD flag says so."""
        if self.header["flags"] & initexec.MEMFD:
            return self.head(), Fd("memfd", self.body())
        return self.head() + self.body(), None


def test_model_matches_the_encoder():
    """The model above is initexec's format: same header size, same bytes for a request,
    inline and in a memfd; and the model takes what the encoder makes."""
    assert HEADER_STRUCT.size == initexec._REQ.size
    msg, body = initexec.encode(7, ["/bin/true", "x"], {"A": "1"}, "/tmp", 1, 2, [3, 4],
                                ["/bin/true"], True)
    assert body is None  # small enough to travel inline
    req = Request(header=dict(magic=initexec.REQ_MAGIC, id=7, uid=1, gid=2,
                              flags=initexec.NULL_STDIN, ngroups=2, nargv=2, nenv=1, ncand=1),
                  groups=[3, 4], argv=[b"/bin/true", b"x"], env=[b"A=1"],
                  cands=[b"/bin/true"], cwd=b"/tmp")
    assert req.encode() == (msg, None)
    assert expected_errno(msg, null_fds(2)) == 0
    env = {f"V{i}": "x" for i in range(initexec.MAX_STRINGS)}  # past what a message holds
    msg, body = initexec.encode(8, ["/bin/true"], env, "/", 0, 0, [5] * 70, ["/bin/true"],
                                False, True)
    assert body is not None
    req = Request(header=dict(magic=initexec.REQ_MAGIC, id=8, uid=0, gid=0,
                              flags=initexec.SCOPE_UNIX | initexec.MEMFD, ngroups=70, nargv=1,
                              nenv=len(env), ncand=1),
                  groups=[5] * 70, argv=[b"/bin/true"],
                  env=[f"{k}={v}".encode() for k, v in env.items()], cands=[b"/bin/true"])
    assert req.head() == msg and req.body() == body
    assert expected_errno(msg, [*null_fds(3), Fd("memfd", body)]) == 0


def _parse(body: bytes, h: dict[str, int]) -> int:
    """The groups, then exactly nargv + nenv + ncand + 1 NUL-terminated strings (the cwd
    last), and nothing after them."""
    p = 4 * h["ngroups"]
    if p > len(body):
        return errno.EINVAL
    rest = body[p:]
    need = h["nargv"] + h["nenv"] + h["ncand"] + 1
    return 0 if rest.endswith(b"\0") and rest.count(b"\0") == need else errno.EINVAL


def expected_errno(data: bytes, fds: list[Fd]) -> int:
    """0 if the init must start a child for this message with these fds attached (in this
    order, however split into SCM_RIGHTS messages: the kernel joins them into one), else the
    errno it must answer: ``serve_one``'s checks, in its order."""
    if len(data) < HEADER_STRUCT.size:
        return errno.EINVAL
    h = dict(zip((name for name, _ in HEADER), HEADER_STRUCT.unpack_from(data), strict=True))
    if h["magic"] != initexec.REQ_MAGIC:
        return errno.EINVAL
    if len(data) > initexec.MAX_MSG or len(fds) > MAX_FDS:
        return errno.EMSGSIZE  # MSG_TRUNC, MSG_CTRUNC
    big = bool(h["flags"] & initexec.MEMFD)
    want_fds = (2 if h["flags"] & initexec.NULL_STDIN else 3) + big
    max_groups = initexec.MAX_BIG_GROUPS if big else initexec.MAX_GROUPS
    max_strings = initexec.MAX_BIG_STRINGS if big else initexec.MAX_STRINGS
    if (h["flags"] & ~KNOWN_FLAGS or len(fds) != want_fds or h["ngroups"] > max_groups
            or h["nargv"] == 0 or h["ncand"] == 0
            or h["nargv"] + h["nenv"] + h["ncand"] > max_strings):
        return errno.EINVAL
    if not big:
        return _parse(data[HEADER_STRUCT.size:], h)
    memfd = fds[-1]
    sealed = (memfd.kind == "memfd" and memfd.mode != "path"
              and memfd.seals & SEALED == SEALED)
    if len(data) != HEADER_STRUCT.size or not sealed or memfd.length() <= 0:
        return errno.EINVAL
    if memfd.length() > initexec.MAX_BIG:
        return errno.E2BIG
    if memfd.mode == "wronly":
        return errno.EACCES  # mmap(PROT_READ) of a write-only fd
    return _parse(memfd.content(), h)


def accepted(data: bytes, fds: list[Fd]) -> bool:
    """Whether the init must start a child for this message with these fds."""
    return expected_errno(data, fds) == 0


# ---- strategies -------------------------------------------------------------------------
name = st.binary(min_size=1, max_size=24).map(lambda b: b.replace(b"\0", b"\1"))
valid_path = st.sampled_from([b"/bin/true", b"/usr/bin/true", b"/nonexistent", b"true"])
stdio_fd = st.sampled_from(["null", "null", "pipe"]).map(Fd)


@st.composite
def valid_header(draw: st.DrawFn, n: dict[str, int], big: bool) -> dict[str, int]:
    flags = draw(st.sampled_from([0, initexec.NULL_STDIN, initexec.SCOPE_UNIX,
                                  initexec.NULL_STDIN | initexec.SCOPE_UNIX]))
    return dict(magic=initexec.REQ_MAGIC, id=draw(U32), uid=draw(st.sampled_from([0, 65534])),
                gid=draw(st.sampled_from([0, 65534])),
                flags=flags | (initexec.MEMFD if big else 0), **n)


@st.composite
def valid_request(draw: st.DrawFn, big: bool | None = None) -> Request:
    """A request the init must accept: inline (up to every limit of a message) or in a memfd
    (up to every limit of a memfd, or small)."""
    if big is None:
        big = draw(st.booleans())
    groups = draw(st.lists(st.integers(0, 65534), max_size=4))
    argv = [draw(valid_path), *draw(st.lists(name, max_size=3))]
    env = draw(st.lists(name.map(lambda b: b"K=" + b), max_size=3))
    cands = [argv[0]] if argv[0].startswith(b"/") else [b"/usr/bin/" + argv[0]]
    cwd = draw(st.sampled_from([b"/", b"/tmp", b"/nonexistent"]))
    max_groups = initexec.MAX_BIG_GROUPS if big else initexec.MAX_GROUPS
    max_strings = initexec.MAX_BIG_STRINGS if big else initexec.MAX_STRINGS
    # At a limit, or (memfd) just past what a message holds: built, not drawn, as it is large.
    grow = draw(st.sampled_from(["none", "none", "groups", "strings", "bytes", "max_bytes"]))
    if grow == "groups":
        want = draw(st.sampled_from([max_groups, initexec.MAX_GROUPS + 1] if big
                                    else [max_groups]))
        groups += [65534] * (want - len(groups))
    elif grow == "strings":
        want = draw(st.sampled_from([max_strings, initexec.MAX_STRINGS + 1] if big
                                    else [max_strings]))
        env += [b"E%d=" % i for i in range(want - len(argv) - len(env) - len(cands))]
    elif grow in ("bytes", "max_bytes"):  # a long cwd (chdir fails: the child falls back to /)
        limit = initexec.MAX_BIG if big else initexec.MAX_MSG - HEADER_STRUCT.size
        if grow == "bytes" and big:
            limit = initexec.MAX_MSG + draw(st.integers(0, 64))
        req = Request({}, groups, argv, env, cands, b"")
        cwd = b"/" + b"d" * (limit - len(req.body()) - 1)
    n = dict(ngroups=len(groups), nargv=len(argv), nenv=len(env), ncand=len(cands))
    return Request(header=draw(valid_header(n, big)), groups=groups, argv=argv, env=env,
                   cands=cands, cwd=cwd)


@st.composite
def valid_message(draw: st.DrawFn, big: bool | None = None) -> tuple[bytes, list[Fd]]:
    req = draw(valid_request(big))
    data, memfd = req.encode()
    stdio = [draw(stdio_fd) for _ in range(2 if req.header["flags"] & initexec.NULL_STDIN
                                            else 3)]
    return data, stdio + ([memfd] if memfd else [])


def _mutate_bytes(draw: st.DrawFn, data: bytes, limit: int) -> bytes:
    cut = draw(st.sampled_from(["none", "truncate", "flip", "append", "drop_nul", "oversize"]))
    if cut == "truncate" and data:
        return data[:draw(st.integers(0, len(data) - 1))]
    if cut == "flip" and data:
        i = draw(st.one_of(st.integers(0, len(data) - 1),
                           st.integers(max(0, len(data) - 32), len(data) - 1)))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    if cut == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    if cut == "drop_nul":
        return data.rstrip(b"\0")
    if cut == "oversize":
        return data + b"\1" * (limit + 1 - len(data) + draw(st.integers(0, 64)))
    return data


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, list[Fd]]:
    """A valid request with one or more mutations (of its fields, its bytes, its memfd or its
    fds), and the fds to attach."""
    req = draw(valid_request())
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["field", "field_big", "flags", "groups", "strings"]))
        if kind == "field":  # any header field to any value
            req.header[draw(st.sampled_from([n for n, _ in HEADER]))] = draw(U32)
        elif kind == "field_big":  # counts at or just past their limits
            f = draw(st.sampled_from(["ngroups", "nargv", "nenv", "ncand"]))
            req.header[f] = draw(st.sampled_from(
                [0, initexec.MAX_GROUPS, initexec.MAX_GROUPS + 1, initexec.MAX_STRINGS,
                 initexec.MAX_STRINGS + 1, initexec.MAX_BIG_GROUPS + 1,
                 initexec.MAX_BIG_STRINGS, initexec.MAX_BIG_STRINGS + 1, 2**31, 2**32 - 1]))
        elif kind == "flags":  # a known flag toggled, or an unknown one set
            req.header["flags"] ^= draw(st.sampled_from(
                [initexec.NULL_STDIN, initexec.SCOPE_UNIX, initexec.MEMFD, 8, 1 << 31]))
        elif kind == "groups":
            req.groups = draw(st.lists(U32, max_size=80))
        else:
            req.argv = draw(st.lists(st.binary(max_size=16), max_size=6))
    data, memfd = req.encode()
    if memfd is None:
        data = _mutate_bytes(draw, data, initexec.MAX_MSG)
    else:
        where = draw(st.sampled_from(["none", "header", "body"]))
        if where == "header":  # anything inline past the header
            data = _mutate_bytes(draw, data, initexec.MAX_MSG)
        elif where == "body":
            memfd.body = _mutate_bytes(draw, memfd.body, initexec.MAX_BIG)
    nstdio = 2 if req.header["flags"] & initexec.NULL_STDIN else 3
    fds = [draw(stdio_fd) for _ in range(nstdio)] + ([memfd] if memfd else [])
    for _ in range(draw(st.integers(0, 2))):
        fds = draw(_mutate_fds(fds, req.body()))
    return data, fds


@st.composite
def _mutate_fds(draw: st.DrawFn, fds: list[Fd], body: bytes) -> list[Fd]:
    fds = list(fds)
    memfds = [i for i, f in enumerate(fds) if f.kind == "memfd"]
    kind = draw(st.sampled_from(["seals", "size", "mode", "move", "replace", "add", "drop",
                                 "random"]))
    if kind in ("seals", "size", "mode") and memfds:
        f = fds[draw(st.sampled_from(memfds))]
        if kind == "seals":
            f.seals = draw(st.sampled_from([0, SEAL, SEALED & ~SEAL, SEALED & ~SHRINK,
                                            SEALED & ~GROW, SEALED & ~WRITE, SEALED | EXEC,
                                            SEALED | FUTURE_WRITE, SHRINK | GROW | WRITE | EXEC,
                                            SEALED | EXEC | FUTURE_WRITE]))
        elif kind == "size":  # cut, grown (zeros), empty, past the limit
            n = len(f.body)
            f.size = draw(st.sampled_from([0, 1, max(0, n - 1), n + 1, initexec.MAX_BIG,
                                           initexec.MAX_BIG + 1, 2**31 + 5])
                          | st.integers(0, max(0, n - 1)))
        else:
            f.mode = draw(st.sampled_from(["wronly", "path"]))
    elif kind == "move" and len(fds) > 1:  # the memfd (or any fd) elsewhere than last
        i = draw(st.integers(0, len(fds) - 1))
        fds.insert(draw(st.integers(0, len(fds) - 1)), fds.pop(i))
    elif kind == "replace" and fds:  # a memfd where a stdio fd goes, or the other way round
        i = draw(st.integers(0, len(fds) - 1))
        fds[i] = draw(st.sampled_from(["null", "pipe", "memfd"]).map(
            lambda k: Fd(k, body if k == "memfd" else b"")))
    elif kind == "add":  # one more: a second memfd, or a stray fd
        extra = draw(st.sampled_from(["null", "memfd"]).map(
            lambda k: Fd(k, body if k == "memfd" else b"")))
        fds.insert(draw(st.integers(0, len(fds))), extra)
    elif kind == "drop" and fds:
        fds.pop(draw(st.integers(0, len(fds) - 1)))
    elif kind == "random":
        fds = null_fds(draw(st.integers(0, 16)))
    return fds


@st.composite
def split(draw: st.DrawFn, msg: tuple[bytes, list[Fd]]) -> tuple[bytes, list[list[Fd]]]:
    """The fds in one SCM_RIGHTS control message or several (the kernel joins them)."""
    data, fds = msg
    cuts = sorted(draw(st.lists(st.integers(0, len(fds)), max_size=2)))
    bounds = [0, *cuts, len(fds)]
    return data, [fds[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


raw = st.tuples(st.binary(max_size=256), st.integers(0, 5).map(null_fds))
message = st.one_of(raw, mutated(), valid_message()).flatmap(split)


_VALID = initexec.encode(9, ["/bin/true"], {}, "/", 0, 0, [], ["/bin/true"], True)[0]
_BIG_HEAD, _BIG_BODY = initexec.encode(10, ["/bin/true"], {}, "/", 0, 0, [1] * 100,
                                       ["/bin/true"], True)
assert _BIG_BODY is not None


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

    def maps(self) -> int:
        """How many mappings the init has: a memfd request's are undone after it."""
        with open(f"/proc/{self.init_pid}/maps") as f:
            return sum(1 for _ in f)

    def send(self, data: bytes, groups: list[list[Fd]]) -> None:
        """One message with each group of fds in an SCM_RIGHTS control message of its own."""
        made: list[int] = []
        try:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                    array.array("i", [self._open(f, made) for f in g])) for g in groups if g]
            self.sock.sendmsg([data], anc)
        finally:
            for fd in made:
                os.close(fd)

    def _open(self, f: Fd, made: list[int]) -> int:
        if f.kind == "null":
            return self.null
        if f.kind == "pipe":  # the read end; nobody writes (EOF for a child's stdin)
            r, w = os.pipe2(os.O_CLOEXEC)
            os.close(w)
            made.append(r)
            return r
        fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        made.append(fd)
        view = memoryview(f.body)
        while view:
            view = view[os.write(fd, view):]
        if f.size is not None:
            os.ftruncate(fd, f.size)
        if f.mode != "rw":  # reopened before the seals (a write seal refuses a writer later)
            mode = os.O_WRONLY if f.mode == "wronly" else os.O_PATH
            fd = os.open(f"/proc/self/fd/{fd}", mode | os.O_CLOEXEC)
            made.append(fd)
        if f.seals:
            fcntl.fcntl(made[-2] if f.mode != "rw" else fd, F_ADD_SEALS, f.seals)
        return fd

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


def check_burst(ch: InitChannel, msgs: list[tuple[bytes, list[list[Fd]]]]) -> None:
    """Send the messages back to back (the init drains its queue in one go), then read an
    answer for each in order: the model's errno, or a started child (waited for)."""
    fds_before, maps_before = ch.fd_count(), ch.maps()
    assert ch.tasks() == {ch.init_pid}
    sent: list[tuple[bytes, int]] = []
    for data, groups in msgs:
        want = expected_errno(data, [f for g in groups for f in g])
        try:
            ch.send(data, groups)
        except OSError as e:  # the kernel refused it (EMSGSIZE...): nothing reached the init
            assert want != 0 and not isinstance(e, BlockingIOError), e
            continue
        sent.append((data, want))
    pidfds: list[int] = []
    try:
        for data, want in sent:
            answer, fds = ch.answer()
            reply = answer[-1]
            assert reply[1] == (HEADER_STRUCT.unpack_from(data)[1]
                                if len(data) >= HEADER_STRUCT.size else 0), answer
            if want == 0:
                pidfds += fds
                assert reply[2] > 0 and len(fds) == 1, (answer, fds)
            else:
                for fd in fds:
                    os.close(fd)
                assert reply[2] == -want and fds == [] and len(answer) == 1, (want, answer, fds)
        if not pidfds:
            assert ch.tasks() == {ch.init_pid}, "a rejected request started something"
    finally:
        for fd in pidfds:
            _wait_exit(fd)
    assert ch.alive()
    # Every fd the requests carried is closed again (the init's table does not grow), and a
    # memfd's mappings are gone; the init does both just after it answers.
    deadline = time.monotonic() + ANSWER_S
    while ((ch.fd_count(), ch.maps()) != (fds_before, maps_before)
           and time.monotonic() < deadline):
        time.sleep(0.001)
    assert ch.fd_count() == fds_before, (msgs, ch.fd_count(), fds_before)
    assert ch.maps() == maps_before, (msgs, ch.maps(), maps_before)


def check_serves(ch: InitChannel, big: bool = False) -> None:
    """A valid request works: inline, or (big) with 2,000 env strings in a sealed memfd."""
    env = {f"V{i}": "x" for i in range(2000)} if big else {}
    msg, body = initexec.encode(1, ["/bin/sh", "-c", "exit 7"], env, "/", 0, 0, [],
                                ["/bin/sh"], True)
    assert (body is not None) == big
    memfd = initexec.sealed_memfd(body) if body is not None else -1
    try:
        fds = [ch.null, ch.null] + ([memfd] if memfd >= 0 else [])
        ch.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    finally:
        if memfd >= 0:
            os.close(memfd)
    msgs, fds = ch.answer()
    assert msgs[-1][2] > 0 and len(fds) == 1, msgs
    assert _wait_exit(fds[0]) == 7


# No shrinking: each failing step waits for an answer that does not come; the failing example
# is reported as drawn.
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                 HealthCheck.large_base_example])
@given(msg=message, n=st.integers(0, 15))
# Found before: an empty message went unanswered and stopped the init draining its queue; fds
# past the first four, or in a second SCM_RIGHTS message, stayed open in the init; a memfd
# carrying F_SEAL_EXEC too (every memfd under vm.memfd_noexec) was refused.
@example(msg=(b"", []), n=0)
@example(msg=(_VALID, [null_fds(6)]), n=0)
@example(msg=(_VALID, [null_fds(2), null_fds(3)]), n=0)
@example(msg=(_VALID, [null_fds(1), null_fds(1)]), n=1)
@example(msg=(_VALID, [null_fds(12)]), n=0)
@example(msg=(_VALID, [null_fds(13)]), n=0)
@example(msg=(_BIG_HEAD, [[Fd(), Fd(), Fd("memfd", _BIG_BODY)]]), n=1)
@example(msg=(_BIG_HEAD, [[Fd(), Fd(), Fd("memfd", _BIG_BODY, seals=SEALED | EXEC)]]), n=1)
@example(msg=(_BIG_HEAD, [[Fd(), Fd("memfd", _BIG_BODY), Fd()]]), n=0)
@example(msg=(_BIG_HEAD, [[Fd(), Fd(), Fd("memfd", _BIG_BODY, seals=0)]]), n=0)
@example(msg=(_BIG_HEAD, [[Fd(), Fd(), Fd("memfd", _BIG_BODY, seals=SEALED & ~WRITE)]]), n=0)
@example(msg=(_BIG_HEAD, [[Fd(), Fd(), Fd("memfd", _BIG_BODY, mode="wronly")]]), n=0)
@example(msg=(_BIG_HEAD, [[Fd(), Fd(), Fd("memfd", _BIG_BODY, size=len(_BIG_BODY) - 1)]]),
         n=0)
@example(msg=(_BIG_HEAD, [[Fd(), Fd(), Fd("memfd", _BIG_BODY, size=initexec.MAX_BIG + 1)]]),
         n=0)
@example(msg=(_BIG_HEAD + b"\0", [[Fd(), Fd(), Fd("memfd", _BIG_BODY)]]), n=0)
def test_fuzz_init_channel(channel, msg, n):
    data, groups = msg
    fds = [f for g in groups for f in g]
    big = max((f.length() for f in fds if f.kind == "memfd"), default=-1)
    event(f"{errno.errorcode.get(expected_errno(data, fds), 'started')}"
          + ("" if big < 0 else " (memfd over 64 KiB)" if big > initexec.MAX_MSG
             else " (memfd)"))
    check_burst(channel, [msg])
    if n <= 1:  # now and then: a valid request still works, inline and in a memfd
        check_serves(channel, big=n == 1)


# A few messages queued at once: each gets its own answer, in order, and none's fds or memfd
# outlive it or reach the next (the init keeps its buffers between messages).
@settings(max_examples=max(1, EXAMPLES // 5), deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                 HealthCheck.large_base_example])
@given(msgs=st.lists(message.filter(lambda m: len(m[0]) <= 8192), min_size=2, max_size=4))
@example(msgs=[(_BIG_HEAD, [[Fd(), Fd(), Fd("memfd", _BIG_BODY)]]), (_VALID, [null_fds(3)]),
               (_VALID[:-1], [null_fds(2)]), (_VALID, [null_fds(2)])])
def test_fuzz_init_channel_queued(channel, msgs):
    check_burst(channel, msgs)
    check_serves(channel, big=len(msgs) % 2 == 0)


def test_init_serves_after_the_fuzz(channel):
    check_serves(channel)
    check_serves(channel, big=True)
    assert channel.alive()
