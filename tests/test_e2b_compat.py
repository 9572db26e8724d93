"""The stock ``e2b`` SDK (PyPI), sync and async, against corral's E2B front backed by the
session's real corrald: configured by environment variables only, as a user would.

Also attacks the front: no or wrong API key, a forged or another sandbox's access token, the
daemon's other sandboxes, a sandbox trying to reach the front from inside, and a sandbox's token
holder trying to use up the front (streams, watchers, memory).
"""

from __future__ import annotations

import asyncio
import hashlib
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
from corral.e2b.auth import Keys

e2b = pytest.importorskip("e2b")
from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxException,
    TimeoutException,
)

API_KEY = "e2b_" + secrets.token_hex(20)


class Front:
    def __init__(self, key: str = API_KEY) -> None:
        env = dict(os.environ, CORRAL_E2B_API_KEY=key)
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
        for sb in corral.Sandbox.list({"corral.e2b": Keys(API_KEY).front_label()}):
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


def test_adversarial_outputs_arrive_as_corral_decodes_them(sbx: Sandbox) -> None:
    """The fidelity fuzz's outputs (tests/test_output_fidelity.py: invalid UTF-8 split
    between reads, encoded surrogates, NULs, an unfinished last character...) through the
    front: stdout and stderr are corral's text of them (``bytes.decode("utf-8",
    "replace")``, to the last character), the exit code the command's."""
    from test_output_fidelity import GEN, _plan_file, make_plan

    sbx.files.write("/tmp/gen.py", GEN)
    seeds = [s for s in range(40) if "late" not in make_plan(s) and "hang" not in
             make_plan(s) and make_plan(s)["cap"] >= 4 << 20][:4]
    for seed in [7, *seeds]:  # 7: stdout is one byte, b"\xe2"
        plan = make_plan(seed)
        sbx.files.write(f"/tmp/plan{seed}", _plan_file(plan))
        try:
            r = sbx.commands.run(f"python3 /tmp/gen.py /tmp/plan{seed}", timeout=60)
            code, out, err = r.exit_code, r.stdout, r.stderr
        except CommandExitException as e:
            code, out, err = e.exit_code, e.stdout, e.stderr
        assert out == plan["out"].decode("utf-8", "replace"), seed
        assert err == plan["err"].decode("utf-8", "replace"), seed
        signum = plan.get("signal")
        assert code == (plan["exit"] if signum is None else 128 + signum) or signum, seed


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
    # as envd: a destination's missing directories are made, as the user
    moved = sbx.files.rename("/home/user/d/a.txt", "/home/user/n1/n2/a.txt")
    assert moved.path == "/home/user/n1/n2/a.txt"
    assert sbx.commands.run("stat -c %U /home/user/n1/n2").stdout == "user\n"
    with pytest.raises(FileNotFoundException):
        sbx.files.rename("/home/user/no-such", "/home/user/n3/x")
    assert not sbx.files.exists("/home/user/n3")
    sbx.files.rename("/home/user/n1/n2/a.txt", "/home/user/d/a.txt")
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


def test_a_name_that_is_not_utf8_is_listed_and_watched(sbx: Sandbox) -> None:
    """The agent names a file with bytes that are not UTF-8. envd's clients parse strings
    strictly: the listing came back `internal` (an error the agent made, read as the
    platform's), a watch stream broke and a watcher went silent for good. Such a name comes
    with U+FFFD for each byte that is not UTF-8; the rest of the answer is whole."""
    sbx.files.make_dir("/home/user/nb")
    h = sbx.files.watch_dir("/home/user/nb")
    events: list = []
    try:
        sbx.commands.run("cd /home/user/nb && touch \"$(printf 'bad\\377name')\" ok.txt")
        names = sorted(e.name for e in sbx.files.list("/home/user/nb"))
        assert names == ["bad\ufffdname", "ok.txt"], names

        def seen() -> bool:
            events.extend(h.get_new_events())
            return {"bad\ufffdname", "ok.txt"} <= {e.name for e in events}

        assert wait_until(seen), events
        sbx.files.write("/home/user/nb/later.txt", "x")  # the watch goes on after it
        assert wait_until(lambda: seen() and any(e.name == "later.txt" for e in events))
    finally:
        h.stop()


