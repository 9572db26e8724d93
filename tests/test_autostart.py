"""The embedded default: the first SDK use in a fresh process starts one local corrald, even
when many tasks make their first call at the same moment; and after the daemon is kill -9'd,
the next calls start it again (one starter across threads and processes), the new daemon
re-adopts the sandboxes and the same handles keep working."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from conftest import cgroup_dirs, leaked_sandbox_cgroups

SCRIPT = textwrap.dedent("""
    import asyncio, json
    import corral

    async def one(i):
        async with corral.AsyncSandbox() as sb:
            return (await sb.exec(f"echo {i}")).stdout.strip()

    async def main():
        return await asyncio.gather(*(one(i) for i in range(16)), return_exceptions=True)

    print(json.dumps([str(x) for x in asyncio.run(main())]))
""")


def test_concurrent_first_calls_start_one_daemon():
    state = tempfile.mkdtemp(prefix="corral-rs-auto-", dir="/var/tmp")  # not swept by others
    sock = os.path.join(state, "run", "corrald.sock")
    cgroup = f"corral-test-auto-{os.getpid()}"
    env = dict(os.environ, CORRAL_STATE_DIR=state, CORRAL_SOCKET=sock, CORRAL_CGROUP=cgroup,
               CORRAL_AUTOSTART="1")
    try:
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [str(i) for i in range(16)]
        pids = [line for line in open(os.path.join(state, "corrald.pid"))]
        assert len(pids) == 1
    finally:
        stop = ("from corral.daemon.launcher import stop_daemon; import sys; "
                "stop_daemon(socket_path=sys.argv[1])")
        subprocess.run([sys.executable, "-c", stop, sock], env=env, timeout=60)
        leaked = leaked_sandbox_cgroups(cgroup)
        for top in cgroup_dirs(cgroup):
            try:
                top.rmdir()
            except OSError:
                pass
        shutil.rmtree(state, ignore_errors=True)
    assert leaked == []


class Private:
    """A state dir, socket and cgroup name of its own; the daemon the SDK starts there is
    stopped and everything checked at the end."""

    def __init__(self, tag: str) -> None:
        # Not a corral-test- prefix: a concurrent pytest session sweeps those when it ends.
        self.state = tempfile.mkdtemp(prefix=f"corral-rs-{tag}-", dir="/var/tmp")
        self.sock = os.path.join(self.state, "run", "corrald.sock")
        self.cgroup = f"corral-test-{tag}-{os.getpid()}"
        self.env = dict(os.environ, CORRAL_STATE_DIR=self.state, CORRAL_SOCKET=self.sock,
                        CORRAL_CGROUP=self.cgroup, CORRAL_AUTOSTART="1")
        self.env.pop("CORRAL_URL", None)

    def pid(self) -> int:
        with open(os.path.join(self.state, "corrald.pid")) as f:
            return int(f.read())

    def kill9(self) -> int:
        pid = self.pid()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(f"/proc/{pid}")
        return pid

    def log_count(self, text: str) -> int:
        with open(os.path.join(self.state, "corrald.log"), errors="replace") as f:
            return sum(text in line for line in f)

    def close(self) -> list[str]:
        stop = ("from corral.daemon.launcher import stop_daemon; import sys; "
                "stop_daemon(socket_path=sys.argv[1])")
        subprocess.run([sys.executable, "-c", stop, self.sock], env=self.env, timeout=60)
        leaked = leaked_sandbox_cgroups(self.cgroup)
        for top in cgroup_dirs(self.cgroup):
            for d in sorted(top.rglob("*"), key=lambda p: -len(p.parts)):
                if d.is_dir():
                    try:
                        d.rmdir()
                    except OSError:
                        pass
            try:
                top.rmdir()
            except OSError:
                pass
        shutil.rmtree(self.state, ignore_errors=True)
        return leaked


# The client: auto-starts the daemon, keeps a command running (in flight when the test kills
# the daemon), then uses the same handle again.
CLIENT = textwrap.dedent("""
    import json, sys, threading
    import corral

    sb = corral.Sandbox(timeout=600)
    sb.exec("echo kept > /root/mark")
    inflight = {}

    def long():
        try:
            r = sb.exec("touch /tmp/started; sleep 120")
            inflight["code"] = f"exit {r.exit_code}"
        except corral.CorralError as e:
            inflight["code"] = e.code

    t = threading.Thread(target=long)
    t.start()
    while sb.exec("test -e /tmp/started").exit_code != 0:  # the command is running
        pass
    print("ready", flush=True)
    sys.stdin.readline()  # the test kill -9s corrald here
    t.join(60)
    calls = []
    for _ in range(5):
        try:
            calls.append(sb.exec("cat /root/mark").stdout.strip())
        except corral.CorralError as e:
            calls.append(e.code)
    calls.append(sb.files.read("/root/mark").strip())
    print(json.dumps({"id": sb.id, "inflight": inflight.get("code"), "calls": calls}),
          flush=True)
    sb.kill()
