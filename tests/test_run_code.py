"""run_code (the process substrate's function-call tier), attacked from the code it runs.

Each test runs what untrusted code would try through the real daemon and its real zygotes
(namespaces, read-only root, cgroups, seccomp) and asserts that the attack fails and, where it
could have had an effect, that nothing changed: on the host, in the zygote, in the next
request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_isolation import MADVISE_PROBE, check_madvise_probe
from test_proc_policy import HOST_LEAKS
from test_proc_policy import PROBE as PROC_PROBE

import corral
from corral.daemon import procpolicy
from corral.daemon.substrates.process.pool import UID_BASE, pool_for
from corral.errors import CapacityExceeded, InvalidRequest
from corral.sdk.run_code import run_code_pools

from apiclient import expect_error
from conftest import CGROUP_NAME, SOCKET, STATE_DIR, free_port, private_daemon, wait_until

RC_TOP = CGROUP_NAME + ".runcode"


def run(code: str, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("timeout", 20)
    return corral.run_code(code, **kw)


def slots(pool: str) -> int:
    for p in run_code_pools().pools:
        if p.name == pool:
            return p.slots
    run("import numpy" if pool == "python-numpy" else "true" if pool == "bash" else "pass",
        language="bash" if pool == "bash" else "python")
    return slots(pool)


# Counts a needle in every readable anonymous mapping, heap and stack of the process (read in
# place with ctypes: a python child is not dumpable, so /proc/self/mem is not open to it). The
# needle is spelled reversed in the code, so the code's own text is not a match; the one
# built at run time is.
MEMORY_SCAN = """
import ctypes
needle = NEEDLE[::-1].encode()
found = 0
for line in open('/proc/self/maps'):
    f = line.split()
    lo, hi = (int(x, 16) for x in f[0].split('-'))
    if f[1][0] == 'r' and (len(f) < 6 or f[5] in ('[heap]', '[stack]')):
        found += ctypes.string_at(lo, hi - lo).count(needle)
print(found)
"""


def every_slot(code: str, language: str = "python"):  # type: ignore[no-untyped-def]
    """Run ``code`` once more than there are slots, one after the other: the pool hands out
    its slots in turn, so every slot (and the one a previous request used) runs it."""
    n = slots(pool_for(language, code))
    return [run(code, language=language) for _ in range(n + 1)]


def host_procs_of_slot_uids() -> list[tuple[int, str]]:
    """(pid, comm) of every process on the host running as a run_code slot uid."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            uid = int((d / "status").read_text().split("\nUid:\t")[1].split()[0])
            if UID_BASE <= uid < UID_BASE + (1 << 24):
                out.append((int(d.name), (d / "comm").read_text().strip()))
        except (OSError, IndexError, ValueError):
            pass
    return out


def zygote_pids() -> list[int]:
    """Host pids of this session's zygotes (pid 1 of their namespaces). The zygote cgroup
    holds each launcher and its zygote (and, for an instant, a child not yet in its slot)."""
    pids = set()
    for h in ("pids", "unified"):
        for f in Path("/sys/fs/cgroup", h, RC_TOP).glob("*/zygote/cgroup.procs"):
            pids |= {int(x) for x in f.read_text().split()}

    def parent(p: int) -> int:
        try:
            return int(Path(f"/proc/{p}/status").read_text().split("\nPPid:\t")[1].split()[0])
        except (OSError, IndexError):
            return -1

    launchers = {p for p in pids if parent(p) not in pids}
    return [p for p in pids if parent(p) in launchers]


def _zygote_cgroup_pids() -> dict[int, int]:
    """pid -> parent pid of every process in this session's zygote cgroups."""
    out = {}
    for f in Path("/sys/fs/cgroup", "pids", RC_TOP).glob("*/zygote/cgroup.procs"):
        for x in f.read_text().split():
            try:
                ppid = Path(f"/proc/{x}/status").read_text().split("\nPPid:\t")[1].split()[0]
            except (OSError, IndexError):
                continue
            out[int(x)] = int(ppid)
    return out


def fork_server_pids() -> list[int]:
    """Host pids of the zygotes' fork servers: children of a zygote that stay in its cgroup
    (a request's child leaves it for its slot's at once): the ones seen on both sides of a
    request."""
    assert run("print(1)").ok  # the pool is up
    zygotes = set(zygote_pids())
    first = {p for p, pp in _zygote_cgroup_pids().items() if pp in zygotes}
    assert run("print(1)").ok
    return sorted(first & {p for p, pp in _zygote_cgroup_pids().items() if pp in zygotes})


# ---- it works --------------------------------------------------------------------------------
def test_python_and_bash_run():
    r = run("print(6 * 7)")
    assert (r.status, r.stdout, r.stderr, r.exit_code, r.signal) == ("ok", "42\n", "", 0, None)
    assert r.ok and 0 < r.duration_s < 5
    b = run("echo $((6 * 7)); echo err >&2; exit 3", language="bash")
    assert (b.status, b.stdout, b.stderr, b.exit_code) == ("error", "42\n", "err\n", 3)


def test_stdin_files_exit_codes_and_tracebacks():
    r = run("import sys, json; print(sys.stdin.read().upper(), open('d/x.json').read())",
            stdin="abc", files={"d/x.json": json.dumps({"k": 1})})
    assert r.status == "ok" and r.stdout == 'ABC {"k": 1}\n'
    r = run("import sys; sys.exit(7)")
    assert (r.status, r.exit_code) == ("error", 7)
    r = run("def f():\n    raise ValueError('boom')\nf()")
    assert r.status == "error" and r.exit_code == 1
    assert r.stderr.startswith("Traceback") and 'File "<string>", line 3' in r.stderr
    assert "ValueError: boom" in r.stderr and "zygote" not in r.stderr
    r = run("cat data.txt | wc -l; read x; echo got $x", language="bash",
            files={"data.txt": "a\nb\n"}, stdin="line\n")
    assert r.stdout == "2\ngot line\n"
    r = run("print(__name__, __file__ if '__file__' in dir() else '-')")
    assert r.stdout == "__main__ -\n"


def test_numpy_is_preloaded():
    r = run("import sys; pre = 'numpy' in sys.modules\nimport os, numpy as np\n"
            "print(pre, int(np.arange(10).sum()))")
    assert r.stdout == "True 45\n"
    pools = {p.name: p for p in run_code_pools().pools}
    assert "numpy" in pools["python-numpy"].preloaded
    # Code that does not import numpy runs in the lean zygote, where it can still import it.
    r = run("import sys; print('numpy' in sys.modules); print(__import__('numpy').pi > 3)")
    assert r.stdout == "False\nTrue\n"
    assert "numpy" not in {p.name: p for p in run_code_pools().pools}["python"].preloaded


def test_bad_requests_are_clear_errors():
    from apiclient import client

    with client() as c:
        for body in ({"code": "print(1)", "language": "cobol"}, {"code": "x", "timeout": 0},
                     {"code": "x", "memory_mb": 1}, {"code": "a\x00b"},
                     {"code": "x", "files": {"../escape": "x"}},
                     {"code": "x", "files": {"/abs": "x"}}, {"nope": 1}, {"requests": []},
                     # names no file can have: once the program's own exit 126
                     {"code": "x", "files": {"a/": "x"}}, {"code": "x", "files": {"a//b": "x"}},
                     {"code": "x", "files": {"a" * 256: "x"}},
                     {"code": "x", "files": {"a": "x", "a/b": "y"}}):
            r = c.post("/v1/run_code", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["code"] == "invalid_request"
        r = c.post("/v1/run_code/batch", json={"requests": []})
        assert r.status_code == 400
    with pytest.raises(InvalidRequest):
        corral.run_code("x", language="cobol")


def test_run_code_many_sync_and_async():
    rs = corral.run_code_many(["print(1)", {"code": "echo b", "language": "bash"},
                               {"code": "import sys; sys.exit(2)"}])
    assert [(r.status, r.stdout) for r in rs] == [("ok", "1\n"), ("ok", "b\n"), ("error", "")]

    async def both():  # type: ignore[no-untyped-def]
        one = await corral.run_code_async("print('a')")
        many = await corral.run_code_many_async([f"print({i})" for i in range(20)])
        return one, many

    one, many = asyncio.run(both())
    assert one.stdout == "a\n"
    assert [r.stdout for r in many] == [f"{i}\n" for i in range(20)]


# ---- the view of the host ----------------------------------------------------------------------
def test_host_files_outside_the_view_are_absent():
    r = run(f"""
import os
print(sorted(os.listdir('/')))
for p in ['/etc/shadow', '/root/.bash_history', '/home', '/var', '/sys', '/run',
          {STATE_DIR!r}, {SOCKET!r}, '/proc/1/environ', '/proc/1/root', '/dev/sda', '/dev/mem',
          '/dev/shm', '/sys/fs/cgroup']:
    print(p, os.path.exists(p))
print(open('/proc/self/mountinfo').read().count('\\n'))
""")
    lines = r.stdout.splitlines()
    top = set(eval(lines[0]))  # noqa: S307 - our own print of a list
    # Besides the system dirs, only the first component of the interpreter's prefix (wherever the
    # checkout and its venv live) may show.
    prefixes = {os.path.realpath(p).split("/")[1] for p in (sys.prefix, sys.base_prefix)}
    assert top <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc",
                   "tmp", *prefixes}, top
    assert [line for line in lines[1:-1] if not line.endswith(" False")] == []
    r = run("import os; print(sorted(os.listdir('/etc')))")
    assert "shadow" not in r.stdout and "ssh" not in r.stdout
    # The interpreter's own prefix is there, read-only; nothing else of its parents.
    r = run("import os, sys; print(os.listdir(os.path.dirname(os.path.realpath(sys.prefix))))")
    assert r.stdout.strip() == str([os.path.basename(os.path.realpath(sys.prefix))])