def test_a_recursive_watch_of_a_big_tree_stays_out_of_the_log(sbx: Sandbox) -> None:
    """The agent makes 2,000 directories and the client watches them recursively: events
    still come, each poll is one ``files.tree`` call that is not logged (before, one logged
    ``list`` per directory per poll: ~3,000 entries a second in the sandbox's trajectory for
    5,000 directories, and most of a core of corrald), and a tree past what a watcher
    follows ends the watcher with ``resource_exhausted``, not corrald's time."""
    from corral.e2b.filesystem import MAX_WATCHED

    sbx.commands.run("mkdir -p /home/user/t && cd /home/user/t && seq 2000 | xargs mkdir",
                     timeout=120)
    before = len(corral.Sandbox.connect(sbx.sandbox_id).log())
    h = sbx.files.watch_dir("/home/user/t", recursive=True)
    try:
        events: list = []

        def seen(name: str) -> bool:
            events.extend(h.get_new_events())
            return any(e.name == name for e in events)

        sbx.files.write("/home/user/t/1999/deep.txt", "x")
        assert wait_until(lambda: seen("1999/deep.txt"), 30)
        sbx.commands.run("touch /home/user/t/7/other")
        assert wait_until(lambda: seen("7/other"), 30)
    finally:
        h.stop()
    ops = [e.op for e in corral.Sandbox.connect(sbx.sandbox_id).log()[before:]]
    assert "list" not in ops, ops.count("list")
    sbx.commands.run(f"cd /home/user/t && seq 3000 {MAX_WATCHED + 1000} | xargs touch",
                     timeout=120)
    with pytest.raises(SandboxException, match="entries to watch"):
        sbx.files.watch_dir("/home/user/t", recursive=True)


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


def test_a_front_with_another_key_sees_none_of_this_ones_sandboxes(sbx: Sandbox) -> None:
    """Two fronts on one daemon credential, each with its API key: the sandboxes one makes
    are labelled with a fingerprint of its key, and the other lists, connects to, enters and
    kills none of them (with the same label for all, the second front read a file of the
    first's sandbox and killed it)."""
    other_key = "e2b_" + secrets.token_hex(20)
    other = Front(other_key)
    try:
        api = {"X-API-KEY": other_key}
        r = httpx.get(other.url + "/v2/sandboxes", headers=api)
        assert r.status_code == 200 and sbx.sandbox_id not in r.text, r.text
        r = httpx.get(other.url + f"/v2/sandboxes/{sbx.sandbox_id}", headers=api)
        assert r.status_code == 404, r.text
        r = httpx.delete(other.url + f"/v2/sandboxes/{sbx.sandbox_id}", headers=api)
        assert r.status_code == 404, r.text
        h = {"E2b-Sandbox-Id": sbx.sandbox_id,
             "X-Access-Token": Keys(other_key).access_token(sbx.sandbox_id)}
        r = httpx.get(other.url + "/files", params={"path": "/etc/hostname"}, headers=h)
        assert r.status_code == 401, r.text
        assert sbx.is_running()
    finally:
        other.stop()


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


