"""Commits, builds and pushes of OCI images against a real registry on this machine
(Debian's docker-registry): a sandbox's changes become a layer usable at once; the commit
applies the unpack rules to what the sandbox made (no setuid bit, no device survives); a
build runs each RUN / COPY step in a real sandbox, caches every step, and a failing step
leaves no image; a push writes tar layers a fresh node pulls back and runs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import imagefix as fx
import pytest

import corral
from corral.errors import (
    BuildFailed,
    Conflict,
    ImageNotFound,
    InvalidImage,
    RegistryUnauthorized,
    SandboxNotFound,
    Unsupported,
)
from corral.sdk import Endpoint, admin, dockerfile

from conftest import CGROUP_NAME, private_daemon

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(p) for p in ("/usr/bin/docker-registry", "/usr/bin/skopeo",
                                        fx.BUSYBOX)),
    reason="needs docker-registry, skopeo and busybox-static (scripts/setup.sh)")

CONFIG = {"Env": ["PATH=/bin", "GREETING=base"], "WorkingDir": "/home/app", "User": "app",
          "Cmd": ["echo", "from-base"]}


@pytest.fixture(scope="module")
def env() -> Iterator[dict]:
    base = fx.oci_layout("buildbase", [("gzip", fx.busybox_base()),
                                       ("gzip", [fx.d("opt"), fx.f("opt/base.txt", b"b\n")])],
                        CONFIG)
    with contextlib.ExitStack() as stack:
        reg = stack.enter_context(fx.registry())
        basic = stack.enter_context(fx.registry(auth="htpasswd"))
        reg.push(base, "team/base")
        dcfg = tempfile.mkdtemp(prefix="corral-dockercfg-", dir="/var/tmp")
        stack.callback(shutil.rmtree, dcfg, True)
        d = stack.enter_context(private_daemon("corral-imgb-", f"{CGROUP_NAME}-imgb",
                                               CORRAL_REGISTRIES=f"{reg.addr},{basic.addr}",
                                               DOCKER_CONFIG=dcfg))
        ep = f"unix://{d.socket_path}"
        admin.pull_image(f"{reg.addr}/team/base:latest", endpoint=ep)
        yield {"reg": reg, "basic": basic, "dcfg": dcfg, "daemon": d, "ep": ep,
               "base": f"{reg.addr}/team/base:latest"}


def _rm(ep: str, *names: str) -> None:
    for n in names:
        with contextlib.suppress(ImageNotFound):
            admin.remove_image(n, endpoint=ep)


# ---- commit -------------------------------------------------------------------------------
def test_commit_makes_an_image_usable_at_once(env: dict) -> None:
    ep = env["ep"]
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            r = sb.exec("echo changed > /home/app/state; rm /opt/base.txt; mkdir -p /opt/new;"
                        " echo n > /opt/new/f", user="root")
            assert r.exit_code == 0, r.stderr
            changes = {"Env": ["GREETING=committed"], "Cmd": ["cat", "/opt/new/f"]}
            info = sb.commit("committed", config=changes)
            base = admin.image_info(env["base"], endpoint=ep)
            assert info.kind == "oci" and info.layers[:2] == base.layers
            assert len(info.layers) == 3
            with pytest.raises(Conflict):  # a name is not taken twice unless asked
                sb.commit("committed")
            assert len(sb.commit("committed", config=changes, replace=True).layers) == 3
        with corral.Sandbox(image="committed", endpoint=ep) as again:
            r = again.exec("cat /home/app/state; test -e /opt/base.txt && echo WHITEOUT-LOST;"
                           " cat /opt/new/f; id -un; pwd; echo $GREETING")
            assert r.stdout == "changed\nn\napp\n/home/app\ncommitted\n", r.stderr
        assert admin.image_info("committed", endpoint=ep).config["Cmd"] == ["cat", "/opt/new/f"]
        with pytest.raises(Conflict):  # an existing name, not replaced unless asked
            admin.tag_image("committed", "committed", endpoint=ep)
    finally:
        _rm(ep, "committed")


def test_two_commits_to_one_new_name_at_once_one_wins(env: dict) -> None:
    """Both commits pass the early name check; the second to record is refused, not a
    silent overwrite of the first (eight rounds, so the two overlap in most of them)."""
    ep = env["ep"]
    with corral.Sandbox(image=env["base"], endpoint=ep) as a, \
            corral.Sandbox(image=env["base"], endpoint=ep) as b, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        a.exec("echo a > /home/app/who").check()
        b.exec("echo b > /home/app/who").check()
        for i in range(8):
            name = f"contested-{i}"
            try:
                futs = [pool.submit(sb.commit, name) for sb in (a, b)]
                outcomes = []
                for f in futs:
                    try:
                        outcomes.append(f.result(timeout=120).layers)
                    except Conflict:
                        outcomes.append(None)
                won = [x for x in outcomes if x is not None]
                assert len(won) == 1, outcomes
                assert admin.image_info(name, endpoint=ep).layers == won[0]
            finally:
                _rm(ep, name)


def test_commit_of_a_snapshot_chain_and_bad_requests(env: dict) -> None:
    ep = env["ep"]
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("echo one > /home/app/one")
            snap = sb.snapshot()
        with corral.Sandbox(snapshot=snap, endpoint=ep) as kid:
            kid.exec("echo two > /home/app/two")
            info = kid.commit("chained")
            with pytest.raises(corral.InvalidRequest):
                kid.commit("Bad Name!")
            with pytest.raises(Conflict):
                kid.commit("host")
        snap.delete()
        with corral.Sandbox(image="chained", endpoint=ep) as c:
            assert c.exec("cat /home/app/one /home/app/two").stdout == "one\ntwo\n"
        assert len(info.layers or []) == 4  # base 2 + the snapshot's + the commit's
        sbx = corral.Sandbox(image="host", endpoint=ep)
        try:
            with pytest.raises(Unsupported):  # the host's files are not layers
                sbx.commit("from-host")
        finally:
            sbx.kill()
        from corral.sdk import api
        from corral.sdk.sync_transport import transport

        with pytest.raises(SandboxNotFound):
            transport(Endpoint.parse(ep)).call(api.commit("sb-nosuch", "x"))
    finally:
        _rm(ep, "chained")


def test_commit_clears_setuid_and_drops_what_the_sandbox_made_privileged(env: dict) -> None:
    """Attack: root in a sandbox makes a setuid-root shell, a setgid file, and tries a device
    node; the committed image carries none of it."""
    ep = env["ep"]
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            r = sb.exec("cp /bin/busybox /opt/rootsh && chmod 4755 /opt/rootsh &&"
                        " echo x > /opt/g && chmod 2755 /opt/g && mkdir /opt/sg &&"
                        " chmod 2775 /opt/sg; mknod /opt/mem c 1 1 2>/dev/null;"
                        " stat -c %a /opt/rootsh", user="root")
            assert r.stdout.strip().endswith("4755"), (r.stdout, r.stderr)
            sb.commit("suid-attempt")
        with corral.Sandbox(image="suid-attempt", endpoint=ep) as c:
            r = c.exec("stat -c %a /opt/rootsh /opt/g /opt/sg; test -e /opt/mem && echo DEV")
            assert r.stdout.split() == ["755", "755", "2775"], r.stdout
    finally:
        _rm(ep, "suid-attempt")


# ---- builds -------------------------------------------------------------------------------
def test_python_builder_runs_steps_in_sandboxes_and_caches_them(env: dict) -> None:
    ep = env["ep"]
    ctx = tempfile.mkdtemp(prefix="corral-build-", dir="/var/tmp")
    try:
        os.makedirs(os.path.join(ctx, "src"))
        with open(os.path.join(ctx, "src", "main.sh"), "w") as fh:
            fh.write("echo main $MODE\n")
        recipe = (corral.Image.from_registry(env["base"])
                  .run_commands("echo $GREETING > /home/app/built; id -un >> /home/app/built")
                  .env({"MODE": "test"})
                  .copy_local_dir(os.path.join(ctx, "src"), "/srv/app")
                  .workdir("/srv/app")
                  .cmd(["sh", "main.sh"]))
        cold = recipe.build("built", endpoint=ep)
        assert not any(s.cached for s in cold.steps)
        with corral.Sandbox(image="built", endpoint=ep) as sb:
            r = sb.exec("cat /home/app/built; pwd; sh main.sh")
            assert r.stdout == "base\napp\n/srv/app\nmain test\n", r.stderr
        warm = recipe.build("built", endpoint=ep)
        assert warm.cached and warm.seconds < 1.0, warm
        # a changed COPY source invalidates its step and those after it, not those before
        with open(os.path.join(ctx, "src", "main.sh"), "w") as fh:
            fh.write("echo v2\n")
        third = recipe.build("built", endpoint=ep)
        assert [s.cached for s in third.steps] == [True, True, False, False, False]
        with corral.Sandbox(image="built", endpoint=ep) as sb:
            assert sb.exec("sh main.sh").stdout == "v2\n"
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
        _rm(ep, "built")


def test_two_builds_of_one_recipe_at_once_both_succeed(env: dict) -> None:
    """Both builders miss the cache for the same step (a barrier holds each until the other
    has missed too) and run it; the second commit of that content-named step is the
    first one's result, not a conflict."""
    ep = env["ep"]
    recipe = (corral.Image.from_registry(env["base"])
              .run_commands(f"echo raced-{time.time_ns()} > /home/app/r")
              .env({"RACED": "1"}))
    both_missed = threading.Barrier(2)

    def output(line: str) -> None:
        if line.startswith("[1/") and not line.endswith("(cached)"):
            both_missed.wait(timeout=60)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(recipe.build, name, endpoint=ep, output=output)
                for name in ("raced-a", "raced-b")]
        a, b = (f.result(timeout=300) for f in futs)
    try:
        assert not a.steps[0].cached and not b.steps[0].cached
        assert a.steps[-1].image == b.steps[-1].image
        with corral.Sandbox(image="raced-b", endpoint=ep) as sb:
            assert sb.exec("cat /home/app/r; echo $RACED").stdout.startswith("raced-")
    finally:
        _rm(ep, "raced-a", "raced-b")