# Every top-level /proc entry outside the allow list, in bash: what reading it (a file) or
# listing it (a directory) gives; then the caller's cgroups.
PROC_PROBE_BASH = r"""
cd /proc
for n in *; do
    case $n in [0-9]*) continue ;; esac
    case ",$ALLOWED," in *",$n,"*) continue ;; esac
    if [ -d "$n" ] && [ ! -L "$n" ]; then
        echo "$n entries=$(ls -A "$n" 2>/dev/null | wc -l)"
    else
        echo "$n bytes=$(head -c 65536 "$n" 2>/dev/null | wc -c)"
    fi
done
sed 's/^/cgroup /' /proc/self/cgroup
"""


def check_proc_shows_nothing_of_the_host(out: str) -> None:
    """``out``: a proc probe's lines (test_proc_policy.PROBE's or PROC_PROBE_BASH's), then
    the caller's /proc/self/cgroup, each line prefixed ``cgroup``."""
    seen: dict[str, str] = {}
    cgroups: list[str] = []
    for line in out.splitlines():
        name, got = line.split(" ", 1)
        if name == "cgroup":
            cgroups.append(got)
        else:
            seen[name] = got
    for name in HOST_LEAKS + ("config.gz", "softirqs"):
        if os.path.exists(f"/proc/{name}"):
            assert name in seen, (name, out)
    for name, got in seen.items():
        assert got in ("bytes=0", "entries=0") or got.startswith("error="), (name, got)
        assert "created" not in got, (name, got)
    # its own cgroup namespace, rooted at its own cgroups: no host path (v2 "0::/", v1 one
    # line a hierarchy, each "/")
    assert cgroups and all(c.rsplit(":", 1)[1] == "/" for c in cgroups), cgroups


def test_proc_shows_nothing_of_the_host():
    """The process tier's /proc has the container's masks (corral.daemon.procpolicy): every
    top-level entry outside the allow list reads empty (the host's boot command line, kernel
    config, iomem, interrupts, zoneinfo, diskstats...), in python and bash requests and in a
    process session; and each sees its own cgroups as the root of a cgroup namespace."""
    allowed = ",".join(sorted(procpolicy.PROC_ALLOWED))
    r = run(f"import sys; sys.argv = ['-c', {allowed!r}]\n{PROC_PROBE}\n"
            "print(''.join('cgroup ' + x for x in open('/proc/self/cgroup')), end='')")
    assert r.status == "ok", r
    check_proc_shows_nothing_of_the_host(r.stdout)
    r = run(f"ALLOWED={allowed}\n{PROC_PROBE_BASH}", language="bash")
    assert r.status == "ok", r
    check_proc_shows_nothing_of_the_host(r.stdout)
    with corral.Sandbox(substrate="process", timeout=60) as sb:
        sb.files.write("/tmp/probe.sh", PROC_PROBE_BASH)
        r2 = sb.exec(["bash", "-c", f"ALLOWED={allowed}; . /tmp/probe.sh"], timeout=30)
        assert r2.exit_code == 0, r2
        check_proc_shows_nothing_of_the_host(r2.stdout)
        # /proc/sys stays readable (as in a container), and no command can write it
        r2 = sb.exec("cat /proc/sys/kernel/ostype; echo x > /proc/sys/kernel/hostname; "
                     "echo wrote=$?")
        lines = r2.stdout.split()
        assert lines[0] == "Linux" and lines[1] != "wrote=0", r2


def test_nothing_is_writable_but_the_scratch_dir_and_it_is_wiped():
    probe = """
import os
for p in ['/x', '/usr/x', '/etc/x', '/tmp/x', '/dev/x', '/proc/x', '/dev/shm/x',
          os.path.dirname(os.getcwd()) + '/x']:
    try:
        open(p, 'w').write('x'); print('WROTE', p)
    except OSError as e:
        print('no', p, e.errno)
print(os.getcwd(), os.listdir('.'))
"""
    r = run(probe)
    assert "WROTE" not in r.stdout, r.stdout
    run("open('left.txt', 'w').write('secret'); import os; os.mkdir('d'); "
        "os.chmod('.', 0o777); os.symlink('/etc/passwd', 'link')")
    for r in every_slot("import os; print(os.listdir('.'), oct(os.stat('.').st_mode & 0o777))"):
        assert r.stdout == "[] 0o700\n", r.stdout


def test_a_deep_tree_in_the_scratch_dir_is_wiped_without_a_restart():
    every_slot("pass")  # every zygote of the pool started
    started = {p.name: p.started for p in run_code_pools().pools}
    r = run("import os\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')\n"
            "open('f', 'w').write('x'); print('deep')", timeout=60)
    assert r.stdout == "deep\n", r.stderr
    for r in every_slot("import os; print(os.listdir('.'))"):
        assert r.stdout == "[]\n"
    assert {p.name: p.started for p in run_code_pools().pools}["python"] == started["python"]


def test_a_request_that_takes_every_inode_of_its_scratch_takes_none_of_the_others():
    """Each request's scratch is a tmpfs of its own (room and inodes). A request that
    creates files until refused fails on its own (its exit code), while requests beside it
    write their files and run, and no zygote restarts; where all slots of a zygote shared
    one /tmp, the filler left others' files unwritable and the scratch wipe failing, which
    restarted the zygote and failed every request on it, the filler's too, as infra."""
    every_slot("pass")
    started = {p.name: p.started for p in run_code_pools().pools}
    filler = ("import os\nn = 0\ntry:\n    while True:\n"
              "        os.close(os.open(str(n), os.O_CREAT | os.O_WRONLY)); n += 1\n"
              "except OSError as e:\n    print('refused', e.errno, n > 1000)\n"
              "raise SystemExit(3)")
    reader = "print(open('in.txt').read())"
    items = [{"code": filler, "timeout": 60}] + [
        {"code": reader, "files": {"in.txt": str(i)}} for i in range(12)]
    for _ in range(2):
        res = corral.run_code_many(items)
        assert res[0].exit_code == 3 and res[0].stdout.startswith("refused 28 True"), res[0]
        assert [r.stdout for r in res[1:]] == [f"{i}\n" for i in range(12)], res[1:]
    for r in every_slot("import os; print(os.listdir('.'))"):
        assert r.stdout == "[]\n"
    assert {p.name: p.started for p in run_code_pools().pools}["python"] == started["python"]


def test_no_network_at_all():
    r = run("""
import socket, errno
for fam, typ in [(socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_DGRAM),
                 (socket.AF_NETLINK, socket.SOCK_RAW), (socket.AF_PACKET, socket.SOCK_RAW)]:
    try:
        socket.socket(fam, typ); print('SOCKET', fam)
    except OSError as e:
        print('no', fam, errno.errorcode[e.errno])
s = socket.socket(socket.AF_UNIX)
for path in [SOCK, '/run/corral/corrald.sock']:
    try:
        s.connect(path); print('CONNECTED', path)
    except OSError as e:
        print('no', path, errno.errorcode[e.errno])
""".replace("SOCK", repr(SOCKET)))
    assert "SOCKET" not in r.stdout and "CONNECTED" not in r.stdout, r.stdout
    r = run("ip -o link 2>&1; cat /proc/net/dev | tail -n +3", language="bash")
    assert "eth" not in r.stdout and "UP" not in r.stdout, r.stdout


def _abstract_bound(name: str) -> bool:
    """Some process on the host has the abstract unix socket ``name`` bound (a request is
    running): read from each network namespace's /proc/PID/net/unix once."""
    seen: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
            if ns in seen:
                continue
            seen.add(ns)
            with open(f"/proc/{pid}/net/unix") as f:
                if any(line.rstrip().endswith(" @" + name) for line in f):
                    return True
        except OSError:
            continue
    return False


def test_abstract_unix_sockets_do_not_join_two_requests():
    listener = "import socket, time; s = socket.socket(socket.AF_UNIX); s.bind('\\0rc-probe'); " \
               "s.listen(); print('listening', flush=True); time.sleep(4)"
    connector = """
import socket, errno
s = socket.socket(socket.AF_UNIX)
try:
    s.connect('\\0rc-probe'); print('CONNECTED')
except OSError as e:
    print('no', errno.errorcode[e.errno])
"""

    async def both():  # type: ignore[no-untyped-def]
        a = asyncio.create_task(corral.run_code_async(listener, timeout=20))
        assert await asyncio.to_thread(wait_until, lambda: _abstract_bound("rc-probe"), 15)
        b = await corral.run_code_async(connector, timeout=20)
        return await a, b

    a, b = asyncio.run(both())
    assert a.stdout == "listening\n"
    assert b.stdout.startswith("no "), b.stdout


