"""A Dockerfile as a ``corral.Image`` recipe (the builder: corral.sdk.build). Both
``corral image build`` and ``corral tasks run`` (a task's environment/Dockerfile) read
Dockerfiles here.

Built: stages (``FROM image [AS name]``, ``--platform=linux/amd64`` allowed; ``FROM name`` of
an earlier stage continues it), RUN (shell or JSON form), COPY and ADD of local files,
directories and globs (relative to the context, never outside it, checked here, before
anything runs; ``--chown``), ``COPY --from=`` an earlier stage (by name or index) or an image,
ENV, ARG (a default, ``--build-arg`` overrides it; those before the first FROM are for FROM
lines, and a stage names one again with a bare ``ARG K`` to use it), WORKDIR, USER, LABEL,
MAINTAINER (a label), CMD, ENTRYPOINT, EXPOSE, STOPSIGNAL, and comments and ``\\`` line
continuations. ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` of ARGs and ENVs are substituted in
every instruction but RUN (its shell expands its own; ARGs are in its environment). The
result is the last stage, or ``target``; its recipe holds the stages it copies from, so a
build builds those only. Anything else (``COPY --chmod``, RUN flags, ADD of a URL or an
archive, SHELL, ONBUILD; VOLUME and HEALTHCHECK unless the caller ignores them) is
build_failed naming the line, never built half-way; so is a ``--from`` of the stage itself
(``reason``: stage_cycle), of a later stage (later_stage), of an index past the last stage
(unknown_stage), a second stage of one name (duplicate_stage) and an unknown ``target``
(unknown_target)."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

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


_STAGE_NAME = re.compile(r"^[a-z][a-z0-9._-]*$")


def _stage_fail(n: int, reason: str, msg: str, **details: object) -> BuildFailed:
    return BuildFailed(f"line {n}: {msg}", details={"line": n, "reason": reason, **details})


@dataclass
class _Stage:
    name: str | None
    image: Image
    env: dict[str, str] = field(default_factory=dict)  # ENVs so far, for substitution
    args: dict[str, str] = field(default_factory=dict)  # this stage's ARGs


def _from(rest: str, n: int, meta: Mapping[str, str]) -> tuple[str, str | None]:
    """(base, stage name) of a FROM line, its ARGs (those before the first FROM) substituted."""
    words = _subst(rest, meta).split()
    if words and words[0].lower() == "--platform=linux/amd64":
        words = words[1:]
    if len(words) == 3 and words[1].upper() == "AS":
        name = words[2].lower()
        if not _STAGE_NAME.match(name):
            raise _fail(n, f"bad stage name {words[2]!r} (a letter, then letters, digits, "
                        "'.', '_' or '-')")
        return words[0], name
    if len(words) != 1:
        raise _fail(n, "FROM takes one image (corral builds linux/amd64 only)")
    return words[0], None


def _arg_pairs(rest: str, n: int, values: Mapping[str, str]) -> dict[str, str | None]:
    """``K=V`` pairs (substituted) and bare ``K``s (None) of an ARG line."""
    try:
        words = shlex.split(rest)
    except ValueError as e:
        raise _fail(n, f"ARG: {e}") from None
    if not words:
        raise _fail(n, "ARG needs an argument")
    out: dict[str, str | None] = {}
    for w in words:
        k, sep, v = w.partition("=")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise _fail(n, f"bad ARG name {k!r}")
        out[k] = _subst(v, {**values, **{a: b for a, b in out.items() if b is not None}}) \
            if sep else None
    return out


def parse(text: str, context: str, build_args: Mapping[str, str] | None = None, *,
          ignore: Collection[str] = (), target: str | None = None) -> Image:
    """The recipe of Dockerfile ``text`` whose COPY/ADD sources are under ``context``;
    instructions named in ``ignore`` (of RUNTIME_ONLY) are skipped rather than refused.
    ``target``: the stage whose image is the result (default the last); a build of it builds
    only the stages it copies from or stands on."""
    given = dict(build_args or {})
    meta: dict[str, str] = {}  # ARGs before the first FROM: for FROM lines (and ARG K later)
    stages: list[_Stage] = []
    lines = _lines(text)
    # every stage's name (None: unnamed) by index, for --from of a later one
    names: list[str | None] = []
    for _, line in lines:
        words = line.split()
        if words[0].upper() == "FROM":
            named = len(words) >= 3 and words[-2].upper() == "AS"
            names.append(words[-1].lower() if named else None)

    for n, line in lines:
        instr, _, rest = line.strip().partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            base, name = _from(rest, n, meta)
            if name is not None and any(st.name == name for st in stages):
                raise _stage_fail(n, "duplicate_stage", f"a second stage named {name!r}",
                                  stage=name)
            parent = next((st for st in stages if st.name == base.lower()), None)
            if parent is not None:  # an earlier stage as the base: its steps, then these
                image = Image(parent.image.base, parent.image.steps, stage=name)
                stages.append(_Stage(name, image, dict(parent.env)))
            else:
                stages.append(_Stage(name, Image(base, stage=name)))
            continue
        if instr == "ARG":
            scope = stages[-1].args if stages else meta
            for k, v in _arg_pairs(rest, n, {**scope, **(stages[-1].env if stages else {})}
                                   ).items():
                if k in given:
                    scope[k] = given[k]
                elif v is not None:
                    scope[k] = v
                elif stages and k in meta:  # a global ARG named again inside a stage
                    scope[k] = meta[k]
                # else declared with no value: unset, as Docker leaves it
            continue
        if not stages:
            raise _fail(n, f"{instr} before FROM")
        st = stages[-1]
        if instr in ignore and instr in RUNTIME_ONLY:
            continue
        values = {**st.args, **st.env}
        if instr != "RUN":
            rest = _subst(rest, values) if instr not in ("ENV", "LABEL") else rest
        image = st.image
        if instr == "RUN":
            if rest.startswith("--"):
                raise _fail(n, f"RUN options ({rest.split()[0]}) are not supported")
            argv = _json_list(rest, n)
            arg_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in st.args.items())
            if argv is not None:
                image = image.run_commands(argv)
            else:  # ARGs are in the environment of RUN, as Docker does
                image = image.run_commands(f"{'export ' + arg_env + '; ' if arg_env else ''}"
                                           f"{rest}")
        elif instr in ("COPY", "ADD"):
            image = image._add(_copy(instr, rest, context, n, stages, names))
        elif instr == "ENV":
            pairs = _pairs(rest, n, "ENV", values)
            st.env.update(pairs)
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
        st.image = image
    if not stages:
        raise BuildFailed("the Dockerfile has no FROM")
    if target is None:
        return stages[-1].image
    for st in stages:
        if st.name == target.lower():
            return st.image
    raise BuildFailed(f"no stage named {target!r} (stages: "
                      f"{', '.join(str(x) for x in names if x) or 'none named'})",
                      details={"reason": "unknown_target", "target": target,
                               "stages": [x for x in names if x]})


def _stage_of(ref: str, n: int, stages: list[_Stage], names: list[str | None]) -> Image | None:
    """The earlier stage ``--from=ref`` names (an index or a name), or None for an image."""
    cur = len(stages) - 1
    if ref.isdigit():
        idx = int(ref)
        if idx >= len(names):
            raise _stage_fail(n, "unknown_stage", f"--from={ref}: there are {len(names)} "
                              "stages (counted from 0)", stage=ref)
    elif ref.lower() in names:
        idx = names.index(ref.lower())
    else:
        return None
    if idx == cur:
        raise _stage_fail(n, "stage_cycle", f"--from={ref} is the stage it is in", stage=ref)
    if idx > cur:
        raise _stage_fail(n, "later_stage", f"--from={ref} is a later stage; a stage copies "
                          "only from stages before it", stage=ref)
    return stages[idx].image


def _copy(instr: str, rest: str, context: str, n: int, stages: list[_Stage],
          names: list[str | None]) -> Step:
    flags: list[str] = []
    while rest.startswith("--"):  # flags come before a JSON form's list
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.lstrip()
    try:
        words = _json_list(rest, n) or shlex.split(rest)
    except ValueError as e:
        raise _fail(n, f"{instr}: {e}") from None
    chown = from_ = None
    for flag in flags:
        key, _, value = flag.partition("=")
        if key == "--chown" and value:
            chown = value
        elif key == "--from" and value and instr == "COPY":
            from_ = value
        else:
            raise _fail(n, f"{instr} option {key} is not supported (only --chown"
                        f"{' and --from' if instr == 'COPY' else ''})")
    if len(words) < 2:
        raise _fail(n, f"{instr} needs a source and a destination")
    srcs = words[:-1]
    if from_ is not None:
        stage = _stage_of(from_, n, stages, names)
        args: dict[str, object] = {"source": stage if stage is not None else from_,
                                   "from": from_, "srcs": srcs, "dest": words[-1]}
        if stage is None:  # an image, or neither: the builder says which
            args["stages"] = [x for x in names if x]
        if chown is not None:
            args["chown"] = chown
        return Step("copy_from", args)
    if instr == "ADD" and any(s.endswith(_ARCHIVE) for s in srcs):
        raise _fail(n, "ADD of an archive (auto-extract) is not supported; COPY it and RUN tar")
    paths = _sources(srcs, context, n, instr)
    copy: dict[str, object] = {"srcs": paths, "dest": words[-1], "context": context}
    if chown is not None:
        copy["chown"] = chown
    return Step("copy", copy)
