"""OpenAI-style function-calling tools over a sandbox, for any agent loop.

``SPECS`` are the tool definitions to hand a model (``tools=SPECS``): ``bash``, ``read_file``,
``write_file``, ``str_replace``. ``execute(sandbox, call)`` (``aexecute`` for an AsyncSandbox)
runs one call and returns a ToolResult, never raising for a bad call: a malformed call, a
missing file or an ambiguous replacement is ``is_error`` with a message the model can read.
A platform failure is ``infra`` (corral.rl.episode.is_infra): the caller masks the episode
instead of showing the model a made-up error. ``parse_tool_calls`` reads calls out of model
text in the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` convention.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corral import errors as ce
from corral.sdk.async_sandbox import AsyncSandbox
from corral.sdk.sandbox import Sandbox

MAX_OUTPUT = 16384        # characters of a result shown to the model (the end is kept)
# The biggest file read_file and str_replace read: a file the agent made (a sparse GiB is
# free to make) is read into the trainer's memory, and only MAX_OUTPUT of it is shown.
MAX_FILE_BYTES = 4 << 20
DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 600.0


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required,
                       "additionalProperties": False}}}


_PATH = {"type": "string", "description": "Absolute path in the sandbox."}
SPECS: list[dict[str, Any]] = [
    _fn("bash", "Run a shell command in the sandbox; returns its output and exit code.",
        {"command": {"type": "string", "description": "The command (run by /bin/sh -c)."},
         "timeout": {"type": "number", "description": f"Seconds (default {DEFAULT_TIMEOUT:g},"
                                                      f" at most {MAX_TIMEOUT:g})."}},
        ["command"]),
    _fn("read_file", "Read a text file from the sandbox.", {"path": _PATH}, ["path"]),
    _fn("write_file", "Write a text file in the sandbox (parents are created; an existing "
        "file is replaced).", {"path": _PATH, "content": {"type": "string"}},
        ["path", "content"]),
    _fn("str_replace", "Replace the one occurrence of old_str in a file with new_str.",
        {"path": _PATH, "old_str": {"type": "string"}, "new_str": {"type": "string"}},
        ["path", "old_str", "new_str"]),
]
NAMES = frozenset(s["function"]["name"] for s in SPECS)


@dataclass
class ToolResult:
    name: str
    content: str
    is_error: bool = False
    infra: bool = False
    call_id: str | None = None

    def message(self) -> dict[str, Any]:
        """The chat message that carries the result back to the model."""
        msg: dict[str, Any] = {"role": "tool", "content": self.content, "name": self.name}
        if self.call_id is not None:
            msg["tool_call_id"] = self.call_id
        return msg


class _BadCall(Exception):
    pass


def _parse(call: Mapping[str, Any]) -> tuple[str, dict[str, Any], str | None]:
    """(name, arguments, id) of an OpenAI tool call (``{"function": {"name", "arguments":
    <JSON text>}}``) or a plain ``{"name", "arguments": {...}}``."""
    if not isinstance(call, Mapping):
        raise _BadCall("a tool call is an object")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise _BadCall("function must be an object")
    name, args = fn.get("name"), fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise _BadCall(f"arguments are not JSON: {e}") from None
    if name not in NAMES:
        raise _BadCall(f"unknown tool {name!r}; tools: {', '.join(sorted(NAMES))}")
    if not isinstance(args, dict):
        raise _BadCall("arguments must be an object")
    cid = call.get("id")
    return str(name), args, cid if isinstance(cid, str) else None


def _str(args: dict[str, Any], key: str) -> str:
    v = args.get(key)
    if not isinstance(v, str):
        raise _BadCall(f"{key} must be a string")
    return v


def _timeout(args: dict[str, Any]) -> float:
    t = args.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= MAX_TIMEOUT:
        raise _BadCall(f"timeout must be a number of seconds, 0 to {MAX_TIMEOUT:g}")
    return float(t)


def _tail(s: str) -> str:
    return s if len(s) <= MAX_OUTPUT else "[...]\n" + s[-MAX_OUTPUT:]


def _bash_text(stdout: str, stderr: str, code: int, timed_out: bool) -> str:
    out = stdout + stderr
    note = f"[timed out, exit code {code}]" if timed_out else f"[exit code {code}]"
    return _tail(out + ("" if not out or out.endswith("\n") else "\n") + note)


def _text(data: bytes, path: str) -> str:
    """A file read with ``max_bytes=MAX_FILE_BYTES + 1``, as text; a bigger one is the
    model's error."""
    if len(data) > MAX_FILE_BYTES:
        raise _BadCall(f"{path} is bigger than {MAX_FILE_BYTES} bytes: look at parts of it with "
                       "bash (head, tail, grep, sed)")
    return data.decode("utf-8", "replace")


