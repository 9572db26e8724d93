"""The substrate boundary: the engine holds policy only, and a substrate is added through the
registry alone. Needs no root: the engine runs in-process on a private state dir, over a
minimal real substrate defined here (commands run as plain host processes in a directory of
their own), which is registered only by this test."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from corral.config import Config
from corral.daemon.app import create_app
from corral.daemon.engine import Engine
from corral.daemon.substrates import registry
from corral.daemon.substrates.base import (
    Capabilities,
    ExecSpec,
    SandboxRuntime,
    Spawned,
    Substrate,
)
from corral.errors import InvalidRequest, SandboxNotRunning, Unsupported
from corral.models import ExecRequest, SandboxSpec

ROOT = Path(__file__).resolve().parent.parent / "python" / "corral" / "daemon"
ENGINE = sorted((ROOT / "engine").glob("*.py"))  # the engine package's modules


# ---- the engine names no mechanism ---------------------------------------------------------
def test_engine_names_no_mechanism():
    """No cgroup call, overlay/upper path, freezer or substrate name in the engine: not in its
    code, strings or comments."""
    assert len(ENGINE) > 1
    for path in ENGINE:
        text = path.read_text()
        for word in ("cgroup", "overlay", "upper", "freezer", "container", "initexec", "_core"):
            hits = [n for n, line in enumerate(text.splitlines(), 1) if word in line.lower()]
            assert not hits, f"engine/{path.name} names {word!r} on lines {hits}"


def test_engine_imports_no_substrate_and_probes_nothing():
    tree = ast.Module(body=[n for p in ENGINE for n in ast.parse(p.read_text()).body],
                      type_ignores=[])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("corral.daemon.substrates.") or \
                node.module in ("corral.daemon.substrates.base",), node.module
            assert node.module not in ("corral.daemon.cgroups", "corral._core"), node.module
        if isinstance(node, ast.Import):
            for a in node.names:
                assert "cgroups" not in a.name and "container" not in a.name, a.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            # optional methods are part of the protocol: never looked up by name
            assert node.func.id not in ("getattr", "hasattr"), ast.unparse(node)


def test_base_imports_no_substrate_types():
    tree = ast.parse((ROOT / "substrates" / "base.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and ("initexec" in m or "container" in m or "cgroups" in m) for m in mods)


def test_protocol_has_one_return_type_per_method():
    """Every public method of the protocol is annotated with one type (Optional counts as
    one: ``X | None``), never a union of alternatives the caller must tell apart."""
    tree = ast.parse((ROOT / "substrates" / "base.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Substrate")
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        assert fn.returns is not None, fn.name
        parts = [ast.unparse(p) for p in _union_members(fn.returns)]
        assert len([p for p in parts if p != "None"]) <= 1 or fn.name == "destroy_many", \
            (fn.name, ast.unparse(fn.returns))


def _union_members(node: ast.expr) -> list[ast.expr]:
    """The alternatives of a top-level ``A | B | ...`` (a union inside ``tuple[...]`` is one
    member: the tuple)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_members(node.left) + _union_members(node.right)
    return [node]


# ---- a minimal real substrate, registered only here -----------------------------------------
def _starttime(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[19])


async def _ready(value: Spawned) -> Spawned:
    return value


