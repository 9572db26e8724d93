"""The engine: registry of sandboxes, lifecycle, admission, TTL/idle reaper, exec, files,
persistence and re-adoption after a restart.

Modules: ``core`` (the Engine: registry, lifecycle, reaper, destroy, pause), ``execs``,
``files``, ``snapshotting`` (snapshots, fork, restore), ``recovery`` (re-adoption at start),
``base`` (the Sandbox record, constants), ``host`` (what the parts need of the Engine).

Policy lives here; mechanism (namespaces, mounts, resource limits, freezing, file syscalls)
in the substrate, reached only through the protocol of ``corral.daemon.substrates.base`` and
gated by each substrate's capability table (an operation it lacks: ``unsupported``, before any
side effect). Nothing here names a substrate.
Cheap substrate calls (create, spawn, small file operations: ~1 ms in the Rust core, GIL
released) run directly on the event loop: a thread hop would cost more than the call. Slow ones
(destroy, tar, big files, image import) go through ``asyncio.to_thread``.

Ending states, as reported to callers (``reason`` in the error details; the category a trainer
masks by in brackets, corral.errors):
  killed -> ``sandbox_not_running`` (409, task): the client's own DELETE. An exec in flight
      when that happens gets the same error, not a fake exit code.
  operator_killed -> ``sandbox_killed`` (409, infra): a DELETE of a sandbox made for a
      trajectory that did not carry one of the trajectory's keys (see by_operator).
  expired, idle_timeout -> ``sandbox_expired`` (409, limit): the TTL / idle timeout it chose.
  crashed -> ``sandbox_crashed`` (409; limit for an OOM kill, else task): the init died
      because of what ran in the sandbox: an OOM kill in its memory limit, or the init ending
      in a way nothing outside does (``details["cause"]``, see Substrate.end_cause).
  lost -> ``sandbox_lost`` (410, infra): the init died, the daemon did not kill it, and
      nothing in the sandbox explains it (the host killed it, the node or daemon failed), or
      an OOM kill from outside its own memory limit did (``details["cause"]`` ``host_oom``).
  shutdown -> ``daemon_restarted`` (503, infra): the daemon stopped while the call was running.
"""
from .base import DEFAULT_PATH, MAX_READ_BYTES, Sandbox, _effective_timeout, by_operator, new_id
from .core import Engine

__all__ = ["DEFAULT_PATH", "MAX_READ_BYTES", "Engine", "Sandbox", "_effective_timeout",
           "by_operator", "new_id"]