def _replace(text: str, old: str, new: str, path: str) -> str:
    if not old:
        raise _BadCall("old_str must not be empty")
    n = text.count(old)
    if n != 1:
        raise _BadCall(f"old_str occurs {n} times in {path}; it must occur exactly once")
    return text.replace(old, new, 1)


def _failed(name: str, cid: str | None, e: Exception) -> ToolResult:
    from corral.rl.episode import is_infra

    if isinstance(e, ce.CorralError):
        return ToolResult(name, f"error: {e.message}", is_error=True, infra=is_infra(e),
                          call_id=cid)
    return ToolResult(name, f"error: {e}", is_error=True, call_id=cid)


def execute(sb: Sandbox, call: Mapping[str, Any]) -> ToolResult:
    """Run one tool call in ``sb``."""
    name, cid = "?", None
    try:
        name, args, cid = _parse(call)
        if name == "bash":
            r = sb.exec(_str(args, "command"), timeout=_timeout(args))
            return ToolResult(name, _bash_text(r.stdout, r.stderr, r.exit_code, r.timed_out),
                              call_id=cid)
        path = _str(args, "path")
        if name == "read_file":
            data = sb.files.read_bytes(path, max_bytes=MAX_FILE_BYTES + 1)
            return ToolResult(name, _tail(_text(data, path)), call_id=cid)
        if name == "write_file":
            sb.files.write(path, _str(args, "content"))
            return ToolResult(name, f"wrote {path}", call_id=cid)
        old, new = _str(args, "old_str"), _str(args, "new_str")
        mode = sb.files.stat(path).mode
        text = _text(sb.files.read_bytes(path, max_bytes=MAX_FILE_BYTES + 1), path)
        sb.files.write(path, _replace(text, old, new, path), mode=mode)
        return ToolResult(name, f"replaced 1 occurrence in {path}", call_id=cid)
    except (_BadCall, ce.CorralError) as e:
        return _failed(name, cid, e)


async def aexecute(sb: AsyncSandbox, call: Mapping[str, Any]) -> ToolResult:
    """``execute`` for an AsyncSandbox."""
    name, cid = "?", None
    try:
        name, args, cid = _parse(call)
        if name == "bash":
            r = await sb.exec(_str(args, "command"), timeout=_timeout(args))
            return ToolResult(name, _bash_text(r.stdout, r.stderr, r.exit_code, r.timed_out),
                              call_id=cid)
        path = _str(args, "path")
        if name == "read_file":
            data = await sb.files.read_bytes(path, max_bytes=MAX_FILE_BYTES + 1)
            return ToolResult(name, _tail(_text(data, path)), call_id=cid)
        if name == "write_file":
            await sb.files.write(path, _str(args, "content"))
            return ToolResult(name, f"wrote {path}", call_id=cid)
        old, new = _str(args, "old_str"), _str(args, "new_str")
        mode = (await sb.files.stat(path)).mode
        text = _text(await sb.files.read_bytes(path, max_bytes=MAX_FILE_BYTES + 1), path)
        await sb.files.write(path, _replace(text, old, new, path), mode=mode)
        return ToolResult(name, f"replaced 1 occurrence in {path}", call_id=cid)
    except (_BadCall, ce.CorralError) as e:
        return _failed(name, cid, e)


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The calls in model text (``<tool_call>{json}</tool_call>``, Hermes/Qwen style). A block
    that is not JSON becomes a call to the tool ``?`` whose execution reports the problem."""
    calls: list[dict[str, Any]] = []
    for block in _TAGGED.findall(text):
        try:
            obj = json.loads(block)
        except ValueError:
            obj = None
        calls.append(obj if isinstance(obj, dict) else {"name": "?", "arguments": {}})
    return calls
