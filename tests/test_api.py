"""The daemon's HTTP API, route by route, over the real unix socket and real sandboxes.

Every error code the API can return is provoked here at least once, with bad input of every
kind; the session fixture then checks that nothing leaked.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid

import pytest

from corral.daemon import capacity
from corral.models import (
    DaemonStatus,
    ExecResult,
    FileEntry,
    ImageInfo,
    ProcessHandle,
    ProcessStatus,
    SandboxInfo,
)

from apiclient import api_waiting, client, create, expect_error, kill, run
from conftest import (
    CGROUP_NAME,
    SOCKET,
    STATE_DIR,
    DaemonProcess,
    free_port,
    leaked_sandbox_cgroups,
    spare_cgroups,
    wait_until,
)


@pytest.fixture(scope="module")
def c():
    with client() as cl:
        yield cl


@pytest.fixture(scope="module")
def sb(c):
    info = create(c, timeout=900, env={"FROM_SPEC": "spec", "BOTH": "spec"})
    yield info["id"]
    kill(c, info["id"])


@pytest.fixture
def fresh(c):
    """A sandbox of its own, for tests that kill or break it."""
    info = create(c, timeout=300)
    yield info
    c.delete(f"/v1/sandboxes/{info['id']}")


def cgroups_of(sid: str) -> list[str]:
    return [p for p in leaked_sandbox_cgroups() if p.endswith("/" + sid)]


# ---- daemon ----------------------------------------------------------------------------
def test_health_and_status(c):
    assert c.get("/v1/health").json() == {"ok": True}
    st = DaemonStatus.model_validate(c.get("/v1/status").json())
    assert st.substrates == ["container", "gvisor", "process"]  # gvisor: runsc (setup.sh)
    assert st.state_dir == STATE_DIR
    assert st.cgroup_version in (1, 2)
    # No CORRAL_MAX_SANDBOXES: derived from this machine (memory, kernel limits) at start.
    want = capacity.derive()
    assert (st.capacity, st.capacity_bound_by) == (want.count, want.bound_by)
    assert st.pid == int(open(os.path.join(STATE_DIR, "corrald.pid")).read())
    # The count of creates (a cluster gateway matches its placements to it): one more.
    info = create(c)
    try:
        assert DaemonStatus.model_validate(c.get("/v1/status").json()).created == st.created + 1
    finally:
        c.delete(f"/v1/sandboxes/{info['id']}")


def test_socket_is_root_only():
    assert stat.S_IMODE(os.stat(SOCKET).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(SOCKET)).st_mode) == 0o700


def test_metrics(c):
    r = c.get("/metrics")
    assert r.status_code == 200
    assert "corral_sandboxes " in r.text and "corral_created_total" in r.text


def test_unknown_route_and_method(c):
    expect_error(c.get("/v1/nope"), "not_found", 404)
    expect_error(c.put("/v1/health"), "invalid_request", 405)


# ---- create / info / list / kill ---------------------------------------------------------
def test_create_info_kill(c):
    info = SandboxInfo.model_validate(create(c, labels={"t": "cik"}, metadata={"m": "1"}))
    assert info.id.startswith("sb-") and len(info.id) == 19
    int(info.id[3:], 16)
    assert info.state == "running" and info.substrate == "container" and info.image == "host"
    assert info.hostname == info.id
    assert info.expires_at == pytest.approx(info.created_at + 300)
    assert info.init_pid and os.path.exists(f"/proc/{info.init_pid}")
    assert len(cgroups_of(info.id)) >= 1
    got = c.get(f"/v1/sandboxes/{info.id}").json()
    assert got["labels"] == {"t": "cik"} and got["metadata"] == {"m": "1"}
    assert got["last_active_at"] >= info.last_active_at
    r = c.delete(f"/v1/sandboxes/{info.id}")
    assert r.json() == {"id": info.id, "killed": True}
    assert not os.path.exists(os.path.join(STATE_DIR, "sandboxes", info.id))
    assert not cgroups_of(info.id)
    assert wait_until(lambda: not os.path.exists(f"/proc/{info.init_pid}"), 5)
    # Ended sandboxes answer precisely; a second kill is a no-op.
    err = expect_error(c.get(f"/v1/sandboxes/{info.id}"), "sandbox_not_running", 409)
    assert err["details"]["reason"] == "killed"
    assert c.delete(f"/v1/sandboxes/{info.id}").json() == {"id": info.id, "killed": False}
    expect_error(c.post(f"/v1/sandboxes/{info.id}/exec", json={"cmd": "true"}),
                 "sandbox_not_running", 409)


def test_create_with_options(c):
    info = create(c, hostname="box-1", cpu=0.5, memory_mb=256, pids=64, idle_timeout=600,
                  network="none")
    try:
        assert (info["hostname"], info["cpu"], info["memory_mb"], info["pids"]) == \
            ("box-1", 0.5, 256, 64)
        assert run(c, info["id"], "hostname")["stdout"] == "box-1\n"
    finally:
        kill(c, info["id"])


def test_batch_create_and_label_filter(c):
    tag = uuid.uuid4().hex[:8]
    r = c.post("/v1/sandboxes/batch", json={"count": 3, "spec": {"labels": {"batch": tag}}})
    assert r.status_code == 201, r.text
    boxes = [SandboxInfo.model_validate(b) for b in r.json()["sandboxes"]]
    assert len({b.id for b in boxes}) == 3
    listed = c.get("/v1/sandboxes", params={"label": f"batch={tag}"}).json()["sandboxes"]
    assert sorted(b["id"] for b in listed) == sorted(b.id for b in boxes)
    assert c.get("/v1/sandboxes", params={"label": f"batch={tag}x"}).json()["sandboxes"] == []
    for b in boxes:
        assert run(c, b.id, "echo ok")["stdout"] == "ok\n"
        kill(c, b.id)
    expect_error(c.get("/v1/sandboxes", params={"label": "=x"}), "invalid_request", 400)


BAD_SPECS = [
    {"memory_mb": -1}, {"memory_mb": 10**12}, {"cpu": 0}, {"cpu": 100000}, {"pids": 1},
    {"pids": -5}, {"timeout": -5}, {"timeout": 0}, {"timeout": 1e12}, {"idle_timeout": 0},
    {"env": {"A=B": "x"}}, {"env": {"A": "x\u0000"}}, {"labels": {"bad key!": "x"}},
    {"hostname": "bad host!"}, {"no_such_field": 1},
    {"substrate": "Docker!"}, {"substrate": ""}, {"substrate": 1}, {"image": ""}, {"cwd": ""},
]


@pytest.mark.parametrize("spec", BAD_SPECS, ids=[json.dumps(s) for s in BAD_SPECS])
def test_create_rejects_bad_spec(c, spec):
    before = set(leaked_sandbox_cgroups())
    err = expect_error(c.post("/v1/sandboxes", json=spec), "invalid_request", 400)
    assert "SandboxSpec" in err["message"] and err["details"]["errors"]
    assert set(leaked_sandbox_cgroups()) == before


@pytest.mark.parametrize("name,code,status", [("docker", "invalid_request", 400),
                                               ("gvisor-nope", "invalid_request", 400),
                                               ("vm", "unsupported", 501)])
def test_create_on_a_substrate_not_served(c, name, code, status):
    """A well-formed name the daemon does not serve: unsupported if corral knows it, else
    invalid_request; either way it names what is served and makes nothing."""
    before = set(leaked_sandbox_cgroups())
    n = len(c.get("/v1/sandboxes").json()["sandboxes"])
    err = expect_error(c.post("/v1/sandboxes", json={"substrate": name}), code, status)
    assert "available: container" in err["message"] and err["details"]["substrate"] == name
    assert len(c.get("/v1/sandboxes").json()["sandboxes"]) == n
    assert set(leaked_sandbox_cgroups()) == before


def test_substrates_table(c):
    table = c.get("/v1/substrates").json()["substrates"]
    assert [s["name"] for s in table] == c.get("/v1/status").json()["substrates"]
    caps = next(s for s in table if s["name"] == "container")["capabilities"]
    assert caps["snapshot"] and caps["pause"] and caps["files"] and caps["restore"]
    assert caps["networks"] == ["none", "disabled", "internet", "policy"]


@pytest.mark.parametrize("network", ["host", "bridge", "", "NONE", 1, None])
def test_create_rejects_unknown_network(c, network):
    before = set(leaked_sandbox_cgroups())
    for path, body in (("/v1/sandboxes", {"network": network}),
                       ("/v1/sandboxes/batch", {"count": 2, "spec": {"network": network}})):
        err = expect_error(c.post(path, json=body), "invalid_network", 400)
        assert err["details"]["modes"] == ["none", "disabled", "internet"], err
    assert set(leaked_sandbox_cgroups()) == before


def test_create_network_disabled(c):
    sb = create(c, network="disabled")
    try:
        assert sb["network"] == "disabled"
        r = run(c, sb["id"], "echo ok")
        assert r["stdout"] == "ok\n"
    finally:
        kill(c, sb["id"])


@pytest.mark.parametrize("body", [b"{", b"[]", b"null", b"\xff\xfe", b'{"memory_mb": "lots"}'])
def test_create_rejects_invalid_json(c, body):
    expect_error(c.post("/v1/sandboxes", content=body), "invalid_request", 400)


def test_batch_rejects_bad_count(c):
    for n in (0, -1, 10**6):
        expect_error(c.post("/v1/sandboxes/batch", json={"count": n}), "invalid_request", 400)


def test_bad_image_and_unsupported_substrate(c):
    err = expect_error(c.post("/v1/sandboxes", json={"image": "no-such-image"}),
                       "image_not_found", 404)
    assert "no-such-image" in err["message"]
    for sub in ("microvm", "vm"):
        err = expect_error(c.post("/v1/sandboxes", json={"substrate": sub}), "unsupported", 501)
        assert "not available on this daemon" in err["message"]


UNKNOWN = "sb-0123456789abcdef"


@pytest.mark.parametrize("method,path,body", [
    ("GET", "", None), ("DELETE", "", None), ("POST", "/timeout", {"timeout": 10}),
    ("POST", "/exec", {"cmd": "true"}), ("GET", "/procs/1", None),
    ("POST", "/procs/1/wait", {}), ("GET", "/files?path=/etc/hostname", None),
    ("PUT", "/files?path=/x", None), ("GET", "/files/list?path=/", None),
    ("GET", "/files/stat?path=/", None), ("POST", "/files/mkdir", {"path": "/x"}),
    ("POST", "/files/remove", {"path": "/x"}), ("POST", "/files/rename",
                                                 {"src": "/x", "dst": "/y"}),
    ("GET", "/files/tar?path=/", None),
])
def test_unknown_sandbox(c, method, path, body):
    r = c.request(method, f"/v1/sandboxes/{UNKNOWN}{path}", json=body)
    err = expect_error(r, "sandbox_not_found", 404)
    assert UNKNOWN in err["message"]
    expect_error(c.get("/v1/sandboxes/not-an-id"), "sandbox_not_found", 404)


def test_set_timeout(c, fresh):
    sid = fresh["id"]
    r = c.post(f"/v1/sandboxes/{sid}/timeout", json={"timeout": 3600})
    assert r.status_code == 200
    info = SandboxInfo.model_validate(r.json())
    assert info.expires_at == pytest.approx(time.time() + 3600, abs=5)
    for bad in ({"timeout": -1}, {"timeout": 0}, {"timeout": 1e12}, {}):
        expect_error(c.post(f"/v1/sandboxes/{sid}/timeout", json=bad), "invalid_request", 400)


# ---- exec --------------------------------------------------------------------------------
def test_exec_basics(c, sb):
    r = ExecResult.model_validate(run(c, sb, "echo out; echo err >&2; exit 3"))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    assert not r.truncated and not r.timed_out and r.duration_s < 5
    assert (r.stdout_bytes, r.stderr_bytes) == (4, 4)
    r = run(c, sb, ["/bin/echo", "a b", "$HOME"])
    assert r["stdout"] == "a b $HOME\n"
    assert run(c, sb, "printf 'h\u00e9llo \u2603'")["stdout"] == "h\u00e9llo \u2603"
    assert run(c, sb, "kill -TERM $$")["exit_code"] == 128 + signal.SIGTERM


def test_exec_missing_binary_is_127(c, sb):
    assert run(c, sb, ["/no/such/binary"])["exit_code"] == 127
    r = run(c, sb, "no-such-command-xyz")
    assert r["exit_code"] == 127 and "not found" in r["stderr"]


def test_exec_env_cwd_user(c, sb):
    r = run(c, sb, "echo $FROM_SPEC $BOTH $FROM_REQ; echo $PATH; echo $HOME $LANG $TERM; "
                   "echo $HOSTNAME; pwd", env={"BOTH": "req", "FROM_REQ": "r"})
    lines = r["stdout"].splitlines()
    assert lines[0] == "spec req r"
    assert lines[1] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert lines[2] == "/root C.UTF-8 xterm"
    assert lines[3] == sb
    assert lines[4] == "/root"
    assert run(c, sb, "pwd", cwd="/tmp")["stdout"] == "/tmp\n"
    assert run(c, sb, "id -u; id -g")["stdout"] == "0\n0\n"
    r = run(c, sb, "id -u; id -g; echo $HOME", user="nobody")
    assert r["stdout"].split() == ["65534", "65534", "/nonexistent"]
    assert run(c, sb, "id -u; id -g", user=4321)["stdout"].split() == ["4321", "4321"]
    assert run(c, sb, "id -u", user="65534")["stdout"] == "65534\n"
    expect_error(c.post(f"/v1/sandboxes/{sb}/exec", json={"cmd": "id", "user": "nobody-xyz"}),
                 "user_not_found", 404)
    expect_error(c.post(f"/v1/sandboxes/{sb}/exec", json={"cmd": "pwd", "cwd": "tmp"}),
                 "invalid_path", 400)
    expect_error(c.post(f"/v1/sandboxes/{sb}/exec", json={"cmd": "true", "env": {"A=B": "1"}}),
                 "invalid_request", 400)


def test_exec_user_from_sandbox_passwd(c, fresh):
    sid = fresh["id"]
    c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/etc/passwd"},
          content=b"root:x:0:0:root:/root:/bin/sh\nagent:x:1500:1600::/home/agent:/bin/sh\n")
    c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/etc/group"},
          content=b"root:x:0:\nagents:x:1600:\nextra:x:1700:agent,other\n")
    r = run(c, sid, "id -u; id -g; id -G; echo $HOME", user="agent")
    assert r["stdout"].split() == ["1500", "1600", "1600", "1700", "/home/agent"]


def test_exec_stdin(c, sb):
    assert run(c, sb, "cat", stdin="hello\n")["stdout"] == "hello\n"
    big = "x" * (1 << 20)  # more than a pipe holds: written as the command reads
    assert run(c, sb, "wc -c", stdin=big)["stdout"].strip() == str(1 << 20)
    assert run(c, sb, "cat")["stdout"] == ""  # no stdin: /dev/null, not a hang


def test_exec_output_cap(c, sb):
    r = run(c, sb, "yes abcdefgh | head -c 20000000; echo tail >&2", max_output_bytes=1000)
    assert r["truncated"] and len(r["stdout"]) == 1000 and r["stdout_bytes"] == 20_000_000
    assert r["stderr"] == "tail\n" and r["exit_code"] == 0
    r = run(c, sb, "head -c 6000000 /dev/zero | tr '\\0' a")  # default cap: 4 MiB
    assert r["truncated"] and len(r["stdout"]) == 4 * 1024 * 1024
    r = run(c, sb, "head -c 100000 /dev/zero | tr '\\0' a", max_output_bytes=100000)
    assert not r["truncated"] and len(r["stdout"]) == 100000
    assert run(c, sb, "echo hi", max_output_bytes=0)["stdout"] == ""


def test_exec_timeout_kills_process_group(c, sb):
    t0 = time.monotonic()
    r = run(c, sb, "sleep 1000 & echo $! > /tmp/grandchild; sleep 1000", timeout=1)
    assert r["timed_out"] and r["exit_code"] == 137
    assert time.monotonic() - t0 < 10
    r = run(c, sb, "p=$(cat /tmp/grandchild); for i in $(seq 100); do "
                   "kill -0 $p 2>/dev/null || { echo dead; exit; }; sleep 0.05; done; echo alive")
    assert r["stdout"] == "dead\n"


def test_exec_returns_when_command_exits_even_if_a_child_holds_stdout(c, sb):
    t0 = time.monotonic()
    r = run(c, sb, "sleep 30 & echo started", timeout=20)
    assert r["stdout"] == "started\n" and r["exit_code"] == 0
    assert time.monotonic() - t0 < 5
    # The background child keeps running (no SIGPIPE, no kill).
    assert run(c, sb, "pgrep -x sleep >/dev/null && echo yes")["stdout"] == "yes\n"
    run(c, sb, "pkill -x sleep; true")


def test_exec_sigpipe_is_default(c, sb):
    r = run(c, sb, "yes | head -n 1", timeout=20)
    assert r["stdout"] == "y\n" and r["exit_code"] == 0 and r["duration_s"] < 10


BAD_EXECS = [
    {}, {"cmd": ""}, {"cmd": []}, {"cmd": "  "}, {"cmd": 5}, {"cmd": ["a\u0000b"]},
    {"cmd": "true", "timeout": 0}, {"cmd": "true", "timeout": -1},
    {"cmd": "true", "max_output_bytes": -1}, {"cmd": "true", "max_output_bytes": 10**12},
    {"cmd": "true", "bogus": 1},
]


@pytest.mark.parametrize("body", BAD_EXECS, ids=[json.dumps(b) for b in BAD_EXECS])
def test_exec_rejects_bad_request(c, sb, body):
    expect_error(c.post(f"/v1/sandboxes/{sb}/exec", json=body), "invalid_request", 400)


def test_sandbox_killed_mid_exec(c, fresh):
    sid = fresh["id"]
    threading.Timer(0.5, lambda: c.delete(f"/v1/sandboxes/{sid}")).start()
    t0 = time.monotonic()
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 60"})
    err = expect_error(r, "sandbox_not_running", 409)
    assert err["details"]["reason"] == "killed"
    assert time.monotonic() - t0 < 10
    assert wait_until(lambda: not cgroups_of(sid))


def test_init_killed_mid_exec_is_sandbox_lost(c, fresh):
    sid, init_pid = fresh["id"], fresh["init_pid"]
    threading.Timer(0.5, lambda: os.kill(init_pid, signal.SIGKILL)).start()
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 60"})
    expect_error(r, "sandbox_lost", 410)
    expect_error(c.get(f"/v1/sandboxes/{sid}"), "sandbox_lost", 410)
    assert wait_until(lambda: not cgroups_of(sid))
    assert wait_until(lambda: not os.path.exists(os.path.join(STATE_DIR, "sandboxes", sid)))


def test_init_killed_while_idle_is_detected(c, fresh):
    sid, init_pid = fresh["id"], fresh["init_pid"]
    os.kill(init_pid, signal.SIGKILL)
    assert wait_until(lambda: c.get(f"/v1/sandboxes/{sid}").status_code == 410)
    expect_error(c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}), "sandbox_lost", 410)
    assert wait_until(lambda: not cgroups_of(sid))
    assert sid not in [s["id"] for s in c.get("/v1/sandboxes").json()["sandboxes"]]


def test_daemon_keeps_serving_during_floods_and_long_commands(c, sb):
    other = create(c)["id"]
    results = {}

    def flood():
        with client() as c2:
            results["flood"] = run(c2, sb, "timeout 3 yes x; true", max_output_bytes=1 << 20)

    def sleeper():
        with client() as c2:
            results["sleep"] = run(c2, other, "sleep 3")

    threads = [threading.Thread(target=flood), threading.Thread(target=sleeper)]
    for t in threads:
        t.start()

    def running(sid: str, name: str) -> bool:
        return run(c, sid, f"pgrep -x {name} >/dev/null && echo y")["stdout"] == "y\n"

    assert wait_until(lambda: running(sb, "yes") and running(other, "sleep"), timeout=3)
    with client() as c3:
        for _ in range(10):
            t0 = time.monotonic()
            assert c3.get("/v1/health").status_code == 200
            assert run(c3, other, "echo fast")["stdout"] == "fast\n"
            assert time.monotonic() - t0 < 1.0
    for t in threads:
        t.join()
    assert results["flood"]["truncated"] and results["sleep"]["exit_code"] == 0
    kill(c, other)


# ---- background processes ----------------------------------------------------------------
def start_bg(c, sid, cmd, **kw) -> int:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "background": True, **kw})
    assert r.status_code == 200, r.text
    h = ProcessHandle.model_validate(r.json())
    assert h.sandbox_id == sid and h.cmd == cmd
    return h.pid


def test_background_stdin_wait(c, sb):
    pid = start_bg(c, sb, "read x; echo got $x; echo $$; echo done >&2")
    st = ProcessStatus.model_validate(c.get(f"/v1/sandboxes/{sb}/procs/{pid}").json())
    assert st.running and st.exit_code is None and st.pid == pid
    assert c.post(f"/v1/sandboxes/{sb}/procs/{pid}/stdin", json={"data": "hi\n"}).json() == \
        {"ok": True}
    r = c.post(f"/v1/sandboxes/{sb}/procs/{pid}/wait", json={"timeout": 30}).json()
    assert r["stdout"] == f"got hi\n{pid}\n" and r["stderr"] == "done\n" and r["exit_code"] == 0
    st = c.get(f"/v1/sandboxes/{sb}/procs/{pid}").json()
    assert st == {"pid": pid, "running": False, "exit_code": 0, "timed_out": False,
                  "signal": None, "oom_killed": False}
    expect_error(c.post(f"/v1/sandboxes/{sb}/procs/{pid}/stdin", json={"data": "x"}),
                 "conflict", 409)


def test_background_stdin_eof(c, sb):
    pid = start_bg(c, sb, "wc -l")
    c.post(f"/v1/sandboxes/{sb}/procs/{pid}/stdin", json={"data": "a\nb\n"})
    c.post(f"/v1/sandboxes/{sb}/procs/{pid}/stdin", json={"data": "c\n", "eof": True})
    r = c.post(f"/v1/sandboxes/{sb}/procs/{pid}/wait", json={"timeout": 30}).json()
    assert r["stdout"].strip() == "3"


def test_background_stream(c, sb):
    pid = start_bg(c, sb, "echo first; sleep 0.3; for i in 2 3; do echo $i; echo e$i >&2; "
                          "sleep 0.1; done; exit 5")
    lines = []
    with c.stream("GET", f"/v1/sandboxes/{sb}/procs/{pid}/stream") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in r.iter_lines() if x]
    out = "".join(x["data"] for x in lines[:-1] if x["stream"] == "stdout")
    err = "".join(x["data"] for x in lines[:-1] if x["stream"] == "stderr")
    assert (out, err) == ("first\n2\n3\n", "e2\ne3\n")
    end = {"pid": pid, "running": False, "exit_code": 5, "timed_out": False, "signal": None,
           "oom_killed": False}
    assert lines[-1] == end
    # Streaming a finished process replays its output.
    with c.stream("GET", f"/v1/sandboxes/{sb}/procs/{pid}/stream") as r:
        again = [json.loads(x) for x in r.iter_lines() if x]
    assert again[-1] == end
    assert "".join(x.get("data", "") for x in again if x.get("stream") == "stdout") == out


def test_background_wait_timeout_and_kill(c, sb):
    pid = start_bg(c, sb, "sleep 100 & sleep 100")
    expect_error(c.post(f"/v1/sandboxes/{sb}/procs/{pid}/wait", json={"timeout": 0.2}),
                 "process_running", 409)
    assert c.post(f"/v1/sandboxes/{sb}/procs/{pid}/kill", json={"signal": 15}).json() == \
        {"ok": True}
    r = c.post(f"/v1/sandboxes/{sb}/procs/{pid}/wait", json={"timeout": 30}).json()
    assert r["exit_code"] == 128 + 15
    # The group went too; killing again is a no-op.
    assert run(c, sb, "pgrep -x sleep || echo none")["stdout"] == "none\n"
    assert c.post(f"/v1/sandboxes/{sb}/procs/{pid}/kill", json={}).status_code == 200
    expect_error(c.post(f"/v1/sandboxes/{sb}/procs/{pid}/kill", json={"signal": 0}),
                 "invalid_request", 400)


def test_background_timeout(c, sb):
    pid = start_bg(c, sb, "sleep 100", timeout=0.5)
    r = c.post(f"/v1/sandboxes/{sb}/procs/{pid}/wait", json={"timeout": 30}).json()
    assert r["timed_out"] and r["exit_code"] == 137


def test_background_output_is_capped(c, sb):
    pid = start_bg(c, sb, "head -c 3000000 /dev/zero | tr '\\0' b", max_output_bytes=1000)
    r = c.post(f"/v1/sandboxes/{sb}/procs/{pid}/wait", json={"timeout": 30}).json()
    assert r["truncated"] and len(r["stdout"]) == 1000 and r["stdout_bytes"] == 3_000_000


def test_unknown_process(c, sb):
    for path in ("", "/stream"):
        expect_error(c.get(f"/v1/sandboxes/{sb}/procs/999999{path}"), "process_not_found", 404)
    expect_error(c.post(f"/v1/sandboxes/{sb}/procs/999999/wait", json={}),
                 "process_not_found", 404)
    expect_error(c.get(f"/v1/sandboxes/{sb}/procs/abc"), "invalid_request", 400)


def test_background_process_ends_with_its_sandbox(c, fresh):
    sid = fresh["id"]
    pid = start_bg(c, sid, "sleep 100")
    result = {}

    def waiter():
        with client() as c2:
            result["r"] = c2.post(f"/v1/sandboxes/{sid}/procs/{pid}/wait", json={})

    t = threading.Thread(target=waiter)
    t.start()
    assert wait_until(lambda: api_waiting(c) >= 1)  # the wait is in the daemon
    kill(c, sid)
    t.join(10)
    expect_error(result["r"], "sandbox_not_running", 409)
    expect_error(c.get(f"/v1/sandboxes/{sid}/procs/{pid}"), "sandbox_not_running", 409)


# ---- files -------------------------------------------------------------------------------
def f(sid: str, sub: str = "") -> str:
    return f"/v1/sandboxes/{sid}/files{sub}"


def test_files_roundtrip(c, sb):
    assert c.put(f(sb), params={"path": "/work/a/b.txt"}, content=b"hello").json() == \
        {"ok": True}
    r = c.get(f(sb), params={"path": "/work/a/b.txt"})
    assert r.content == b"hello" and r.headers["content-type"] == "application/octet-stream"
    st = FileEntry.model_validate(c.get(f(sb, "/stat"), params={"path": "/work/a/b.txt"}).json())
    assert (st.name, st.path, st.type, st.size, st.mode) == ("b.txt", "/work/a/b.txt", "file",
                                                             5, 0o644)
    assert run(c, sb, "cat /work/a/b.txt")["stdout"] == "hello"
    c.put(f(sb), params={"path": "/work/a/run.sh", "mode": "493"}, content=b"#!/bin/sh\necho x\n")
    assert run(c, sb, "/work/a/run.sh")["stdout"] == "x\n"
    entries = c.get(f(sb, "/list"), params={"path": "/work/a"}).json()["entries"]
    assert sorted(e["name"] for e in entries) == ["b.txt", "run.sh"]
    binary = bytes(range(256)) * 4
    c.put(f(sb), params={"path": "/work/bin"}, content=binary)
    assert c.get(f(sb), params={"path": "/work/bin"}).content == binary


def test_files_read_max_bytes(c, sb):
    c.put(f(sb), params={"path": "/work/ten"}, content=b"0123456789")
    r = c.get(f(sb), params={"path": "/work/ten", "max_bytes": "4"})
    assert r.content == b"0123" and r.headers["x-corral-truncated"] == "true"
    r = c.get(f(sb), params={"path": "/work/ten", "max_bytes": "10"})
    assert r.content == b"0123456789" and "x-corral-truncated" not in r.headers
    expect_error(c.get(f(sb), params={"path": "/work/ten", "max_bytes": "-1"}),
                 "invalid_request", 400)
    big = os.urandom(3 << 20)  # past the direct-read size: the threaded path truncates too
    c.put(f(sb), params={"path": "/work/big3"}, content=big)
    r = c.get(f(sb), params={"path": "/work/big3", "max_bytes": str(2 << 20)})
    assert r.content == big[: 2 << 20] and r.headers["x-corral-truncated"] == "true"


def test_files_big(c, sb):
    data = os.urandom(5 << 20)
    assert c.put(f(sb), params={"path": "/work/big"}, content=data).status_code == 200
    assert c.get(f(sb), params={"path": "/work/big"}).content == data
    assert run(c, sb, "wc -c < /work/big")["stdout"].strip() == str(5 << 20)


def test_files_mkdir_remove_rename(c, sb):
    ok = {"ok": True}
    assert c.post(f(sb, "/mkdir"), json={"path": "/work/m/n/o"}).json() == ok
    expect_error(c.post(f(sb, "/mkdir"), json={"path": "/work/m", "parents": False}),
                 "file_exists", 409)
    expect_error(c.post(f(sb, "/mkdir"), json={"path": "/work/zz/y", "parents": False}),
                 "file_not_found", 404)
    assert c.get(f(sb, "/stat"), params={"path": "/work/m/n"}).json()["type"] == "dir"
    expect_error(c.post(f(sb, "/remove"), json={"path": "/work/m"}), "directory_not_empty", 409)
    c.put(f(sb), params={"path": "/work/m/file"}, content=b"1")
    assert c.post(f(sb, "/rename"), json={"src": "/work/m/file", "dst": "/work/m/moved"}).json() \
        == ok
    expect_error(c.get(f(sb), params={"path": "/work/m/file"}), "file_not_found", 404)
    assert c.get(f(sb), params={"path": "/work/m/moved"}).content == b"1"
    assert c.post(f(sb, "/remove"), json={"path": "/work/m", "recursive": True}).json() == ok
    expect_error(c.get(f(sb, "/stat"), params={"path": "/work/m"}), "file_not_found", 404)
    expect_error(c.post(f(sb, "/remove"), json={"path": "/work/m"}), "file_not_found", 404)


def test_files_errors(c, sb):
    expect_error(c.get(f(sb), params={"path": "/no/such/file"}), "file_not_found", 404)
    expect_error(c.get(f(sb)), "invalid_request", 400)
    for bad in ("relative/path", "", "/a\u0000b"):
        expect_error(c.get(f(sb), params={"path": bad}), "invalid_path", 400)
    expect_error(c.post(f(sb, "/mkdir"), json={"path": "rel"}), "invalid_path", 400)
    expect_error(c.post(f(sb, "/rename"), json={"src": "/etc/hostname", "dst": "x"}),
                 "invalid_path", 400)
    expect_error(c.put(f(sb), params={"path": "/work/x", "mode": "abc"}), "invalid_request", 400)
    expect_error(c.put(f(sb), params={"path": "/work/x", "mode": "99999"}),
                 "invalid_request", 400)
    expect_error(c.get(f(sb), params={"path": "/etc"}), "is_a_directory", 409)
    expect_error(c.put(f(sb), params={"path": "/etc"}, content=b"x"), "is_a_directory", 409)
    expect_error(c.get(f(sb, "/list"), params={"path": "/etc/hostname"}), "not_a_directory", 409)
    expect_error(c.post(f(sb, "/mkdir"), json={}), "invalid_request", 400)


def test_files_cannot_escape_root(c, sb):
    # The host has /etc/shadow; the sandbox's /etc does not; `..` and symlinks stay inside.
    assert os.path.exists("/etc/shadow")
    for p in ("/../../../etc/shadow", "/etc/../../etc/shadow"):
        expect_error(c.get(f(sb), params={"path": p}), "file_not_found", 404)
    run(c, sb, "mkdir -p /work/esc && ln -sfn / /work/esc/root && ln -sfn ../../.. /work/esc/up")
    for p in ("/work/esc/root/etc/shadow", "/work/esc/up/etc/shadow"):
        expect_error(c.get(f(sb), params={"path": p}), "file_not_found", 404)
    c.put(f(sb), params={"path": "/work/esc/up/tmp/corral-escape-probe"}, content=b"x")
    assert not os.path.exists("/tmp/corral-escape-probe")


def test_files_tar(c, sb):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("one.txt", b"1"), ("sub/two.txt", b"22")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert c.put(f(sb, "/tar"), params={"path": "/work/tar"}, content=buf.getvalue()).json() == \
        {"ok": True}
    assert run(c, sb, "cat /work/tar/one.txt /work/tar/sub/two.txt")["stdout"] == "122"
    r = c.get(f(sb, "/tar"), params={"path": "/work/tar"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = tar.getnames()
        assert any(n.endswith("sub/two.txt") for n in names), names
        member = next(m for m in tar.getmembers() if m.name.endswith("sub/two.txt"))
        assert tar.extractfile(member).read() == b"22"
    expect_error(c.put(f(sb, "/tar"), params={"path": "/work/t2"}, content=b"not a tar"),
                 "invalid_request", 400)


# ---- images ------------------------------------------------------------------------------
def test_images(c):
    images = [ImageInfo.model_validate(i) for i in c.get("/v1/images").json()["images"]]
    assert any(i.name == "host" and i.kind == "builtin" for i in images)
    src = tempfile.mkdtemp(prefix="corral-img-", dir="/var/tmp")
    os.makedirs(os.path.join(src, "etc"))
    with open(os.path.join(src, "etc", "hello.txt"), "w") as fh:
        fh.write("from the image\n")
    name = f"api-test-{uuid.uuid4().hex[:8]}"
    r = c.post("/v1/images", json={"name": name, "source": src})
    assert r.status_code == 201, r.text
    assert ImageInfo.model_validate(r.json()).kind == "rootfs"
    assert name in [i["name"] for i in c.get("/v1/images").json()["images"]]
    expect_error(c.post("/v1/images", json={"name": name, "source": src}), "conflict", 409)
    expect_error(c.post("/v1/images", json={"name": "Bad Name", "source": src}),
                 "invalid_request", 400)
    expect_error(c.post("/v1/images", json={"name": "x-missing", "source": "/no/such/dir"}),
                 "invalid_request", 400)
    info = create(c, image=name)
    try:
        assert c.get(f(info["id"]), params={"path": "/etc/hello.txt"}).text == "from the image\n"
    finally:
        kill(c, info["id"])
        shutil.rmtree(src, ignore_errors=True)  # the image holds its own copy


# ---- a second daemon: capacity, TCP with a token -----------------------------------------


@pytest.fixture(scope="module")
def small():
    """A daemon of its own (max 3 sandboxes, TCP with a token) on its own state and cgroup."""
    state = tempfile.mkdtemp(prefix="corral-small-", dir="/var/tmp")
    cg = f"{CGROUP_NAME}-small"
    port = free_port()
    d = DaemonProcess(state, os.path.join(state, "run", "corrald.sock"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_CGROUP", cg)
        mp.setenv("CORRAL_MAX_SANDBOXES", "3")
        mp.setenv("CORRAL_TCP", f"127.0.0.1:{port}")
        mp.setenv("CORRAL_TOKEN", "s3cret")
        d.start()
    d.port = port
    yield d
    d.stop()
    assert leaked_sandbox_cgroups(cg) == [] and spare_cgroups(cg) == []
    assert os.listdir(os.path.join(state, "sandboxes")) == []
    subprocess.run(["rm", "-rf", state], check=False)


def test_capacity_exceeded(small):
    with client(small.socket_path) as c:
        ids = [create(c)["id"] for _ in range(3)]
        err = expect_error(c.post("/v1/sandboxes", json={}), "capacity_exceeded", 429)
        assert err["details"]["capacity"] == 3
        assert c.get("/v1/status").json()["capacity_bound_by"] == "config"
        kill(c, ids.pop())
        expect_error(c.post("/v1/sandboxes/batch", json={"count": 2}), "capacity_exceeded", 429)
        assert len(c.get("/v1/sandboxes").json()["sandboxes"]) == 2
        ids.append(create(c)["id"])
        for sid in ids:
            kill(c, sid)


def test_tcp_requires_token(small):
    import httpx

    base = f"http://127.0.0.1:{small.port}"
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.get("/v1/health").status_code == 200
        expect_error(c.get("/v1/status"), "unauthorized", 401)
        expect_error(c.get("/v1/status", headers={"Authorization": "Bearer nope"}),
                     "unauthorized", 401)
        auth = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/status", headers=auth).json()["capacity"] == 3
        info = c.post("/v1/sandboxes", json={}, headers=auth).json()
        r = c.post(f"/v1/sandboxes/{info['id']}/exec", json={"cmd": "echo tcp"}, headers=auth)
        assert r.json()["stdout"] == "tcp\n"
        assert c.delete(f"/v1/sandboxes/{info['id']}", headers=auth).json()["killed"]


def test_tcp_refused_without_token():
    state = tempfile.mkdtemp(prefix="corral-notoken-", dir="/var/tmp")
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "corral.daemon", "--state-dir", state,
                        "--socket", os.path.join(state, "s.sock"), "--tcp",
                        f"127.0.0.1:{free_port()}"], env=env, capture_output=True, timeout=60)
    subprocess.run(["rm", "-rf", state], check=False)
    assert r.returncode != 0
    assert b"token" in r.stderr


def test_second_daemon_on_same_state_dir_refuses():
    r = subprocess.run([sys.executable, "-m", "corral.daemon", "--socket",
                        os.path.join(STATE_DIR, "run", "other.sock")],
                       capture_output=True, timeout=60)
    assert r.returncode != 0 and b"another corrald" in r.stderr
    with client() as c:
        assert c.get("/v1/health").status_code == 200
