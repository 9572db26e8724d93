"""OCI images end to end against real registries on this machine (Debian's docker-registry):
pull (OCI and Docker manifests, an index, gzip and zstd layers), basic and token auth with
credentials from a docker config written after the daemon started, plain HTTP only where
allowed, digest verification, one pull however many sandboxes ask, the image config, the
unpack rules attacked by hostile layers, and ls / inspect / rm / prune of the layer store."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

import imagefix as fx
import pytest

import corral
from corral.errors import (
    Conflict,
    DigestMismatch,
    ImageNotFound,
    ImagePullFailed,
    InvalidImage,
    RegistryUnauthorized,
    TooLarge,
)
from corral.sdk import admin

from conftest import CGROUP_NAME, private_daemon

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(p) for p in ("/usr/bin/docker-registry", "/usr/bin/skopeo",
                                        fx.BUSYBOX)),
    reason="needs docker-registry, skopeo and busybox-static (scripts/setup.sh)")

MAX_BYTES = 64 << 20
MAX_FILES = 20_000
CONFIG = {"Env": ["PATH=/bin", "GREETING=hello from the image"], "WorkingDir": "/home/app",
          "User": "app", "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo from-cmd"],
          "Labels": {"org.corral.test": "yes"}}


def app_layers() -> list[tuple[str, list[fx.Member]]]:
    top = [fx.d("etc", xattrs={"trusted.overlay.opaque": "y"}),  # honoured, it would hide
           fx.f("etc/.wh.gone"), fx.d("opt"), fx.d("opt/data"),    # the base's /etc
           fx.f("opt/data/.wh..wh..opq"), fx.f("opt/data/new", b"new data\n"),
           fx.link("opt/hl", "opt/data/new"), fx.sym("opt/outside", "/etc/passwd"),
           fx.chr_("opt/dev", 1, 3), fx.f("opt/suid", b"#!/bin/sh\n", 0o4755),
           fx.f("opt/sgid", b"#!/bin/sh\n", 0o2755), fx.d("opt/shared", 0o2775),
           fx.f("opt/attr", b"x", xattrs={"user.test": "kept",
                                          "security.capability": "forged",
                                          "trusted.overlay.redirect": "/etc"})]
    return [("gzip", fx.busybox_base()), ("gzip", top),
            ("zstd", [fx.d("opt"), fx.f("opt/z.txt", b"from a zstd layer\n")])]


@pytest.fixture(scope="module")
def layouts() -> dict[str, str]:
    base = fx.busybox_base()
    out = {"app": fx.oci_layout("app", app_layers(), CONFIG)}
    out["other"] = fx.oci_layout("other", [("gzip", base), ("gzip", [fx.f("other", b"1")])])
    out["solo"] = fx.oci_layout("solo", [("gzip", base), ("gzip", [fx.f("solo", b"1")])])
    out["corrupt"] = fx.oci_layout("corrupt", [("gzip", [fx.f("corrupt-base", b"b" * 4096)]),
                                               ("gzip", [fx.f("corrupt", b"c" * 4096)])])
    out["arm"] = fx.oci_layout("arm", [("gzip", [fx.f("arm", b"wrong platform")])])
    out["index"] = fx.index_layout("index", [("linux", "arm64", out["arm"]),
                                             ("linux", "amd64", out["other"])])
    out["dotdot"] = fx.oci_layout("dotdot", [("gzip", [fx.f("../../escape", b"x")])])
    out["symwrite"] = fx.oci_layout("symwrite", [("gzip", [
        fx.sym("evil", "/var/tmp/corral-img-target"), fx.f("evil/pwned", b"x")])])
    out["hardlink"] = fx.oci_layout("hardlink", [("gzip", [fx.link("shadow", "/etc/shadow")])])
    out["deep"] = fx.oci_layout("deep", [("gzip", [fx.f("d/" * 600 + "x", b"deep")])])
    out["huge"] = fx.oci_layout("huge", [("zstd", [fx.f("zeros", 200 << 20)])])
    out["many"] = fx.oci_layout("many", [("zstd", [fx.f(f"f{i}") for i in range(30_000)])])
    # the same layer twice (the same COPY in two steps), and more layers than are taken
    out["twice"] = fx.oci_layout("twice", [("gzip", base), ("gzip", [fx.f("mid", b"m")]),
                                           ("gzip", base)])
    out["tall"] = fx.oci_layout("tall", [("gzip", [fx.f(f"l{i}", b"x")]) for i in range(81)])
    return out


def host_ip() -> str | None:
    r = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                       capture_output=True, text=True)
    for line in r.stdout.splitlines():
        return line.split()[3].split("/")[0]
    return None


@pytest.fixture(scope="module")
def env(layouts: dict[str, str]) -> Iterator[dict]:
    ip = host_ip()
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(fx.registry())
        basic = stack.enter_context(fx.registry(auth="htpasswd"))
        token = stack.enter_context(fx.registry(auth="token"))
        far = stack.enter_context(fx.registry(host=ip)) if ip else None
        far_ok = stack.enter_context(fx.registry(host=ip)) if ip else None
        for repo in ("team/app", "team/app2"):
            plain.push(layouts["app"], repo)
        plain.push(layouts["other"], "team/other")
        plain.push(layouts["index"], "team/multi", "latest", "--all")
        plain.push(layouts["other"], "team/docker", "latest", "--format", "v2s2")
        for name in ("dotdot", "symwrite", "hardlink", "deep", "huge", "many", "tall"):
            plain.push(layouts[name], f"hostile/{name}")
        plain.push(layouts["twice"], "team/twice")
        basic.push(layouts["other"], "private/other")
        token.push(layouts["other"], "private/other")
        for r in (far, far_ok):
            if r is not None:
                r.push(layouts["other"], "team/other")
        dcfg = tempfile.mkdtemp(prefix="corral-dockercfg-", dir="/var/tmp")
        stack.callback(lambda: __import__("shutil").rmtree(dcfg, ignore_errors=True))
        d = stack.enter_context(private_daemon(
            "corral-img-", f"{CGROUP_NAME}-img", DOCKER_CONFIG=dcfg,
            CORRAL_IMAGE_MAX_BYTES=str(MAX_BYTES), CORRAL_IMAGE_MAX_FILES=str(MAX_FILES),
            CORRAL_INSECURE_REGISTRIES=far_ok.addr if far_ok else "",
            CORRAL_REGISTRIES=",".join(n for r in (plain, basic, token, far, far_ok)
                                       if r is not None for n in r.names)))
        yield {"plain": plain, "basic": basic, "token": token, "far": far, "far_ok": far_ok,
               "dcfg": dcfg, "daemon": d, "ep": f"unix://{d.socket_path}"}


def leftovers(state: str) -> list[str]:
    return os.listdir(os.path.join(state, "oci", "tmp"))


def layer_dirs(state: str) -> set[str]:
    return set(os.listdir(os.path.join(state, "oci", "layers")))


# ---- pull and run -------------------------------------------------------------------------
def test_pull_multilayer_image_and_run_it(env: dict) -> None:
    ref = f"{env['plain'].addr}/team/app:latest"
    events: list[dict] = []
    info = admin.pull_image(ref, progress=events.append, endpoint=env["ep"])
    assert info.kind == "oci" and info.name == ref and len(info.layers or []) == 3
    assert info.config and info.config["User"] == "app"
    assert events[0]["event"] == "resolved" and events[0]["layers"] == 3
    assert {e["state"] for e in events if e["event"] == "layer"} >= {"downloading", "done"}
    with corral.Sandbox(image=ref, endpoint=env["ep"]) as sb:
        r = sb.exec("cat /opt/data/new /opt/z.txt; test -e /opt/data/old && echo OPAQUE-BROKEN;"
                    " test -e /etc/gone && echo WHITEOUT-BROKEN; test -e /opt/dev && echo DEV;"
                    " stat -c '%i %h' /opt/hl /opt/data/new; readlink /opt/outside;"
                    " grep -c app /opt/outside; stat -c %a /opt/suid /opt/sgid /opt/shared;"
                    " id -un; pwd; echo $GREETING")
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[:2] == ["new data", "from a zstd layer"]
        assert "BROKEN" not in r.stdout and "DEV" not in lines
        (i1, n1), (i2, n2) = (x.split() for x in lines[2:4])
        assert i1 == i2 and n1 == n2 == "2"  # a hard link: one inode, two names
        # the absolute symlink resolves inside the sandbox: the image's passwd, not the host's
        assert lines[4] == "/etc/passwd" and lines[5] == "1"
        assert lines[6:9] == ["755", "755", "2775"]  # setuid/setgid off files, kept on a dir
        assert lines[9:] == ["app", "/home/app", "hello from the image"]
        assert sb.exec("id -u", user="root").stdout.strip() == "0"  # the call says otherwise


def test_forged_xattrs_are_dropped_user_xattrs_kept(env: dict) -> None:
    ref = f"{env['plain'].addr}/team/app:latest"
    info = admin.pull_image(ref, endpoint=env["ep"])
    state = env["daemon"].state_dir
    top = (info.layers or [])[1].split(":")[1]
    # the layer's mount, seen through the daemon's own mount namespace
    mnt = f"/proc/{env['daemon'].proc.pid}/root" + os.path.join(state, "oci", "m", top[:16])
    with corral.Sandbox(image=ref, endpoint=env["ep"]):  # mounted while in use
        names = os.listxattr(os.path.join(mnt, "opt", "attr"))
    assert "user.test" in names
    assert "security.capability" not in names
    assert not any(n.startswith("trusted.") for n in names)


def test_index_picks_linux_amd64_and_docker_manifests_pull(env: dict) -> None:
    for repo in ("team/multi", "team/docker"):
        ref = f"{env['plain'].addr}/{repo}:latest"
        with corral.Sandbox(image=ref, endpoint=env["ep"]) as sb:  # pulled on first use
            r = sb.exec("cat /other; test -e /arm && echo ARM")
            assert r.stdout == "1", (repo, r.stdout, r.stderr)


def test_many_sandboxes_asking_at_once_pull_once(env: dict) -> None:
    reg = env["plain"]
    ref = f"{reg.addr}/team/app2:latest"
    n = 6

    def make(_: int) -> corral.Sandbox:
        return corral.Sandbox(image=ref, endpoint=env["ep"])

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        boxes = list(pool.map(make, range(n)))
    try:
        for sb in boxes:
            assert sb.exec("cat /opt/z.txt").stdout == "from a zstd layer\n"
    finally:
        for sb in boxes:
            sb.kill()
    assert reg.requests("/v2/team/app2/manifests/latest") == 1
    # the layers were already in the node's store (team/app): not fetched again
    assert reg.requests("/v2/team/app2/blobs/sha256:") == 1  # the config only


# ---- auth and transport -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["basic", "token"])
def test_auth_credentials_read_at_pull_time(env: dict, kind: str) -> None:
    reg = env[kind]
    ref = f"{reg.addr}/private/other:latest"
    fx.docker_config(env["dcfg"], {})
    with pytest.raises(RegistryUnauthorized):
        admin.pull_image(ref, endpoint=env["ep"])
    fx.docker_config(env["dcfg"], {reg.addr: ("corral", "wrong")})
    with pytest.raises(RegistryUnauthorized):
        admin.pull_image(ref, endpoint=env["ep"])
    # a login after the daemon started counts
    fx.docker_config(env["dcfg"], {f"http://{reg.addr}/v1/": reg.creds})
    try:
        assert admin.pull_image(ref, endpoint=env["ep"]).kind == "oci"
        with corral.Sandbox(image=ref, endpoint=env["ep"]) as sb:
            assert sb.exec("cat /other").stdout == "1"
    finally:
        fx.docker_config(env["dcfg"], {})
        admin.remove_image(ref, endpoint=env["ep"])


def test_plain_http_only_for_loopback_or_configured_registries(env: dict) -> None:
    if env["far"] is None:
        pytest.skip("no non-loopback address on this machine")
    with pytest.raises(ImagePullFailed) as e:
        admin.pull_image(f"{env['far'].addr}/team/other", endpoint=env["ep"])
    assert "plain HTTP" in e.value.message
    ok = admin.pull_image(f"{env['far_ok'].addr}/team/other", endpoint=env["ep"])
    assert ok.kind == "oci"
    admin.remove_image(ok.name, endpoint=env["ep"])


def test_only_allowed_registries_and_bare_names_stay_local(env: dict) -> None:
    with pytest.raises(corral.errors.Forbidden):  # not in CORRAL_REGISTRIES: never contacted
        admin.pull_image("registry.invalid.example:5000/x/y:1", endpoint=env["ep"])
    with pytest.raises(ImageNotFound) as e:  # a bare name is a local image, never pulled
        corral.Sandbox(image="no-such-local-image", endpoint=env["ep"])
    assert "docker.io/library/NAME:TAG" in e.value.message


def test_unknown_image_and_bad_references(env: dict) -> None:
    with pytest.raises(ImageNotFound):
        admin.pull_image(f"{env['plain'].addr}/team/nope:latest", endpoint=env["ep"])
    with pytest.raises(corral.InvalidRequest):
        admin.pull_image("UPPER/Case::x", endpoint=env["ep"])
    with pytest.raises(ImageNotFound):
        admin.image_info(f"{env['plain'].addr}/team/never:1", endpoint=env["ep"])


def test_a_blob_that_does_not_match_its_digest_is_rejected(env: dict, layouts: dict) -> None:
    reg = env["plain"]
    reg.push(layouts["corrupt"], "team/corrupt")
    import json

    with open(os.path.join(layouts["corrupt"], "index.json")) as fh:
        man_digest = json.load(fh)["manifests"][0]["digest"]
    with open(os.path.join(layouts["corrupt"], "blobs", "sha256", man_digest[7:])) as fh:
        top = json.load(fh)["layers"][-1]
    # the registry's own copy of the top layer, corrupted in place (same size)
    path = reg.blob_path(top["digest"])
    with open(path, "r+b") as fh:
        data = bytearray(fh.read())
        data[len(data) // 2] ^= 0xFF
        fh.seek(0)
        fh.write(data)
    state = env["daemon"].state_dir
    before = layer_dirs(state)
    with pytest.raises(DigestMismatch):
        admin.pull_image(f"{reg.addr}/team/corrupt", endpoint=env["ep"])
    # neither the bad layer nor the good one under it stays: nothing half-imported
    assert layer_dirs(state) == before
    assert leftovers(state) == []
    assert all(i.name != f"{reg.addr}/team/corrupt:latest"
               for i in admin.images(endpoint=env["ep"]))


# ---- hostile layers -----------------------------------------------------------------------
@pytest.mark.parametrize("name,error", [
    ("dotdot", InvalidImage), ("symwrite", InvalidImage), ("hardlink", InvalidImage),
    ("deep", InvalidImage), ("huge", TooLarge), ("many", TooLarge)])
def test_hostile_layer_is_refused_and_leaves_nothing(env: dict, name: str, error: type) -> None:
    state = env["daemon"].state_dir
    before = layer_dirs(state)
    target = "/var/tmp/corral-img-target"
    os.makedirs(target, exist_ok=True)
    try:
        with pytest.raises(error) as e:
            corral.Sandbox(image=f"{env['plain'].addr}/hostile/{name}", endpoint=env["ep"])
        assert os.listdir(target) == []  # nothing written through the symlink
        if error is TooLarge:
            assert e.value.details["limit"] == "image_max_bytes"
    finally:
        os.rmdir(target)
    assert layer_dirs(state) == before
    assert leftovers(state) == []
    assert not os.path.exists(os.path.join(os.path.dirname(state), "escape"))


def test_an_image_of_more_layers_than_taken_is_refused_before_any_is_fetched(env: dict) -> None:
    """Each layer of an image is a mount of the daemon's for as long as it runs: 2,500 layers
    were all mounted before the create found their overlay too long for the kernel."""
    state = env["daemon"].state_dir
    before = layer_dirs(state)
    with pytest.raises(InvalidImage) as e:
        admin.pull_image(f"{env['plain'].addr}/hostile/tall", endpoint=env["ep"])
    assert e.value.details == {"limit": "image_layers", "max": 80, "layers": 81}
    assert layer_dirs(state) == before and leftovers(state) == []


def test_an_image_listing_a_layer_twice_runs(env: dict) -> None:
    """Overlay refuses a lower twice: every create of such an image was ``internal``."""
    ref = f"{env['plain'].addr}/team/twice"
    img = admin.pull_image(ref, endpoint=env["ep"])
    assert len(img.layers or []) == 3 and len(set(img.layers or [])) == 2
    with corral.Sandbox(image=ref, endpoint=env["ep"]) as sb:
        r = sb.exec("cat /mid && ls /bin/sh")
        assert (r.exit_code, r.stdout) == (0, "m/bin/sh\n"), r


# ---- the store ----------------------------------------------------------------------------
def test_ls_inspect_rm_and_prune_share_layers(env: dict, layouts: dict) -> None:
    reg, ep, state = env["plain"], env["ep"], env["daemon"].state_dir
    reg.push(layouts["solo"], "team/solo")
    a = admin.pull_image(f"{reg.addr}/team/solo", endpoint=ep)
    b = admin.pull_image(f"{reg.addr}/team/app", endpoint=ep)
    shared = set(a.layers or []) & set(b.layers or [])
    assert len(shared) == 1  # the busybox base: stored once
    names = {i.name for i in admin.images(endpoint=ep)}
    assert {a.name, b.name} <= names
    got = admin.image_info(f"{reg.addr}/team/app", endpoint=ep)  # the short spelling
    assert got.digest == b.digest and got.config == b.config
    with corral.Sandbox(image=a.name, endpoint=ep):
        with pytest.raises(Conflict):
            admin.remove_image(a.name, endpoint=ep)
    gone = admin.remove_image(a.name, endpoint=ep)
    only_a = {x[7:] for x in set(a.layers or []) - shared}
    assert {x[7:] for x in gone["layers_removed"]} == only_a
    have = layer_dirs(state)
    assert not only_a & have and {x[7:] for x in shared} <= have
    with pytest.raises(ImageNotFound):
        admin.image_info(a.name, endpoint=ep)
    assert admin.prune_images(endpoint=ep).layers_removed == []


# ---- composing layers at create time ------------------------------------------------------
def test_compose_base_toolkit_and_workspace(env: dict) -> None:
    reg, ep, state = env["plain"], env["ep"], env["daemon"].state_dir
    work = tempfile.mkdtemp(prefix="corral-workspace-", dir="/var/tmp")
    try:
        os.makedirs(os.path.join(work, "src"))
        with open(os.path.join(work, "src", "task.py"), "w") as fh:
            fh.write("print('task')\n")
        layers = [corral.Layer.from_image(f"{reg.addr}/team/other", at="/opt/tools"),
                  corral.Layer.from_dir(work, at="/workspace")]
        base = f"{reg.addr}/team/app"
        with corral.Sandbox(image=base, layers=layers, endpoint=ep) as a:
            before = layer_dirs(state)
            with corral.Sandbox(image=base, layers=layers, endpoint=ep) as b:
                assert layer_dirs(state) == before  # the workspace is stored once
                r = b.exec("cat /opt/tools/other /workspace/src/task.py /opt/z.txt")
                assert r.stdout == "1print('task')\nfrom a zstd layer\n", r.stderr
            # copy-on-write: a sandbox's writes reach neither the source dir nor its peers
            assert a.exec("echo changed > /workspace/src/task.py; echo x > /opt/tools/new",
                          user="root").exit_code == 0
            with corral.Sandbox(image=base, layers=layers, endpoint=ep) as c:
                assert c.exec("cat /workspace/src/task.py").stdout == "print('task')\n"
                assert c.exec("test -e /opt/tools/new").exit_code == 1
        with open(os.path.join(work, "src", "task.py")) as fh:
            assert fh.read() == "print('task')\n"
        # a changed workspace is a new layer
        with open(os.path.join(work, "src", "task.py"), "w") as fh:
            fh.write("print('v2')\n")
        with corral.Sandbox(image=base, layers=layers, endpoint=ep) as d:
            assert d.exec("cat /workspace/src/task.py").stdout == "print('v2')\n"
    finally:
        __import__("shutil").rmtree(work, ignore_errors=True)
    with pytest.raises(corral.InvalidRequest):
        corral.Layer.from_dir(work, at="/proc/x")


# ---- import from files, the CLI -----------------------------------------------------------
def test_import_oci_layout_dir_tar_and_docker_save(env: dict, layouts: dict) -> None:
    ep = env["ep"]
    tmp = tempfile.mkdtemp(prefix="corral-imgimport-", dir="/var/tmp")
    try:
        oci_tar = os.path.join(tmp, "layout.tar")
        subprocess.run(["tar", "-C", layouts["app"], "-cf", oci_tar, "."], check=True)
        docker_tar = os.path.join(tmp, "saved.tar")
        subprocess.run(["skopeo", "copy", "--quiet", "--insecure-policy",
                        f"oci:{layouts['other']}:latest",
                        f"docker-archive:{docker_tar}:team/other:v1"], check=True,
                       capture_output=True, env={**os.environ, "HOME": tmp})
        cases = [("imp-oci-dir", layouts["app"], "cat /opt/z.txt", "from a zstd layer\n"),
                 ("imp-oci-tar", oci_tar, "cat /opt/data/new", "new data\n"),
                 ("imp-docker", docker_tar, "cat /other", "1")]
        for name, src, cmd, want in cases:
            info = admin.import_image(name, src, endpoint=ep)
            assert info.kind == "oci" and info.layers, name
            with corral.Sandbox(image=name, endpoint=ep) as sb:
                assert sb.exec(cmd).stdout == want, name
            if name != "imp-docker":
                assert info.config and info.config["User"] == "app"
        # a layout with a corrupted blob is refused whole
        bad = os.path.join(tmp, "bad")
        subprocess.run(["cp", "-a", layouts["corrupt"], bad], check=True)
        blobs = os.path.join(bad, "blobs", "sha256")
        with open(os.path.join(bad, "index.json")) as fh:
            man = __import__("json").load(fh)["manifests"][0]["digest"][7:]
        with open(os.path.join(blobs, man)) as fh:
            layer = __import__("json").load(fh)["layers"][0]["digest"][7:]
        with open(os.path.join(blobs, layer), "r+b") as fh:
            fh.seek(20)
            fh.write(b"\xff\xff")
        with pytest.raises((DigestMismatch, InvalidImage)):
            admin.import_image("imp-bad", bad, endpoint=ep)
        assert leftovers(env["daemon"].state_dir) == []
        with pytest.raises(ImageNotFound):
            admin.image_info("imp-bad", endpoint=ep)
    finally:
        for name in ("imp-oci-dir", "imp-oci-tar", "imp-docker"):
            with contextlib.suppress(ImageNotFound):
                admin.remove_image(name, endpoint=ep)
        __import__("shutil").rmtree(tmp, ignore_errors=True)


def cli(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run([sys.executable, "-m", "corral.cli", *args], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "CORRAL_SOCKET": env["daemon"].socket_path,
                               "CORRAL_AUTOSTART": "0", "COLUMNS": "200"})


def test_cli_pull_inspect_run_default_command_rm(env: dict) -> None:
    ref = f"{env['plain'].addr}/team/app:latest"
    with contextlib.suppress(ImageNotFound):
        admin.remove_image(ref, endpoint=env["ep"])
    r = cli(env, "image", "pull", ref)
    assert r.returncode == 0, r.stderr
    assert "3 layers" in r.stderr and "pulled " + ref in r.stdout
    assert "done" in r.stderr or "cached" in r.stderr
    r = cli(env, "image", "inspect", ref)
    assert r.returncode == 0 and "org.corral.test" in r.stdout and "/home/app" in r.stdout
    assert ref in cli(env, "image", "ls").stdout
    r = cli(env, "run", "--image", ref)  # no command: Entrypoint + Cmd, as the image's User
    assert (r.returncode, r.stdout) == (0, "from-cmd\n"), r.stderr
    r = cli(env, "run", "--image", ref, "--", "id -un; pwd")
    assert r.stdout == "app\n/home/app\n", r.stderr
    r = cli(env, "image", "rm", ref)
    assert r.returncode == 0 and "removed" in r.stdout, r.stderr
    assert cli(env, "image", "inspect", ref).returncode != 0


def test_snapshot_fork_restore_of_an_image_sandbox(env: dict) -> None:
    ref = f"{env['plain'].addr}/team/app:latest"
    with corral.Sandbox(image=ref, endpoint=env["ep"]) as sb:
        sb.exec("echo one > /home/app/state")
        snap = sb.snapshot()
        kids = sb.fork(2)
        try:
            for k in kids:
                assert k.exec("cat /home/app/state /opt/z.txt").stdout == \
                    "one\nfrom a zstd layer\n"
        finally:
            for k in kids:
                k.kill()
        sb.exec("rm /home/app/state")
        sb.restore(snap)
        assert sb.exec("cat /home/app/state; id -un").stdout == "one\napp\n"
        with corral.Sandbox(snapshot=snap, endpoint=env["ep"]) as again:
            assert again.exec("cat /home/app/state").stdout == "one\n"
        with pytest.raises(Conflict):  # the snapshot holds the image
            admin.remove_image(ref, endpoint=env["ep"])
        snap.delete()


@pytest.mark.parametrize("kill9", [False, True])
def test_image_sandboxes_across_a_daemon_restart(env: dict, kill9: bool) -> None:
    ref = f"{env['plain'].addr}/team/app:latest"
    d, ep = env["daemon"], env["ep"]
    sb = corral.Sandbox(image=ref, endpoint=ep)
    try:
        # a graceful stop ends the sandboxes and unmounts the layers; a kill leaves both,
        # and the next daemon re-adopts the sandbox and reuses the mounts
        d.restart(kill9=kill9)
        if kill9:
            assert sb.exec("cat /opt/z.txt").stdout == "from a zstd layer\n"
        else:
            with pytest.raises(corral.DaemonRestarted):
                sb.exec("true")
        with corral.Sandbox(image=ref, endpoint=ep) as again:
            assert again.exec("cat /opt/data/new").stdout == "new data\n"
    finally:
        sb.kill()