def test_hostile_bodies_are_4xx_and_an_upload_is_never_written_short(sbx: Sandbox,
                                                                    front: Front) -> None:
    """A gzip upload cut short was inflated as far as it went and written, a shorter file
    answered 200 (aiohttp checks a deflate stream's end, not a gzip one's); a corrupt one,
    a signal that is a list, JSON nested 100,000 deep and a bad part header were 500s.
    Each is a 4xx now, and a whole gzip or deflate upload is written whole."""
    import gzip
    import zlib

    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    data = os.urandom(100_000) * 3
    packed = gzip.compress(data)
    up = dict(h, **{"Content-Type": "application/octet-stream"})

    def upload(body: bytes, encoding: str, path: str) -> httpx.Response:
        return httpx.post(front.url + "/files", params={"path": path, "username": "root"},
                          content=body, headers=dict(up, **{"Content-Encoding": encoding}))

    for body, encoding in ((packed[:len(packed) // 2], "gzip"), (packed[:-8], "gzip"),
                           (packed[:20] + b"\x00" * 50 + packed[70:], "gzip"),
                           (packed + b"tail", "gzip"), (b"not compressed", "deflate")):
        r = upload(body, encoding, "/tmp/cut.bin")
        assert r.status_code == 400, (encoding, len(body), r.text)
    assert not sbx.files.exists("/tmp/cut.bin")
    assert upload(b"x", "br", "/tmp/br.bin").status_code == 415
    for body, encoding in ((packed, "gzip"), (zlib.compress(data), "deflate")):
        r = upload(body, encoding, f"/tmp/whole-{encoding}.bin")
        assert r.status_code == 200, r.text
        got = sbx.commands.run(f"sha256sum /tmp/whole-{encoding}.bin").stdout.split()[0]
        assert got == hashlib.sha256(data).hexdigest()
    r = httpx.post(front.url + "/files", params={"path": "/tmp/m"},
                   content=b"--x\r\nBad Header Line\r\n\r\nbody\r\n--x--\r\n",
                   headers=dict(h, **{"Content-Type": "multipart/form-data; boundary=x"}))
    assert 400 <= r.status_code < 500, r.text
    unary = dict(h, **{"Content-Type": "application/json"})
    proc = sbx.commands.run("sleep 60", background=True)
    try:
        for sig in ([], {}, [9], None, True):
            r = httpx.post(front.url + "/process.Process/SendSignal", headers=unary,
                           json={"process": {"pid": proc.pid}, "signal": sig})
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (sig, r.text)
    finally:
        proc.kill()
    deep = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(front.url + "/filesystem.Filesystem/Stat", content=deep, headers=unary)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    r = httpx.post(front.url + "/v2/sandboxes", content=deep,
                   headers={"X-API-KEY": API_KEY, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text


# ---- resource exhaustion by a sandbox's token holder --------------------------------------
def _envd(s: Sandbox, kind: str = "stream") -> dict[str, str]:
    ctype = "application/connect+json" if kind == "stream" else "application/json"
    return {"E2b-Sandbox-Id": s.sandbox_id, "X-Access-Token": s._envd_access_token,
            "Content-Type": ctype}


def _envelope(msg: dict) -> bytes:  # type: ignore[type-arg]
    data = json.dumps(msg).encode()
    return b"\x00" + len(data).to_bytes(4, "big") + data


class _Stream:
    """A Connect server stream held open, read one message at a time."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp, self.it, self.buf = resp, resp.aiter_raw(), b""

    async def next(self) -> tuple[int, dict] | None:  # type: ignore[type-arg]
        while True:
            if len(self.buf) >= 5:
                n = int.from_bytes(self.buf[1:5], "big")
                if len(self.buf) >= 5 + n:
                    flags, msg = self.buf[0], json.loads(self.buf[5:5 + n])
                    self.buf = self.buf[5 + n:]
                    return flags, msg
            try:
                self.buf += await self.it.__anext__()
            except StopAsyncIteration:
                return None

    async def until_end(self) -> dict:  # type: ignore[type-arg]
        while (got := await self.next()) is not None:
            if got[0] & 0x02:
                return got[1]
        raise AssertionError("the stream ended without its end message")


def test_keepalive_is_at_most_50_s() -> None:
    """A client asking for rare keepalives (or none: a huge number) still gets one at least
    every 50 s, so a vanished client's stream is noticed and ended."""
    from aiohttp.test_utils import make_mocked_request

    from corral.e2b import process

    def interval(raw: str) -> float:
        return process._keepalive(make_mocked_request(
            "POST", "/", headers={"Keepalive-Ping-Interval": raw}))

    for raw in ("3600", "61", "999999", "9" * 5000, "\u00b2", "0", "-5", ""):
        assert 0 < interval(raw) <= 50, raw
    assert interval("10") == 10


def test_streams_are_capped_per_sandbox(front: Front) -> None:
    """One sandbox's client opening stream after stream gets resource_exhausted past its
    share; other sandboxes are not affected, a closed stream gives its slot back, and every
    stream ends when its sandbox does."""
    from corral.e2b.state import STREAMS_PER_SANDBOX

    a = Sandbox.create(timeout=120)
    b = Sandbox.create(timeout=120)
    try:
        pid = a.commands.run("sleep 600", background=True).pid  # its stream is one
        url = front.url + "/process.Process/Connect"
        hdrs = dict(_envd(a), **{"Keepalive-Ping-Interval": "1"})
        body = _envelope({"process": {"pid": pid}})

        async def main() -> None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                async def open_one() -> tuple[_Stream, dict]:  # type: ignore[type-arg]
                    resp = await c.send(c.build_request("POST", url, content=body,
                                                        headers=hdrs), stream=True)
                    st = _Stream(resp)
                    got = await st.next()
                    assert got is not None
                    return st, got[1]

                held: list[_Stream] = []
                refused: list[dict] = []  # type: ignore[type-arg]
                for _ in range(STREAMS_PER_SANDBOX + 1):
                    st, msg = await open_one()
                    if "error" in msg:
                        refused.append(msg["error"])
                        await st.resp.aclose()
                    else:
                        assert msg["event"]["start"]["pid"] == pid
                        held.append(st)
                assert refused and len(held) == STREAMS_PER_SANDBOX - 1, (len(held), refused)
                assert {e["code"] for e in refused} == {"resource_exhausted"}
                # the stock SDK sees it as a rate limit; another sandbox runs as usual
                with pytest.raises(RateLimitException):
                    await asyncio.to_thread(a.commands.run, "echo no")
                r = await asyncio.to_thread(b.commands.run, "echo yes")
                assert r.stdout == "yes\n"
                # a stream the client closed is noticed (its keepalive) and frees its slot
                await held.pop().resp.aclose()
                deadline = time.monotonic() + 15
                while True:
                    st, msg = await open_one()
                    if "event" in msg:
                        held.append(st)
                        break
                    await st.resp.aclose()
                    assert time.monotonic() < deadline, "the closed stream kept its slot"
                # the sandbox ends: so does every stream on it
                await asyncio.to_thread(a.kill)
                ends = await asyncio.wait_for(
                    asyncio.gather(*(s.until_end() for s in held)), 30)
                assert len(ends) == len(held)
                for s in held:
                    await s.resp.aclose()

        asyncio.run(main())
    finally:
        a.kill()
        b.kill()


def test_watchers_are_capped_per_sandbox(front: Front) -> None:
    """One sandbox's client cannot take every watcher slot of the front."""
    from corral.e2b.filesystem import MAX_WATCHERS, WATCHERS_PER_SANDBOX

    a = Sandbox.create(timeout=120)
    b = Sandbox.create(timeout=120)
    try:
        base = front.url + "/filesystem.Filesystem/"
        ids: list[str] = []
        refused = None
        for _ in range(MAX_WATCHERS + 1):
            r = httpx.post(base + "CreateWatcher", json={"path": "/tmp"}, headers=_envd(a, "unary"))
            if r.status_code != 200:
                refused = r
                break
            ids.append(r.json()["watcherId"])
        assert refused is not None and refused.status_code == 429, refused
        assert refused.json()["code"] == "resource_exhausted"
        assert len(ids) == WATCHERS_PER_SANDBOX
        # a WatchDir stream is a watcher too
        r = httpx.post(base + "WatchDir", content=_envelope({"path": "/tmp"}), headers=_envd(a),
                       timeout=30)
        assert r.content[0] == 0x02, r.content
        assert json.loads(r.content[5:])["error"]["code"] == "resource_exhausted"
        # another sandbox still watches
        h = b.files.watch_dir("/tmp")
        b.files.write("/tmp/seen.txt", "x")
        assert wait_until(lambda: any(e.name == "seen.txt" for e in h.get_new_events()))
        h.stop()
        # a removed watcher gives its slot back
        r = httpx.post(base + "RemoveWatcher", json={"watcherId": ids.pop()},
                       headers=_envd(a, "unary"))
        assert r.status_code == 200, r.text
        r = httpx.post(base + "CreateWatcher", json={"path": "/tmp"}, headers=_envd(a, "unary"))
        assert r.status_code == 200, r.text
    finally:
        a.kill()
        b.kill()


def _rss_peak_reset(pid: int) -> int:
    """Reset the process's peak RSS (VmHWM) to its current RSS; the RSS in bytes."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return _vm(pid, "VmRSS")


def _vm(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def test_downloads_are_streamed(sbx: Sandbox, front: Front) -> None:
    """A big file (sparse: free for the sandbox) passes through the front without the front
    ever holding it: its peak memory grows by far less than the file."""
    size = 256 << 20
    sbx.commands.run(f"truncate -s {size} /home/user/sparse")
    before = _rss_peak_reset(front.proc.pid)
    got = 0
    with httpx.stream("GET", front.url + "/files", params={"path": "/home/user/sparse"},
                      headers=_envd(sbx, "unary"), timeout=120) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            got += len(chunk)
    assert got == size
    grew = _vm(front.proc.pid, "VmHWM") - before
    assert grew < 64 << 20, f"the front's peak memory grew by {grew >> 20} MiB"


async def _read_by_the_peer(writer: asyncio.StreamWriter) -> None:
    """Wait until what ``writer`` sent is out of both ends' kernel queues (``ss``): the front
    has read it into its buffer (aiohttp reads at most ~128 KiB ahead of its handler)."""
    port = writer.get_extra_info("sockname")[1]
    deadline = time.monotonic() + 60
    while True:
        proc = await asyncio.create_subprocess_exec(
            "ss", "-Htn", "state", "established", f"( sport = :{port} or dport = :{port} )",
            stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        rows = [line.split() for line in out.decode().splitlines() if line.strip()]
        if len(rows) == 2 and all(r[0] == r[1] == "0" for r in rows):  # Recv-Q, Send-Q
            return
        assert time.monotonic() < deadline, rows
        await asyncio.sleep(0.05)


def test_request_bytes_in_memory_are_capped(front: Front) -> None:
    """Uploads and RPC messages held in memory are taken from a share per sandbox: past it (a
    slow upload holding it, a small gzip body that inflates past it, a big message) the answer
    is 429 / resource_exhausted, other sandboxes upload as usual (gzip too), and the share
    comes back when the upload ends."""
    import gzip

    from corral.e2b.files import MAX_BODY

    a = Sandbox.create(timeout=120)
    b = Sandbox.create(timeout=120)
    try:
        url = front.url + "/files"
        stat = front.url + "/filesystem.Filesystem/Stat"
        octet = {"Content-Type": "application/octet-stream"}
        small = b"y" * (2 << 20)

        async def hold_share() -> tuple[asyncio.StreamWriter, asyncio.Future[bytes]]:
            """An upload that sends nearly all of a's share and stalls short of its end; its
            answer (a refusal) as a future."""
            reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
            sent = MAX_BODY - (1 << 20)
            head = "".join(f"{k}: {v}\r\n" for k, v in dict(
                _envd(a, "unary"), **octet, **{"Content-Length": str(sent + 1),
                                              "Host": "front"}).items())
            writer.write(f"POST /files?path=/tmp/slow&username=root HTTP/1.1\r\n{head}\r\n"
                         .encode() + b"x" * sent)
            await writer.drain()
            return writer, asyncio.ensure_future(reader.read(100))

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                async def up(s: Sandbox, data: bytes, path: str,
                             extra: dict[str, str] | None = None) -> httpx.Response:
                    return await c.post(url, params={"path": path, "username": "root"},
                                        content=data, headers=dict(_envd(s, "unary"), **octet,
                                                                   **(extra or {})))

                slow, answer = await hold_share()
                await _read_by_the_peer(slow)
                r = await up(a, small, "/tmp/second")
                assert r.status_code == 429, r.text
                assert "at most" in r.json()["message"] and not answer.done()
                bomb = gzip.compress(b"\0" * (4 << 20))  # ~4 KiB that inflates to 4 MiB
                r = await up(a, bomb, "/tmp/bomb", {"Content-Encoding": "gzip"})
                assert r.status_code == 429, r.text
                r = await c.post(stat, headers=_envd(a, "unary"),  # an RPC's message too
                                 json={"path": "/", "pad": "x" * (2 << 20)})
                assert r.status_code == 429 and r.json()["code"] == "resource_exhausted", r.text
                r = await up(b, small, "/tmp/other")
                assert r.status_code == 200, r.text
                r = await up(b, bomb, "/tmp/inflated", {"Content-Encoding": "gzip"})
                assert r.status_code == 200, r.text
                slow.close()  # cut short: its share comes back
                answer.cancel()
                deadline = time.monotonic() + 15
                while (r := await up(a, small, "/tmp/third")).status_code == 429:
                    assert time.monotonic() < deadline, "the cut upload kept its share"
                assert r.status_code == 200, r.text
                r = await c.post(stat, headers=_envd(a, "unary"),  # read whole, however big
                                 json={"path": "/", "pad": "x" * (2 << 20)})
                assert r.status_code == 200 and r.json()["entry"]["type"], r.text

        asyncio.run(main())
        assert a.commands.run("stat -c %s /tmp/third").stdout == f"{2 << 20}\n"
        assert b.commands.run("stat -c %s /tmp/inflated").stdout == f"{4 << 20}\n"
        b.files.write("/home/user/gz.txt", "through gzip\n", gzip=True)  # the stock SDK's way
        assert b.files.read("/home/user/gz.txt") == "through gzip\n"
    finally:
        a.kill()
        b.kill()