# ---- processes -----------------------------------------------------------------------------------
def test_cannot_kill_or_ptrace_the_zygote_or_another_request():
    victim = ("import socket, time; s = socket.socket(socket.AF_UNIX); "
              "s.bind('\\0rc-victim'); time.sleep(3); print('alive')")
    attacker = """
import os, signal, ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
me = os.getpid()
seen = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
killed, traced = [], []
for pid in range(1, 5000):
    if pid == me:
        continue
    try:
        os.kill(pid, signal.SIGKILL); killed.append(pid)
    except OSError:
        pass
    if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
        traced.append(pid)
print('seen', seen == [me], 'killed', killed, 'traced', traced)
"""

    async def both():  # type: ignore[no-untyped-def]
        v = asyncio.create_task(corral.run_code_async(victim, timeout=30))
        assert await asyncio.to_thread(wait_until, lambda: _abstract_bound("rc-victim"), 15)
        a = await corral.run_code_async(attacker, timeout=30)
        return await v, a

    servers = fork_server_pids()
    assert servers
    before = set(zygote_pids()) | set(servers)
    v, a = asyncio.run(both())
    assert a.stdout == "seen True killed [] traced []\n", (a.stdout, a.stderr)
    assert (v.status, v.stdout) == ("ok", "alive\n")
    assert before <= set(zygote_pids()) | set(fork_server_pids())  # none died
    assert run("print(1)").ok


def test_madvise_cannot_push_own_pages_to_swap():
    """The request's code cannot push its pages to swap (docs/trajectory.md, "Whose OOM")."""
    r = run(MADVISE_PROBE)
    assert r.exit_code == 0, r.stderr
    check_madvise_probe(r.stdout)


def test_no_process_outlives_its_request():
    code = """
import os, subprocess
subprocess.Popen(['sleep', '1000'], start_new_session=True)
if os.fork() == 0:          # a daemon: double fork, new session
    os.setsid()
    if os.fork() == 0:
        os.execv('/bin/sleep', ['sleep', '1001'])
    os._exit(0)
print('left them')
"""
    assert run(code).stdout == "left them\n"
    assert run("sleep 1002 & disown; nohup sleep 1003 >/dev/null 2>&1 &", language="bash").ok
    # Killed as its slot is cleaned, just after the answer (the slot is not reused before).
    assert wait_until(lambda: not [p for p in host_procs_of_slot_uids() if p[1] == "sleep"],
                      timeout=10)
    for r in every_slot("import os; print([p for p in os.listdir('/proc') if p.isdigit()] == "
                        "[str(os.getpid())])"):
        assert r.stdout == "True\n"


def test_fork_bomb_is_contained():
    t = time.monotonic()
    r = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass", timeout=3)
    assert r.status == "timeout" and time.monotonic() - t < 15
    r = run(":(){ :|:& };:; sleep 2", language="bash", timeout=5)
    assert r.status in ("ok", "error", "timeout")
    # The answer comes when the request's own process is reaped; the bomb's other processes
    # are killed as its slot is cleaned, just after (the slot is not reused before).
    assert wait_until(lambda: all(c != "bash" for _, c in host_procs_of_slot_uids()),
                      timeout=15), host_procs_of_slot_uids()
    assert run("print('fine')").stdout == "fine\n"


def test_memory_bombs_are_memory_exceeded():
    r = run("x = bytearray(512 << 20); print(len(x))", memory_mb=64)
    assert (r.status, r.signal, r.stdout) == ("memory_exceeded", signal.SIGKILL, "")
    r = run("import numpy as np; a = np.ones((1 << 27,)); print(a.sum())", memory_mb=128)
    assert r.status == "memory_exceeded"
    # Files in the scratch dir count too (tmpfs pages are charged to the request).
    r = run("head -c 300000000 /dev/zero > big; echo done", language="bash", memory_mb=64)
    assert r.status in ("memory_exceeded", "error") and "done" not in r.stdout
    r = run("x = bytearray(100 << 20); print('ok')", memory_mb=256)
    assert r.status == "ok"


def test_infinite_loop_times_out_with_its_tree():
    t = time.monotonic()
    r = run("import subprocess; subprocess.Popen(['sleep', '999']); \nwhile True: pass",
            timeout=1.5)
    took = time.monotonic() - t
    assert (r.status, r.signal) == ("timeout", signal.SIGKILL)
    assert 1.4 <= r.duration_s < 5 and took < 10
    assert wait_until(lambda: not [p for p in host_procs_of_slot_uids() if p[1] == "sleep"],
                      timeout=10)


# Code that tries to tell the daemon a status of its own choosing: it writes ``word`` to every
# fd it holds past stdio (fd 4 was a pipe on which a python child told its exit code as it
# ended, and the answer went out on that word alone), then ends its own way.
FORGE = """import os, struct
for fd in range(3, 256):
    try:
        os.write(fd, {word!r})
    except OSError:
        pass
"""


def test_a_request_cannot_choose_the_status_it_is_reported_with():
    """A request's status, exit code and signal are how its process really ended: the fork
    server that reaps it writes its wait status to the daemon, on a pipe no request holds.
    The attack: a status pipe a request holds (fd 4, written by python as it ended) let a
    snippet write "0" and then abort, exit 3 or fail an assert and be reported ok with exit
    code 0, its later output dropped, and go on running unreported until its timeout; "-7"
    or "99999999999" became its exit code."""
    cases = [  # (word, then, timeout) -> (status, exit_code, signal, stdout)
        (b"0", "print('tests: FAILED', flush=True)\nos.abort()", 10,
         ("error", 134, signal.SIGABRT, "tests: FAILED\n")),
        (b"0", "raise SystemExit(3)", 10, ("error", 3, None, "")),
        (b"0", "assert 1 == 2, 'test failed'", 10, ("error", 1, None, "")),
        (b"-7", "raise SystemExit(1)", 10, ("error", 1, None, "")),
        (b"99999999999", "print('end')", 10, ("ok", 0, None, "end\n")),
        (struct.pack("=id", 0, 0.0), "raise SystemExit(4)", 10, ("error", 4, None, "")),
        (b"0", "os.kill(os.getpid(), 9)", 10, ("error", 137, signal.SIGKILL, "")),
        # it goes on after the word: answered at its real end, with what it printed until then
        (b"0", "import time\ntime.sleep(1.5)\nprint('after', flush=True)\nraise SystemExit(5)",
         10, ("error", 5, None, "after\n")),
        (b"0", "import subprocess, time\nsubprocess.Popen(['sleep', '1234'])\n"
               "print('bye', flush=True)\ntime.sleep(60)", 2,
         ("timeout", 137, signal.SIGKILL, "bye\n")),
    ]
    rs = corral.run_code_many([{"code": FORGE.format(word=word) + then, "timeout": timeout}
                               for word, then, timeout, _ in cases])
    for (word, then, _, want), r in zip(cases, rs, strict=True):
        assert (r.status, r.exit_code, r.signal, r.stdout) == want, (word, then, r)
    assert "AssertionError: test failed" in rs[2].stderr
    assert rs[7].duration_s >= 1.5 and rs[8].duration_s >= 2
    # bash holds no such fd either
    b = run("for fd in 3 4 5 6 7 8 9; do echo 0 >&$fd; done 2>/dev/null; kill -ABRT $$",
            language="bash")
    assert (b.status, b.exit_code, b.signal) == ("error", 134, signal.SIGABRT), b
    # what the one that went on started died with it, and nothing is left in any slot
    assert wait_until(lambda: not [p for p in host_procs_of_slot_uids() if p[1] == "sleep"],
                      timeout=15)
    for r in every_slot("import os; print([p for p in os.listdir('/proc') if p.isdigit()] == "
                        "[str(os.getpid())])"):
        assert r.stdout == "True\n"


def test_huge_output_is_truncated():
    r = run("import sys; sys.stdout.write('x' * (50 << 20)); print('end', file=sys.stderr)",
            max_output_bytes=1 << 20)
    assert r.status == "output_truncated" and r.truncated
    assert len(r.stdout) == 1 << 20 and r.stderr == "end\n"
    r = run("yes", language="bash", timeout=1.5, max_output_bytes=1000)
    assert r.status == "timeout" and r.truncated and len(r.stdout) == 1000


