"""ImageStore against the real filesystem: the host skeleton and safe imports."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tarfile
import tempfile

import pytest

from corral.daemon.images import ImageStore
from corral.errors import Conflict, ImageNotFound, InvalidRequest

FORBIDDEN_HOST_DIRS = ["/root", "/home", "/var", "/run", "/tmp", "/srv", "/work", "/mnt", "/opt",
                       "/boot", "/media", "/etc", "/"]


@pytest.fixture
def workdir():
    d = tempfile.mkdtemp(prefix="corral-img-test-", dir="/var/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store(workdir):
    return ImageStore(os.path.join(workdir, "state"))


@pytest.fixture(scope="module")
def host_store():
    d = tempfile.mkdtemp(prefix="corral-img-host-", dir="/var/tmp")
    try:
        s = ImageStore(d)
        yield s, s.ensure_host()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _rd(p: str) -> str:
    with open(p) as f:
        return f.read()


def _wr(p: str, data: str | bytes) -> None:
    with open(p, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def _mode(p: str) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# ---- host ----------------------------------------------------------------------------------
def test_host_skeleton_layout(host_store):
    _, img = host_store
    assert img.name == "host" and img.kind == "builtin"
    root = img.overlays[0][1][0]
    assert img.overlays[0][0] == "/" and img.overlays[1] == ("/usr", ["/usr"])
    for d in ["usr", "proc", "dev", "sys", "tmp", "run", "var", "var/tmp", "root", "home", "mnt",
              "opt", "srv", "etc"]:
        assert os.path.isdir(os.path.join(root, d)) and not os.path.islink(os.path.join(root, d))
    assert _mode(os.path.join(root, "tmp")) == 0o1777
    assert _mode(os.path.join(root, "var/tmp")) == 0o1777
    assert _mode(os.path.join(root, "root")) == 0o700
    for empty in ["usr", "proc", "dev", "sys", "tmp", "run", "root", "home", "mnt", "opt", "srv",
                  "var/tmp"]:
        assert os.listdir(os.path.join(root, empty)) == [], empty
    assert os.listdir(os.path.join(root, "var")) == ["tmp"]
    for n in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"]:
        host, mine = "/" + n, os.path.join(root, n)
        if os.path.islink(host):
            assert os.readlink(mine) == os.readlink(host)
        elif os.path.isdir(host):
            assert os.path.isdir(mine) and os.listdir(mine) == []
            assert (host, [host]) in img.overlays
        else:
            assert not os.path.lexists(mine)
    # Only the skeleton and the OS dirs are lower layers: no host dir holding user data.
    lowers = {lo for _, ls in img.overlays for lo in ls}
    assert not lowers & set(FORBIDDEN_HOST_DIRS)
    assert set(os.listdir(root)) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr",
                                     "proc", "dev", "sys", "tmp", "run", "var", "root", "home",
                                     "mnt", "opt", "srv", "etc"}


def test_host_etc_is_sanitized(host_store):
    _, img = host_store
    etc = os.path.join(img.overlays[0][1][0], "etc")
    assert os.path.isfile(os.path.join(etc, "passwd"))
    for secret in ["shadow", "gshadow", "shadow-", "gshadow-", "ssl/private", "sudoers"]:
        assert not os.path.lexists(os.path.join(etc, secret)), secret
    # Everything the copy holds is world-readable; no device, socket or setuid file.
    for dirpath, dirnames, filenames in os.walk(etc):
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            if stat.S_ISLNK(st.st_mode):
                continue
            assert st.st_mode & 0o004, os.path.join(dirpath, n)
            assert stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) \
                or stat.S_ISFIFO(st.st_mode)
            assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID) or stat.S_ISDIR(st.st_mode)
    # Whatever the host's /etc hides from other users is absent from the copy.
    for dirpath, dirnames, filenames in os.walk("/etc"):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            if not stat.S_ISLNK(st.st_mode) and not st.st_mode & 0o004:
                assert not os.path.lexists(os.path.join(etc, os.path.relpath(p, "/etc"))), p
    # Symlinks stay symlinks, verbatim.
    for dirpath, _, filenames in os.walk("/etc"):
        for n in filenames:
            p = os.path.join(dirpath, n)
            mine = os.path.join(etc, os.path.relpath(p, "/etc"))
            if os.path.islink(p) and os.path.lexists(os.path.dirname(mine)):
                assert os.readlink(mine) == os.readlink(p)


def test_host_is_cached_and_rebuilt_when_outdated(host_store, workdir):
    s, img = host_store
    assert s.ensure_host() is img
    assert s.get("host") is img
    # A second store on a copy of the state: a stale marker triggers a rebuild; the old
    # skeleton is set aside (live sandboxes may still use it as a lower layer).
    state = os.path.join(workdir, "state")
    shutil.copytree(os.path.dirname(s.dir), state, symlinks=True)
    meta_path = os.path.join(state, "images", "host", "image.json")
    meta = json.loads(_rd(meta_path))
    meta["marker"] = "v0:old"
    _wr(meta_path, json.dumps(meta))
    s2 = ImageStore(state)
    img2 = s2.ensure_host()
    assert img2.meta["marker"] != "v0:old"
    assert any(n.startswith(".old-host-") for n in os.listdir(s2.dir))
    assert os.path.isfile(os.path.join(img2.overlays[0][1][0], "etc", "passwd"))


# ---- import --------------------------------------------------------------------------------
def _make_tree(src: str, outside: str) -> None:
    os.makedirs(os.path.join(src, "usr/bin"))
    os.makedirs(os.path.join(src, "etc"))
    _wr(os.path.join(src, "usr/bin/tool"), "#!/bin/sh\necho hi\n")
    os.chmod(os.path.join(src, "usr/bin/tool"), 0o755)
    _wr(os.path.join(src, "etc/conf"), "x=1\n")
    os.chmod(os.path.join(src, "etc/conf"), 0o600)
    os.symlink("usr/bin", os.path.join(src, "bin"))
    os.symlink("/etc/passwd", os.path.join(src, "abs-link"))
    os.symlink(outside, os.path.join(src, "out-link"))  # must be copied, not followed
    os.link(os.path.join(src, "etc/conf"), os.path.join(src, "etc/conf.hard"))
    _wr(os.path.join(src, "usr/bin/suid"), "x")
    os.chmod(os.path.join(src, "usr/bin/suid"), 0o4755)
    os.mkfifo(os.path.join(src, "fifo"))
    os.mknod(os.path.join(src, "null-dev"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))


def test_import_directory(store, workdir):
    src, outside = os.path.join(workdir, "src"), os.path.join(workdir, "outside")
    os.makedirs(outside)
    _wr(os.path.join(outside, "secret"), "s")
    _make_tree(src, outside)
    info = store.import_image("mydir", src)
    assert info.name == "mydir" and info.kind == "rootfs" and info.size_bytes > 0
    img = store.get("mydir")
    (root,) = img.overlays[0][1]
    assert img.overlays == [("/", [root])]
    assert _rd(os.path.join(root, "usr/bin/tool")).startswith("#!/bin/sh")
    assert _mode(os.path.join(root, "usr/bin/tool")) == 0o755
    assert _mode(os.path.join(root, "etc/conf")) == 0o600
    assert os.readlink(os.path.join(root, "bin")) == "usr/bin"
    assert os.readlink(os.path.join(root, "abs-link")) == "/etc/passwd"
    assert os.readlink(os.path.join(root, "out-link")) == outside
    assert os.lstat(os.path.join(root, "etc/conf")).st_ino == \
        os.lstat(os.path.join(root, "etc/conf.hard")).st_ino
    assert _mode(os.path.join(root, "usr/bin/suid")) == 0o755  # setuid stripped
    assert stat.S_ISFIFO(os.lstat(os.path.join(root, "fifo")).st_mode)
    assert not os.path.lexists(os.path.join(root, "null-dev"))  # devices skipped
    assert [i.name for i in store.list()] == ["host", "mydir"]
    # Persisted: a new store (daemon restart) sees it.
    again = ImageStore(os.path.dirname(store.dir))
    assert again.get("mydir").overlays == img.overlays


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", **kw) -> None:
    ti = tarfile.TarInfo(name)
    for k, v in kw.items():
        setattr(ti, k, v)
    if ti.type in (tarfile.REGTYPE, tarfile.AREGTYPE):
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    else:
        tf.addfile(ti)


def _tarball(path: str, members: list[tuple]) -> str:
    with tarfile.open(path, "w:gz") as tf:
        for m in members:
            _add(tf, *m[:2], **(m[2] if len(m) > 2 else {}))
    return path


def test_import_tarball(store, workdir):
    tgz = _tarball(os.path.join(workdir, "img.tar.gz"), [
        ("./", b"", {"type": tarfile.DIRTYPE, "mode": 0o755}),
        ("./usr/bin/", b"", {"type": tarfile.DIRTYPE, "mode": 0o755}),
        ("./usr/bin/hello", b"#!/bin/sh\necho hello\n", {"mode": 0o755}),
        ("./bin", b"", {"type": tarfile.SYMTYPE, "linkname": "usr/bin"}),
        ("./etc/localtime", b"", {"type": tarfile.SYMTYPE,
                                  "linkname": "/usr/share/zoneinfo/UTC"}),
        ("/abs/file", b"abs", {"mode": 0o644}),  # leading "/" dropped, like GNU tar
        ("./usr/bin/hello2", b"", {"type": tarfile.LNKTYPE, "linkname": "./usr/bin/hello"}),
        ("./usr/bin/sudo", b"x", {"mode": 0o4755, "uid": 0}),
        ("./dev/sda", b"", {"type": tarfile.BLKTYPE, "devmajor": 8, "devminor": 0}),
        ("./ro/", b"", {"type": tarfile.DIRTYPE, "mode": 0o555}),
        ("./ro/inner", b"i", {"mode": 0o444}),
    ])
    info = store.import_image("mytar", tgz)
    assert info.kind == "rootfs"
    (root,) = store.get("mytar").overlays[0][1]
    assert _rd(os.path.join(root, "usr/bin/hello")) == "#!/bin/sh\necho hello\n"
    assert _mode(os.path.join(root, "usr/bin/hello")) == 0o755
    assert os.readlink(os.path.join(root, "bin")) == "usr/bin"
    assert os.readlink(os.path.join(root, "etc/localtime")) == "/usr/share/zoneinfo/UTC"
    assert _rd(os.path.join(root, "abs/file")) == "abs"
    assert os.lstat(os.path.join(root, "usr/bin/hello2")).st_ino == \
        os.lstat(os.path.join(root, "usr/bin/hello")).st_ino
    assert _mode(os.path.join(root, "usr/bin/sudo")) == 0o755
    assert not os.path.lexists(os.path.join(root, "dev/sda"))
    assert _mode(os.path.join(root, "ro")) == 0o555
    assert _rd(os.path.join(root, "ro/inner")) == "i"
    assert not os.path.exists("/abs/file") or os.path.getsize("/abs/file") != 3


@pytest.mark.parametrize("evil", [
    [("../../escape", b"pwned")],
    [("./ok", b"ok"), ("a/../../escape", b"pwned")],
    # a symlink to outside, then a member written through it
    [("link", b"", {"type": tarfile.SYMTYPE, "linkname": "{outside}"}),
     ("link/escape", b"pwned")],
    [("link", b"", {"type": tarfile.SYMTYPE, "linkname": "../../.."}),
     ("link/escape", b"pwned")],
    # hard links to files outside the root
    [("hl", b"", {"type": tarfile.LNKTYPE, "linkname": "../../outside/secret"})],
    [("hl", b"", {"type": tarfile.LNKTYPE, "linkname": "{outside}/secret"})],
])
def test_import_evil_tarball_writes_nothing_outside(store, workdir, evil):
    outside = os.path.join(workdir, "outside")
    os.makedirs(outside)
    _wr(os.path.join(outside, "secret"), "secret")
    members = [(m[0], m[1], {k: (v.format(outside=outside) if isinstance(v, str) else v)
                             for k, v in (m[2] if len(m) > 2 else {}).items()}) for m in evil]
    tgz = _tarball(os.path.join(workdir, "evil.tgz"), members)
    before = sorted(os.listdir(workdir))
    with pytest.raises(InvalidRequest):
        store.import_image("evil", tgz)
    for d in [workdir, outside, store.dir, os.path.dirname(store.dir), "/"]:
        assert not os.path.lexists(os.path.join(d, "escape")), d
    assert sorted(os.listdir(workdir)) == before
    assert os.listdir(outside) == ["secret"]
    assert os.lstat(os.path.join(outside, "secret")).st_nlink == 1
    assert _rd(os.path.join(outside, "secret")) == "secret"
    # Nothing half-built is left and the name stays free.
    assert [n for n in os.listdir(store.dir) if n != "host"] == []
    with pytest.raises(ImageNotFound):
        store.get("evil")


def test_import_bad_sources_and_names(store, workdir):
    src = os.path.join(workdir, "src")
    os.makedirs(os.path.join(src, "etc"))
    for bad in ["", "Bad", "../x", "a/b", ".hidden", "x" * 64, "a b", "é"]:
        with pytest.raises(InvalidRequest):
            store.import_image(bad, src)
    with pytest.raises(Conflict):
        store.import_image("host", src)
    with pytest.raises(InvalidRequest):
        store.import_image("nosrc", os.path.join(workdir, "missing"))
    junk = os.path.join(workdir, "junk.tar.gz")
    _wr(junk, b"this is not a tarball at all" * 10)
    with pytest.raises(InvalidRequest):
        store.import_image("junk", junk)
    with pytest.raises(InvalidRequest):
        store.import_image("dev", "/dev/null")
    with pytest.raises(InvalidRequest):  # would copy the store into itself
        store.import_image("self", os.path.dirname(store.dir))
    store.import_image("once", src)
    with pytest.raises(Conflict):
        store.import_image("once", src)
    assert sorted(n for n in os.listdir(store.dir) if not n.startswith(".old-")) == ["once"]


def test_get_unknown_and_remove(store, workdir):
    src = os.path.join(workdir, "src")
    os.makedirs(os.path.join(src, "etc"))
    store.import_image("gone-soon", src)
    with pytest.raises(ImageNotFound) as ei:
        store.get("nope")
    assert "gone-soon" in str(ei.value) and "host" in str(ei.value)
    with pytest.raises(InvalidRequest):
        store.remove("host")
    store.remove("gone-soon")
    with pytest.raises(ImageNotFound):
        store.get("gone-soon")
    with pytest.raises(ImageNotFound):
        store.remove("gone-soon")
    assert os.listdir(store.dir) == []
    store.import_image("gone-soon", src)  # the name is free again


def test_images_dir_is_private(store):
    assert _mode(store.dir) == 0o700
