"""A Dockerfile as a ``corral.Image`` recipe (the builder: corral.sdk.build).

Built: one stage of FROM, RUN (shell or JSON form), COPY and ADD of local files and
directories (relative to the context, never outside it), ENV, ARG (``--build-arg``
overrides a default), WORKDIR, USER, LABEL, CMD, ENTRYPOINT, EXPOSE, STOPSIGNAL, and
comments and ``\\`` line continuations. ``$VAR`` / ``${VAR}`` of ARGs and ENVs are
substituted in FROM, COPY, ADD, ENV, LABEL, USER, WORKDIR, EXPOSE (RUN's shell expands its
own). Anything else (a second FROM, ``COPY --from``/``--chown``, ADD of a URL, SHELL, VOLUME,
HEALTHCHECK, ONBUILD) is build_failed naming the line, never ignored."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping

from corral.errors import BuildFailed
from corral.sdk.build import Image, Step

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_SUBSTITUTED = {"FROM", "COPY", "ADD", "ENV", "LABEL", "USER", "WORKDIR", "EXPOSE",
                "STOPSIGNAL"}


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


def _json_list(rest: str) -> list[str] | None:
    if not rest.lstrip().startswith("["):
        return None
    try:
        v = json.loads(rest)
    except ValueError:
        return None
    return v if isinstance(v, list) and all(isinstance(x, str) for x in v) else None


def _pairs(rest: str, n: int, what: str) -> dict[str, str]:
    """``K=V K2="V 2"`` (or the old ``K V`` form) as a dict."""
    words = shlex.split(rest)
    if words and "=" not in words[0]:
        key, _, value = rest.strip().partition(" ")
        return {key: value.strip()}
    out = {}
    for w in words:
        k, sep, v = w.partition("=")
        if not sep or not k:
            raise BuildFailed(f"line {n}: {what} expects KEY=VALUE, got {w!r}",
                              details={"line": n})
        out[k] = v
    return out


def parse(text: str, context: str, build_args: Mapping[str, str] | None = None) -> Image:
    """The recipe of Dockerfile ``text`` whose COPY/ADD sources are under ``context``."""
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    given = dict(build_args or {})
    image: Image | None = None

    def subst(s: str) -> str:
        return _VAR.sub(lambda m: {**args, **env}.get(m.group(1) or m.group(2), ""), s)

    for n, line in _lines(text):
        instr, _, rest = line.strip().partition(" ")
        instr = instr.upper()
        rest = rest.strip()
        if instr in _SUBSTITUTED:
            rest = subst(rest)
        if instr == "ARG":
            k, sep, v = rest.partition("=")
            args[k.strip()] = given.get(k.strip(), v.strip().strip('"') if sep else "")
            continue
        if instr == "FROM":
            if image is not None:
                raise BuildFailed(f"line {n}: a second FROM (multi-stage builds are not "
                                  "supported)", details={"line": n})
            words = rest.split()
            if len(words) != 1 and not (len(words) == 3 and words[1].upper() == "AS"):
                raise BuildFailed(f"line {n}: FROM takes one image (no --platform)",
                                  details={"line": n})
            image = Image(words[0])
            continue
        if image is None:
            raise BuildFailed(f"line {n}: {instr} before FROM", details={"line": n})
        if instr == "RUN":
            argv = _json_list(rest)
            if rest.startswith("--"):
                raise BuildFailed(f"line {n}: RUN options ({rest.split()[0]}) are not "
                                  "supported", details={"line": n})
            arg_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in args.items())
            if argv is not None:
                image = image.run_commands(argv)
            else:  # ARGs are in the environment of RUN, as Docker does
                image = image.run_commands(f"{'export ' + arg_env + '; ' if arg_env else ''}"
                                           f"{rest}")
        elif instr in ("COPY", "ADD"):
            words = _json_list(rest) or shlex.split(rest)
            if any(w.startswith("--") for w in words):
                raise BuildFailed(f"line {n}: {instr} options ({words[0]}) are not supported",
                                  details={"line": n})
            if len(words) < 2:
                raise BuildFailed(f"line {n}: {instr} needs a source and a destination",
                                  details={"line": n})
            srcs = words[:-1]
            if instr == "ADD" and any(re.match(r"^[a-z]+://", s) for s in srcs):
                raise BuildFailed(f"line {n}: ADD of a URL is not supported (only local "
                                  "files)", details={"line": n})
            if any(s.endswith((".tar", ".tar.gz", ".tgz", ".tar.xz")) for s in srcs) \
                    and instr == "ADD":
                raise BuildFailed(f"line {n}: ADD of an archive (auto-extract) is not "
                                  "supported; COPY it and RUN tar", details={"line": n})
            image = image._add(Step("copy", {
                "srcs": [os.path.join(context, s.lstrip("/")) for s in srcs],
                "dest": words[-1], "context": context}))
        elif instr == "ENV":
            pairs = _pairs(rest, n, "ENV")
            env.update(pairs)
            image = image.env(pairs)
        elif instr == "LABEL":
            image = image.label(_pairs(rest, n, "LABEL"))
        elif instr == "WORKDIR":
            image = image.workdir(rest)
        elif instr == "USER":
            image = image.user(rest)
        elif instr in ("CMD", "ENTRYPOINT"):
            argv = _json_list(rest)
            if argv is None:
                argv = ["/bin/sh", "-c", rest]
            image = image.cmd(argv) if instr == "CMD" else image.entrypoint(argv)
        elif instr == "EXPOSE":
            ports = [p if "/" in p else p + "/tcp" for p in rest.split()]
            image = image._add(Step("config", {"changes": {"ExposedPorts": ports}}))
        elif instr == "STOPSIGNAL":
            image = image._add(Step("config", {"changes": {"StopSignal": rest}}))
        else:
            raise BuildFailed(f"line {n}: {instr} is not supported (supported: FROM, RUN, "
                              "COPY, ADD of local files, ENV, ARG, WORKDIR, USER, LABEL, CMD, "
                              "ENTRYPOINT, EXPOSE, STOPSIGNAL)", details={"line": n})
    if image is None:
        raise BuildFailed("the Dockerfile has no FROM")
    return image