def test_a_failing_step_shows_its_output_and_leaves_no_image(env: dict) -> None:
    ep = env["ep"]
    before = {i.name for i in admin.images(endpoint=ep)}
    recipe = corral.Image.from_registry(env["base"]).run_commands(
        "echo partial > /home/app/p; echo boom >&2; exit 3")
    with pytest.raises(BuildFailed) as e:
        recipe.build("never", endpoint=ep)
    assert e.value.details["exit_code"] == 3 and "boom" in e.value.details["stderr"]
    assert {i.name for i in admin.images(endpoint=ep)} == before


def test_dockerfile_build_and_unsupported_instructions(env: dict) -> None:
    ep = env["ep"]
    ctx = tempfile.mkdtemp(prefix="corral-dockerfile-", dir="/var/tmp")
    try:
        with open(os.path.join(ctx, "hello.txt"), "w") as fh:
            fh.write("hello\n")
        text = (f"ARG BASE={env['base']}\nFROM $BASE\n# a comment\nARG WHO=world\n"
                "ENV A=1 \\\n    B=two\nUSER root\nRUN echo \"$WHO $A $B\" > /greet\n"
                "WORKDIR /data\nCOPY hello.txt ./\nRUN [\"cat\", \"/data/hello.txt\"]\n"
                "LABEL org.example=yes\nUSER app\nEXPOSE 8080\n"
                "ENTRYPOINT [\"/bin/sh\", \"-c\"]\nCMD [\"cat /greet\"]\n")
        recipe = dockerfile.parse(text, ctx, {"WHO": "corral"})
        t0 = time.monotonic()
        res = recipe.build("fromdocker", endpoint=ep)
        assert time.monotonic() - t0 < 120
        info = res.image
        assert info.config["User"] == "app" and info.config["WorkingDir"] == "/data"
        assert info.config["Labels"]["org.example"] == "yes"
        assert info.config["ExposedPorts"] == ["8080/tcp"]
        with corral.Sandbox(image="fromdocker", endpoint=ep) as sb:
            r = sb.exec("cat /greet /data/hello.txt; id -un; pwd")
            assert r.stdout == "corral 1 two\nhello\napp\n/data\n", r.stderr
        assert recipe.build("fromdocker", endpoint=ep).cached
        for bad in ("FROM x\nVOLUME /v\n", "FROM x\nCOPY --chmod=755 b c\n",
                    "FROM x AS 1bad\n", "FROM x\nADD --from=x b c\n",
                    "FROM x\nADD http://example.com/a /a\n", "RUN true\n"):
            with pytest.raises(BuildFailed):
                dockerfile.parse(bad, ctx)
        with pytest.raises(corral.InvalidRequest):  # a COPY source outside the context
            dockerfile.parse(f"FROM {env['base']}\nCOPY ../../etc/passwd /p\n", ctx).build(
                "escape", endpoint=ep)
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
        _rm(ep, "fromdocker")


