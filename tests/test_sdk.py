"""The Python SDK against the session's real corrald: Sandbox (sync) and AsyncSandbox (asyncio).

No mocks: every call crosses the unix socket into real sandboxes. Each test kills what it makes
(context managers or finally), and the session fixture fails the run if anything leaked.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import os
import pickle
import threading
import time
import uuid
from pathlib import Path

import pytest

import corral
from corral import AsyncSandbox, CommandFailed, ExecResult, Process, Sandbox
from corral.errors import (
    CorralError,
    DaemonRestarted,
    DaemonUnavailable,
    DirectoryNotEmpty,
    FileNotFound,
    ImageNotFound,
    InfraError,
    InvalidNetwork,
    InvalidPath,
    InvalidRequest,
    NotADirectory,
    SandboxNotFound,
    SandboxNotRunning,
    Unsupported,
)
from corral.sdk import AsyncFiles, AsyncProcess, Files
from corral.sdk.twins import public_methods, to_async


def tag() -> dict[str, str]:
    """A label unique to one test, so list() only sees that test's sandboxes."""
    return {"test": uuid.uuid4().hex[:12]}


@pytest.fixture(scope="module")
def sb():
    with Sandbox(timeout=900, labels={"test": "sdk-shared"}) as box:
        yield box


# ---- sync: lifecycle ------------------------------------------------------------------------
def test_context_manager_creates_and_kills():
    labels = tag()
    with Sandbox(image="host", cpu=1, memory_mb=256, labels=labels) as box:
        assert box.id.startswith("sb-")
        assert box.last_info is not None and box.last_info.state == "running"
        assert box.last_info.labels == labels and box.last_info.memory_mb == 256
        r = box.exec("echo hello; echo oops >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "oops\n", 0)
        assert isinstance(r, ExecResult) and r.ok and r.duration_s >= 0
        sid = box.id
    assert Sandbox.list(labels=labels) == []
    with pytest.raises(SandboxNotRunning) as ei:
        Sandbox.connect(sid)
    assert not ei.value.infra


def test_create_connect_list_by_labels():
    labels = tag()
    a = Sandbox.create(labels={**labels, "role": "a"}, metadata={"owner": "tests"})
    b = Sandbox.create(labels={**labels, "role": "b"})
    try:
        assert {x.id for x in Sandbox.list(labels=labels)} == {a.id, b.id}
        assert [x.id for x in Sandbox.list(labels={**labels, "role": "b"})] == [b.id]
        assert [x.id for x in Sandbox.list(labels=[f"test={labels['test']}", "role=a"])] == [a.id]
        assert {x.id for x in Sandbox.list(labels={"test": labels["test"], "role": None})} \
            == {a.id, b.id}
        listed = Sandbox.list(labels={**labels, "role": "a"})[0]
        assert listed.last_info.metadata == {"owner": "tests"}
        again = Sandbox.connect(a.id)
        assert again == a and again.exec("hostname").stdout.strip() == a.last_info.hostname
        assert Sandbox.from_id(b.id).exec("echo lazy").stdout == "lazy\n"
    finally:
        assert a.kill() is True
        assert b.kill() is True
    assert a.kill() is False  # already ended: not an error
    assert Sandbox.list(labels=labels) == []


def test_create_many_is_one_batch():
    labels = tag()
    boxes = Sandbox.create_many(8, labels=labels, memory_mb=128)
    try:
        assert len({b.id for b in boxes}) == 8
        assert all(b.last_info.memory_mb == 128 for b in boxes)
        assert {b.id for b in Sandbox.list(labels=labels)} == {b.id for b in boxes}
        names = {b.exec("hostname").stdout for b in boxes}
        assert len(names) == 8
    finally:
        for b in boxes:
            b.kill()


def test_info_set_timeout_and_kill():
    box = Sandbox(timeout=60)
    try:
        first = box.info()
        assert first.state == "running" and first.expires_at - first.created_at == \
            pytest.approx(60, abs=1)
        later = box.set_timeout(1000)
        assert later.expires_at - time.time() == pytest.approx(1000, abs=5)
        assert box.last_info == later
        assert box.is_running()
    finally:
        assert box.kill()
    assert not box.is_running()
    with pytest.raises(SandboxNotRunning):
        box.exec("true")


# ---- sync: exec -----------------------------------------------------------------------------
def test_exec_shell_argv_env_cwd_user_stdin(sb):
    assert sb.exec(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"
    assert sb.exec("echo $GREETING", env={"GREETING": "hi there"}).stdout == "hi there\n"
    assert sb.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sb.exec("id -u", user="nobody").stdout.strip() == "65534"
    assert sb.exec("id -u", user=0).stdout.strip() == "0"
    assert sb.exec("cat", stdin="from stdin\n").stdout == "from stdin\n"
    assert sb.exec("wc -c", stdin=b"12345").stdout.strip() == "5"
    assert sb.exec(("sh", "-c", "exit 3")).exit_code == 3


def test_exec_failures_are_results_not_errors(sb):
    r = sb.exec("echo partial; echo bad >&2; exit 4")
    assert (r.exit_code, r.ok, r.stdout) == (4, False, "partial\n")
    with pytest.raises(CommandFailed) as ei:
        r.check()
    err = ei.value
    assert isinstance(err, CorralError) and not err.infra and not isinstance(err, InfraError)
    assert err.result is r and "bad" in err.message and err.details["exit_code"] == 4
    clone = pickle.loads(pickle.dumps(err))
    assert isinstance(clone, CommandFailed) and clone.result == r and not clone.infra
    assert sb.exec("no-such-binary-here").exit_code == 127
    assert sb.exec("true").check().ok


def test_exec_timeout_and_output_cap(sb):
    t0 = time.monotonic()
    r = sb.exec("echo started; sleep 30", timeout=0.5)
    assert r.timed_out and r.exit_code == 137 and not r.ok
    assert r.stdout == "started\n" and time.monotonic() - t0 < 10
    with pytest.raises(CommandFailed, match="timed out"):
        r.check()
    big = sb.exec("head -c 100000 /dev/zero | tr '\\0' x", max_output_bytes=1000)
    assert big.truncated and len(big.stdout) == 1000 and big.stdout_bytes == 100000


# ---- sync: files ----------------------------------------------------------------------------
def test_files_roundtrip(sb):
    f = sb.files
    assert isinstance(f, Files)
    f.write("/data/dir/hello.txt", "héllo\n")
    assert f.read("/data/dir/hello.txt") == "héllo\n"
    blob = bytes(range(256)) * 40
    f.write("/data/blob.bin", blob, mode=0o600)
    assert f.read_bytes("/data/blob.bin") == blob
    assert f.read_bytes("/data/blob.bin", max_bytes=10) == blob[:10]
    st = f.stat("/data/blob.bin")
    assert (st.type, st.size, st.mode & 0o777) == ("file", len(blob), 0o600)
    assert f.exists("/data/dir/hello.txt") and not f.exists("/data/nope")
    assert not f.exists("/data/blob.bin/child")
    assert {e.name for e in f.list("/data")} == {"dir", "blob.bin"}
    f.mkdir("/data/x/y/z")
    f.rename("/data/dir/hello.txt", "/data/x/y/z/moved.txt")
    assert sb.exec("cat /data/x/y/z/moved.txt").stdout == "héllo\n"
    with pytest.raises(DirectoryNotEmpty):
        f.remove("/data/x")
    f.remove("/data/x", recursive=True)
    assert not f.exists("/data/x")
    # Paths with characters that mean something in URLs.
    odd = "/data/a b+c%20d?e#f&g=h.txt"
    f.write(odd, "odd")
    assert f.read(odd) == "odd" and sb.exec(["cat", odd]).stdout == "odd"


def test_files_errors(sb):
    with pytest.raises(FileNotFound) as ei:
        sb.files.read("/definitely/not/here")
    assert not ei.value.infra
    with pytest.raises(InvalidPath):
        sb.files.read("relative/path")
    with pytest.raises(InvalidRequest):
        sb.files.write("/x", 12345)  # type: ignore[arg-type]


def test_upload_download(sb, tmp_path: Path):
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "top.txt").write_text("top")
    (src / "pkg" / "sub" / "deep.bin").write_bytes(b"\x00\x01deep")
    sb.files.upload(src, "/up")
    out = sb.exec("cd /up && find . -type f | sort && cat top.txt").stdout
    assert out == "./pkg/sub/deep.bin\n./top.txt\ntop"
    sb.exec("echo made-inside > /up/pkg/new.txt")
    dst = tmp_path / "dst"
    names = sb.files.download("/up", dst)
    assert "top.txt" in [n.lstrip("./") for n in names]
    assert (dst / "pkg" / "sub" / "deep.bin").read_bytes() == b"\x00\x01deep"
    assert (dst / "pkg" / "new.txt").read_text() == "made-inside\n"


def test_large_bodies_both_ways(sb):
    blob = os.urandom(12 * 1024 * 1024 + 7)
    sb.files.write("/big.bin", blob)
    assert sb.exec("wc -c < /big.bin").stdout.strip() == str(len(blob))
    assert sb.files.read_bytes("/big.bin") == blob
    out = sb.exec("head -c 1000000 /big.bin | od -An -v -tx1 | tr -d ' \\n'").stdout
    assert bytes.fromhex(out) == blob[:1000000]  # 2 MB of hex: under the output cap


def test_files_tree_is_one_unlogged_breadth_first_answer():
    """files.tree: breadth first, each directory's by name, cut at ``depth`` and ``limit``
    (``truncated``), a symlink not followed; errors as list's; and no entry in the log."""
    with Sandbox(timeout=120) as box:
        box.exec("mkdir -p /t/b/d /t/a/c && touch /t/z /t/a/c/f && ln -s / /t/a/up")
        before = len(box.log())
        tree = box.files.tree("/t")
        assert [e.path for e in tree.entries] == ["/t/a", "/t/b", "/t/z", "/t/a/c",
                                                  "/t/a/up", "/t/b/d", "/t/a/c/f"]
        assert not tree.truncated and tree.entries[4].type == "symlink"
        assert [e.path for e in box.files.tree("/t", depth=1).entries] == ["/t/a", "/t/b",
                                                                          "/t/z"]
        cut = box.files.tree("/t", limit=4)
        assert cut.truncated and [e.path for e in cut.entries][-1] == "/t/a/c"
        assert not box.files.tree("/t", limit=7).truncated
        with pytest.raises(FileNotFound):
            box.files.tree("/nope")
        with pytest.raises(NotADirectory):
            box.files.tree("/t/z")
        with pytest.raises(InvalidRequest):
            box.files.tree("/t", depth=65)
        assert len(box.log()) == before


# ---- sync: background processes -------------------------------------------------------------
def test_background_stream_wait(sb):
    p = sb.exec("for i in 1 2 3; do echo out$i; sleep 0.1; done; echo err >&2; exit 5",
                background=True)
    assert isinstance(p, Process) and p.sandbox_id == sb.id and p.pid > 1
    chunks = list(p.stream())
    out = "".join(d for s, d in chunks if s == "stdout")
    assert out == "out1\nout2\nout3\n"
    assert "".join(d for s, d in chunks if s == "stderr") == "err\n"
    assert p.exit_code == 5
    res = p.wait(timeout=5)
    assert (res.exit_code, res.stdout) == (5, "out1\nout2\nout3\n")
    st = p.status()
    assert not st.running and st.exit_code == 5


def test_background_stdin_and_kill(sb):
    p = sb.exec("cat", background=True)
    p.send_stdin("line one\n")
    p.send_stdin("line two\n", eof=True)
    assert p.wait(timeout=10).stdout == "line one\nline two\n"

    q = sb.exec("read x; echo got $x", background=True)
    assert q.status().running
    q.send_stdin("ping\n")
    q.close_stdin()
    assert q.wait(timeout=10).stdout == "got ping\n"

    r = sb.exec("sleep 60", background=True)
    with pytest.raises(corral.ProcessStillRunning) as ei:
        r.wait(timeout=0.2)
    assert not ei.value.infra  # a slow command, not a platform failure; it keeps running
    assert r.status().running
    r.kill()
    res = r.wait(timeout=10)
    assert res.exit_code == 137 and not r.status().running


def test_a_streams_end_says_how_its_process_ended(sb):
    """The last line of a stream carries the process's status whole: a signal is told from an
    exit code past 128, and an OOM kill at the sandbox's limit is told as such, as wait()
    does. Before, it had only the exit code and timed_out."""
    p = sb.exec("exec sleep 60", background=True)
    p.kill(15)
    assert list(p.stream()) == []
    assert (p.exit_code, p.signal, p.oom_killed) == (143, 15, False)
    q = sb.exec("exit 143", background=True)
    assert list(q.stream()) == []
    assert (q.exit_code, q.signal, q.oom_killed) == (143, None, False)
    with corral.Sandbox(memory_mb=48, timeout=120) as small:
        hog = small.exec(["python3", "-c", "b = []\nwhile True: b.append(bytearray(1 << 20))"],
                         background=True)
        assert list(hog.stream()) == []
        assert (hog.exit_code, hog.signal, hog.oom_killed) == (137, 9, True)


def test_abandoned_stream_does_not_poison_the_client(sb):
    p = sb.exec("for i in $(seq 1 200); do echo line $i; sleep 0.01; done", background=True)
    for _stream, data in p.stream():
        assert data.startswith("line")
        break  # stop reading half-way: that connection must be dropped, not reused
    assert sb.exec("echo next").stdout == "next\n"
    assert p.wait(timeout=30).stdout.count("line") == 200
    many = "".join(d for _, d in sb.exec("seq 1 50000", background=True).stream())
    assert many == "".join(f"{i}\n" for i in range(1, 50001))


# ---- pickling across processes ----------------------------------------------------------------
def _use_handles(payload: bytes) -> tuple[str, str, int, str]:
    box, proc = pickle.loads(payload)
    out = box.exec("cat /pickled.txt").stdout
    box.files.write("/from-child.txt", f"child {os.getpid()}")
    res = proc.wait(timeout=30)
    return box.id, out, res.exit_code, res.stdout


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_pickled_handles_work_in_another_process(sb, method):
    sb.files.write("/pickled.txt", "across processes")
    proc = sb.exec("echo bg-done", background=True)
    payload = pickle.dumps((sb, proc))
    assert len(payload) < 1000  # id + endpoint, nothing else
    sb.exec("true")  # the parent's pool now holds a connection the fork child must not use
    ctx = multiprocessing.get_context(method)
    with ctx.Pool(1) as pool:
        sid, out, code, stdout = pool.apply(_use_handles, (payload,))
    assert (sid, out, code, stdout) == (sb.id, "across processes", 0, "bg-done\n")
    assert sb.files.read("/from-child.txt").startswith("child ")
    assert sb.exec("echo parent-still-fine").stdout == "parent-still-fine\n"


def test_many_threads_share_the_sync_client(sb):
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(10):
                assert sb.exec(f"echo {i}-{j}").stdout == f"{i}-{j}\n"
        except BaseException as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---- errors: request errors vs infra errors ---------------------------------------------------
def test_error_classes_for_bad_input():
    with pytest.raises(SandboxNotFound) as ei:
        Sandbox.connect("sb-0000000000000000")
    assert ei.value.code == "sandbox_not_found" and not ei.value.infra
    with pytest.raises(SandboxNotFound):
        Sandbox.from_id("sb-0000000000000000").exec("true")
    with pytest.raises(InvalidRequest):
        Sandbox(cpu=-1)
    with pytest.raises(InvalidRequest):
        Sandbox(memory_mb=10**9)
    with pytest.raises(InvalidRequest):
        Sandbox(labels={"bad key!": "x"})
    with pytest.raises(ImageNotFound):
        Sandbox(image="no-such-image")
    with pytest.raises(Unsupported):
        Sandbox(substrate="vm")
    with pytest.raises(InvalidRequest):
        Sandbox.from_id("sb-0000000000000000").exec("")
    with pytest.raises(InvalidRequest):
        Sandbox.from_id("sb-0000000000000000").exec("true", timeout=-1)
    with pytest.raises(InvalidRequest):
        Sandbox.create_many(0)
    with pytest.raises(InvalidRequest):
        Sandbox(endpoint="ftp://nowhere")
    with pytest.raises(InvalidNetwork) as en:
        Sandbox(network="host")  # type: ignore[arg-type]
    assert en.value.code == "invalid_network" and isinstance(en.value, InvalidRequest)


def test_network_disabled_sync_and_async():
    probe = ("python3 -c \"import socket\ntry: socket.socket(); print('inet')\n"
             "except OSError: print('refused')\"")
    with Sandbox(network="disabled") as sb:
        assert sb.last_info is not None and sb.last_info.network == "disabled"
        assert sb.exec(probe).stdout == "refused\n"

    async def go() -> None:
        async with AsyncSandbox(network="disabled") as box:
            assert (await box.info()).network == "disabled"
            assert (await box.exec(probe)).stdout == "refused\n"
        with pytest.raises(InvalidNetwork):
            await AsyncSandbox.create(network="bogus")  # type: ignore[arg-type]

    asyncio.run(go())


def test_daemon_unavailable_is_infra(monkeypatch, tmp_path):
    monkeypatch.setenv("CORRAL_AUTOSTART", "0")
    missing = str(tmp_path / "no.sock")
    with pytest.raises(DaemonUnavailable) as ei:
        Sandbox(endpoint=missing)
    assert ei.value.infra and isinstance(ei.value, InfraError)
    with pytest.raises(DaemonUnavailable):
        Sandbox.list(endpoint=missing)

    async def go() -> None:
        with pytest.raises(DaemonUnavailable):
            await AsyncSandbox.create(endpoint=missing)

    asyncio.run(go())


def test_daemon_dying_mid_call_is_daemon_restarted(daemon):
    """kill -9 of corrald during an exec: the caller gets an infra error (masked by a
    trainer), never a fake exit code; after the restart the sandbox is usable again."""
    box = Sandbox(timeout=600)
    try:
        killer = threading.Timer(0.5, daemon.kill9)
        killer.start()
        with pytest.raises((DaemonRestarted, DaemonUnavailable)) as ei:
            box.exec("sleep 30")
        killer.join()
        assert ei.value.infra
        with pytest.raises(DaemonUnavailable):
            box.exec("true")  # nothing answers now (autostart is off in this session)
        daemon.start()
        assert box.exec("echo back").stdout == "back\n"  # re-adopted by the new daemon
    finally:
        if daemon.proc is None:
            daemon.start()
        box.kill()


# ---- the two facades are the same API -------------------------------------------------------
@pytest.mark.parametrize("sync_cls,async_cls", [(Sandbox, AsyncSandbox), (Files, AsyncFiles),
                                                (Process, AsyncProcess)])
def test_sync_and_async_are_the_same_api(sync_cls, async_cls):
    """Names, parameter kinds, defaults, annotations and docstrings: equal, with the async
    twins' names (AsyncSandbox, AsyncProcess, AsyncIterator, ...) in the async facade."""
    s, a = public_methods(sync_cls), public_methods(async_cls)
    assert s.keys() == a.keys()
    missing: list[str] = []
    for name in ["__init__", *s]:
        ss = inspect.signature(getattr(sync_cls, name))
        sa = inspect.signature(getattr(async_cls, name))
        assert list(ss.parameters) == list(sa.parameters), name
        for p, q in zip(ss.parameters.values(), sa.parameters.values(), strict=True):
            assert (p.kind, p.default) == (q.kind, q.default), (name, p.name)
            assert to_async(str(p.annotation)) == str(q.annotation), (name, p.name)
        if name != "__init__":
            assert to_async(str(ss.return_annotation)) == str(sa.return_annotation), name
            doc = inspect.getdoc(s[name])
            if doc:
                assert inspect.getdoc(a[name]) == to_async(doc), name
            missing += [] if doc else [name]
    assert not missing, f"{sync_cls.__name__}: no docstring for {missing}"
    for name in a:
        fn = getattr(async_cls, name)
        if name not in ("from_id",):
            assert inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn), name


