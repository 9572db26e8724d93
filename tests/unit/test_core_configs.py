"""The Rust core's configs cross into it as typed classes: keyword-only, checked when made,
and the calls take nothing else (no dict matched by key name). Making them needs no root."""

from __future__ import annotations

import pytest

_core = pytest.importorskip("corral._core")


def overlay():  # type: ignore[no-untyped-def]
    return _core.Overlay(target="/", lower=["/l"], upper="/u", work="/w")


def test_configs_are_keyword_only_and_typed():
    with pytest.raises(TypeError):
        _core.ExecConfig(1, 2, ["true"])  # positional
    with pytest.raises(TypeError):
        _core.ExecConfig(init_pid=1, pidfd=2, argv="true")  # a str is not a list
    with pytest.raises(TypeError):
        _core.ExecConfig(init_pid=1, pidfd=2, argv=["true"], uid="0")
    with pytest.raises(TypeError):
        _core.ExecConfig(init_pid=1, argv=["true"])  # pidfd is required
    with pytest.raises(TypeError):
        _core.ExecConfig(init_pid=1, pidfd=2, argv=["true"], cmd="true")  # no such argument
    with pytest.raises(OverflowError):
        _core.ExecConfig(init_pid=1, pidfd=2, argv=["true"], uid=1 << 32)
    with pytest.raises(TypeError):
        _core.SpawnConfig(init_fd=3, root="/r", overlays=[{"target": "/"}])  # not an Overlay
    _core.SpawnConfig(init_fd=3, root="/r", overlays=[overlay()], rlimits={"nofile": 64})


def test_rlimits_are_checked_when_made():
    for bad in ({"bogus": 1}, {"nofile": (10, 5)}, {"nofile": "many"}, {1: 1}):
        with pytest.raises(ValueError):
            _core.ExecConfig(init_pid=1, pidfd=2, argv=["true"], rlimits=bad)
        with pytest.raises(ValueError):
            _core.SpawnConfig(init_fd=3, root="/r", overlays=[overlay()], rlimits=bad)


def test_the_calls_take_only_the_classes():
    """A dict is refused before anything is done (no process, no syscall)."""
    with pytest.raises(TypeError):
        _core.exec_in({"init_pid": 1, "pidfd": 2, "argv": ["true"]})
    with pytest.raises(TypeError):
        _core.spawn_sandbox({"init_fd": 3, "root": "/r", "overlays": []})
    with pytest.raises(TypeError):
        _core.spawn_sandbox(_core.ExecConfig(init_pid=1, pidfd=2, argv=["true"]))


def _enter_in_a_child(entry, stdio) -> str:  # type: ignore[no-untyped-def]
    """``entry.enter(stdio)`` in a forked child (should it wrongly get past its checks, it
    acts on the child only): the error's type name, or "entered"."""
    import os

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            entry.enter(stdio)
            out = "entered"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = type(e).__name__
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 100).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return got


def test_zygote_entry_checks_its_arguments_before_any_syscall():
    def entry_for(dir: str, rlimits: list) -> object:  # type: ignore[type-arg]
        return _core.ZygoteEntry(join=[], dir=dir, umask=0o077, uid=1, gid=1, rlimits=rlimits)

    with pytest.raises(TypeError):
        _core.ZygoteEntry([], "/tmp", 0o077, 1, 1, [])  # positional
    with pytest.raises(ValueError):
        entry_for("/tmp/\0x", [])
    with pytest.raises(ValueError):
        entry_for("/tmp", [("bogus", 1, 1)])
    entry = entry_for("/nonexistent-dir", [])
    for bad in ([(5, 0, False), (6, 0, False)],     # a target twice, none for 1
                [(5, 1, False)],                     # a gap: no target 0
                [(-1, 0, False)],                    # no such source
                [(5, 0, False), (6, 2, False)],      # a gap: no target 1
                [(5, i, False) for i in range(9)]):  # more than it takes
        assert _enter_in_a_child(entry, bad) == "ValueError", bad