class HostProcSubstrate(Substrate):
    """Each sandbox: a directory and a host process standing in for its init; commands run as
    plain host processes (our children) in that directory. No isolation: tests only."""

    name = "hostproc"
    capabilities = Capabilities()  # no files, snapshots, pause: those are unsupported

    def __init__(self, ctx: registry.Context) -> None:
        self.dir = os.path.join(ctx.config.state_dir, "sandboxes")
        self.made: list[str] = []

    def create(self, sandbox_id: str, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        sdir = os.path.join(self.dir, sandbox_id)
        os.makedirs(os.path.join(sdir, "work"), exist_ok=True)
        pid = os.posix_spawn("/bin/sleep", ["sleep", "3600"], {}, setsid=True)
        self.made.append(sandbox_id)
        return SandboxRuntime(sandbox_id=sandbox_id, init_pid=pid, init_starttime=_starttime(pid),
                              sandbox_dir=sdir, cgroup_paths=[], pidfd=os.pidfd_open(pid))

    def adopt(self, runtime: SandboxRuntime) -> bool:
        return False

    def is_alive(self, runtime: SandboxRuntime) -> bool:
        try:
            return os.waitid(os.P_PID, runtime.init_pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def destroy(self, runtime: SandboxRuntime) -> None:
        if runtime.pidfd >= 0:
            signal.pidfd_send_signal(runtime.pidfd, signal.SIGKILL)
            os.waitid(os.P_PIDFD, runtime.pidfd, os.WEXITED)
            os.close(runtime.pidfd)
            runtime.pidfd = -1
        shutil.rmtree(runtime.sandbox_dir, ignore_errors=True)

    def cleanup_orphans(self, known_ids: set[str]) -> list[str]:
        return []

    def close(self, *, retire: bool = False) -> None:
        pass

    def spawn(self, runtime: SandboxRuntime, spec: ExecSpec,
              loop: asyncio.AbstractEventLoop) -> Awaitable[Spawned]:
        acts: list[tuple[Any, ...]] = []
        for target, fd in ((0, spec.stdin_fd), (1, spec.stdout_fd), (2, spec.stderr_fd)):
            if fd >= 0:
                acts.append((os.POSIX_SPAWN_DUP2, fd, target))
            else:
                acts.append((os.POSIX_SPAWN_OPEN, target, os.devnull, os.O_RDWR, 0))
        # posix_spawn has no chdir: a shell steps into the sandbox's directory, then execs.
        work = os.path.join(runtime.sandbox_dir, "work")
        argv = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', work, *spec.argv]
        pid = os.posix_spawn("/bin/sh", argv, spec.env, file_actions=acts, setsid=True)
        return _ready(Spawned(pidfd=-1, pid=pid, ns_pid=pid, own_child=True))


@pytest.fixture
def engine():
    registry.register("hostproc", HostProcSubstrate)
    state = tempfile.mkdtemp(prefix="corral-boundary-", dir="/var/tmp")
    loop = asyncio.new_event_loop()
    eng = Engine(Config(state_dir=state, trajlog=False, reaper_interval_s=0.05),
                 substrates=["hostproc"])
    try:
        loop.run_until_complete(eng.start())
        yield eng, loop
    finally:
        try:
            loop.run_until_complete(eng.shutdown())
            eng.close()
        finally:
            loop.close()
            registry.unregister("hostproc")
            shutil.rmtree(state, ignore_errors=True)


def test_a_registered_substrate_runs_through_the_unchanged_engine(engine):
    eng, loop = engine
    sub = eng.substrates["hostproc"]
    assert isinstance(sub, HostProcSubstrate)

    async def flow() -> None:
        sb = await eng.create(SandboxSpec(substrate="hostproc", image="host"))
        assert sb.state == "running" and sb.spec.substrate == "hostproc"
        assert sb.info()["substrate"] == "hostproc"
        res = await eng.exec(sb.id, ExecRequest(cmd="echo out; echo err >&2; pwd; exit 3"))
        assert res["exit_code"] == 3
        out = res["stdout"].splitlines()
        assert out[0] == "out" and out[1] == os.path.join(sb.runtime.sandbox_dir, "work")
        assert res["stderr"] == "err\n"
        # stdin, a timeout, a background process: the engine's own exec policy
        res = await eng.exec(sb.id, ExecRequest(cmd="cat", stdin="fed"))
        assert res["stdout"] == "fed"
        res = await eng.exec(sb.id, ExecRequest(cmd="sleep 30", timeout=0.2))
        assert res["timed_out"] and res["exit_code"] == 128 + 9
        handle = await eng.exec(sb.id, ExecRequest(cmd="echo bg", background=True))
        waited = await eng.wait(sb.id, handle["pid"], 10)
        assert waited["stdout"] == "bg\n" and waited["exit_code"] == 0
        sdir = sb.runtime.sandbox_dir
        assert os.path.isdir(sdir)
        assert await eng.kill(sb.id)
        assert not os.path.exists(sdir)
        with pytest.raises(SandboxNotRunning):
            await eng.exec(sb.id, ExecRequest(cmd="true"))

    loop.run_until_complete(flow())
    assert eng.counters["created"] == 1 and eng.counters["killed"] == 1


def test_a_missing_capability_is_unsupported_before_any_side_effect(engine):
    eng, loop = engine

    async def flow() -> None:
        sb = await eng.create(SandboxSpec(substrate="hostproc", image="host"))
        before = sorted(os.listdir(sb.runtime.sandbox_dir))
        calls: list[Any] = [
            eng.snapshot(sb.id, "s1"), eng.fork(sb.id, 2, None, False),
            eng.restore(sb.id, "s1"), eng.stat(sb.id, "/"), eng.mkdir(sb.id, "/x", True),
            eng.write_file(sb.id, "/x", b"y", 0o644), eng.read_file(sb.id, "/etc/passwd", 10),
        ]
        for call in calls:
            with pytest.raises(Unsupported) as e:
                await call
            assert e.value.code == "unsupported" and e.value.status == 501
            assert e.value.details["substrate"] == "hostproc"
        for op in (eng.pause, eng.resume):
            with pytest.raises(Unsupported):
                await op(sb.id)
        assert sb.state == "running" and len(eng.sandboxes) == 1
        assert sorted(os.listdir(sb.runtime.sandbox_dir)) == before
        # a network mode the substrate cannot give: refused before anything is made
        with pytest.raises(Unsupported):
            await eng.create(SandboxSpec(substrate="hostproc", network="disabled"))
        assert len(eng.sandboxes) == 1
        await eng.kill(sb.id)

    loop.run_until_complete(flow())
    assert eng.counters["created"] == 1 and eng.counters["create_failed"] == 0
    assert eng.snapshot_list() == []


def test_substrate_names(engine):
    eng, loop = engine
    with pytest.raises(InvalidRequest) as e:  # not a substrate corral knows
        loop.run_until_complete(eng.create(SandboxSpec(substrate="nosuch")))
    assert "available: hostproc" in str(e.value)
    with pytest.raises(Unsupported):  # one corral knows, not served by this daemon
        loop.run_until_complete(eng.create(SandboxSpec(substrate="container")))
    with pytest.raises(ValueError):
        SandboxSpec(substrate="No Such!")
    assert SandboxSpec().substrate == "container"
    assert eng.sandboxes == {}


def test_substrates_route_and_errors_over_http(engine):
    """GET /v1/substrates shows the capability table; an unsupported operation is 501 with
    the stable code through the real HTTP layer."""
    eng, loop = engine
    with tempfile.TemporaryDirectory(prefix="corral-bnd-") as d:
        path = os.path.join(d, "s.sock")

        async def main() -> tuple[httpx.Response, ...]:
            runner = web.AppRunner(create_app(eng), access_log=None)
            await runner.setup()
            await web.UnixSite(runner, path).start()
            try:
                async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path),
                                             base_url="http://corral") as c:
                    subs = await c.get("/v1/substrates")
                    made = await c.post("/v1/sandboxes", json={"substrate": "hostproc"})
                    sid = made.json()["id"]
                    ran = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo hi"})
                    snap = await c.post(f"/v1/sandboxes/{sid}/snapshot", json={})
                    read = await c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/a"})
                    bad = await c.post("/v1/sandboxes", json={"substrate": "nosuch"})
                    st = await c.get("/v1/status")
                    gone = await c.delete(f"/v1/sandboxes/{sid}")
                    return subs, made, ran, snap, read, bad, st, gone
            finally:
                await runner.cleanup()

        subs, made, ran, snap, read, bad, st, gone = loop.run_until_complete(main())
    assert subs.status_code == 200
    table = subs.json()["substrates"]
    assert [s["name"] for s in table] == ["hostproc"]
    assert table[0]["capabilities"]["snapshot"] is False
    assert table[0]["operations"] == ["create", "exec", "kill"]
    assert made.status_code == 201 and made.json()["substrate"] == "hostproc"
    assert ran.json()["stdout"] == "hi\n"
    for r in (snap, read):
        assert r.status_code == 501 and r.json()["error"]["code"] == "unsupported"
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    assert st.json()["substrates"] == ["hostproc"] and "cgroup_version" not in st.json()
    assert gone.json() == {"id": made.json()["id"], "killed": True}


