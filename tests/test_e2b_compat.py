"""The stock ``e2b`` SDK (PyPI), sync and async, against corral's E2B front backed by the
session's real corrald: configured by environment variables only, as a user would.

Also attacks the front: no or wrong API key, a forged or another sandbox's access token, the
daemon's other sandboxes, and a sandbox trying to reach the front from inside.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

import corral

e2b = pytest.importorskip("e2b")
from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    NotFoundException,
    Sandbox,
    SandboxException,
    TimeoutException,
)

API_KEY = "e2b_" + secrets.token_hex(20)


class Front:
    def __init__(self) -> None:
        env = dict(os.environ, CORRAL_E2B_API_KEY=API_KEY)
        self.proc = subprocess.Popen([sys.executable, "-m", "corral.e2b", "serve", "--port",
                                      "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, text=True, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until it listens (or dies: "")
        m = re.match(r"listening on (http://127\.0\.0\.1:(\d+))", line)
        if not m:
            self.stop()
            raise RuntimeError(f"the front did not start: {line!r} {self.proc.stderr.read()}")
        self.url, self.port = m.group(1), int(m.group(2))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    f = Front()
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY",
                                            "E2B_DOMAIN", "E2B_DEBUG")}
    os.environ.update(E2B_API_URL=f.url, E2B_SANDBOX_URL=f.url, E2B_API_KEY=API_KEY)
    os.environ.pop("E2B_DEBUG", None)
    try:
        yield f
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for sb in corral.Sandbox.list({"corral.e2b": "1"}):
            sb.kill()
        f.stop()


@pytest.fixture
def sbx(front: Front) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=120)
    try:
        yield s
    finally:
        s.kill()


def wait_until(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


# ---- commands -----------------------------------------------------------------------------
def test_run_echo_and_users(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo hi")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "", 0)
    assert sbx.commands.run("whoami; pwd; echo $HOME").stdout == "user\n/home/user\n/home/user\n"
    assert sbx.commands.run("whoami; pwd", user="root").stdout == "root\n/root\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("echo $A-$B", envs={"A": "1", "B": "2"}).stdout == "1-2\n"
    assert sbx.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"


def test_create_env_and_metadata(front: Front) -> None:
    s = Sandbox.create(envs={"GREETING": "hello"}, metadata={"run": "m1"}, timeout=60)
    try:
        assert s.commands.run("echo $GREETING").stdout == "hello\n"
        info = s.get_info()
        assert info.metadata == {"run": "m1"} and info.sandbox_id == s.sandbox_id
        assert info.template_id == "base"
    finally:
        s.kill()


def test_exit_code_and_stderr(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo out; echo err >&2; exit 3")
    assert ei.value.exit_code == 3
    assert ei.value.stdout == "out\n" and ei.value.stderr == "err\n"


def test_streaming_callbacks(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    r = sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.1; done; echo oops >&2",
                         on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "line1\nline2\nline3\n" == r.stdout
    assert "".join(err) == "oops\n"
    assert len(out) >= 3  # delivered as they came, not at the end in one piece


def test_background_list_kill(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 60", background=True)
    assert h.pid > 1
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert h.kill() is True
    with pytest.raises(CommandExitException) as ei:
        h.wait()
    assert ei.value.exit_code == -1
    assert wait_until(lambda: h.pid not in [p.pid for p in sbx.commands.list()])
    assert sbx.commands.kill(h.pid) is False  # gone: not found


def test_background_stdin_and_connect(sbx: Sandbox) -> None:
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello ")
    h.send_stdin(b"world\n")
    h.close_stdin()
    assert h.wait().stdout == "hello world\n"
    slow = sbx.commands.run("sleep 0.5; echo done", background=True)
    again = sbx.commands.connect(slow.pid)
    assert again.wait().stdout.endswith("done\n")


def test_command_timeout_kills_it(sbx: Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30; echo never", timeout=1)
    assert time.monotonic() - t0 < 10
    # the command was killed in the sandbox, not left behind
    assert wait_until(lambda: "sleep 30" not in sbx.commands.run(
        "ps -eo args", user="root").stdout)


# ---- files --------------------------------------------------------------------------------
def test_files_roundtrip(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/a.txt", "alpha\n")
    assert info.path == "/home/user/a.txt" and info.name == "a.txt"
    assert sbx.files.read("/home/user/a.txt") == "alpha\n"
    assert sbx.files.read("a.txt") == "alpha\n"  # relative: from the user's home
    sbx.files.write("b.bin", b"\x00\x01\xff")
    assert bytes(sbx.files.read("b.bin", format="bytes")) == b"\x00\x01\xff"
    # written as the user, so the user's commands may change it
    assert sbx.commands.run("stat -c %U a.txt && echo more >> a.txt").stdout == "user\n"
    names = {e.name for e in sbx.files.list("/home/user")}
    assert {"a.txt", "b.bin"} <= names
    assert sbx.files.exists("/home/user/a.txt")
    assert sbx.files.make_dir("/home/user/d/e") is True
    assert sbx.files.make_dir("/home/user/d/e") is False  # already there
    assert sbx.commands.run("stat -c %U /home/user/d/e").stdout == "user\n"
    moved = sbx.files.rename("/home/user/a.txt", "/home/user/d/a.txt")
    assert moved.path == "/home/user/d/a.txt"
    assert sbx.files.read("/home/user/d/a.txt") == "alpha\nmore\n"
    deep = sbx.files.list("/home/user", depth=3)
    assert "/home/user/d/e" in {e.path for e in deep}
    st = sbx.files.get_info("/home/user/d")
    assert st.type is not None and st.type.value == "dir"
    sbx.files.remove("/home/user/d")
    assert not sbx.files.exists("/home/user/d")
    sbx.files.write_files([{"path": "/tmp/x/1", "data": "1"}, {"path": "/tmp/x/2", "data": "2"}])
    assert sbx.commands.run("cat /tmp/x/1 /tmp/x/2").stdout == "12"
    # parents made for the user are the user's: it can write next to its file
    sbx.files.write("/home/user/p/q/f.txt", "f")
    assert sbx.commands.run("touch /home/user/p/q/g && stat -c %U /home/user/p").stdout == "user\n"
    with pytest.raises(SandboxException):  # as in E2B, the user may not write into /root
        sbx.files.write("/root/nope.txt", "x")
    sbx.files.write("/root/r.txt", "r", user="root")
    assert sbx.commands.run("stat -c %U /root/r.txt", user="root").stdout == "root\n"


def test_large_file_as_user(sbx: Sandbox) -> None:
    """Past what a command's stdin carries, the daemon writes and hands the file over."""
    import hashlib

    data = secrets.token_bytes(9 << 20)
    sbx.files.write("/home/user/big.bin", data)
    r = sbx.commands.run("stat -c '%U %s' big.bin && sha256sum big.bin")
    assert r.stdout.splitlines() == [f"user {len(data)}",
                                     f"{hashlib.sha256(data).hexdigest()}  big.bin"]
    assert bytes(sbx.files.read("/home/user/big.bin", format="bytes")) == data
    # symlinks the user planted lead nowhere the user could not write: at the target, or a
    # directory on its way
    sbx.files.write("/etc/root-only.conf", "root's\n", user="root")
    sbx.commands.run("ln -sf /etc/root-only.conf /home/user/link.bin && "
                     "ln -sfn /etc /home/user/etc")
    with pytest.raises(SandboxException):
        sbx.files.write("/home/user/link.bin", data)
    assert sbx.files.read("/etc/root-only.conf") == "root's\n"
    with pytest.raises(SandboxException):
        sbx.files.write("/home/user/etc/planted.conf", data)
    assert not sbx.files.exists("/etc/planted.conf")
    assert sbx.commands.run("ls -A /tmp | grep -c corral-upload || true").stdout == "0\n"


