"""The embedded default: the first SDK use in a fresh process starts one local corrald, even
when many tasks make their first call at the same moment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

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
    import json

    state = tempfile.mkdtemp(prefix="corral-test-auto-", dir="/var/tmp")
    sock = os.path.join(state, "run", "corrald.sock")
    cgroup = f"corral-test-auto-{os.getpid()}"
    env = dict(os.environ, CORRAL_STATE_DIR=state, CORRAL_SOCKET=sock, CORRAL_CGROUP=cgroup)
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