def test_registry_builds_only_what_is_named():
    with pytest.raises(ValueError, match="no substrate 'nosuch'"):
        registry.build(["nosuch"], registry.Context(Config(state_dir="/nonexistent"), None, {}))
    assert "container" in registry.defaults()
    assert re.fullmatch(r"[a-z]+", registry.names()[0])


# ---- the Rust core's stub ----------------------------------------------------------------------
def test_core_stub_matches_the_module():
    """python/corral/_core.pyi lists exactly what corral._core exports, with the same
    parameters and defaults."""
    import inspect

    from corral import _core

    stub = ast.parse((ROOT.parent / "_core.pyi").read_text())
    funcs = {n.name: n for n in stub.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name for n in stub.body if isinstance(n, ast.ClassDef)}
    consts = {t.id for n in stub.body if isinstance(n, ast.AnnAssign)
              for t in [n.target] if isinstance(t, ast.Name)}
    exported = {n for n in dir(_core) if not n.startswith("_")}
    assert exported == set(funcs) | consts | (classes & exported), \
        exported ^ (set(funcs) | consts | (classes & exported))
    for name, fn in funcs.items():
        sig = inspect.signature(getattr(_core, name))
        assert [a.arg for a in fn.args.args] == list(sig.parameters), name
        defaults = [ast.literal_eval(d) if not (isinstance(d, ast.Constant)
                                                and d.value is Ellipsis) else ...
                    for d in fn.args.defaults]
        real = [p.default for p in sig.parameters.values()
                if p.default is not inspect.Parameter.empty]
        assert defaults == real, (name, defaults, real)
    # The config classes: keyword-only constructors, the stub's names and defaults.
    inits = {n.name: f for n in stub.body if isinstance(n, ast.ClassDef)
             for f in n.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"}
    assert {"SpawnConfig", "ExecConfig", "Overlay"} <= set(inits)
    for name, init in inits.items():
        params = inspect.signature(getattr(_core, name)).parameters
        assert [a.arg for a in init.args.kwonlyargs] == list(params), name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values()), name
        stub_defaults = [None if d is None else ast.literal_eval(d)
                         if not (isinstance(d, ast.Constant) and d.value is Ellipsis) else ...
                         for d in init.args.kw_defaults]
        real = [None if p.default is inspect.Parameter.empty else p.default
                for p in params.values()]
        assert stub_defaults == real, (name, stub_defaults, real)