# ---- multi-stage --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stages(env: dict) -> Iterator[dict]:
    """A slim image (busybox, no /opt/base.txt) to copy into, and a tools image in the
    registry that no build has pulled yet."""
    reg = env["reg"]
    slim = fx.oci_layout("buildslim", [("gzip", fx.busybox_base()),
                                       ("gzip", [fx.sym("bin/chown", "busybox")])],
                         {"Env": ["PATH=/bin"]})
    tools = fx.oci_layout("buildtools", [("gzip", [fx.d("opt"), fx.d("opt/tools"),
                                                   fx.f("opt/tools/tool.sh", b"echo tool\n",
                                                        0o755),
                                                   fx.d("opt/tools/lib"),
                                                   fx.f("opt/tools/lib/x", b"x\n")])])
    reg.push(slim, "team/slim")
    reg.push(tools, "team/tools")
    yield {"slim": f"{reg.addr}/team/slim:latest", "tools": f"{reg.addr}/team/tools:latest"}


def _two_stage(env: dict, stages: dict) -> str:
    return (f"ARG BASE={env['base']}\nFROM $BASE AS build\nARG V=one\nUSER root\n"
            "RUN mkdir -p /src/out && echo compiled-$V > /src/out/app && echo junk > /src/junk"
            " && chmod 755 /src/out/app\n"
            "FROM build AS test\nRUN echo tested > /src/tested\n"
            f"FROM {stages['slim']}\nRUN echo slim > /slim\n"
            "COPY --from=build --chown=app:app /src/out/ /usr/local/bin/\n"
            "COPY --from=0 /src/out/app /opt/app-copy\n"
            f"COPY --from={stages['tools']} /opt/tools/*.sh /opt/tools/lib /opt/\n"
            "CMD [\"cat\", \"/usr/local/bin/app\"]\n")


