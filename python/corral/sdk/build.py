"""Image builds: ``corral.Image``, a chain of steps over a base image, built by the daemon
one step at a time. A step that changes files (``run_commands``, ``copy_local_dir``...) runs
in a real sandbox on the previous step's image and is committed as one layer; a step that
changes only the config (``env``, ``cmd``...) is a tag (no files). Each step's image is named
by a hash of everything it depends on (the base image's digest, layers and config, the steps
before it, its own command or the bytes it copies): ``build-<hash>``. A build finds those
names first, so a rebuild with nothing changed runs no sandbox at all.

A recipe may copy files out of another recipe (a stage: built first, only when some step
needs it) or out of an image (``copy_from``): a sandbox on that image hands a tar of the
paths to the step's sandbox; the step's key holds the source image's identity and the paths.

>>> img = (corral.Image.from_registry("127.0.0.1:5000/team/base:1")
...        .run_commands("echo hi > /greeting").env({"MODE": "test"})
...        .copy_local_dir("./src", "/app").workdir("/app").cmd(["python3", "main.py"]))
>>> img.build("task-v1")
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import posixpath
import shlex
import stat
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corral.errors import (
    BuildFailed,
    Conflict,
    FileNotFound,
    ImageNotFound,
    InvalidPath,
    InvalidRequest,
    IsASymlink,
    NotADirectory,
    TooLarge,
)
from corral.models import ImageInfo
from corral.sdk import api
from corral.sdk.endpoint import Endpoint
from corral.sdk.results import ExecResult
from corral.sdk.sync_transport import transport

# Bump when what a step does for the same inputs changes: older cache entries stop matching.
BUILD_VERSION = 1
CACHE_PREFIX = "build-"


@dataclass(frozen=True)
class Step:
    kind: str  # "run" | "copy" | "copy_from" | "workdir" | "config"
    args: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "run":
            return "RUN " + " && ".join(self.args["cmds"]) if isinstance(
                self.args["cmds"][0], str) else "RUN " + json.dumps(self.args["cmds"])
        if self.kind == "copy":
            chown = f"--chown={self.args['chown']} " if self.args.get("chown") else ""
            return f"COPY {chown}{' '.join(self.args['srcs'])} {self.args['dest']}"
        if self.kind == "copy_from":
            chown = f"--chown={self.args['chown']} " if self.args.get("chown") else ""
            return (f"COPY --from={self.args['from']} {chown}{' '.join(self.args['srcs'])} "
                    f"{self.args['dest']}")
        if self.kind == "workdir":
            return f"WORKDIR {self.args['path']}"
        return "CONFIG " + json.dumps(self.args["changes"], sort_keys=True)


@dataclass
class StepResult:
    step: str
    image: str
    cached: bool
    seconds: float


@dataclass
class BuildResult:
    image: ImageInfo
    steps: list[StepResult]
    seconds: float

    @property
    def cached(self) -> bool:
        """Every step came from the cache."""
        return all(s.cached for s in self.steps)


class Image:
    """An image recipe: a base and steps, each method returning a new recipe."""

    def __init__(self, base: str, steps: Sequence[Step] = (), *,
                 stage: str | None = None) -> None:
        self.base = base
        self.steps: tuple[Step, ...] = tuple(steps)
        self.stage = stage  # a name for progress lines when another recipe copies from it

    def _add(self, step: Step) -> Image:
        return Image(self.base, (*self.steps, step), stage=self.stage)

    def named(self, stage: str) -> Image:
        """The same recipe, called ``stage`` in progress lines."""
        return Image(self.base, self.steps, stage=stage)

    # ---- bases ----------------------------------------------------------------------------
    @staticmethod
    def from_registry(reference: str) -> Image:
        """A registry image (pulled by the daemon if its node lacks it)."""
        return Image(reference)

    @staticmethod
    def from_name(name: str) -> Image:
        """An image the daemon has (imported, committed, built)."""
        return Image(name)

    @staticmethod
    def from_dockerfile(path: str | os.PathLike[str], context: str | os.PathLike[str] | None
                        = None, *, build_args: Mapping[str, str] | None = None,
                        target: str | None = None) -> Image:
        """The recipe of a Dockerfile (its COPY sources under ``context``, default the
        file's directory); ``target``: the stage to build, default the last."""
        from corral.sdk import dockerfile

        with open(path) as f:
            text = f.read()
        ctx = os.path.abspath(context if context is not None else os.path.dirname(
            os.path.abspath(path)))
        return dockerfile.parse(text, ctx, build_args, target=target)

    # ---- steps that change files ----------------------------------------------------------
    def run_commands(self, *cmds: str | Sequence[str]) -> Image:
        """Run shell commands (a string) or argvs (a list) in turn, as the image's user in
        its working directory; one layer for all of them."""
        if not cmds:
            raise InvalidRequest("run_commands needs a command")
        return self._add(Step("run", {"cmds": [c if isinstance(c, str) else list(c)
                                               for c in cmds]}))

    def apt_install(self, *packages: str) -> Image:
        """``apt-get install`` (Debian-based images; the step needs the network)."""
        pkgs = " ".join(shlex.quote(p) for p in packages)
        return self.run_commands("apt-get update && DEBIAN_FRONTEND=noninteractive apt-get "
                                 f"install -y --no-install-recommends {pkgs}")

    def pip_install(self, *packages: str) -> Image:
        """``pip install`` with the image's python3 (the step needs the network, or a
        package index the network mode reaches)."""
        return self.run_commands("python3 -m pip install --no-cache-dir "
                                 + " ".join(shlex.quote(p) for p in packages))

    def copy_local_dir(self, local: str | os.PathLike[str], remote: str) -> Image:
        """The contents of the local directory ``local`` into ``remote`` (made if missing),
        owned by root, modes and mtimes kept."""
        return self._add(Step("copy", {"srcs": [os.fspath(local)], "dest": remote.rstrip("/")
                                       + "/", "context": None}))

    def copy_local_file(self, local: str | os.PathLike[str], remote: str) -> Image:
        """One local file to ``remote`` (a path; ending in ``/``: into that directory)."""
        return self._add(Step("copy", {"srcs": [os.fspath(local)], "dest": remote,
                                       "context": None}))

    def copy_from(self, source: Image | str, srcs: str | Sequence[str], dest: str, *,
                  chown: str | None = None) -> Image:
        """Paths ``srcs`` (absolute in ``source``; a ``*``/``?``/``[]`` pattern in the last
        component) out of another recipe ``source`` (built first, as a stage of this build) or
        out of an image (a name or a registry reference) into ``dest``, as COPY does: a
        directory's contents, a file by its name into a ``dest`` ending in ``/`` (or when
        there are several) else as ``dest``. Owned by root unless ``chown``."""
        paths = [srcs] if isinstance(srcs, str) else list(srcs)
        if not paths:
            raise InvalidRequest("copy_from needs a source path")
        label = source if isinstance(source, str) else (source.stage or source.base)
        args: dict[str, Any] = {"source": source, "from": label, "srcs": paths, "dest": dest}
        if chown:
            args["chown"] = chown
        return self._add(Step("copy_from", args))

    def workdir(self, path: str) -> Image:
        """The working directory of later steps and of the image's sandboxes (made)."""
        return self._add(Step("workdir", {"path": path}))

    # ---- steps that change only the config ------------------------------------------------
    def env(self, values: Mapping[str, str]) -> Image:
        return self._add(Step("config", {"changes": {
            "Env": [f"{k}={v}" for k, v in values.items()]}}))

    def user(self, user: str) -> Image:
        return self._add(Step("config", {"changes": {"User": user}}))

    def cmd(self, argv: Sequence[str]) -> Image:
        return self._add(Step("config", {"changes": {"Cmd": list(argv)}}))

    def entrypoint(self, argv: Sequence[str]) -> Image:
        return self._add(Step("config", {"changes": {"Entrypoint": list(argv)}}))

    def label(self, labels: Mapping[str, str]) -> Image:
        return self._add(Step("config", {"changes": {"Labels": dict(labels)}}))

    # ---- building -------------------------------------------------------------------------
    def build(self, name: str, *, endpoint: str | Endpoint | None = None,
              network: str = "none", step_timeout: float = 1800.0,
              memory_mb: int = 2048, output: Callable[[str], None] | None = None,
              replace: bool = True) -> BuildResult:
        """Build it as image ``name`` (replacing one of that name unless ``replace=False``).
        Steps run in sandboxes with ``network``; a failing step raises BuildFailed with its
        output and leaves no layer. ``output`` gets progress lines."""
        return _Builder(self, Endpoint.parse(endpoint), network, step_timeout, memory_mb,
                        output or (lambda s: None)).build(name, replace)


def glob_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def _sha(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True).encode())
        h.update(b"\0")
    return h.hexdigest()