""")


def test_client_restarts_a_killed_daemon_and_keeps_its_handle():
    p = Private("restart")
    proc = subprocess.Popen([sys.executable, "-c", CLIENT], env=p.env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        first = p.kill9()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        res = json.loads(out.strip().splitlines()[-1])
        # The call in flight is told the daemon went away (infra); every later call works on
        # the same handle, against a new daemon that re-adopted the sandbox.
        assert res["inflight"] == "daemon_restarted", res
        assert res["calls"] == ["kept"] * 6, res
        assert p.pid() != first
        assert p.log_count('"corrald started"') == 2
        assert p.log_count("another corrald") == 0
        assert p.log_count('"adopted": 1') == 1, "the new daemon re-adopted the sandbox"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        leaked = p.close()
    assert leaked == []


# Eight threads per process, released together, each calling on a sandbox whose daemon is dead.
HAMMER = textwrap.dedent("""
    import json, sys, threading
    import corral

    box = corral.Sandbox.from_id(sys.argv[1])
    gate = threading.Barrier(8)
    out = [None] * 8

    def one(i):
        gate.wait()
        try:
            out[i] = box.exec(f"echo {i}").stdout.strip()
        except corral.CorralError as e:
            out[i] = e.code

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    print("ready", flush=True)
    sys.stdin.readline()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out), flush=True)
""")


# The same from one event loop: eight tasks of an AsyncSandbox.
HAMMER_ASYNC = textwrap.dedent("""
    import asyncio, json, sys
    import corral

    async def main():
        box = corral.AsyncSandbox.from_id(sys.argv[1])

        async def one(i):
            try:
                return (await box.exec(f"echo {i}")).stdout.strip()
            except corral.CorralError as e:
                return e.code

        return await asyncio.gather(*(one(i) for i in range(8)))

    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(asyncio.run(main())), flush=True)
""")


def test_threads_and_processes_on_a_dead_daemon_start_exactly_one():
    p = Private("herd")
    procs: list[subprocess.Popen] = []
    try:
        made = subprocess.run(
            [sys.executable, "-c", "import corral; print(corral.Sandbox(timeout=600).id)"],
            env=p.env, capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        sid = made.stdout.strip()
        p.kill9()
        procs = [subprocess.Popen([sys.executable, "-c", script, sid], env=p.env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for script in (HAMMER, HAMMER, HAMMER, HAMMER_ASYNC)]
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        for proc in procs:  # all at once
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            assert json.loads(out.strip().splitlines()[-1]) == [str(i) for i in range(8)]
        # One start before the kill, exactly one after: no second daemon was even launched.
        assert p.log_count('"corrald started"') == 2
        assert p.log_count("another corrald") == 0
        assert p.log_count('"adopted": 1') == 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        leaked = p.close()  # the graceful stop destroys the sandbox
    assert leaked == []


def test_explicit_endpoint_is_never_started():
    """Only the embedded default (the socket the environment names) is started: an endpoint
    the caller chose is reported unavailable."""
    p = Private("explicit")
    try:
        code = ("import corral, sys\n"
                "try: corral.Sandbox.list(endpoint=sys.argv[1])\n"
                "except corral.DaemonUnavailable: print('unavailable')\n")
        other = os.path.join(p.state, "other.sock")
        r = subprocess.run([sys.executable, "-c", code, other], env=p.env, capture_output=True,
                           text=True, timeout=60)
        assert r.stdout.strip() == "unavailable", r.stderr
        assert not os.path.exists(os.path.join(p.state, "corrald.log"))
    finally:
        p.close()


def test_a_failing_start_backs_off():
    """A daemon that cannot start is not launched again on every call: the next calls within
    the backoff fail at once with the reason."""
    p = Private("backoff")
    try:
        bad = os.path.join(p.state, "not-a-dir")
        open(bad, "w").close()  # the state dir cannot be made: every start fails
        code = textwrap.dedent("""
            import json, corral
            out = []
            for _ in range(3):
                try:
                    corral.Sandbox.list()
                except corral.DaemonUnavailable as e:
                    out.append(e.message)
            print(json.dumps(out))
        """)
        r = subprocess.run([sys.executable, "-c", code], env=dict(p.env, CORRAL_STATE_DIR=bad),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        msgs = json.loads(r.stdout)
        assert len(msgs) == 3 and "starting one failed" in msgs[0], msgs
        assert all("next try in" in m for m in msgs[1:]), msgs
    finally:
        p.close()