def test_multi_stage_build_takes_only_the_copied_files(env: dict, stages: dict) -> None:
    """Stage 1 builds a file with RUN; the slim last stage copies it (and files of a
    registry image, pulled on demand) and has nothing else of stage 1; the ``test`` stage
    the last one does not need is not built; a rebuild runs no sandbox."""
    ep = env["ep"]
    try:
        recipe = dockerfile.parse(_two_stage(env, stages), "/nonexistent-context")
        res = recipe.build("twostage", endpoint=ep)
        assert not any("tested" in s.step for s in res.steps), res.steps
        assert [s.step.split(":")[0] for s in res.steps][:3] == ["RUN echo slim > /slim",
                                                                  "build", "build"]
        with corral.Sandbox(image="twostage", endpoint=ep, cwd="/") as sb:
            r = sb.exec("cat /usr/local/bin/app /opt/app-copy /slim; stat -c '%U %a' "
                        "/usr/local/bin/app /opt/app-copy; sh /opt/tool.sh; ls /opt;"
                        " test -e /src && echo STAGE1-LEAKED; test -e /opt/base.txt &&"
                        " echo BASE-LEAKED")
            assert r.stdout == ("compiled-one\ncompiled-one\nslim\napp 755\nroot 755\n"
                                "tool\napp-copy\ndata\ntool.sh\nx\n"), r.stderr
        info = admin.image_info("twostage", endpoint=ep)
        slim = admin.image_info(stages["slim"], endpoint=ep)
        built = admin.image_info(res.steps[2].image, endpoint=ep)  # the end of stage 1
        assert info.layers is not None and slim.layers is not None
        assert info.layers[:2] == slim.layers and len(info.layers) == 2 + 4
        assert not set(built.layers or []) & set(info.layers[2:])  # no layer of stage 1
        assert info.config["Cmd"] == ["cat", "/usr/local/bin/app"]
        warm = [recipe.build("twostage", endpoint=ep) for _ in range(3)]
        assert all(w.cached and len(w.steps) == len(res.steps) for w in warm), warm
        assert min(w.seconds for w in warm) < 1.0, warm  # lookups only (the best of 3)
    finally:
        _rm(ep, "twostage")