def copy_tar(srcs: Sequence[str], dest: str, context: str | None) -> tuple[str, bytes]:
    """(the directory to extract into, a tar of the sources) for a copy to ``dest``: a
    directory source's contents, a file by its name (into a ``dest`` ending in ``/``) or as
    ``dest``. Owned by root, deterministic. ``context``: sources must stay inside it."""
    into_dir = dest.endswith("/") or len(srcs) > 1
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        def add(path: str, arc: str) -> None:
            st = os.lstat(path)
            ti = tarfile.TarInfo(arc)
            ti.mode, ti.mtime, ti.uid, ti.gid = stat.S_IMODE(st.st_mode), int(st.st_mtime), 0, 0
            if stat.S_ISDIR(st.st_mode):
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
                for n in sorted(os.listdir(path)):
                    add(os.path.join(path, n), f"{arc}/{n}")
            elif stat.S_ISLNK(st.st_mode):
                ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink(path)
                tf.addfile(ti)
            elif stat.S_ISREG(st.st_mode):
                ti.size = st.st_size
                with open(path, "rb") as f:
                    tf.addfile(ti, f)

        for src in srcs:
            real = os.path.realpath(src)
            if context is not None:
                base = os.path.realpath(context)
                if real != base and not real.startswith(base + "/"):
                    raise InvalidRequest(f"COPY source {src!r} is outside the build context "
                                         f"{context}", details={"source": src})
            if not os.path.lexists(real):
                raise InvalidRequest(f"COPY source {src!r} does not exist",
                                     details={"source": src})
            if os.path.isdir(real):
                for n in sorted(os.listdir(real)):
                    add(os.path.join(real, n), n)
                if not into_dir and len(srcs) == 1:
                    into_dir = True
            elif into_dir:
                add(real, os.path.basename(real))
            else:
                add(real, posixpath.basename(dest))
    target = dest.rstrip("/") if into_dir else posixpath.dirname(dest)
    return target or "/", buf.getvalue()


