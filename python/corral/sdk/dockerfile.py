"""A Dockerfile as a ``corral.Image`` recipe (the builder: corral.sdk.build). Both
``corral image build`` and ``corral tasks run`` (a task's environment/Dockerfile) read
Dockerfiles here.

Built: one stage of FROM (``--platform=linux/amd64`` allowed), RUN (shell or JSON form), COPY
and ADD of local files, directories and globs (relative to the context, never outside it,
checked here, before anything runs; ``--chown``), ENV, ARG (a default, ``--build-arg``
overrides it), WORKDIR, USER, LABEL, MAINTAINER (a label), CMD, ENTRYPOINT, EXPOSE,
STOPSIGNAL, and comments and ``\\`` line continuations. ``$VAR`` / ``${VAR}`` /
``${VAR:-default}`` of ARGs and ENVs are substituted in every instruction but RUN (its shell
expands its own; ARGs are in its environment). Anything else (a second FROM, ``COPY
--from``/``--chmod``, RUN flags, ADD of a URL or an archive, SHELL, ONBUILD; VOLUME and
HEALTHCHECK unless the caller ignores them) is build_failed naming the line, never built
half-way."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
from collections.abc import Collection, Mapping

from corral.errors import BuildFailed
from corral.sdk.build import Image, Step

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
# What only describes a container at run time: a caller with no use for it (a task's
# environment, whose trials run their own commands) may pass these as ``ignore``.
RUNTIME_ONLY = frozenset({"VOLUME", "HEALTHCHECK"})
_ARCHIVE = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tbz2")


def _fail(n: int, msg: str) -> BuildFailed:
    return BuildFailed(f"line {n}: {msg}", details={"line": n})


def _lines(text: str) -> list[tuple[int, str]]:
    """Logical lines (continuations joined, comments and blanks dropped) with their first
    line number."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf.strip():
        out.append((start, buf))
    return out


def _subst(s: str, values: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: values.get(m.group(1) or m.group(3), m.group(2) or ""), s)


def _json_list(rest: str, n: int) -> list[str] | None:
    if not rest.lstrip().startswith("["):
        return None
    try:
        v = json.loads(rest)
    except ValueError:
        return None  # Docker runs it as the shell form
    if not (isinstance(v, list) and v and all(isinstance(x, str) for x in v)):
        raise _fail(n, "a JSON form must be a non-empty list of strings")
    return v


def _pairs(rest: str, n: int, what: str, values: Mapping[str, str]) -> dict[str, str]:
    """``K=V K2="V 2"`` (or the old ``K V`` form; ARG: a bare ``K``) as a dict, each value
    substituted with ``values`` and the pairs before it."""
    try:
        words = shlex.split(rest)
    except ValueError as e:
        raise _fail(n, f"{what}: {e}") from None
    if not words:
        raise _fail(n, f"{what} needs an argument")
    if "=" not in words[0]:
        if what == "ARG":
            return {w: "" for w in words}
        key, _, value = rest.strip().partition(" ")
        return {key: _subst(value.strip(), values)}
    out: dict[str, str] = {}
    for w in words:
        k, sep, v = w.partition("=")
        if not sep or not k:
            raise _fail(n, f"{what} expects KEY=VALUE, got {w!r}")
        out[k] = _subst(v, {**values, **out})
    return out


def _sources(srcs: list[str], context: str, n: int, instr: str) -> list[str]:
    """The sources as paths under ``context``: globs expanded, each one there and inside."""
    base = os.path.realpath(context)
    out: list[str] = []
    for s in srcs:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", s):
            raise _fail(n, f"{instr} of a URL is not supported (only local files)")
        path = os.path.join(base, s.lstrip("/"))
        hits = sorted(glob.glob(path)) if glob.has_magic(s) else [path]
        for h in hits:  # outside first: nothing is said of what exists out there
            real = os.path.realpath(h)
            if real != base and not real.startswith(base + "/"):
                raise _fail(n, f"{instr} source {s!r} is outside the build context")
        if not hits or not all(os.path.lexists(h) for h in hits):
            raise _fail(n, f"{instr} source {s!r} is not in the build context")
        out.extend(hits)
    return out


