"""The ``corral`` CLI, run as a subprocess against the session's daemon (env from conftest)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest

import corral

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(corral.__file__)))


def corral_cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, PYTHONPATH=PKG_PARENT, COLUMNS="200", **(env or {}))
    return subprocess.run([sys.executable, "-m", "corral.cli", *args], input=stdin,
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def ok(*args: str, **kw) -> str:
    r = corral_cli(*args, **kw)
    assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    return r.stdout


@pytest.fixture
def label() -> str:
    return f"clitest={uuid.uuid4().hex[:10]}"


@pytest.fixture
def sid(label):
    out = ok("create", "--label", label, "--memory", "256", "--timeout", "600")
    sid = out.strip()
    yield sid
    corral_cli("rm", sid)


def test_version_and_help():
    assert ok("--version").strip() == f"corral {corral.__version__}"
    out = ok("--help")
    for cmd in ("up", "down", "status", "create", "exec", "run", "ls", "rm", "info", "image",
                "demo"):
        assert cmd in out


def test_status(daemon):
    st = json.loads(ok("status", "--json"))
    assert st["running"] is True and st["pid"] == daemon.proc.pid
    assert "container" in st["substrates"]
    assert "sandboxes" in ok("status")


def test_status_shows_the_capability_table():
    st = json.loads(ok("status", "--json"))
    caps = {s["name"]: s["capabilities"] for s in st["substrate_capabilities"]}
    assert set(caps) == set(st["substrates"]) and caps["container"]["snapshot"] is True
    text = ok("status")
    assert re.search(r"SUBSTRATE\s+FILES\s+SNAPSHOT", text)
    assert re.search(r"container\s+yes\s+yes", text)


def test_create_on_a_substrate_not_served():
    r = corral_cli("create", "--substrate", "nosuch")
    assert r.returncode != 0 and "invalid_request" in r.stderr and "nosuch" in r.stderr


def test_create_ls_info(sid, label):
    assert re.fullmatch(r"sb-[0-9a-f]{16}", sid)
    key, value = label.split("=")
    listed = json.loads(ok("ls", "--json", "--label", label))
    assert [x["id"] for x in listed] == [sid]
    assert listed[0]["labels"] == {key: value} and listed[0]["memory_mb"] == 256
    assert sid in ok("ls")
    assert ok("ls", "-q", "--label", label).split() == [sid]
    assert json.loads(ok("ls", "--json", "--label", f"{key}=other")) == []
    info = json.loads(ok("info", sid, "--json"))
    assert info["id"] == sid and info["state"] == "running"
    assert "256 MiB" in ok("info", sid)


def test_what_a_tenant_or_a_sandbox_wrote_reaches_the_terminal_as_inert_text():
    """Labels, metadata and command output are other people's text: a label
    ``\x1b[23Dcorral.tenant=bob\x1b[K`` made the admin's ``corral ls`` show another tenant's
    label, one of ``[/x]`` made it fail (Rich markup), and a command printing
    ``\x1b[8Dexit 0  tests passed`` read as a pass in ``corral log``. Every control
    character is shown escaped, brackets as they are, and no command fails on them."""
    hostile = "\x1b[2J\x1b]52;c;cHduZWQ=\x07[/x][bold]b"
    with corral.Sandbox(labels={"clitest": hostile[:200]}, metadata={"m": hostile},
                        timeout=120) as sb:
        sb.exec(["sh", "-c", "printf '\\033[8Dexit 0  tests passed\\033[K'; exit 1"])
        for args in (("ls",), ("info", sb.id), ("log", sb.id)):
            r = corral_cli(*args)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
            assert "\x1b" not in r.stdout and "\x07" not in r.stdout, (args, r.stdout)
            if args[0] != "log":
                assert "[/x][bold]b" in r.stdout, (args, r.stdout)
        assert "\\x1b[8Dexit 0" in ok("log", sb.id) and "exit 1" in ok("log", sb.id)
    with pytest.raises(corral.InvalidRequest):  # "$" matched before a final newline
        corral.Sandbox(labels={"corral.tenant\n": "bob"}, timeout=60)


def test_create_json():
    info = json.loads(ok("create", "--json", "--cpu", "0.5", "--env", "A=1"))
    try:
        assert info["cpu"] == 0.5 and info["state"] == "running"
        assert ok("exec", info["id"], "--", "echo $A").strip() == "1"
    finally:
        ok("rm", info["id"])


def test_exec_output_and_exit_codes(sid):
    r = corral_cli("exec", sid, "--", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")
    assert ok("exec", sid, "--", "printf", "%s-", "a b", "c") == "a b-c-"  # an argv
    assert ok("exec", sid, "--no-stream", "--", "echo buffered") == "buffered\n"
    assert ok("exec", sid, "-e", "X=y z", "-w", "/tmp", "--", "echo $X; pwd") == "y z\n/tmp\n"
    assert ok("exec", sid, "-i", "--", "tr a-z A-Z", stdin="piped in\n") == "PIPED IN\n"
    assert ok("exec", sid, "--", "cat") == ""  # stdin is closed, not left hanging
    res = json.loads(corral_cli("exec", sid, "--json", "--", "echo j; exit 3").stdout)
    assert (res["stdout"], res["exit_code"]) == ("j\n", 3)


def test_exec_timeout_exits_124(sid):
    r = corral_cli("exec", sid, "--timeout", "0.5", "--", "echo before; sleep 30")
    assert r.returncode == 124 and r.stdout == "before\n" and "timed out" in r.stderr


def test_exec_errors_exit_125():
    r = corral_cli("exec", "sb-0000000000000000", "--", "true")
    assert r.returncode == 125
    assert r.stderr.strip() == "error [sandbox_not_found]: no sandbox sb-0000000000000000"


def test_run_creates_runs_destroys(label):
    r = corral_cli("run", "--label", label, "--", "python3 -c 'print(6*7)'; exit 4")
    assert (r.returncode, r.stdout) == (4, "42\n")
    assert json.loads(ok("ls", "--json", "--label", label)) == []
    res = json.loads(ok("run", "--json", "--memory", "128", "--", "echo", "json run"))
    assert res["stdout"] == "json run\n" and res["exit_code"] == 0


def test_rm(label):
    a = ok("create", "--label", label).strip()
    b = ok("create", "--label", label).strip()
    assert ok("rm", a).strip() == f"{a} killed"
    assert ok("rm", a).strip() == f"{a} already ended"
    r = corral_cli("rm", "sb-0000000000000000", b)
    assert r.returncode == 1 and "error [sandbox_not_found]" in r.stderr
    assert f"{b} killed" in r.stdout  # the good ids are still removed
    c = ok("create", "--label", label).strip()
    d = ok("create", "--label", label).strip()
    out = ok("rm", "--all", "--label", label)
    assert f"{c} killed" in out and f"{d} killed" in out
    assert json.loads(ok("ls", "--json", "--label", label)) == []
    assert corral_cli("rm").returncode == 2  # usage error: nothing to remove


def test_bad_input_errors():
    r = corral_cli("create", "--cpu", "-1")
    assert r.returncode == 1 and r.stderr.startswith("error [invalid_request]:")
    r = corral_cli("create", "--image", "no-such-image")
    assert r.returncode == 1 and "error [image_not_found]" in r.stderr
    r = corral_cli("info", "sb-0000000000000000", "--json")
    assert r.returncode == 1 and r.stdout == "" and "error [sandbox_not_found]" in r.stderr
    assert corral_cli("create", "--label", "no-equals-sign").returncode == 2


def test_images():
    images = json.loads(ok("image", "ls", "--json"))
    assert "host" in [i["name"] for i in images]
    assert "host" in ok("image", "ls")


def test_image_import(tmp_path):
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "marker").write_text("imported")
    name = f"clitest-{uuid.uuid4().hex[:8]}"
    info = json.loads(ok("image", "import", name, str(root), "--json"))
    assert info["name"] == name
    assert name in [i["name"] for i in json.loads(ok("image", "ls", "--json"))]
    r = corral_cli("image", "import", "Bad Name!", str(root))
    assert r.returncode == 1 and "error [invalid_request]" in r.stderr


def test_no_daemon(tmp_path):
    env = {"CORRAL_SOCKET": str(tmp_path / "none.sock"), "CORRAL_AUTOSTART": "0"}
    for args in (["ls"], ["status"], ["info", "sb-0000000000000000"]):
        r = corral_cli(*args, env=env)
        assert r.returncode == 1, args
        assert r.stderr.startswith("error [daemon_unavailable]:"), (args, r.stderr)
    r = corral_cli("status", "--json", env=env)
    assert r.returncode == 1 and json.loads(r.stdout)["running"] is False
    r = corral_cli("run", "--", "true", env=env)
    assert r.returncode == 125 and "error [daemon_unavailable]" in r.stderr