def test_multi_stage_cache_follows_the_source_stage(env: dict, stages: dict) -> None:
    """A change in stage 1 rebuilds it and every COPY --from of it; the steps before the
    first such COPY stay cached."""
    ep = env["ep"]
    text = _two_stage(env, stages)
    try:
        dockerfile.parse(text, "/", {"V": "one"}).build("msc", endpoint=ep)
        again = dockerfile.parse(text, "/", {"V": "two"}).build("msc", endpoint=ep)
        assert [(s.step.split()[0], s.cached) for s in again.steps] == [
            ("RUN", True), ("build:", True), ("build:", False), ("COPY", False),
            ("COPY", False), ("COPY", False), ("CONFIG", False)]
        with corral.Sandbox(image="msc", endpoint=ep, cwd="/") as sb:
            assert sb.exec("cat /usr/local/bin/app /opt/app-copy").stdout == \
                "compiled-two\ncompiled-two\n"
    finally:
        _rm(ep, "msc")


def test_multi_stage_target_and_a_stage_as_a_base(env: dict, stages: dict) -> None:
    ep = env["ep"]
    try:
        text = _two_stage(env, stages) + "FROM build AS broken\nRUN exit 7\n"
        with pytest.raises(BuildFailed):  # the last stage is the default target
            dockerfile.parse(text, "/").build("never-built", endpoint=ep)
        recipe = dockerfile.parse(text, "/", target="test")
        with tempfile.TemporaryDirectory(dir="/var/tmp") as ctx:
            with open(os.path.join(ctx, "Dockerfile"), "w") as fh:
                fh.write(text)
            same = corral.Image.from_dockerfile(os.path.join(ctx, "Dockerfile"), target="test")
        assert [x.describe() for x in same.steps] == [x.describe() for x in recipe.steps]
        res = recipe.build("mstarget", endpoint=ep)
        assert len(res.steps) == 3 and not any(s.step.startswith("COPY") for s in res.steps)
        with corral.Sandbox(image="mstarget", endpoint=ep, cwd="/") as sb:
            r = sb.exec("cat /src/out/app /src/junk /src/tested; id -un")
            assert r.stdout == "compiled-one\njunk\ntested\nroot\n", r.stderr
        # a name that is no stage: an image the daemon has
        res = dockerfile.parse(f"FROM {stages['slim']}\nCOPY --from=mstarget /src/junk /j\n",
                               "/").build("mslocal", endpoint=ep)
        with corral.Sandbox(image="mslocal", endpoint=ep, cwd="/") as sb:
            assert sb.exec("cat /j").stdout == "junk\n"
        # the Python builder: a recipe copies out of another recipe
        build = (corral.Image.from_registry(env["base"])
                 .run_commands("mkdir -p /home/app/o && echo py > /home/app/o/f")).named("b")
        final = corral.Image.from_registry(stages["slim"]).copy_from(build, "/home/app/o/f",
                                                                     "/srv/got")
        assert final.build("mspy", endpoint=ep).steps[0].step.startswith("b: RUN")
        with corral.Sandbox(image="mspy", endpoint=ep, cwd="/") as sb:
            assert sb.exec("cat /srv/got").stdout == "py\n"
    finally:
        _rm(ep, "mslocal", "mstarget", "mspy", "never-built")


def test_copy_from_an_image_without_a_digest_is_keyed_by_its_bytes(env: dict,
                                                                    stages: dict) -> None:
    """A rootfs image has no content digest: a COPY --from of it is keyed by the bytes it
    copies, so a new tree under the same name is not taken from the cache."""
    ep = env["ep"]
    root = tempfile.mkdtemp(prefix="corral-msroot-", dir="/var/tmp")
    text = f"FROM {stages['slim']}\nCOPY --from=msroot /data/v /v\n"
    try:
        os.makedirs(os.path.join(root, "data"))
        for version in ("1", "2"):
            with open(os.path.join(root, "data", "v"), "w") as fh:
                fh.write(version)
            _rm(ep, "msroot")
            admin.import_image("msroot", root, endpoint=ep)
            res = dockerfile.parse(text, "/").build("msrootb", endpoint=ep)
            assert not res.steps[0].cached
            with corral.Sandbox(image="msrootb", endpoint=ep, cwd="/") as sb:
                assert sb.exec("cat /v").stdout == version
        assert dockerfile.parse(text, "/").build("msrootb", endpoint=ep).cached
    finally:
        shutil.rmtree(root, ignore_errors=True)
        _rm(ep, "msrootb", "msroot")