def test_top_level_exports():
    for name in ("Sandbox", "AsyncSandbox", "ExecResult", "Process", "CommandFailed"):
        assert hasattr(corral, name) and name in corral.__all__


# ---- async ----------------------------------------------------------------------------------
def test_async_sandbox_end_to_end(tmp_path):
    async def go() -> None:
        labels = tag()
        async with AsyncSandbox(labels=labels, memory_mb=256) as box:
            assert box.id.startswith("sb-")
            r = await box.exec("echo hi; exit 2")
            assert (r.stdout, r.exit_code, r.ok) == ("hi\n", 2, False)
            await box.files.write("/a/b.txt", "async text")
            assert await box.files.read("/a/b.txt") == "async text"
            assert await box.files.exists("/a/b.txt")
            assert [e.name for e in await box.files.list("/a")] == ["b.txt"]
            await box.files.rename("/a/b.txt", "/a/c.txt")
            assert (await box.files.stat("/a/c.txt")).size == 10
            await box.files.mkdir("/a/d")
            await box.files.remove("/a/d")
            (tmp_path / "up").mkdir()
            (tmp_path / "up" / "f").write_text("F")
            await box.files.upload(tmp_path / "up", "/up")
            await box.files.download("/up", tmp_path / "down")
            assert (tmp_path / "down" / "f").read_text() == "F"

            p = await box.exec("echo one; sleep 0.1; echo two >&2", background=True)
            assert isinstance(p, AsyncProcess)
            chunks = [c async for c in p.stream()]
            assert [s for s, _ in chunks] == ["stdout", "stderr"] and p.exit_code == 0
            q = await box.exec("cat", background=True)
            await q.send_stdin("in", eof=True)
            assert (await q.wait(10)).stdout == "in"
            assert not (await q.status()).running

            assert [b.id for b in await AsyncSandbox.list(labels=labels)] == [box.id]
            same = await AsyncSandbox.connect(box.id)
            assert same == box and (await same.info()).state == "running"
            assert (await box.set_timeout(500)).expires_at > time.time() + 400
        assert await AsyncSandbox.list(labels=labels) == []
        with pytest.raises(SandboxNotFound):
            await AsyncSandbox.connect("sb-0000000000000000")
        with pytest.raises(InvalidRequest):
            AsyncSandbox(cpu=0)  # validated at construction, before any await

    asyncio.run(go())