@pytest.mark.parametrize("zygote", ["python", "python-numpy"])
def test_no_state_leaks_between_requests(zygote):
    head = "import numpy\n" if zygote == "python-numpy" else "numpy = __import__('numpy')\n"
    poison = head + """
import os, sys, json, builtins
os.environ['LEAK'] = '1'
os.chdir('/')
sys.modules['json'].dumps = lambda *a, **k: 'POISONED'
builtins.LEAKED = True
numpy.LEAKED = True
sys.path.insert(0, '/tmp')
globals()['g'] = 1
"""
    assert pool_for("python", poison) == zygote
    assert run(poison).ok
    check = head + """
import os, sys, json, builtins
print(os.environ.get('LEAK'), os.getcwd().startswith('/tmp/s'), json.dumps(1),
      hasattr(builtins, 'LEAKED'), hasattr(numpy, 'LEAKED'), '/tmp' in sys.path,
      'g' in globals())
"""
    for r in every_slot(check):
        assert r.stdout == "None True 1 False False False False\n", r.stdout


def test_no_state_leaks_between_bash_requests():
    run("export LEAK=1; cd /; echo x > ~/f", language="bash")
    for r in every_slot("echo ${LEAK:-none} $PWD; ls ~", language="bash"):
        assert r.stdout.split()[0] == "none" and r.stdout.split()[1].startswith("/tmp/s")
        assert len(r.stdout.split()) == 2


@pytest.mark.parametrize("zygote", ["python", "python-numpy"])
def test_a_request_leaves_no_trace_in_the_memory_the_next_are_forked_from(zygote):
    """Children are forks of the zygote: if a request's code, input or output passed through
    the zygote, the next children would carry its remnants in their memory. Each later request
    scans all of its own memory for a secret the first one held in every form."""
    head = "import numpy\n" if zygote == "python-numpy" else ""
    secret = "s3cr3t-" + os.urandom(8).hex()
    r = run(head + f"import sys; data = sys.stdin.read() + {secret!r}; print(data)",
            stdin=secret, files={"f.txt": secret})
    assert secret in r.stdout
    scan = head + MEMORY_SCAN.replace("NEEDLE", repr(secret[::-1]))
    assert pool_for("python", scan) == zygote
    for r in every_slot(scan):
        assert r.stdout == "1\n", r.stdout + r.stderr  # its own needle, built at run time


def test_environment_is_its_own():
    """Neither the environment nor the memory of a request holds the daemon's environment
    (the exec-time block a zygote's children inherit is the zygote's own small one)."""
    r = run("import os; print(sorted(os.environ))")
    assert r.stdout == "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']\n", r.stdout
    assert "CORRAL_STATE_DIR" in os.environ  # the daemon has it (conftest sets it)
    r = run(MEMORY_SCAN.replace("NEEDLE", repr("CORRAL_STATE_DIR"[::-1])))
    assert r.stdout == "1\n", r.stdout + r.stderr
    r = run("cat /proc/self/environ | tr '\\0' ' '", language="bash")
    assert "CORRAL" not in r.stdout and "PATH=" in r.stdout


def test_random_state_differs_between_requests():
    outs = {run("import random, numpy; print(random.random(), numpy.random.rand())").stdout
            for _ in range(4)}
    assert len(outs) == 4


def test_sysv_ipc_and_mqueues_are_off():
    r = run("""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
print('shm', libc.shmget(1234, 4096, 0o1666), errno.errorcode.get(ctypes.get_errno()))
print('msg', libc.msgget(1234, 0o1666), errno.errorcode.get(ctypes.get_errno()))
print('sem', libc.semget(1234, 1, 0o1666), errno.errorcode.get(ctypes.get_errno()))
""")
    assert [line.split()[1] for line in r.stdout.splitlines()] == ["-1", "-1", "-1"], r.stdout


def test_a_dead_zygote_is_replaced():
    assert run("print(1)").ok
    pids = zygote_pids()
    assert pids
    started = {p.name: p.started for p in run_code_pools().pools}
    for p in pids:
        os.kill(p, signal.SIGKILL)
    assert wait_until(lambda: not set(pids) & set(zygote_pids()), timeout=10)
    # A request in flight when it died gets infra_error; the next ones get a new zygote.
    results = []
    for _ in range(3):
        try:
            results.append(run("print(2)").stdout)
        except corral.InfraError:
            results.append("infra")
    assert results[-1] == "2\n"
    now = {p.name: p.started for p in run_code_pools().pools}
    assert now["python"] > started["python"]


def test_a_dead_fork_server_takes_its_zygote_and_is_replaced():
    """The fork server is the zygote's child: killed (from the host: requests cannot), its
    zygote ends with it (a request in flight gets infra_error, never a task's failure), and
    the next request starts a new zygote with a new server."""
    servers = fork_server_pids()
    # The zygotes of these servers (not every zygote: one that is just starting has no
    # server yet to kill).
    procs = _zygote_cgroup_pids()
    zygotes = {procs[p] for p in servers if p in procs} & set(zygote_pids())
    assert servers and zygotes
    for p in servers:
        os.kill(p, signal.SIGKILL)
    assert wait_until(lambda: not zygotes & set(zygote_pids()), timeout=10)
    results = []
    for _ in range(3):
        try:
            results.append(run("print(3)").stdout)
        except corral.InfraError:
            results.append("infra")
    assert results[-1] == "3\n"
    assert not set(servers) & set(fork_server_pids())