def test_copy_from_reads_only_the_source_stages_own_files(env: dict, stages: dict) -> None:
    """Attack: stage 1 plants symlinks that climb out of its root and into /proc, and the
    last stage copies through them; what arrives is stage 1's own files (or a refusal),
    never the host's."""
    ep = env["ep"]
    marker = f"host-only-{time.time_ns()}"
    host_file = tempfile.NamedTemporaryFile("w", prefix="corral-mshost-", dir="/var/tmp",
                                            delete=False)
    host_file.write(marker)
    host_file.close()
    name = os.path.basename(host_file.name)
    stage = (f"FROM {env['base']} AS evil\nUSER root\n"
             "RUN ln -s ../../../../../../../../ /up && ln -s /proc/1/root /pr &&"
             f" ln -s /proc/self/cwd /cwd && mkdir -p /var/tmp &&"
             f" echo stage-own > /var/tmp/{name}\nFROM {stages['slim']}\n")
    try:
        for via in ("/up", "/pr", "/cwd/var/..", "/up/proc/1/root"):
            try:
                dockerfile.parse(stage + f"COPY --from=evil {via}/var/tmp/{name} /got\n",
                                 "/").build("msevil", endpoint=ep)
            except BuildFailed as e:  # refused (a /proc link) is fine; a leak is not
                assert e.details["reason"] in ("source_refused", "source_not_found"), e.details
                assert marker not in str(e.details)
                continue
            with corral.Sandbox(image="msevil", endpoint=ep, cwd="/") as sb:
                r = sb.exec("cat /got")
                assert r.stdout == "stage-own\n", (via, r)
    finally:
        os.unlink(host_file.name)
        _rm(ep, "msevil")


def test_multi_stage_errors_have_stable_reasons(env: dict, stages: dict) -> None:
    """A --from of the stage itself, of a later stage, of an index past the last, a second
    stage of one name and an unknown target are refused before anything runs; a --from of
    a name that is neither a stage nor an image, and a source path the stage lacks, fail the
    build and leave no image of the target name."""
    ep = env["ep"]
    base = env["base"]
    for text, target, reason in [
            (f"FROM {base} AS a\nCOPY --from=a /x /y\n", None, "stage_cycle"),
            (f"FROM {base} AS a\nCOPY --from=b /x /y\nFROM {base} AS b\n", None,
             "later_stage"),
            (f"FROM {base}\nCOPY --from=1 /x /y\nFROM {base}\n", None, "later_stage"),
            (f"FROM {base}\nCOPY --from=3 /x /y\n", None, "unknown_stage"),
            (f"FROM {base} AS a\nFROM {base} AS A\n", None, "duplicate_stage"),
            (f"FROM {base} AS a\nRUN true\n", "nosuch", "unknown_target")]:
        with pytest.raises(BuildFailed) as e:
            dockerfile.parse(text, "/", target=target)
        assert e.value.code == "build_failed" and e.value.details["reason"] == reason, text
    before = {i.name for i in admin.images(endpoint=ep)}
    for text, reason in [
            (f"FROM {base} AS a\nRUN true\nFROM {base}\nCOPY --from=nosuch /x /y\n",
             "unknown_stage"),
            (f"FROM {base} AS a\nRUN echo > /home/app/e\nFROM {base}\n"
             "COPY --from=a /home/app/missing /y\n", "source_not_found"),
            (f"FROM {base}\nCOPY --from={stages['tools']} /opt/tools/*.none /y\n",
             "source_not_found")]:
        with pytest.raises(BuildFailed) as e:
            dockerfile.parse(text, "/").build("mserr", endpoint=ep)
        assert e.value.details["reason"] == reason, (text, e.value.details)
    after = {i.name for i in admin.images(endpoint=ep)}
    assert "mserr" not in after
    # what stays is the stage step that succeeded (a cached layer) and the pulled tools image
    assert {n for n in after - before if not n.startswith("build-")} <= {stages["tools"]}