def _failed(step: Step, r: ExecResult) -> BuildFailed:
    return BuildFailed(f"step {step.describe()!r} failed (exit {r.exit_code}): "
                       f"{(r.stderr or r.stdout)[-2000:]}",
                       details={"step": step.describe(), "exit_code": r.exit_code,
                                "stdout": r.stdout[-4000:], "stderr": r.stderr[-4000:]})


def _stage_error(reason: str, msg: str, **details: Any) -> BuildFailed:
    return BuildFailed(msg, details={"reason": reason, **details})


def repack(parts: Sequence[tuple[str, bytes]], dest: str) -> tuple[str, bytes]:
    """(the directory to extract into, one tar) of the daemon's tars of source paths
    (``(path, tar)``: a directory's as ``.`` and its contents, a file's as its name) for a
    copy to ``dest``, with copy_tar's rules: a directory's contents, a file by its name into
    a directory ``dest`` or as ``dest``. Owned by root."""
    into_dir = dest.endswith("/") or len(parts) > 1
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
        for path, raw in parts:
            with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
                members = tf.getmembers()
                is_dir = bool(members) and members[0].name in (".", "./")
                if is_dir and len(parts) == 1:
                    into_dir = True
                for m in members:
                    if is_dir:
                        if m.name in (".", "./"):
                            continue
                        name = m.name.removeprefix("./")
                    else:
                        name = posixpath.basename(path) if into_dir else posixpath.basename(
                            dest)
                    ti = tarfile.TarInfo(name)
                    ti.type, ti.mode, ti.mtime = m.type, m.mode, int(m.mtime)
                    ti.linkname, ti.uid, ti.gid = m.linkname, 0, 0
                    if m.isreg():
                        ti.size = m.size
                        out.addfile(ti, tf.extractfile(m))
                    elif m.isdir() or m.issym():
                        out.addfile(ti)
    target = dest.rstrip("/") if into_dir else posixpath.dirname(dest)
    return target or "/", buf.getvalue()


