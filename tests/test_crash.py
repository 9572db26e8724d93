"""kill -9 of corrald under load (issue 4, "Surviving a daemon crash"): every sandbox is
re-adopted with its files, the calls in flight fail with an infra error (never as the
command's own failure), and the trajectory log holds every call a client saw completed."""

from __future__ import annotations

import asyncio
import threading
import time

from corral import AsyncSandbox, Sandbox
from corral.errors import CorralError, DaemonRestarted, DaemonUnavailable


def test_kill9_under_load(daemon):
    boxes = [Sandbox(timeout=600) for _ in range(3)]
    for b in boxes:
        b.files.write("/root/keep", b.id)
    lock = threading.Lock()
    seen: dict[str, list[tuple[str, str, int]]] = {b.id: [] for b in boxes}
    failures: list[tuple[str, BaseException]] = []
    started = threading.Event()

    def note(sid: str, cmd: str, stdout: str, code: int) -> None:
        with lock:
            seen[sid].append((cmd, stdout, code))

    def worker(b: Sandbox, w: str) -> None:
        n = 0
        while True:
            cmd = f"echo {w}-{n}; echo {w}-{n} >> /root/trail; sleep 0.0{n % 3}"
            try:
                r = b.exec(cmd)
            except CorralError as e:
                failures.append((w, e))
                return
            note(b.id, cmd, r.stdout, r.exit_code)
            n += 1
            if n == 5:
                started.set()

    def long_one(b: Sandbox) -> None:
        try:
            r = b.exec("sleep 30; echo late")
        except CorralError as e:
            failures.append(("long", e))
        else:
            failures.append(("long", AssertionError(f"completed: {r}")))

    def async_worker(b: Sandbox) -> None:
        async def main() -> None:
            ab = await AsyncSandbox.connect(b.id)

            async def one(t: int) -> None:
                n = 0
                while True:
                    cmd = f"echo a{t}-{n}"
                    try:
                        r = await ab.exec(cmd)
                    except CorralError as e:
                        failures.append((f"async{t}", e))
                        return
                    note(b.id, cmd, r.stdout, r.exit_code)
                    n += 1

            await asyncio.gather(*(one(t) for t in range(4)))

        asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(b, f"w{i}{j}"))
               for i, b in enumerate(boxes) for j in range(2)]
    threads.append(threading.Thread(target=long_one, args=(boxes[0],)))
    threads.append(threading.Thread(target=async_worker, args=(boxes[1],)))
    try:
        for t in threads:
            t.start()
        assert started.wait(30)
        time.sleep(0.5)  # load running, the long command in flight
        daemon.kill9()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        daemon.start()
        # every caller failed with an infra error; the one in flight with daemon_restarted
        assert len(failures) == len(boxes) * 2 + 1 + 4
        for who, e in failures:
            assert isinstance(e, (DaemonRestarted, DaemonUnavailable)), (who, e)
            assert e.infra
        assert isinstance(dict(failures)["long"], DaemonRestarted)
        total = sum(len(v) for v in seen.values())
        assert total > 20
        for b in boxes:
            again = Sandbox.connect(b.id)  # re-adopted: same id, files intact, usable
            assert again.files.read("/root/keep") == b.id
            assert again.exec("echo alive").stdout == "alive\n"
            logged = {}
            for e in again.log():
                if e.op == "exec" and e.result is not None:
                    logged.setdefault(e.request["cmd"], []).append(e.result)
            for cmd, stdout, code in seen[b.id]:
                assert cmd in logged, f"{cmd!r} was seen by a client but is not in the log"
                res = logged[cmd][0]
                assert (res["stdout"], res["exit_code"]) == (stdout, code)
            # no call was logged as a command failure caused by the crash
            assert all(r["exit_code"] == 0 for rs in logged.values() for r in rs)
    finally:
        if daemon.proc is None:
            daemon.start()
        for b in boxes:
            try:
                b.kill()
            except CorralError:
                pass