# ---- push ---------------------------------------------------------------------------------
def test_push_then_pull_on_a_fresh_node_and_run(env: dict) -> None:
    ep, reg = env["ep"], env["reg"]
    target = f"{reg.addr}/team/pushed:v1"
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("mkdir -p /opt/d && echo pushed > /opt/d/f && ln /opt/d/f /opt/d/hl &&"
                    " rm /opt/base.txt && echo u > /home/app/u", user="root")
            sb.commit("topush", config={"Cmd": ["cat", "/opt/d/f"]})
        res = admin.push_image("topush", target, endpoint=ep)
        assert len(res.layers) == 3 and res.uploaded >= 1
        again = admin.push_image("topush", target, endpoint=ep)
        assert again.uploaded == 0 and again.digest == res.digest  # the registry has them
        with private_daemon("corral-imgp-", f"{CGROUP_NAME}-imgp",
                            CORRAL_REGISTRIES=reg.addr) as fresh:
            fep = f"unix://{fresh.socket_path}"
            with corral.Sandbox(image=target, endpoint=fep) as sb:
                r = sb.exec("cat /opt/d/f; stat -c %h /opt/d/hl; test -e /opt/base.txt &&"
                            " echo WHITEOUT-LOST; cat /home/app/u; id -un")
                assert r.stdout == "pushed\n2\nu\napp\n", r.stderr
            assert admin.image_info(target, endpoint=fep).config["Cmd"] == ["cat", "/opt/d/f"]
        with pytest.raises(Conflict):  # a local name needs a target
            admin.push_image("topush", endpoint=ep)
    finally:
        _rm(ep, "topush")


def test_a_file_named_like_a_whiteout_is_refused_at_push(env: dict) -> None:
    """A file the sandbox named ``.wh.x`` (or ``.wh..wh..opq``) has no form in an OCI
    layer: every reader takes it for a whiteout. Pushed as one, the image lost ``/opt/x``
    and the file itself; the push is refused, naming the file, and nothing is sent."""
    ep, reg = env["ep"], env["reg"]
    for name in (".wh.x", ".wh..wh..opq"):
        target = f"{reg.addr}/team/whiteoutname:v1"
        try:
            with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
                sb.exec(f"mkdir -p /opt/w && echo keep > /opt/w/x && echo data > /opt/w/{name}",
                        user="root")
                sb.commit("whname")
            with pytest.raises(InvalidImage) as e:
                admin.push_image("whname", target, endpoint=ep)
            assert e.value.details["path"].endswith(f"opt/w/{name}"), e.value.details
            assert "whiteout" in str(e.value)
        finally:
            _rm(ep, "whname")


