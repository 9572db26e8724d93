"""Which gVisor platform works on this host: ``runsc --platform=X do true`` for each platform,
with a timeout (the kvm platform hangs on some hosts' KVM), first one that works wins. The
answer is kept in the state dir keyed by the runsc binary and the kernel, so a daemon start
pays for the probe once per (runsc, kernel)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from corral.daemon import kernel

# Preferred first: systrap (newer runsc only) and ptrace need no device; kvm last, it can hang.
PLATFORMS = ("systrap", "ptrace", "kvm")
PROBE_TIMEOUT_S = 8.0
_CANDIDATES = ("/usr/bin/runsc", "/usr/sbin/runsc", "/usr/local/bin/runsc")


def find_runsc() -> str | None:
    found = shutil.which("runsc")
    if found:
        return os.path.realpath(found)
    for p in _CANDIDATES:
        if os.access(p, os.X_OK):
            return p
    return None


def _key(runsc: str) -> list[object]:
    st = os.stat(runsc)
    return [runsc, st.st_mtime_ns, st.st_size, os.uname().release]


def kill_under(root: str) -> None:
    """SIGKILL every process whose command line names ``root`` (a runsc --root of ours that
    nothing else uses): the sandbox and gofer processes a runsc command left behind."""
    needle = f"--root={root}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            continue


def _try(runsc: str, platform: str, work: str) -> str | None:
    """None if ``platform`` runs a sandbox here, else why not."""
    root = tempfile.mkdtemp(prefix=f"probe-{platform}-", dir=work)
    argv = [runsc, f"--root={root}", f"--platform={platform}", "--network=none",
            "do", "true"]
    try:
        # runsc gives its stdio to the sandbox's user: a null node of our own, never the
        # host's /dev/null (kernel.private_null)
        with open(kernel.private_null(os.path.join(work, "null")), "r+b") as null:
            proc = subprocess.Popen(argv, stdin=null, stdout=null, stderr=subprocess.PIPE,
                                    cwd=work, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"platform {platform}: no answer within {PROBE_TIMEOUT_S:g}s"
        if proc.returncode == 0:
            return None
        lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
        return f"platform {platform}: {lines[-1] if lines else f'exit {proc.returncode}'}"
    finally:
        kill_under(root)
        shutil.rmtree(root, ignore_errors=True)


def detect(runsc: str, work: str) -> tuple[str | None, str]:
    """(the first platform that works, or None; why none does). Cached in ``work``."""
    os.makedirs(work, mode=0o700, exist_ok=True)
    cache = os.path.join(work, "probe.json")
    key = _key(runsc)
    with contextlib.suppress(OSError, ValueError):
        with open(cache) as f:
            got = json.load(f)
        if got.get("key") == key:
            return got.get("platform"), str(got.get("reason", ""))
    reasons: list[str] = []
    platform = None
    t0 = time.monotonic()
    for p in PLATFORMS:
        why = _try(runsc, p, work)
        if why is None:
            platform = p
            break
        reasons.append(why)
    reason = "; ".join(reasons)
    tmp = cache + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"key": key, "platform": platform, "reason": reason,
                   "probe_s": round(time.monotonic() - t0, 3)}, f)
    os.replace(tmp, cache)
    return platform, reason