def test_async_lazy_creation_happens_once():
    async def go() -> None:
        labels = tag()
        box = AsyncSandbox(labels=labels)
        with pytest.raises(RuntimeError):
            _ = box.id
        outs = await asyncio.gather(*(box.exec("hostname") for _ in range(10)))
        assert len({o.stdout for o in outs}) == 1
        assert len(await AsyncSandbox.list(labels=labels)) == 1
        assert await box.kill()
        made = await AsyncSandbox(labels=labels)  # awaitable constructor
        assert (await made.exec("echo x")).stdout == "x\n"
        many = await AsyncSandbox.create_many(3, labels=labels)
        assert len(await AsyncSandbox.list(labels=labels)) == 4
        assert await asyncio.gather(made.kill(), *(m.kill() for m in many)) == [True] * 4

    asyncio.run(go())


def test_async_1000_concurrent_calls_in_one_loop():
    async def go() -> None:
        labels = tag()
        boxes = await AsyncSandbox.create_many(4, labels=labels, pids=2048)
        try:
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(boxes[i % 4].exec(["echo", str(i)]) for i in range(1000)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(1000)]
            assert all(r.exit_code == 0 for r in results)
            infos = await asyncio.gather(*(boxes[i % 4].info() for i in range(1000)))
            assert {i.id for i in infos} == {b.id for b in boxes}
            # Mixed and slow: 1,000 calls in flight at once, each holding its connection.
            slow = await asyncio.gather(
                *(boxes[i % 4].exec(["sleep", "1"]) for i in range(1000)))
            assert all(r.exit_code == 0 and not r.timed_out for r in slow)
            assert time.monotonic() - t0 < 120
        finally:
            await asyncio.gather(*(b.kill() for b in boxes))

    asyncio.run(go())