def test_cli_build_commit_push(env: dict) -> None:
    import subprocess
    import sys

    ep, reg, d = env["ep"], env["reg"], env["daemon"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral.cli", *args], capture_output=True,
                              text=True, timeout=300,
                              env={**os.environ, "CORRAL_SOCKET": d.socket_path,
                                   "CORRAL_AUTOSTART": "0", "COLUMNS": "200"})

    ctx = tempfile.mkdtemp(prefix="corral-clibuild-", dir="/var/tmp")
    try:
        with open(os.path.join(ctx, "Dockerfile.test"), "w") as fh:
            fh.write(f"FROM {env['base']}\nRUN echo built-by-cli > /home/app/cli\n"
                     "CMD [\"cat\", \"/home/app/cli\"]\n")
        r = cli("image", "build", "-f", os.path.join(ctx, "Dockerfile.test"), "-t", "clib", ctx)
        assert r.returncode == 0 and "built clib" in r.stdout, r.stderr
        r = cli("image", "build", "-f", os.path.join(ctx, "Dockerfile.test"), "-t", "clib", ctx)
        assert "2 of 2 steps cached" in r.stdout and "(cached)" in r.stderr, (r.stdout, r.stderr)
        r = cli("run", "--image", "clib")
        assert r.stdout == "built-by-cli\n", r.stderr
        with corral.Sandbox(image="clib", endpoint=ep) as sb:
            sb.exec("echo more >> /home/app/cli")
            r = cli("image", "commit", sb.id, "clic")
            assert r.returncode == 0 and "committed clic" in r.stdout, r.stderr
        with open(os.path.join(ctx, "Dockerfile.stages"), "w") as fh:
            fh.write(f"FROM {env['base']} AS one\nRUN echo one > /home/app/one\n"
                     f"FROM {env['base']}\nCOPY --from=one /home/app/one /home/app/copied\n"
                     "RUN cat /home/app/one\n")
        r = cli("image", "build", "-f", os.path.join(ctx, "Dockerfile.stages"), "--target",
                "one", "-t", "clistage", ctx)
        assert r.returncode == 0 and "built clistage" in r.stdout, r.stderr
        assert "[1/1] RUN" in r.stderr and "COPY" not in r.stderr, r.stderr
        r = cli("image", "build", "-f", os.path.join(ctx, "Dockerfile.stages"), "-t",
                "clistage", ctx)  # the last stage: its RUN sees no file of stage one
        assert r.returncode != 0 and "build_failed" in r.stderr, r.stderr
        assert "[one 1/1] RUN" in r.stderr and "(cached)" in r.stderr, r.stderr
        r = cli("image", "build", "-f", os.path.join(ctx, "Dockerfile.stages"), "--target",
                "two", "-t", "clistage", ctx)
        assert r.returncode != 0 and "no stage named 'two'" in r.stderr, r.stderr
        r = cli("image", "push", "clic", f"{reg.addr}/team/clic:1")
        assert r.returncode == 0 and "pushed" in r.stdout, r.stderr
        with open(os.path.join(ctx, "Dockerfile.bad"), "w") as fh:
            fh.write(f"FROM {env['base']}\nHEALTHCHECK CMD true\n")
        r = cli("image", "build", "-f", os.path.join(ctx, "Dockerfile.bad"), "-t", "x", ctx)
        assert r.returncode != 0 and "build_failed" in r.stderr and "line 2" in r.stderr
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
        _rm(ep, "clib", "clic", "clistage")


def test_commit_on_a_rootfs_image(env: dict) -> None:
    ep = env["ep"]
    root = tempfile.mkdtemp(prefix="corral-rootfs-", dir="/var/tmp")
    try:
        os.makedirs(os.path.join(root, "bin"))
        os.makedirs(os.path.join(root, "etc"))
        shutil.copy(fx.BUSYBOX, os.path.join(root, "bin", "busybox"))
        for a in ("sh", "cat", "echo"):
            os.symlink("busybox", os.path.join(root, "bin", a))
        with open(os.path.join(root, "etc", "passwd"), "w") as fh:
            fh.write("root:x:0:0:root:/root:/bin/sh\n")
        admin.import_image("rootfsbase", root, endpoint=ep)
        with corral.Sandbox(image="rootfsbase", endpoint=ep, cwd="/") as sb:
            sb.exec("echo on-rootfs > /etc/mark").check()
            info = sb.commit("rootfscommit")
        assert len(info.layers or []) == 2  # the tree as one layer, then the change
        with corral.Sandbox(image="rootfscommit", endpoint=ep, cwd="/") as sb:
            assert sb.exec("cat /etc/mark").stdout == "on-rootfs\n"
    finally:
        shutil.rmtree(root, ignore_errors=True)
        _rm(ep, "rootfscommit", "rootfsbase")


def test_push_needs_the_registrys_credentials(env: dict) -> None:
    ep, basic = env["ep"], env["basic"]
    target = f"{basic.addr}/private/pushed:1"
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("echo secret-push > /home/app/p").check()
            sb.commit("authpush")
        fx.docker_config(env["dcfg"], {})
        with pytest.raises(RegistryUnauthorized):
            admin.push_image("authpush", target, endpoint=ep)
        fx.docker_config(env["dcfg"], {basic.addr: basic.creds})
        res = admin.push_image("authpush", target, endpoint=ep)
        assert res.uploaded >= 1
        admin.remove_image("authpush", endpoint=ep)
        with corral.Sandbox(image=target, endpoint=ep) as sb:  # pulled back with the login
            assert sb.exec("cat /home/app/p").stdout == "secret-push\n"
    finally:
        fx.docker_config(env["dcfg"], {})
        _rm(ep, "authpush", target)