def test_cli_run_code(tmp_path):
    env = dict(os.environ)
    cli = [sys.executable, "-m", "corral.cli.main"]
    p = subprocess.run([*cli, "run-code", "-c", "print(40 + 2)"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert (p.returncode, p.stdout) == (0, "42\n"), p.stderr
    f = tmp_path / "prog.sh"
    f.write_text("echo from-file; exit 5\n")
    p = subprocess.run([*cli, "run-code", "--language", "bash", str(f)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert (p.returncode, p.stdout) == (5, "from-file\n")
    p = subprocess.run([*cli, "run-code", "-c", "while True: pass", "--timeout", "1"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 124
    p = subprocess.run([*cli, "run-code", "--json", "-c", "print(1)"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert json.loads(p.stdout)["status"] == "ok"


# ---- a daemon of its own: an interpreter under /tmp ----------------------------------------------
def test_an_interpreter_under_tmp_is_seen_and_nothing_else_of_tmp():
    """The zygote's view mounts a /tmp of its own: a daemon whose venv lives under the host's
    /tmp (a checkout there) still has its interpreter's packages inside, and only them; a
    session (whose /tmp is its home) has none of it."""
    top = tempfile.mkdtemp(prefix="corral-test-venv-", dir="/tmp")
    try:
        venv = os.path.join(top, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True,
                       timeout=120)
        site = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                               "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # The daemon imports corral and its dependencies from where this test's do.
        Path(site, "corral_test_paths.pth").write_text(
            "\n".join(p for p in sys.path if p and os.path.isdir(p)) + "\n")
        Path(site, "corral_probe_mod.py").write_text("WHERE = 'the venv under /tmp'\n")
        Path(top, "secret.txt").write_text("beside the venv, not of it\n")
        cg = f"corral-test-rcv-{os.getpid()}"
        with private_daemon("corral-test-rcv-", cg, os.path.join(venv, "bin", "python"),
                            CORRAL_RUNCODE_ZYGOTES="1") as d:
            ep = d.socket_path
            r = corral.run_code(
                "import os, sys, corral_probe_mod\n"
                "print(corral_probe_mod.WHERE)\nprint(sys.prefix)\n"
                "print(sorted(os.listdir(os.path.dirname(sys.prefix))))\n"
                "try:\n    open(os.path.join(sys.prefix, 'x'), 'w')\n"
                "except OSError as e:\n    print(e.strerror)\n", endpoint=ep)
            assert r.ok, r
            assert r.stdout.splitlines() == ["the venv under /tmp", venv, "['venv']",
                                             "Read-only file system"], r
            # A session's /tmp is its home: the daemon's venv is not in its view at all.
            with corral.Sandbox(substrate="process", endpoint=ep) as sb:
                r = sb.exec(f"ls -A /tmp; test -e {venv} || echo no-venv; "
                            f"cat {top}/secret.txt 2>/dev/null")
                assert r.stdout.split() == ["no-venv"], r.stdout
    finally:
        shutil.rmtree(top, ignore_errors=True)


# ---- a daemon of its own: the queue bound, and the stop ----------------------------------------
def test_full_pool_says_capacity_exceeded_and_stop_leaves_nothing():
    cg = f"corral-test-rcq-{os.getpid()}"
    with private_daemon("corral-test-rcq-", cg, CORRAL_RUNCODE_SLOTS="1",
                        CORRAL_RUNCODE_ZYGOTES="1", CORRAL_RUNCODE_MAX_QUEUE="1") as d:
        ep = d.socket_path
        assert corral.run_code("print(1)", endpoint=ep).ok
        # Its slot comes back once the zygote has reaped the child, just after the answer.
        assert wait_until(lambda: run_code_pools(ep).pools[0].busy == 0, timeout=10)

        async def flood():  # type: ignore[no-untyped-def]
            tasks = [asyncio.create_task(corral.run_code_async(
                "import time; time.sleep(1.5); print('done')", endpoint=ep)) for _ in range(4)]
            return await asyncio.gather(*tasks, return_exceptions=True)

        out = asyncio.run(flood())
        done = [r for r in out if not isinstance(r, BaseException)]
        full = [r for r in out if isinstance(r, CapacityExceeded)]
        assert len(done) == 2 and len(full) == 2, out
        assert all(r.stdout == "done\n" for r in done)
        assert full[0].details["max_queue"] == 1
        with pytest.raises(CapacityExceeded):
            corral.run_code_many(["print(1)"] * 3, endpoint=ep)
        assert wait_until(lambda: run_code_pools(ep).pools[0].busy == 0, timeout=10)
        assert [r.stdout for r in corral.run_code_many(["print(1)"] * 2, endpoint=ep)] == \
            ["1\n", "1\n"]
        zygotes = [int(x) for f in Path("/sys/fs/cgroup/pids").glob(cg + ".runcode/*/zygote/"
                                                                  "cgroup.procs")
                   for x in f.read_text().split()]
        assert zygotes
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{cg}.runcode")), "cgroups left"

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
        except (OSError, IndexError):
            return True

    assert wait_until(lambda: all(gone(p) for p in zygotes), timeout=10), "zygotes left"


RC_ADMIN = "rc-admin-token-0123456789"
RC_TOKENS = {"alice": "rc-alice-token-0123456789", "bob": "rc-bob-token-0123456789",
             "carol": "rc-carol-token-0123456789"}
SLEEP_A = "import time; time.sleep(1); print('a')"


@contextlib.contextmanager
def _tenant_clients(**env: str) -> Iterator[dict[str, httpx.Client]]:
    """A daemon of its own on TCP with three tenants (one slot, a queue of 7): their clients
    and the admin's."""
    tokdir = tempfile.mkdtemp(prefix="corral-test-rct-tok-", dir="/var/tmp")
    tokens = os.path.join(tokdir, "tokens.json")
    Path(tokens).write_text(json.dumps(RC_TOKENS))
    port = free_port()
    cg = f"corral-test-rct-{os.getpid()}"
    clients: dict[str, httpx.Client] = {}
    try:
        with private_daemon("corral-test-rct-", cg, CORRAL_TCP=f"127.0.0.1:{port}",
                            CORRAL_TOKEN=RC_ADMIN, CORRAL_TOKENS=tokens,
                            CORRAL_RUNCODE_SLOTS="1", CORRAL_RUNCODE_ZYGOTES="1",
                            CORRAL_RUNCODE_MAX_QUEUE="7", **env):
            for who, tok in (("admin", RC_ADMIN), *RC_TOKENS.items()):
                clients[who] = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                            headers={"Authorization": f"Bearer {tok}"})
            yield clients
            for c in clients.values():
                c.close()
        assert not list(Path("/sys/fs/cgroup").glob(f"*/{cg}.runcode")), "cgroups left"
    finally:
        shutil.rmtree(tokdir, ignore_errors=True)


def _pool(admin: httpx.Client) -> dict:
    pools = admin.get("/v1/run_code/pools").json()["pools"]
    return next(p for p in pools if p["name"] == "python")


def test_one_tenants_run_code_neither_locks_out_nor_queues_ahead_of_another():
    """A tenant held every slot and the whole queue (two batches of 1,024 snippets of up to
    300 s): every other tenant's run_code was capacity_exceeded until they drained, hours
    later, and a request that got in waited behind all of them. A tenant's requests hold at
    most an equal share of a pool's slots and queue among the tenants using it and one more
    (half when alone; more is quota_exceeded, its own), so a third tenant finds room however
    the two others fill theirs; the slots go to the tenants by turns."""
    with _tenant_clients() as c:
        assert c["bob"].post("/v1/run_code", json={"code": "print(0)"}).status_code == 200
        r = c["alice"].post("/v1/run_code/batch",
                            json={"requests": [{"code": "print(1)"}] * 5})  # half of 1 + 7: 4
        expect_error(r, "quota_exceeded", 429)
        assert r.json()["error"]["details"]["resource"] == "run_code"
        assert _pool(c["admin"])["queued"] == 0  # the refused batch took no place
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(c["alice"].post(
            "/v1/run_code/batch", json={"requests": [{"code": SLEEP_A}] * 4})))
        t.start()
        try:
            assert wait_until(lambda: _pool(c["admin"])["queued"] == 3, timeout=30)
            r = c["bob"].post("/v1/run_code", json={"code": "print('b')"})
            assert r.status_code == 200 and r.json()["stdout"] == "b\n", r.text
            # bob waited behind one of alice's, not all three
            assert _pool(c["admin"])["queued"] >= 1
        finally:
            t.join(60)
        assert [x["stdout"] for x in out[0].json()["results"]] == ["a\n"] * 4
        # Alice and bob both in: a third of 8 each (half each, 4 and 4, filled the pool), and
        # carol finds room.
        slow = "import time; time.sleep(3); print('s')"
        held = [threading.Thread(target=lambda who=who, n=n: out.append(c[who].post(
            "/v1/run_code/batch", json={"requests": [{"code": slow}] * n})))
            for who, n in (("alice", 4), ("bob", 2))]
        held[0].start()
        try:
            assert wait_until(lambda: _pool(c["admin"])["queued"] == 3, timeout=30)
            r = c["bob"].post("/v1/run_code/batch", json={"requests": [{"code": slow}] * 3})
            expect_error(r, "quota_exceeded", 429)
            held[1].start()
            assert wait_until(lambda: _pool(c["admin"])["queued"] == 5, timeout=30)
            r = c["carol"].post("/v1/run_code", json={"code": "print('c')"})
            assert r.status_code == 200 and r.json()["stdout"] == "c\n", r.text
        finally:
            for h in held:
                if h.ident is not None:
                    h.join(60)
        assert sorted(len(x.json()["results"]) for x in out[1:]) == [2, 4]


def test_run_code_a_client_left_is_not_run_and_a_stop_with_a_queue_leaves_nothing():
    """A batch whose client hung up ran to its end (1,084 snippets queued for a client long
    gone). Its requests are dropped, the one running killed. Then a daemon stopped with a
    queue: its zygotes came back for the queued requests after the stop had removed their
    cgroups, and left ~20 cgroup directories behind (_tenant_clients checks)."""
    with _tenant_clients() as c:
        assert c["alice"].post("/v1/run_code", json={"code": "print(0)"}).status_code == 200
        served = _pool(c["admin"])["served"]
        with pytest.raises(httpx.ReadTimeout):
            c["alice"].post("/v1/run_code/batch", json={"requests": [{"code": SLEEP_A}] * 4},
                            timeout=0.5)
        assert wait_until(lambda: (p := _pool(c["admin"]))["queued"] == 0 and p["busy"] == 0,
                          timeout=30)
        assert _pool(c["admin"])["served"] == served
        def queue_up() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the daemon stops under it
                c["admin"].post("/v1/run_code/batch", json={"requests": [{"code": SLEEP_A}] * 8})

        t = threading.Thread(target=queue_up, daemon=True)
        t.start()
        assert wait_until(lambda: _pool(c["admin"])["queued"] >= 6, timeout=30)


# ---- a request against its zygote and the next request in its slot --------------------------
def _zygotes_of(top: str) -> list[int]:
    """Host pids of the zygotes under the cgroup top ``top`` (pid 1 of their namespaces)."""
    pids = set()
    for f in Path("/sys/fs/cgroup/pids", top).glob("*/zygote/cgroup.procs"):
        pids |= {int(x) for x in f.read_text().split()}

    def parent(p: int) -> int:
        try:
            return int(Path(f"/proc/{p}/status").read_text().split("\nPPid:\t")[1].split()[0])
        except (OSError, IndexError):
            return -1

    launchers = {p for p in pids if parent(p) not in pids}
    return [p for p in pids if parent(p) in launchers]


def _started(ep: str, pool: str) -> int:
    return next(p.started for p in run_code_pools(ep).pools if p.name == pool)


def _cpu_cgroup(pid: int | str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if "cpu" in ctrls.split(","):
            return path
    raise AssertionError(f"no cpu cgroup for {pid}")


@pytest.mark.skipif(not Path("/sys/fs/cgroup/cpu/cpu.shares").exists(),
                    reason="the cgroup v1 cpu hierarchy (this host's layout)")
def test_requests_weigh_less_cpu_than_their_zygote_and_the_daemon():
    """A request's processes are in its slot's cpu cgroup, under a top that weighs a quarter
    of one of the daemon's tasks; the zygote stays in the daemon's. Where every request
    shared the daemon's cpu cgroup, 6 requests of 63 busy processes each starved the zygote
    (their own timeouts came back as infra_error) and the daemon's lxcfs."""
    # seen from the host: a request's own /proc/self/cgroup shows "/" (its cgroup namespace)
    t = threading.Thread(target=run, args=("sleep 3",), kwargs={"language": "bash"})
    t.start()
    try:
        assert wait_until(lambda: any(c == "sleep" for _, c in host_procs_of_slot_uids()), 15)
        pid = next(p for p, c in host_procs_of_slot_uids() if c == "sleep")
        cpu = _cpu_cgroup(pid)
    finally:
        t.join(30)
    assert cpu.startswith(f"/{RC_TOP}/bash-") and cpu.rsplit("/", 1)[1].startswith("s"), cpu
    top = int(Path("/sys/fs/cgroup/cpu", RC_TOP, "cpu.shares").read_text())
    assert top <= 256
    def parent(p: int) -> int:
        return int(Path(f"/proc/{p}/status").read_text().split("\nPPid:\t")[1].split()[0])

    for z in zygote_pids():
        daemon = parent(parent(z))  # the zygote's launcher's parent
        assert "corral.daemon" in Path(f"/proc/{daemon}/cmdline").read_text()
        assert not _cpu_cgroup(daemon).startswith(f"/{RC_TOP}")
        assert not _cpu_cgroup(z).startswith(f"/{RC_TOP}"), _cpu_cgroup(z)
        assert int(Path("/sys/fs/cgroup/cpu", _cpu_cgroup(z).lstrip("/"), "cpu.shares")
                   .read_text()) > top


def test_spinning_requests_end_as_timeouts_and_starve_neither_zygote_nor_neighbour():
    """Requests that fill their process limit with busy loops each end as their own
    ``timeout`` (limit), a request beside them on the same zygote runs, and the zygote is not
    restarted."""
    cg = f"corral-test-rcspin-{os.getpid()}"
    spin = "for i in $(seq 40); do (while :; do :; done) & done; while :; do :; done"
    with private_daemon("corral-test-rcspin-", cg, CORRAL_RUNCODE_SLOTS="8",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("true", language="bash", endpoint=ep).ok
        items = [{"code": spin, "language": "bash", "timeout": 3}] * 5 + [
            {"code": "echo hi", "language": "bash", "timeout": 20}]
        res = corral.run_code_many(items, endpoint=ep)
        assert [(r.status, r.signal) for r in res[:5]] == [("timeout", 9)] * 5, res
        assert res[5].status == "ok" and res[5].stdout == "hi\n", res[5]
        assert corral.run_code("echo after", language="bash", timeout=20,
                               endpoint=ep).stdout == "after\n"
        assert _started(ep, "bash") == 1


def test_a_timeout_is_the_requests_own_when_its_zygote_is_slow_to_answer():
    """A request whose own deadline passed is a ``timeout``, never infra, even when its
    zygote does not confirm the kill in time (here: stopped from the host past the answer's
    grace); a request beside it is answered, and the zygote goes on once it runs again."""
    cg = f"corral-test-rcslow-{os.getpid()}"
    with private_daemon("corral-test-rcslow-", cg, CORRAL_RUNCODE_SLOTS="2",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("true", language="bash", endpoint=ep).ok
        zygotes = _zygotes_of(cg + ".runcode")
        assert len(zygotes) == 1

        async def both():  # type: ignore[no-untyped-def]
            return await asyncio.gather(
                corral.run_code_async("sleep 60", language="bash", timeout=1, endpoint=ep),
                corral.run_code_async("import time; time.sleep(2); print('beside')",
                                      timeout=30, endpoint=ep),
                return_exceptions=True)

        os.kill(zygotes[0], signal.SIGSTOP)
        try:
            slow, beside = asyncio.run(both())
        finally:
            os.kill(zygotes[0], signal.SIGCONT)
        assert not isinstance(slow, BaseException), slow
        assert (slow.status, slow.exit_code, slow.signal) == ("timeout", 137, 9)
        assert not isinstance(beside, BaseException) and beside.stdout == "beside\n", beside
        assert corral.run_code("echo on", language="bash", timeout=20,
                               endpoint=ep).stdout == "on\n"
        assert _started(ep, "bash") == 1


def _waiting_children(top: str, pool: str) -> list[int]:
    """Host pids of the processes in a pool's slot cgroups: each slot's child, forked ahead of
    its request (the pool idle: none is running one)."""
    pids: list[int] = []
    for f in Path("/sys/fs/cgroup/pids", top).glob(f"{pool}-*/s*/cgroup.procs"):
        pids += [int(x) for x in f.read_text().split()]
    return pids


def test_a_request_whose_process_died_before_it_ran_is_infra_never_its_own_status():
    """Each request runs in a child forked ahead of it that waits for it. One that died while
    it waited (killed from the host, or its own set-up failed) ran nothing of the request:
    the request is infra_error, never the status of that death (137, SIGKILL: a failure of
    the task to a trainer). The attack: the zygote stopped from the host (so the daemon hands
    the slots out before it is told of the deaths), every waiting child of the pool killed,
    then requests on them. A request that did start and was killed the same way is its own."""
    cg = f"corral-test-rcgone-{os.getpid()}"
    with private_daemon("corral-test-rcgone-", cg, CORRAL_RUNCODE_SLOTS="2",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        top = cg + ".runcode"
        assert corral.run_code("true", language="bash", endpoint=ep).ok
        (z,) = _zygotes_of(top)
        assert d.proc is not None

        def handed_to_the_daemon() -> bool:
            """Both slots' children waiting, the daemon holding each one's request pipe."""
            kids = _waiting_children(top, "bash")
            try:
                held = {os.readlink(f) for f in Path(f"/proc/{d.proc.pid}/fd").iterdir()}
                return len(kids) == 2 and all(os.readlink(f"/proc/{c}/fd/3") in held
                                              for c in kids)
            except OSError:
                return False

        assert wait_until(handed_to_the_daemon, 15)
        os.kill(z, signal.SIGSTOP)
        try:
            victims = _waiting_children(top, "bash")
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in victims),
                              15)  # reaped by the fork server, the zygote still stopped

            async def both():  # type: ignore[no-untyped-def]
                return await asyncio.gather(
                    *(corral.run_code_async("echo ran", language="bash", timeout=20,
                                            endpoint=ep) for _ in victims),
                    return_exceptions=True)

            got = asyncio.run(both())
        finally:
            os.kill(z, signal.SIGCONT)
        for r in got:
            assert isinstance(r, corral.InfraError), r
            assert r.details.get("cause") == "not_started", r.details
        # The zygote goes on: the next requests run, on the same zygote.
        assert corral.run_code("echo on", language="bash", timeout=20,
                               endpoint=ep).stdout == "on\n"
        # A request that had started is its own, however it ends: killed from the host too.
        out: dict[str, object] = {}

        def call() -> None:
            out["r"] = corral.run_code("echo up; sleep 60", language="bash", timeout=30,
                                       endpoint=ep)

        t = threading.Thread(target=call, daemon=True)
        t.start()
        assert wait_until(lambda: any(c == "sleep" for _, c in host_procs_of_slot_uids()), 15)
        for pid in _waiting_children(top, "bash"):
            os.kill(pid, signal.SIGKILL)
        t.join(30)
        r = out["r"]
        assert (r.status, r.exit_code, r.stdout) == ("error", 137, "up\n"), r  # type: ignore[union-attr]
        assert _started(ep, "bash") == 1


def _queued_to(pid: int) -> int:
    """Bytes waiting in the socket between the daemon and zygote ``pid`` (its end: fd
    ``sys.argv[-1]`` of the launcher it was forked from), as the kernel's sock_diag says."""
    fd = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")[-1].decode()
    inode = os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").rstrip("]")
    out = subprocess.run(["ss", "-x", "-a", "-n"], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 6 and f[5] == inode:  # Netid State Recv-Q Send-Q Local Port ...
            return int(f[2])
    raise AssertionError(f"no socket {inode} in ss:\n{out}")


def test_a_program_that_ended_before_its_deadline_is_not_a_timeout_when_the_answer_is_late():
    """The daemon answers on the word of the child's fork server (its wait status and when it
    reaped it), which does not wait for the zygote: a request whose zygote is stopped from
    the host is answered with its own status. And the daemon's timer may run before that
    word is read: the program's outcome is then its own, decided by when its fork server
    reaped it (never by the program, nor by which came first). Here the daemon is stopped
    from the host while the request runs, until past its deadline."""
    cg = f"corral-test-rclate-{os.getpid()}"
    with private_daemon("corral-test-rclate-", cg, CORRAL_RUNCODE_SLOTS="2",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("true", language="bash", endpoint=ep).ok
        (z,) = _zygotes_of(cg + ".runcode")
        out: dict[str, object] = {}

        def call(code: str, timeout: float) -> None:
            try:
                out["r"] = corral.run_code(code, language="bash", timeout=timeout, endpoint=ep)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                out["r"] = e

        os.kill(z, signal.SIGSTOP)
        try:
            t = threading.Thread(target=call, args=("echo hi; exit 3", 20), daemon=True)
            t.start()
            assert wait_until(lambda: "r" in out, 15), "no answer while the zygote is stopped"
        finally:
            os.kill(z, signal.SIGCONT)
        r = out.pop("r")
        assert not isinstance(r, BaseException), r
        assert (r.status, r.exit_code, r.signal, r.stdout) == ("error", 3, None, "hi\n"), r
        # the word waits in its pipe, the timer is due: the program's own status
        assert d.proc is not None
        t = threading.Thread(target=call, args=("sleep 0.3; echo hi; exit 3", 1), daemon=True)
        t.start()
        assert wait_until(lambda: any(c == "sleep" for _, c in host_procs_of_slot_uids()), 15)
        seen = time.monotonic()  # after the request's start: its deadline is before seen + 1
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: not any(c == "sleep" for _, c in
                                              host_procs_of_slot_uids()), 15)
            assert wait_until(lambda: time.monotonic() > seen + 1.2, 5)
            assert "r" not in out
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        t.join(30)
        r = out.pop("r")
        assert not isinstance(r, BaseException), r
        assert (r.status, r.exit_code, r.signal, r.stdout) == ("error", 3, None, "hi\n"), r
        assert r.duration_s < 1, r
        # a program still running at its deadline is a timeout, with the zygote stopped too
        os.kill(z, signal.SIGSTOP)
        try:
            t = threading.Thread(target=call, args=("sleep 60", 1), daemon=True)
            t.start()
            assert wait_until(lambda: _queued_to(z) > 0, 30), "the timer never ran"
        finally:
            os.kill(z, signal.SIGCONT)
        t.join(30)
        r = out["r"]
        assert (r.status, r.exit_code, r.signal) == ("timeout", 137, 9), r  # type: ignore[union-attr]
        assert _started(ep, "bash") == 1  # the zygote was never restarted


def test_a_slot_s_files_are_out_of_reach_of_other_requests_whatever_their_modes():
    """A request that opens its working directory and files to everyone (0777, 0666) still
    has them out of reach of a request in another slot: the slot's tmpfs root is the
    zygote's, 0710 with the slot's group. Where a request's scratch was its own 0700
    directory, another slot opened its files after a chmod and held them past its end."""
    cg = f"corral-test-rcreach-{os.getpid()}"
    with private_daemon("corral-test-rcreach-", cg, CORRAL_RUNCODE_SLOTS="2",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("pass", endpoint=ep).ok
        (z,) = _zygotes_of(cg + ".runcode")
        owner = ("import os, time\nos.chmod('.', 0o777)\n"
                 "open('big', 'w').write('x' * 4096); os.chmod('big', 0o666)\n"
                 "open('ready', 'w').close()\nt = time.monotonic()\n"
                 "while not os.path.exists('go') and time.monotonic() - t < 60:\n"
                 "    time.sleep(0.01)\nprint(os.getcwd())")
        out: dict[str, object] = {}

        async def owner_run():  # type: ignore[no-untyped-def]
            out["owner"] = await corral.run_code_async(owner, timeout=90, endpoint=ep)

        async def attack():  # type: ignore[no-untyped-def]
            task = asyncio.create_task(owner_run())
            ready: list[Path] = []

            def seen() -> bool:
                ready[:] = list(Path(f"/proc/{z}/root/tmp").glob("s*/ready")) + list(
                    Path(f"/proc/{z}/root/tmp").glob("s*/w/ready"))
                return bool(ready)

            while not seen():  # the owner is up: its files are there
                assert not task.done(), out
                await asyncio.sleep(0.01)
            probe = ("import os\nfor i in (0, 1):\n"
                     "    for p in (f'/tmp/s{i}', f'/tmp/s{i}/w'):\n"
                     "        if p == os.getcwd(): continue\n"
                     "        for f in (p + '/big', p):\n"
                     "            try:\n"
                     "                os.listdir(f) if f == p else os.close(os.open(f, 0))\n"
                     "                print('REACHED', f)\n"
                     "            except OSError as e:\n"
                     "                print('no', f, e.errno)\n")
            out["probe"] = await corral.run_code_async(probe, endpoint=ep)
            (ready[0].parent / "go").write_text("")
            await task

        asyncio.run(attack())
        probe = out["probe"]
        assert "REACHED" not in probe.stdout and "no" in probe.stdout, probe  # type: ignore[attr-defined]
        assert out["owner"].ok, out["owner"]  # type: ignore[attr-defined]


def test_a_file_held_past_its_request_gets_the_slot_rebuilt_never_a_task_error():
    """Files another process still holds when a request ends stay charged to its slot's
    tmpfs and memory cgroup. The wipe sees the tmpfs is not empty: the slot is retired and
    the zygote made afresh, so the next request has its whole scratch and its memory limit.
    Where the slot was used again as it was, the next request saw the room taken and a
    lower memory limit failed (EBUSY) as invalid_request, a task error."""
    cg = f"corral-test-rchold-{os.getpid()}"
    with private_daemon("corral-test-rchold-", cg, CORRAL_RUNCODE_SLOTS="1",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("pass", endpoint=ep).ok
        (z,) = _zygotes_of(cg + ".runcode")
        writer = ("import os, time\n"
                  "for n in ('big1', 'big2'):\n"
                  "    with open(n, 'wb') as f:\n"
                  "        for _ in range(150): f.write(b'1' * (1 << 20))\n"
                  "open('ready', 'w').close()\nt = time.monotonic()\n"
                  "while not os.path.exists('go') and time.monotonic() - t < 60:\n"
                  "    time.sleep(0.01)\nprint('wrote')")
        held: list[int] = []

        async def hold():  # type: ignore[no-untyped-def]
            task = asyncio.create_task(corral.run_code_async(writer, memory_mb=1024,
                                                             timeout=90, endpoint=ep))
            root = Path(f"/proc/{z}/root/tmp/s0")
            where = [root / "w", root]

            def seen() -> bool:
                return any((p / "ready").exists() for p in where)

            while not seen():
                assert not task.done(), task
                await asyncio.sleep(0.01)
            at = next(p for p in where if (p / "ready").exists())
            held.extend(os.open(at / n, os.O_RDONLY) for n in ("big1", "big2"))
            (at / "go").write_text("")
            return await task

        try:
            assert asyncio.run(hold()).stdout == "wrote\n"
            room = ("import os\nst = os.statvfs('.')\nprint(st.f_bavail * st.f_frsize >> 20)")
            r = corral.run_code(room, memory_mb=1024, endpoint=ep)
            assert int(r.stdout) >= 500, r
            r = corral.run_code("x = bytearray(180 << 20); print('fits')", memory_mb=256,
                                endpoint=ep)
            assert (r.status, r.stdout) == ("ok", "fits\n"), r
            assert _started(ep, "python") == 2  # made afresh once
        finally:
            for fd in held:
                os.close(fd)


def test_files_a_request_leaves_in_flight_in_its_own_sockets_never_cost_the_zygote():
    """A request that sends its scratch file and both ends of a socket pair over the pair
    itself (SCM_RIGHTS) leaves a cycle only the kernel's collector frees, on its own pass
    after the request's processes are gone. The wipe found the tmpfs not empty then and
    retired the zygote: any request could have its zygote rebuilt at will (7 of 10 did), a
    restart's CPU and a pool's worth of slots for a few milliseconds of its own. The slot
    waits for the collector instead: the same zygote serves every request, each with its
    whole scratch."""
    cg = f"corral-test-rccycle-{os.getpid()}"
    cycle = ("import array, os, socket\n"
             "f = os.open('held.bin', os.O_RDWR | os.O_CREAT, 0o600)\n"
             "os.write(f, b'y' * (4 << 20))\n"
             "a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
             "def send(s, fds):\n"
             "    s.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,\n"
             "                        array.array('i', fds))])\n"
             "send(a, [a.fileno(), b.fileno(), f])\n"
             "send(b, [a.fileno(), b.fileno()])\n"
             "print('sent')")
    room = ("import os\nst = os.statvfs('.')\n"
            "print(st.f_files - st.f_ffree, st.f_bfree == st.f_blocks)")
    with private_daemon("corral-test-rccycle-", cg, CORRAL_RUNCODE_SLOTS="1",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("pass", endpoint=ep).ok
        for _ in range(10):
            r = corral.run_code(cycle, endpoint=ep)
            assert (r.status, r.stdout) == ("ok", "sent\n"), r
            r = corral.run_code(room, endpoint=ep)
            assert r.stdout == "2 True\n", r  # the tmpfs's root and the working directory
        assert _started(ep, "python") == 1


# inotify and fanotify watches, each on the host's /usr/bin (the view binds it) and on the
# request's own working directory: "<call> <result> <errno>" per line.
WATCH_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                               ctypes.c_char_p]
fd = libc.inotify_init1(0)
ffd = libc.fanotify_init(0x200, os.O_RDONLY)  # FAN_REPORT_FID: no capability needed
for path in (b"/usr/bin", os.getcwd().encode()):
    w = libc.inotify_add_watch(fd, path, 0x20)  # IN_OPEN
    print("inotify", w, ctypes.get_errno() if w < 0 else 0)
    m = libc.fanotify_mark(ffd, 1, 0x20, -100, path)  # FAN_MARK_ADD, FAN_OPEN
    print("fanotify", m, ctypes.get_errno() if m < 0 else 0)
"""


def test_no_request_can_watch_the_hosts_files():
    """The view binds the host's own OS directories: an inotify or fanotify watch on them
    saw every open of their files on the host, by host processes and by other tenants'
    requests (a watcher saw the binaries another tenant's bash request ran). The process
    tier's filter refuses both watch calls (EPERM), on any path; a container refuses
    fanotify marks only."""
    lines = run(WATCH_PROBE).stdout.splitlines()
    assert lines == ["inotify -1 1", "fanotify -1 1"] * 2, lines
    with corral.Sandbox(substrate="process", timeout=60) as sb:
        sb.files.write("/tmp/watch.py", WATCH_PROBE)
        lines = sb.exec("cd /tmp && python3 watch.py").stdout.splitlines()
        assert lines == ["inotify -1 1", "fanotify -1 1"] * 2, lines
    with corral.Sandbox(timeout=60) as sb:  # a container's files are its own: inotify works
        sb.files.write("/tmp/watch.py", WATCH_PROBE)  # (fanotify marks: refused everywhere)
        lines = sb.exec("cd /tmp && python3 watch.py").stdout.splitlines()
        assert [line.rsplit(" ", 1)[1] for line in lines] == ["0", "1"] * 2, lines


def test_nothing_set_on_the_working_directory_reaches_the_next_request():
    """The working directory is made afresh for each request: its xattrs, times and mode
    are not the previous request's (they were a channel to the next one in the slot)."""
    writer = ("import os\nd = os.getcwd()\nos.setxattr(d, 'user.secret', b'42')\n"
              "os.utime(d, ns=(1234567890123456789, 987654321987654321))\n"
              "os.chmod(d, 0o755)\nprint(os.listxattr(d))")
    assert all(r.stdout == "['user.secret']\n" for r in every_slot(writer))
    reader = ("import os, time\nd = os.getcwd()\nst = os.stat(d)\n"
              "print(os.listxattr(d), abs(st.st_mtime - time.time()) < 600, "
              "oct(st.st_mode & 0o777))")
    for r in every_slot(reader):
        assert r.stdout == "[] True 0o700\n", r.stdout


def test_a_memory_limit_the_kernel_refuses_is_infra_and_retires_the_slot():
    """The slot's limit write failing (v1: EBUSY, memory held from outside the slot) is the
    host's state: infra_error, and the zygote is retired, never invalid_request."""
    import errno

    from corral.daemon.substrates.process import pool as pool_mod

    class Memory:
        limit = 1 << 62

        def set(self, nbytes: int) -> None:
            raise OSError(errno.EBUSY, "Device or resource busy")

    class Slot:
        index = 3
        memory = Memory()

    class FakePool:
        language = "python"

    z = pool_mod.Zygote.__new__(pool_mod.Zygote)
    z.pool, z.name, z.retiring = FakePool(), "python-0", False  # type: ignore[assignment]
    with pytest.raises(corral.InfraError) as e:
        asyncio.run(z._set_limit(Slot(), 256 << 20))  # type: ignore[arg-type]
    assert e.value.category == "infra" and e.value.details["errno"] == errno.EBUSY
    assert z.retiring


def test_a_huge_tree_is_wiped_off_the_zygote_s_loop():
    """A tree of tens of thousands of directories is removed by a helper process: requests
    on other slots of the same zygote go on meanwhile (on its loop, such a wipe held every
    other slot of the zygote for about 1.5 s)."""
    cg = f"corral-test-rcwipe-{os.getpid()}"
    with private_daemon("corral-test-rcwipe-", cg, CORRAL_RUNCODE_SLOTS="2",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("pass", endpoint=ep).ok
        deep = ("import os\nfor _ in range(60000):\n    os.mkdir('d'); os.chdir('d')\n"
                "print('deep')")
        r = corral.run_code(deep, memory_mb=1024, timeout=120, endpoint=ep)
        assert r.stdout == "deep\n", r
        # Answered on the child's word: its slot is being wiped now. Others run meanwhile,
        # each in a small part of the wipe's time (on the loop, one of them waited it out).
        t0, took = time.monotonic(), []
        while run_code_pools(ep).pools[0].busy:
            t = time.monotonic()
            assert corral.run_code("print(1)", endpoint=ep).stdout == "1\n"
            took.append(time.monotonic() - t)
        wipe = time.monotonic() - t0
        assert len(took) >= 3 and max(took) < wipe / 2, (wipe, took)
        for _ in range(3):
            assert corral.run_code("import os; print(os.listdir('.'))",
                                   endpoint=ep).stdout == "[]\n"
        assert _started(ep, "python") == 1


# 60 processes, each with 40 mappings of the same 256 MiB: 2.6 M page table entries apiece
# (1.2 GiB of page tables, charged to the request), whose teardown at exit takes ~10 s of
# the machine's two cores once they are killed.
SLOW_TO_DIE = """
import mmap, os, time
fd = os.memfd_create('pages')
size = 256 << 20
os.ftruncate(fd, size)
os.posix_fallocate(fd, 0, size)
r, w = os.pipe()
for _ in range(60):
    if os.fork() == 0:
        maps = [mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                for _ in range(40)]
        os.write(w, b'x')
        time.sleep(1000)
os.close(w)
n = 0
while n < 60:
    n += len(os.read(r, 64))
print('mapped')
"""


def test_processes_slow_to_die_hold_only_their_own_slot():
    """A request that leaves processes whose exit takes seconds (page tables built up on
    purpose) holds only its own slot while they die: requests beside it on the same zygote
    run to their end, and the zygote is not restarted. Where the zygote waited for them on
    its loop, it gave the slot up after 5 s and was restarted as dead, failing every other
    request it ran with infra_error."""
    cg = f"corral-test-rcslowdie-{os.getpid()}"
    with private_daemon("corral-test-rcslowdie-", cg, CORRAL_RUNCODE_SLOTS="4",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("pass", endpoint=ep).ok
        attack: list[object] = []
        beside: list[object] = []

        def attacker() -> None:
            attack.append(corral.run_code(SLOW_TO_DIE, memory_mb=2048, timeout=200,
                                          endpoint=ep))

        def neighbour() -> None:
            # Requests one after the other while the attack runs and its processes die.
            until = None
            while until is None or time.monotonic() < until:
                if until is None and not a.is_alive():
                    until = time.monotonic() + 15
                try:
                    beside.append(corral.run_code("import time; time.sleep(1); print('ok')",
                                                  timeout=60, endpoint=ep))
                except corral.CorralError as e:
                    beside.append(e)

        a = threading.Thread(target=attacker)
        a.start()
        others = [threading.Thread(target=neighbour) for _ in range(3)]
        for t in others:
            t.start()
        for t in (a, *others):
            t.join()
        assert len(attack) == 1 and attack[0].stdout == "mapped\n", attack  # type: ignore[attr-defined]
        bad = [r for r in beside if isinstance(r, BaseException) or r.stdout != "ok\n"]  # type: ignore[attr-defined]
        assert not bad and len(beside) > 30, (bad, len(beside))
        assert _started(ep, "python") == 1
        for _ in range(5):  # the attacker's slot too, once its processes are gone
            assert corral.run_code("print(2)", endpoint=ep).stdout == "2\n"
    # A stop while a process is still in its exit waits for it: no cgroup is left behind.
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{cg}.runcode")), "cgroups left"


def test_cgroups_that_cannot_be_rebuilt_are_infra_never_the_request_s_fault():
    """A zygote started again while a slot of its last one still holds a process that does
    not die (here: a process of the test's, frozen in a freezer cgroup of its own, put in the
    slot's memory cgroup; a request's processes slow to exit do the same for seconds) fails
    the request that came to start it with infra_error, not with the errno's
    invalid_request (EBUSY)."""
    cg = f"corral-test-rcrebuild-{os.getpid()}"
    frz = Path("/sys/fs/cgroup/freezer", f"corral-test-rcfrz-{os.getpid()}")
    with private_daemon("corral-test-rcrebuild-", cg, CORRAL_RUNCODE_SLOTS="2",
                        CORRAL_RUNCODE_ZYGOTES="1") as d:
        ep = d.socket_path
        assert corral.run_code("pass", endpoint=ep).ok
        slot = Path("/sys/fs/cgroup/memory", cg + ".runcode", "python-0", "s0")
        assert slot.is_dir()
        frz.mkdir()
        held = subprocess.Popen(["sleep", "1000"])
        try:
            (frz / "tasks").write_text(str(held.pid))
            (slot / "tasks").write_text(str(held.pid))
            (frz / "freezer.state").write_text("FROZEN")
            assert wait_until(lambda: (frz / "freezer.state").read_text().strip() == "FROZEN")
            zygotes = _zygotes_of(cg + ".runcode")
            assert len(zygotes) == 1
            os.kill(zygotes[0], signal.SIGKILL)
            assert wait_until(lambda: not run_code_pools(ep).pools[0].zygotes)
            with pytest.raises(corral.CorralError) as e:
                corral.run_code("pass", endpoint=ep)
            assert e.value.category == "infra", e.value
        finally:
            held.kill()
            (frz / "freezer.state").write_text("THAWED")
            held.wait()
            frz.rmdir()
        assert corral.run_code("print(3)", endpoint=ep).stdout == "3\n"
        assert _started(ep, "python") == 2