# ---- operations as data ------------------------------------------------------------------------
def test_handlers_dispatch_operations_and_touch_no_engine_state():
    """Every logged sandbox call goes through ops.dispatch: the handlers call no trajlog.run
    and reach into no sandbox record (its state, busy count, runtime) nor the substrates."""
    tree = ast.parse((ROOT / "app.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("sandboxes", "busy", "runtime", "substrates", "capturing",
                                     "threads", "state"), ast.unparse(node)
            if node.attr == "run" and isinstance(node.value, ast.Attribute):
                assert node.value.attr != "trajlog", ast.unparse(node)


def test_the_operation_set_is_closed():
    from corral.daemon import ops

    subclasses = {c for c in vars(ops).values()
                  if isinstance(c, type) and issubclass(c, ops.Op) and c is not ops.Op}
    assert subclasses == set(ops.OPS)
    names = {c.name for c in ops.OPS if isinstance(c.__dict__.get("name"), str)}
    assert {"create", "exec", "wait", "kill", "info", "snapshot", "fork", "restore", "pause",
            "resume", "stat", "list", "mkdir", "remove", "rename"} <= names
    # the two whose name depends on the call
    assert ops.Write("s", None, "/a", b"", 0o644, False).name == "write"
    assert ops.Write("s", None, "/a", b"", None, False).name == "upload"


def test_dispatch_waits_out_a_capture_for_pause(engine):
    """A pause dispatched while a snapshot capture holds the sandbox runs only once the
    capture is over (its freeze is not a pause)."""
    from corral.daemon import ops

    eng, loop = engine

    async def flow() -> None:
        sb = await eng.create(SandboxSpec(substrate="hostproc"))
        sb.capturing = loop.create_future()
        task = asyncio.ensure_future(ops.dispatch(eng, ops.Pause(sb.id, None)))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()  # held by the capture
        done, sb.capturing = sb.capturing, None
        done.set_result(None)
        with pytest.raises(Unsupported):  # then runs: hostproc cannot pause
            await task
        await eng.kill(sb.id)

    loop.run_until_complete(flow())