def test_file_not_found(sbx: Sandbox) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/nope/nothing")
    with pytest.raises(FileNotFoundException):
        sbx.files.list("/nope")
    with pytest.raises(NotFoundException):
        sbx.files.remove("/nope")
    assert sbx.files.exists("/nope") is False


def test_watch_dir(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/w")
    h = sbx.files.watch_dir("/home/user/w")
    events: list = []
    try:
        def seen(kind: str) -> bool:
            events.extend(h.get_new_events())
            return any(e.name == "new.txt" and e.type.name == kind for e in events)

        sbx.files.write("/home/user/w/new.txt", "x")
        assert wait_until(lambda: seen("CREATE"))
        sbx.commands.run("rm /home/user/w/new.txt")
        assert wait_until(lambda: seen("REMOVE"))
    finally:
        h.stop()


# ---- lifecycle ----------------------------------------------------------------------------
def test_list_timeout_kill_not_found(front: Front) -> None:
    tag = secrets.token_hex(4)
    a = Sandbox.create(metadata={"t": tag}, timeout=60)
    try:
        listed = Sandbox.list(query=e2b.SandboxQuery(metadata={"t": tag})).next_items()
        assert [s.sandbox_id for s in listed] == [a.sandbox_id]
        end0 = a.get_info().end_at
        a.set_timeout(600)
        assert (a.get_info().end_at - end0).total_seconds() > 400
        b = Sandbox.connect(a.sandbox_id)
        assert b.commands.run("echo same").stdout == "same\n"
        assert b.get_metrics() == []
    finally:
        assert a.kill() is True
    assert Sandbox.kill(a.sandbox_id) is False  # already gone
    with pytest.raises(NotFoundException):
        Sandbox.connect(a.sandbox_id)
    with pytest.raises(SandboxException):  # SandboxNotRunningException: it was killed
        a.commands.run("echo x")


def test_ttl_expiry_is_not_running(front: Front) -> None:
    s = Sandbox.create(timeout=1)
    assert wait_until(lambda: not s.is_running(), timeout=15)
    with pytest.raises(TimeoutException):  # SandboxNotRunningException is one
        s.commands.run("echo late")


def test_pause_resume(front: Front) -> None:
    s = Sandbox.create(timeout=60)
    try:
        h = s.commands.run("sleep 30", background=True)
        s.pause()
        assert s.get_info().state.value == "paused"
        s2 = Sandbox.connect(s.sandbox_id)  # resumes it
        assert s2.get_info().state.value == "running"
        assert h.pid in [p.pid for p in s2.commands.list()]
    finally:
        s.kill()


# ---- async --------------------------------------------------------------------------------
def test_async_sdk(front: Front) -> None:
    async def main() -> None:
        s = await AsyncSandbox.create(timeout=60)
        try:
            got: list[str] = []
            r = await s.commands.run("echo a; echo b", on_stdout=got.append)
            assert r.stdout == "a\nb\n" and "".join(got) == "a\nb\n"
            await s.files.write("/home/user/f", "async")
            assert await s.files.read("/home/user/f") == "async"
            with pytest.raises(FileNotFoundException):
                await s.files.read("/home/user/missing")
            h = await s.commands.run("sleep 60", background=True)
            assert await h.kill() is True
            with pytest.raises(TimeoutException):
                await s.commands.run("sleep 30", timeout=1)
            ids = [x.sandbox_id for x in await AsyncSandbox.list().next_items()]
            assert s.sandbox_id in ids
            events: list = []
            w = await s.files.watch_dir("/home/user", on_event=events.append)
            await s.files.write("/home/user/watched", "w")
            deadline = time.monotonic() + 10
            while not any(e.name == "watched" for e in events) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await w.stop()
            assert any(e.name == "watched" for e in events)
            await s.set_timeout(120)
        finally:
            await s.kill()
        assert not await AsyncSandbox.kill(s.sandbox_id)

    asyncio.run(main())


# ---- attacks on the front -----------------------------------------------------------------
def test_api_key_required(front: Front) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_" + "0" * 40)
    for headers in ({}, {"X-API-KEY": ""}, {"X-API-KEY": API_KEY + "x"},
                    {"Authorization": f"Bearer {API_KEY}"}):
        r = httpx.get(front.url + "/v2/sandboxes", headers=headers)
        assert r.status_code == 401, headers


@pytest.mark.parametrize("key", [None, "short"])
def test_front_refuses_to_start_without_a_key(key: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_E2B_API_KEY"}
    args = [sys.executable, "-m", "corral.e2b", "serve", "--port", "0"]
    if key is not None:
        args += ["--api-key", key]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "listening" not in r.stdout, (r.stdout, r.stderr)


def test_access_token_is_per_sandbox(front: Front) -> None:
    a = Sandbox.create(timeout=60)
    b = Sandbox.create(timeout=60)
    try:
        body = b'{"path": "/etc/hostname"}'
        url = front.url + "/filesystem.Filesystem/Stat"
        base = {"Content-Type": "application/json", "E2b-Sandbox-Id": a.sandbox_id}
        tokens = [None, "", "0" * 64, b._envd_access_token, API_KEY]
        for tok in tokens:
            h = dict(base) if tok is None else dict(base, **{"X-Access-Token": tok})
            r = httpx.post(url, content=body, headers=h)
            assert r.status_code == 401, tok
            assert r.json()["code"] == "unauthenticated"
        r = httpx.get(front.url + "/files", params={"path": "/etc/hostname"},
                      headers=dict(base, **{"X-Access-Token": b._envd_access_token}))
        assert r.status_code == 401
        ok = httpx.post(url, content=body,
                        headers=dict(base, **{"X-Access-Token": a._envd_access_token}))
        assert ok.status_code == 200 and ok.json()["entry"]["name"] == "hostname"
    finally:
        a.kill()
        b.kill()


def test_other_sandboxes_are_invisible(front: Front) -> None:
    with corral.Sandbox(timeout=60) as own:
        ids = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert own.id not in ids
        with pytest.raises(NotFoundException):
            Sandbox.connect(own.id)
        assert Sandbox.kill(own.id) is False
        assert own.is_running()
        # the API key's holder can compute an access token for any id: envd's routes still
        # refuse a sandbox the front did not make
        from corral.e2b.auth import Keys

        h = {"E2b-Sandbox-Id": own.id, "X-Access-Token": Keys(API_KEY).access_token(own.id),
             "Content-Type": "application/json"}
        r = httpx.post(front.url + "/filesystem.Filesystem/Stat", headers=h,
                       content=b'{"path": "/etc/hostname"}')
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
        r = httpx.post(front.url + "/process.Process/Start", headers=h,
                       content=b'{"process": {"cmd": "/bin/true"}}')
        assert r.status_code == 401, r.text
        r = httpx.get(front.url + "/files", params={"path": "/etc/hostname"}, headers=h)
        assert r.status_code == 401, r.text
        assert own.exec("true").ok


def test_header_bytes_that_are_not_utf8_are_a_wrong_key(sbx: Sandbox, front: Front) -> None:
    r = httpx.get(front.url + "/v2/sandboxes", headers={"X-API-KEY": b"e2b_\xff\xfe" * 4})
    assert r.status_code == 401, r.text
    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": b"\xff" * 64,
         "Content-Type": "application/json"}
    r = httpx.post(front.url + "/filesystem.Filesystem/Stat", headers=h,
                   content=b'{"path": "/etc/hostname"}')
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
    h = dict(h, **{"E2b-Sandbox-Id": b"sb-\xff", "X-Access-Token": sbx._envd_access_token})
    r = httpx.post(front.url + "/filesystem.Filesystem/Stat", headers=h,
                   content=b'{"path": "/etc/hostname"}')
    assert r.status_code == 401, r.text


def test_bad_requests_are_4xx(front: Front) -> None:
    h = {"X-API-KEY": API_KEY, "Content-Type": "application/json"}
    for body in (b"", b"[]", b"{", b'{"templateID": 3}', b'{"templateID": "base", "timeout": -1}',
                 b'{"templateID": "base", "metadata": {"a": 1}}'):
        r = httpx.post(front.url + "/v2/sandboxes", content=body, headers=h)
        assert 400 <= r.status_code < 500, (body, r.text)
    r = httpx.post(front.url + "/v2/sandboxes", headers=h,
                   json={"templateID": "no-such-template-x"})
    assert r.status_code == 404


def test_sandbox_cannot_reach_the_front(sbx: Sandbox, front: Front) -> None:
    """From inside, the front's port answers nowhere: not on the sandbox's loopback, not on
    any address of the host."""
    host_ips = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    probe = ("import socket, sys\n"
             "ok = []\n"
             "for ip in sys.argv[2:]:\n"
             "    s = socket.socket(socket.AF_INET6 if ':' in ip else socket.AF_INET)\n"
             "    s.settimeout(1)\n"
             "    try:\n"
             "        s.connect((ip, int(sys.argv[1]))); ok.append(ip)\n"
             "    except OSError:\n"
             "        pass\n"
             "print('reached', ok)\n")
    for user in ("user", "root"):
        sbx.files.write("/tmp/probe.py", probe, user="root")
        r = sbx.commands.run(f"python3 /tmp/probe.py {front.port} 127.0.0.1 ::1 "
                             + " ".join(host_ips), user=user)
        assert r.stdout == "reached []\n", r.stdout
    # and the host can: the probe itself works
    assert httpx.get(front.url + "/v2/sandboxes", headers={"X-API-KEY": API_KEY}).status_code == 200


def test_bench_e2b_runs(front: Front) -> None:
    """The comparison script runs end to end (numbers are reported, not asserted)."""
    from corral.bench import e2b as bench

    res = bench.measure(rounds=2, warmup=1)
    for v in bench.VARIANTS:
        assert res["variants"][v]["total"]["n"] == 2
    print(bench.report(res))


def test_malformed_connect_requests_are_answered(sbx: Sandbox, front: Front) -> None:
    """Garbage on envd's Connect routes gets a Connect error, never a 500 or a hang."""
    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    base = front.url
    unary = dict(h, **{"Content-Type": "application/json"})
    for body in (b"", b"{", b"[1]", b'{"path": 5}', b'{"path": "/x\\u0000y"}', b"\xff\xfe",
                 b'{"path": "/x\\ud800"}'):
        r = httpx.post(base + "/filesystem.Filesystem/Stat", content=body, headers=unary)
        assert 400 <= r.status_code < 500 and isinstance(r.json()["code"], str), (body, r.text)
    # stdin that is not UTF-8 (a command's stdin is text in corral), a multipart upload cut
    # short: 4xx, never a 500
    proc = sbx.commands.run("cat", background=True)
    r = httpx.post(base + "/process.Process/SendInput", headers=unary,
                   json={"process": {"pid": proc.pid}, "input": {"stdin": "7A=="}})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    proc.kill()
    r = httpx.post(base + "/files", params={"path": "/tmp/up"}, content=b"--x\r\n",
                   headers=dict(h, **{"Content-Type": "multipart/form-data; boundary=x"}))
    assert 400 <= r.status_code < 500, r.text
    r = httpx.post(base + "/process.Process/Nope", content=b"{}", headers=unary)
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    stream = dict(h, **{"Content-Type": "application/connect+json"})
    for body in (b"", b"\x00\x00\x00", b"\x00\x00\x00\x00\x10{}", b"\x01\x00\x00\x00\x02{}",
                 b"\x00\x00\x00\x00\x02[]", b"\x00\x00\x00\x00\x02{}\x00\x00\x00\x00\x02{}",
                 b'\x00\x00\x00\x00\x14{"process": {}}   '):
        r = httpx.post(base + "/process.Process/Start", content=body, headers=stream, timeout=30)
        assert r.status_code == 200, body
        data = r.content
        assert data[0] == 0x02, (body, data)  # only the end-of-stream message
        end = json.loads(data[5:])
        assert end["error"]["code"] in ("invalid_argument", "unimplemented"), (body, end)
    # a Start whose program does not exist still ends properly (exit 127)
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("/no/such/program")
    assert ei.value.exit_code == 127