def parse(text: str, context: str, build_args: Mapping[str, str] | None = None, *,
          ignore: Collection[str] = ()) -> Image:
    """The recipe of Dockerfile ``text`` whose COPY/ADD sources are under ``context``;
    instructions named in ``ignore`` (of RUNTIME_ONLY) are skipped rather than refused."""
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    given = dict(build_args or {})
    image: Image | None = None

    for n, line in _lines(text):
        instr, _, rest = line.strip().partition(" ")
        instr, rest = instr.upper(), rest.strip()
        values = {**args, **env}
        if instr == "ARG":
            for k, v in _pairs(rest, n, "ARG", values).items():
                args[k] = given.get(k, v)
            continue
        if instr == "FROM":
            if image is not None:
                raise _fail(n, "a second FROM (multi-stage builds are not supported)")
            words = _subst(rest, values).split()
            if words and words[0].lower() == "--platform=linux/amd64":
                words = words[1:]
            if len(words) != 1 and not (len(words) == 3 and words[1].upper() == "AS"):
                raise _fail(n, "FROM takes one image (corral builds linux/amd64 only)")
            image = Image(words[0])
            continue
        if image is None:
            raise _fail(n, f"{instr} before FROM")
        if instr in ignore and instr in RUNTIME_ONLY:
            continue
        if instr != "RUN":
            rest = _subst(rest, values) if instr not in ("ENV", "LABEL") else rest
        if instr == "RUN":
            if rest.startswith("--"):
                raise _fail(n, f"RUN options ({rest.split()[0]}) are not supported")
            argv = _json_list(rest, n)
            arg_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in args.items())
            if argv is not None:
                image = image.run_commands(argv)
            else:  # ARGs are in the environment of RUN, as Docker does
                image = image.run_commands(f"{'export ' + arg_env + '; ' if arg_env else ''}"
                                           f"{rest}")
        elif instr in ("COPY", "ADD"):
            image = image._add(_copy(instr, rest, context, n))
        elif instr == "ENV":
            pairs = _pairs(rest, n, "ENV", values)
            env.update(pairs)
            image = image.env(pairs)
        elif instr in ("LABEL", "MAINTAINER"):
            image = image.label(_pairs(rest, n, "LABEL", values) if instr == "LABEL"
                                else {"maintainer": _subst(rest, values)})
        elif instr == "WORKDIR":
            image = image.workdir(rest)
        elif instr == "USER":
            image = image.user(rest)
        elif instr in ("CMD", "ENTRYPOINT"):
            argv = _json_list(rest, n) or ["/bin/sh", "-c", rest]
            image = image.cmd(argv) if instr == "CMD" else image.entrypoint(argv)
        elif instr == "EXPOSE":
            ports = [p if "/" in p else p + "/tcp" for p in rest.split()]
            image = image._add(Step("config", {"changes": {"ExposedPorts": ports}}))
        elif instr == "STOPSIGNAL":
            image = image._add(Step("config", {"changes": {"StopSignal": rest}}))
        else:
            raise _fail(n, f"{instr} is not supported (supported: FROM, RUN, COPY, ADD of "
                        "local files, ENV, ARG, WORKDIR, USER, LABEL, MAINTAINER, CMD, "
                        "ENTRYPOINT, EXPOSE, STOPSIGNAL)")
    if image is None:
        raise BuildFailed("the Dockerfile has no FROM")
    return image


def _copy(instr: str, rest: str, context: str, n: int) -> Step:
    try:
        words = _json_list(rest, n) or shlex.split(rest)
    except ValueError as e:
        raise _fail(n, f"{instr}: {e}") from None
    chown = None
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        if flag.startswith("--chown=") and len(flag) > len("--chown="):
            chown = flag.split("=", 1)[1]
        else:
            raise _fail(n, f"{instr} option {flag.split('=')[0]} is not supported "
                        "(only --chown)")
    if len(words) < 2:
        raise _fail(n, f"{instr} needs a source and a destination")
    srcs = words[:-1]
    if instr == "ADD" and any(s.endswith(_ARCHIVE) for s in srcs):
        raise _fail(n, "ADD of an archive (auto-extract) is not supported; COPY it and RUN tar")
    paths = _sources(srcs, context, n, instr)
    args = {"srcs": paths, "dest": words[-1], "context": context}
    if chown is not None:
        args["chown"] = chown
    return Step("copy", args)
