"""The Dockerfile subset a task's environment is built from, without Docker.

A build is a list of steps run in a corral sandbox started on the base image: ``RUN`` under
``/bin/sh -c`` (as Docker runs it), ``COPY``/``ADD`` of files from the build context (the
task's ``environment/`` directory), ``WORKDIR``, ``ENV``, ``ARG`` (its default), ``USER``.
Instructions that only describe a container (``CMD``, ``ENTRYPOINT``, ``EXPOSE``, ``LABEL``,
``VOLUME``, ``HEALTHCHECK``, ``STOPSIGNAL``, ``MAINTAINER``) are ignored. Anything that needs
Docker itself (several ``FROM`` stages, ``COPY --from``, URLs in ``ADD``, ``ONBUILD``,
``SHELL``) is refused with ``invalid_task``, never half-built.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from corral.errors import InvalidRequest

IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "VOLUME", "HEALTHCHECK", "STOPSIGNAL",
           "MAINTAINER"}


def invalid(msg: str) -> InvalidRequest:
    return InvalidRequest(msg, code="invalid_task")


@dataclass(frozen=True)
class Run:
    cmd: str
    env: tuple[tuple[str, str], ...]
    cwd: str
    user: str | None


@dataclass(frozen=True)
class Copy:
    sources: tuple[Path, ...]      # resolved, inside the context
    dest: str                      # absolute, in the sandbox
    dest_is_dir: bool              # several sources, or a dest ending in "/"
    chown: str | None


@dataclass
class Build:
    base: str
    steps: list[Run | Copy] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)   # ENV in force at the end
    workdir: str = "/"
    user: str | None = None


def _lines(text: str) -> list[tuple[int, str]]:
    """Logical lines: comments dropped, backslash continuations joined."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # a comment inside a continued RUN, as Docker allows
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, (buf + line).strip()))
        buf = ""
    if buf:
        out.append((start, buf.strip()))
    return out


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def _subst(s: str, env: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        return env.get(name, m.group(2) or "")
    return _VAR.sub(one, s)


def _pairs(args: str, env: dict[str, str], what: str, n: int) -> dict[str, str]:
    """``ENV a=1 b="x y"`` or the old ``ENV a 1``."""
    words = shlex.split(args)
    if not words:
        raise invalid(f"Dockerfile line {n}: {what} needs an argument")
    if "=" not in words[0]:
        if what == "ARG":
            return {words[0]: env.get(words[0], "")}
        return {words[0]: _subst(args.split(None, 1)[1] if len(words) > 1 else "", env)}
    out: dict[str, str] = {}
    for w in words:
        if "=" not in w:
            raise invalid(f"Dockerfile line {n}: {what} {w!r} is not KEY=VALUE")
        k, v = w.split("=", 1)
        out[k] = _subst(v, {**env, **out})
    return out


def _abs(path: str, workdir: str) -> str:
    return os.path.normpath(path if path.startswith("/") else os.path.join(workdir, path))


def parse(text: str, context: Path) -> Build:
    """The build a Dockerfile describes, its COPY sources resolved inside ``context``."""
    build: Build | None = None
    args: dict[str, str] = {}
    ctx = context.resolve()
    for n, line in _lines(text):
        word, _, rest = line.partition(" ")
        op, rest = word.upper(), rest.strip()
        if op == "FROM":
            if build is not None:
                raise invalid(f"Dockerfile line {n}: several FROM stages are not supported")
            words = [w for w in rest.split() if not w.startswith("--")]
            if not words:
                raise invalid(f"Dockerfile line {n}: FROM needs an image")
            build = Build(base=_subst(words[0], args))
            continue
        if op == "ARG":
            if build is None:
                args.update(_pairs(rest, args, "ARG", n))
            else:
                build.env.update({k: v for k, v in _pairs(rest, build.env, "ARG", n).items()
                                  if k not in build.env})
            continue
        if build is None:
            raise invalid(f"Dockerfile line {n}: {op} before FROM")
        if op in IGNORED:
            continue
        if op == "RUN":
            if rest.startswith("--"):
                raise invalid(f"Dockerfile line {n}: RUN flags ({rest.split()[0]}) need Docker")
            cmd = _exec_form(rest, n) or rest
            build.steps.append(Run(cmd, tuple(sorted(build.env.items())), build.workdir,
                                   build.user))
        elif op == "ENV":
            build.env.update(_pairs(rest, build.env, "ENV", n))
        elif op == "WORKDIR":
            build.workdir = _abs(_subst(rest, build.env), build.workdir)
            build.steps.append(Run(f"mkdir -p {shlex.quote(build.workdir)}", (), "/", None))
        elif op == "USER":
            build.user = _subst(rest, build.env) or None
        elif op in ("COPY", "ADD"):
            build.steps.append(_copy(op, rest, build, ctx, n))
        else:
            raise invalid(f"Dockerfile line {n}: {op} is not supported")
    if build is None:
        raise invalid("the Dockerfile has no FROM")
    return build


def _exec_form(rest: str, n: int) -> str | None:
    if not rest.startswith("["):
        return None
    try:
        argv = json.loads(rest)
    except ValueError:
        return None  # Docker runs it as shell form too
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise invalid(f"Dockerfile line {n}: a JSON RUN must be a list of strings")
    return shlex.join(argv)


def _copy(op: str, rest: str, build: Build, ctx: Path, n: int) -> Copy:
    chown = None
    words = _exec_form(rest, n)
    parts = shlex.split(words) if words is not None else rest.split()
    while parts and parts[0].startswith("--"):
        flag = parts.pop(0)
        if flag.startswith("--chown="):
            chown = _subst(flag.split("=", 1)[1], build.env)
        elif flag.startswith("--chmod="):
            raise invalid(f"Dockerfile line {n}: {op} --chmod is not supported")
        else:
            raise invalid(f"Dockerfile line {n}: {op} {flag} needs Docker")
    if len(parts) < 2:
        raise invalid(f"Dockerfile line {n}: {op} needs a source and a destination")
    *srcs, dest = (_subst(p, build.env) for p in parts)
    sources: list[Path] = []
    for s in srcs:
        if "://" in s:
            raise invalid(f"Dockerfile line {n}: {op} from a URL is not supported")
        hits = sorted(glob.glob(str(ctx / s))) if glob.has_magic(s) else [str(ctx / s)]
        if not hits:
            raise invalid(f"Dockerfile line {n}: {s!r} matches nothing in the build context")
        for h in hits:
            p = Path(h).resolve()
            if p != ctx and ctx not in p.parents:
                raise invalid(f"Dockerfile line {n}: {s!r} is outside the build context")
            if not p.exists():
                raise invalid(f"Dockerfile line {n}: {s!r} is not in the build context")
            sources.append(p)
    dest_is_dir = dest.endswith("/") or len(sources) > 1
    return Copy(tuple(sources), _abs(dest, build.workdir), dest_is_dir, chown)