class _Builder:
    def __init__(self, image: Image, ep: Endpoint, network: str, step_timeout: float,
                 memory_mb: int, out: Callable[[str], None]) -> None:
        self.image, self.ep, self.network = image, ep, network
        self.timeout, self.memory_mb, self.out = step_timeout, memory_mb, out
        self.t = transport(ep)
        # the stages built in this build, by recipe (each built once however many use it)
        self.stages: dict[int, tuple[Image, ImageInfo]] = {}
        self.results: list[StepResult] = []

    def _info(self, name: str) -> ImageInfo | None:
        try:
            return self.t.call(api.image(name))
        except ImageNotFound:
            return None

    def _resolve(self, ref: str, stages: Sequence[str] | None = None) -> ImageInfo:
        """The image ``ref``, pulled if it is a registry reference the daemon lacks.
        ``stages``: a Dockerfile's stage names, for the error of a name that is neither."""
        info = self._info(ref)
        if info is None:
            if not any(c in ref for c in "/:@"):
                if stages is not None:
                    raise _stage_error("unknown_stage", f"--from={ref} is neither a stage of "
                                       f"this Dockerfile ({', '.join(stages) or 'none named'})"
                                       " nor an image the daemon has",
                                       stage=ref, stages=list(stages))
                raise ImageNotFound(f"no image named {ref!r}", details={"image": ref})
            self.out(f"pulling {ref}")
            info = self.t.call(api.pull_image(ref))
        return info

    def build(self, name: str, replace: bool) -> BuildResult:
        t0 = time.monotonic()
        cur = self._build(self.image, "")
        final = self.t.call(api.tag_image(cur.name, name, None, replace))
        return BuildResult(final, self.results, round(time.monotonic() - t0, 4))

    def _source(self, step: Step) -> ImageInfo:
        """The image a copy_from step copies out of: its stage built (once), or resolved."""
        src = step.args["source"]
        if isinstance(src, str):
            return self._resolve(src, step.args.get("stages"))
        if id(src) not in self.stages:
            self.stages[id(src)] = (src, self._build(src, str(step.args["from"])))
        return self.stages[id(src)][1]

    def _build(self, image: Image, stage: str) -> ImageInfo:
        """Every step of ``image`` (from the cache or run): the last step's image.
        ``stage``: its name in progress lines, when another recipe copies from it."""
        base = self._resolve(image.base)
        key = _sha(BUILD_VERSION, base.name, base.digest, base.layers, base.config)
        info, cfg = base, dict(base.config or {})
        for i, step in enumerate(image.steps):
            s0 = time.monotonic()
            blob: bytes = b""
            target = ""
            what: Any = step.args
            source: ImageInfo | None = None
            if step.kind == "copy":
                target, blob = copy_tar(step.args["srcs"], self._dest(step, cfg),
                                        step.args.get("context"))
                what = [target, step.args["chown"]] if step.args.get("chown") else target
            elif step.kind == "copy_from":
                source = self._source(step)
                s0 = time.monotonic()  # the stage's own steps are counted as theirs
                # the source's identity and the paths: a changed stage is another image
                what = [source.name, source.digest, source.layers, step.args["srcs"],
                        self._dest(step, cfg), step.args.get("chown")]
                if not source.layers:  # no stored layers (the host, a rootfs dir): the
                    target, blob = self._extract(step, source, self._dest(step, cfg))
                    source = None      # bytes copied are the key, as for a local COPY
            key = _sha(key, step.kind, what, hashlib.sha256(blob).hexdigest())
            cache = CACHE_PREFIX + key[:48]
            hit = self._info(cache)
            label = f"[{stage + ' ' if stage else ''}{i + 1}/{len(image.steps)}] " \
                    f"{step.describe()}"
            if hit is None:
                self.out(label)
                if source is not None:
                    target, blob = self._extract(step, source, self._dest(step, cfg))
                try:
                    hit = self._run(step, info.name, cache, target, blob)
                except Conflict:
                    # Another build of the same recipe committed this step first; the
                    # name is its content's hash, so that image is this step's result.
                    again = self._info(cache)
                    if again is None:
                        raise
                    hit = again
                cached = False
            else:
                self.out(label + " (cached)")
                cached = True
            info, cfg = hit, dict(hit.config or {})
            self.results.append(StepResult((f"{stage}: " if stage else "") + step.describe(),
                                           cache, cached, round(time.monotonic() - s0, 4)))
        return info

    @staticmethod
    def _dest(step: Step, cfg: Mapping[str, Any]) -> str:
        dest = step.args["dest"]
        if not dest.startswith("/"):
            dest = posixpath.join(cfg.get("WorkingDir") or "/", dest)
        return dest

    def _extract(self, step: Step, source: ImageInfo, dest: str) -> tuple[str, bytes]:
        """(target dir, tar) of the step's paths out of a sandbox on ``source``."""
        from corral.sdk.sandbox import Sandbox

        parts: list[tuple[str, bytes]] = []
        with Sandbox(image=source.name, network="none", endpoint=self.ep, cwd="/",
                     memory_mb=self.memory_mb, timeout=self.timeout + 60) as sb:
            for src in step.args["srcs"]:
                path = posixpath.normpath(posixpath.join("/", src))
                paths = self._glob(sb, step, path) if glob_magic(path) else [path]
                for p in paths:
                    try:
                        parts.append((p, sb._call(api.get_tar(sb.id, p))))
                    except (FileNotFound, NotADirectory):
                        raise self._missing(step, src) from None
                    except (InvalidPath, IsASymlink, TooLarge) as e:  # a /proc link, too big
                        raise _stage_error("source_refused", f"step {step.describe()!r}: "
                                           f"{src}: {e.message}", step=step.describe(),
                                           path=src, code=e.code) from None
        return repack(parts, dest)

    def _glob(self, sb: Any, step: Step, path: str) -> list[str]:
        parent, pattern = posixpath.split(path)
        if glob_magic(parent):
            raise BuildFailed(f"step {step.describe()!r}: a pattern only in the last path "
                              f"component ({path})", details={"step": step.describe()})
        try:
            entries = api.all_pages(sb._call, lambda after: api.list_dir(sb.id, parent, after))
        except (FileNotFound, NotADirectory):
            raise self._missing(step, path) from None
        hits = sorted(posixpath.join(parent, e.name) for e in entries
                      if fnmatch.fnmatchcase(e.name, pattern))
        if not hits:
            raise self._missing(step, path)
        return hits

    @staticmethod
    def _missing(step: Step, src: str) -> BuildFailed:
        return _stage_error("source_not_found", f"step {step.describe()!r}: {src} is not in "
                            f"{step.args['from']}", step=step.describe(), path=src,
                            source=str(step.args["from"]))

    def _run(self, step: Step, cur: str, cache: str, target: str, blob: bytes) -> ImageInfo:
        if step.kind == "config":
            return self.t.call(api.tag_image(cur, cache, step.args["changes"]))
        from corral.sdk.sandbox import Sandbox

        changes: dict[str, Any] | None = None
        with Sandbox(image=cur, network=self.network, endpoint=self.ep, cwd="/",
                     memory_mb=self.memory_mb, timeout=self.timeout + 60) as sb:
            if step.kind == "run":
                cwd = (self._cwd(cur))
                for cmd in step.args["cmds"]:
                    r = sb.exec(cmd, timeout=self.timeout, cwd=cwd)
                    if r.stdout:
                        self.out(r.stdout.rstrip("\n"))
                    if r.exit_code != 0:
                        raise _failed(step, r)
            elif step.kind in ("copy", "copy_from"):
                sb.exec(["mkdir", "-p", target], user=0, timeout=60).check()
                sb._call(api.put_tar(sb.id, target, blob))
                if step.args.get("chown"):  # the copied entries only, as Docker's --chown
                    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
                        top = sorted({m.split("/", 1)[0] for m in tf.getnames()})
                    if top:
                        c = sb.exec(["chown", "-R", step.args["chown"], "--",
                                     *(posixpath.join(target, m) for m in top)],
                                    user=0, timeout=self.timeout)
                        if c.exit_code != 0:
                            raise _failed(step, c)
            elif step.kind == "workdir":
                path = step.args["path"]
                if not path.startswith("/"):
                    path = posixpath.join(self._cwd(cur) or "/", path)
                sb.exec(["mkdir", "-p", path], user=0, timeout=60).check()
                changes = {"WorkingDir": path}
            return sb.commit(cache, config=changes)

    def _cwd(self, image: str) -> str | None:
        info = self._info(image)
        wd = (info.config or {}).get("WorkingDir") if info else None
        return wd if isinstance(wd, str) and wd.startswith("/") else None