def test_async_pickled_handle():
    async def go() -> tuple[bytes, str]:
        box = await AsyncSandbox.create()
        await box.files.write("/p.txt", "pickled async")
        return pickle.dumps(box), box.id

    payload, sid = asyncio.run(go())
    box = pickle.loads(payload)

    async def use() -> str:
        try:
            return await box.files.read("/p.txt")
        finally:
            await box.kill()

    assert box.id == sid and asyncio.run(use()) == "pickled async"  # and in a new loop


# ---- remote: CORRAL_URL + CORRAL_TOKEN over TCP ------------------------------------------------
def test_remote_endpoint_over_tcp_with_token(monkeypatch):
    import shutil
    import socket
    import tempfile

    from conftest import DaemonProcess, cgroup_dirs, leaked_sandbox_cgroups

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cgroup = f"corral-test-tcp-{os.getpid()}"
    state = tempfile.mkdtemp(prefix="corral-test-tcp-", dir="/var/tmp")
    monkeypatch.setenv("CORRAL_CGROUP", cgroup)  # its own cgroups: it must not touch ours
    monkeypatch.setenv("CORRAL_TCP", f"127.0.0.1:{port}")
    monkeypatch.setenv("CORRAL_TOKEN", "test-token")
    remote = DaemonProcess(state_dir=state, socket_path=os.path.join(state, "d.sock"))
    remote.start()
    try:
        url = f"http://127.0.0.1:{port}"
        monkeypatch.setenv("CORRAL_URL", url)
        with Sandbox(labels={"remote": "yes"}) as box:
            assert str(box.endpoint) == url
            assert box.exec("echo remote").stdout == "remote\n"
            p = box.exec("echo a; sleep 0.1; echo b", background=True)
            assert "".join(d for _, d in p.stream()) == "a\nb\n"
            clone = pickle.loads(pickle.dumps(box))
            assert clone.files.exists("/") and clone.endpoint == box.endpoint

            async def go() -> str:
                other = await AsyncSandbox.connect(box.id)
                return (await other.exec("echo async-remote")).stdout

            assert asyncio.run(go()) == "async-remote\n"
        monkeypatch.setenv("CORRAL_TOKEN", "wrong")
        from corral.errors import Unauthorized

        with pytest.raises(Unauthorized):
            # Another spelling of the address is a new endpoint, whose client reads the token.
            Sandbox.list(endpoint=f"http://localhost:{port}")
    finally:
        remote.stop()
        shutil.rmtree(state, ignore_errors=True)
        leaked = leaked_sandbox_cgroups(cgroup)
        for top in cgroup_dirs(cgroup):  # the daemon's (empty) parent cgroups
            try:
                top.rmdir()
            except OSError:
                pass
    assert leaked == []
