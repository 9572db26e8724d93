"""One exception hierarchy for the SDK, the daemon and the CLI.

Every error that crosses the API carries a stable ``code`` (a lowercase snake_case string) and an
HTTP status. The daemon raises these classes; the wire form is
``{"error": {"code": ..., "message": ..., "details": {...}}}``; the SDK maps the code back to the
same class with :func:`error_from_payload`. Codes are part of the public API: never rename one.

Every error has a ``category``, the failure taxonomy a trainer masks by (docs/trajectory.md,
"Masking"):

- ``infra``: the cause is outside the sandbox and outside the agent (node or daemon lost, the
  daemon restarted or unreachable, an operator's kill, no capacity): mask the rollout;
- ``limit``: the agent hit one of its own resource limits (out of memory, its TTL or idle
  timeout, its disk): the rollout's own outcome, score it;
- ``task``: the request or the command failed on its own (a missing file, a bad argument, a
  crash of what ran): score it.

``infra`` is ``category == "infra"``. The wire body carries both.
"""

from __future__ import annotations

from typing import Any, Literal

Category = Literal["infra", "limit", "task"]
CATEGORIES: tuple[str, ...] = ("infra", "limit", "task")


class CorralError(Exception):
    """Base class of every corral error."""

    code: str = "internal"
    status: int = 500
    CATEGORY: str = "task"  # the class's category; an instance may refine it (_category)

    def __init__(self, message: str = "", *, details: dict[str, Any] | None = None,
                 code: str | None = None, category: str | None = None) -> None:
        super().__init__(message or self.__class__.__name__)
        self.message = message or self.__class__.__name__
        self.details = details or {}
        if code is not None:
            self.code = code
        # The category the sender gave (error_from_payload), else the class's.
        self._given = category if category in CATEGORIES else None

    def _category(self) -> str:
        return self.CATEGORY

    @property
    def category(self) -> str:
        """``infra``, ``limit`` or ``task`` (module docstring)."""
        return self._given or self._category()

    @property
    def infra(self) -> bool:
        """A failure of the platform, not of the agent: mask the rollout."""
        return self.category == "infra"

    def to_payload(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details,
                          "category": self.category, "infra": self.infra}}

    def __reduce__(self):  # picklable across Ray / multiprocessing boundaries
        return (_rebuild, (self.code, self.message, self.details, self._given))

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


# --- request errors -------------------------------------------------------------------------
class InvalidRequest(CorralError):
    code, status = "invalid_request", 400


class InvalidPath(InvalidRequest):
    """A path that is not absolute, is malformed, or resolves outside the sandbox root."""

    code, status = "invalid_path", 400


class ForbiddenPath(InvalidPath):
    """A path the files API never serves: anything on a kernel pseudo-filesystem (/proc, /sys,
    cgroupfs, devpts, debugfs, ...) and device nodes, FIFOs and sockets, however reached
    (symlinks, bind mounts, ``..``). 403: a well-formed path that this API refuses to
    serve, which no schema can tell apart from one it serves."""

    code, status = "forbidden_path", 403


class TooLarge(InvalidRequest):
    """A bound on what one request may make the daemon read, write or keep: a snapshot past
    its size, entry or depth limit, an upload past its decompressed size or member count, a
    write past the sandbox's ``disk_mb``. ``details`` names the limit. Category ``limit``
    for the sandbox's disk (``details["limit"]``: ``disk_mb``, or ``disk_share`` when the
    shared scratch area is full and the sandbox holds its fair share of it), else ``task``."""

    code, status = "too_large", 400

    def _category(self) -> str:
        return "limit" if self.details.get("limit") in ("disk_mb", "disk_share") else "task"


class InvalidNetwork(InvalidRequest):
    """A sandbox spec's ``network`` is no mode (``none``, ``disabled``, ``internet``), no
    named allowlist of the daemon's, or a policy with a malformed rule (docs/network.md)."""

    code, status = "invalid_network", 400


class PermissionDenied(InvalidRequest):
    """The sandbox's files refuse the operation (EACCES, EPERM, EROFS): a read-only mount, a
    file only its owner may touch. The request was well formed."""

    code, status = "permission_denied", 403


class Unauthorized(CorralError):
    code, status = "unauthorized", 401


class Forbidden(CorralError):
    """The credential does not allow this call (a TCP token naming a host path)."""

    code, status = "forbidden", 403


class NotFound(CorralError):
    code, status = "not_found", 404


class SandboxNotFound(NotFound):
    code, status = "sandbox_not_found", 404


class ImageNotFound(NotFound):
    code, status = "image_not_found", 404


class NetworkNotFound(NotFound):
    """No named allowlist by that name in the daemon's config (``details["known"]``)."""

    code, status = "network_not_found", 404


class SnapshotNotFound(NotFound):
    code, status = "snapshot_not_found", 404


class FileNotFound(NotFound):
    code, status = "file_not_found", 404


class CwdNotFound(FileNotFound):
    """An exec's working directory does not exist in the sandbox."""

    code, status = "cwd_not_found", 404


class UserNotFound(NotFound):
    """An exec's ``user`` names nobody in the sandbox's /etc/passwd."""

    code, status = "user_not_found", 404


class ProcessNotFound(NotFound):
    code, status = "process_not_found", 404


class Conflict(CorralError):
    code, status = "conflict", 409


class FileExists(Conflict):
    code, status = "file_exists", 409


class NotADirectory(Conflict):
    code, status = "not_a_directory", 409


class IsADirectory(Conflict):
    code, status = "is_a_directory", 409


class IsASymlink(Conflict):
    """The path ends in a symlink an operation does not follow (a write, a mkdir), or loops
    through symlinks (ELOOP): the sandbox's files, not the request, are in the way."""

    code, status = "is_a_symlink", 409


class DirectoryNotEmpty(Conflict):
    code, status = "directory_not_empty", 409


class FileBusy(Conflict):
    """A process in the sandbox holds the file: it is running it (ETXTBSY), or holds a lease
    on it that the daemon's open would have to wait out (EWOULDBLOCK). The sandbox's own
    processes are in the way, not the platform."""

    code, status = "file_busy", 409


class ProcessStillRunning(Conflict):
    """A wait on a background command ran out of time; the command keeps running. This is the
    command's own slowness, not an infrastructure failure."""

    code, status = "process_running", 409


class ExecStalled(Conflict):
    """The sandbox's init did not start the command in time: something in the sandbox holds
    it (a stopped child of the init, say). The sandbox's own doing, not an infrastructure
    failure."""

    code, status = "exec_stalled", 409


class SnapshotExists(Conflict):
    """A snapshot with that name already exists (names are unique)."""

    code, status = "snapshot_exists", 409


class SnapshotChainTooDeep(InvalidRequest):
    """A snapshot chain with more layers than one overlay mount can stack (the mount options
    are limited to one page): start a fresh sandbox, or snapshot an earlier level."""

    code, status = "snapshot_chain_too_deep", 400


class InvalidSnapshotStream(InvalidRequest):
    """A snapshot import whose stream corral will not store: not a snapshot stream, cut short,
    a member outside its layer, a layer the stream and the node both lack (``details``:
    reason). Nothing of it is kept."""

    code, status = "invalid_snapshot_stream", 400


class SnapshotDigestMismatch(InvalidSnapshotStream):
    """An imported layer whose files do not hash to the digest it was sent as: refused,
    nothing of it kept."""

    code, status = "snapshot_digest_mismatch", 400


class SandboxNotRunning(Conflict):
    """The sandbox exists (or existed) but is no longer running: killed by its own client
    (``details["reason"] == "killed"``), or not started yet (``"starting"``), or being
    restored (``"restoring"``). Category ``task``; the subclasses below sort the other
    endings."""

    code, status = "sandbox_not_running", 409


class SandboxKilled(SandboxNotRunning):
    """An operator killed the sandbox under its trajectory (``details["reason"] ==
    "operator_killed"``): a DELETE (``corral rm``, a batch destroy) of a sandbox made for a
    trajectory that did not carry one of that trajectory's keys. Category ``infra``: mask it.
    409, like every "not running" error."""

    code, status = "sandbox_killed", 409
    CATEGORY = "infra"


class SandboxExpired(SandboxNotRunning):
    """The sandbox's TTL (``details["reason"] == "expired"``) or idle timeout
    (``"idle_timeout"``) ran out. Category ``limit``: the agent's own limits."""

    code, status = "sandbox_expired", 409
    CATEGORY = "limit"


class SandboxCrashed(SandboxNotRunning):
    """The sandbox ended because of what ran in it: its memory cgroup ran out of memory
    (``details["cause"] == "oom"``, category ``limit``), it reached its process limit where
    that ends the whole sandbox (``"pids"``, category ``limit``) or its init ended in a way nothing
    outside asked for (``"init_exited"``, with ``"status"``, category ``task``). Not an
    infrastructure failure: the rollout's own outcome. 409, like every "not running" error, so
    a client that does not know the code still sees a non-infra conflict (410 is
    ``sandbox_lost``'s)."""

    code, status = "sandbox_crashed", 409

    def _category(self) -> str:
        return "limit" if self.details.get("cause") in ("oom", "pids") else "task"


class SandboxAtLimit(Conflict):
    """A command could not start because the sandbox is at one of its own limits: its
    processes fill its process limit (``details["limit"] == "pids"``, with ``max``), so not
    even the command's first process could be made. Category ``limit``: what ran in the
    sandbox did this (an agent that leaves processes behind until no command can start is
    scored, never masked). The sandbox keeps running; a command starts again once some of
    its processes end or are killed. Also a pause that a thread of the sandbox held off,
    running in a syscall the freezer cannot stop past the daemon's wait
    (``details["limit"] == "freeze"``)."""

    code, status = "sandbox_at_limit", 409
    CATEGORY = "limit"


class ReplayDivergence(Conflict):
    """An idempotency key already logged for a different request (trajectory log): the client
    is replaying a trajectory that does not match what was recorded."""

    code, status = "replay_divergence", 409


class Unsupported(CorralError):
    """A feature or substrate that is not available on this daemon or host, or an operation
    the sandbox's substrate lacks (its capability table): refused before anything is done."""

    code, status = "unsupported", 501
    CATEGORY = "task"  # the caller asked for what this substrate does not do


# --- infrastructure errors: mask these rollouts, don't learn from them ------------------------
class InvalidImage(InvalidRequest):
    """An image the daemon will not unpack: a manifest, config or layer that breaks the OCI
    rules or corral's unpack policy (a ``..`` name, a write through a symlink, a hard link out
    of its layer, no linux/amd64 variant, a schema-1 manifest). ``details`` says which."""

    code, status = "invalid_image", 400


class BuildFailed(InvalidRequest):
    """An image build step failed: a command exited non-zero (``details``: the step, its
    exit code and the tail of its output), or the recipe or Dockerfile has an instruction
    corral does not build. The step left no layer."""

    code, status = "build_failed", 400


class ImagePullFailed(CorralError):
    """The registry could not be reached or answered with an error (``details``: registry,
    reference, the HTTP status if any). Category ``infra``: not the agent's doing."""

    code, status = "image_pull_failed", 502
    CATEGORY = "infra"


class RegistryUnauthorized(ImagePullFailed):
    """The registry refused the credentials (or wants some and none are configured in
    ``$DOCKER_CONFIG/config.json`` / ``~/.docker/config.json``)."""

    code, status = "registry_unauthorized", 403
    CATEGORY = "task"


class DigestMismatch(ImagePullFailed):
    """A manifest or blob did not hash to the digest it was fetched by: rejected, nothing of
    it kept."""

    code, status = "digest_mismatch", 502


class InfraError(CorralError):
    code, status = "infra_error", 503
    CATEGORY = "infra"


class SnapshotCopyFailed(InfraError):
    """The cluster could not copy a snapshot's layers to the node chosen for a create from it
    (``details``: snapshot, source, target, cause); nothing half-imported stays there."""

    code, status = "snapshot_copy_failed", 502


class CapacityExceeded(InfraError):
    code, status = "capacity_exceeded", 429


class QuotaExceeded(CapacityExceeded):
    """The tenant holds as many live sandboxes on this daemon as its quota allows (the
    tokens file's ``max_sandboxes``, else ``CORRAL_TENANT_MAX_SANDBOXES``), or has as many
    image pulls under way as a tenant may (``details.resource == "pulls"``), or its
    snapshots hold as many records (``"snapshots"``, ``CORRAL_TENANT_MAX_SNAPSHOTS``) or bytes
    (``"snapshot_bytes"``, ``CORRAL_TENANT_SNAPSHOT_MB``) as it may, or its live sandboxes'
    trajectory logs hold its log budget (``"log_bytes"``, ``CORRAL_TENANT_LOG_MB``), or its
    clients hold its share of the TCP listener's connections (``"connections"``,
    ``CORRAL_TCP_MAX_CONNECTIONS_PER_TENANT``; that connection is closed): not the task's
    failure; free one or wait."""

    code = "quota_exceeded"


class SandboxLost(InfraError):
    """The sandbox died for a reason outside it (its init killed by the host with no
    out-of-memory kill recorded in it, node or daemon lost); see SandboxCrashed for the
    sandbox's own failures."""

    code, status = "sandbox_lost", 410


class DaemonRestarted(InfraError):
    """The daemon restarted while the call was in flight; its outcome is unknown."""

    code, status = "daemon_restarted", 503


class StepInterrupted(InfraError):
    """A retry of a keyed call that was in flight when the daemon died: the log says it
    started and never finished, so it may have run, in whole or in part. Its key stays bound
    to this error, so the call never runs twice; ``details`` says what is known (op, key,
    sandbox, ``started_at``, the log entry's ``seq``). Mask the rollout."""

    code, status = "step_interrupted", 409


class DaemonUnavailable(InfraError):
    """No daemon answered (client side only)."""

    code, status = "daemon_unavailable", 503


class Timeout(InfraError):
    """A request to the daemon timed out (not a command's own timeout: see ExecResult)."""

    code, status = "timeout", 504


class InternalError(InfraError):
    code, status = "internal", 500


def _all_subclasses(cls: type[CorralError]) -> list[type[CorralError]]:
    out: list[type[CorralError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_EVERY_ERROR: list[type[CorralError]] = [CorralError, *_all_subclasses(CorralError)]
ERROR_CLASSES: dict[str, type[CorralError]] = {c.code: c for c in _EVERY_ERROR}


def error_from_payload(payload: dict[str, Any], status: int | None = None) -> CorralError:
    """Turn a wire error ``{"error": {...}}`` back into the matching exception."""
    body = payload.get("error", payload) if isinstance(payload, dict) else {}
    code = str(body.get("code", "internal"))
    cls = ERROR_CLASSES.get(code)
    # The sender's category wins (a newer daemon may sort finer); without one (an older
    # daemon, an old log entry) the class decides.
    category = body.get("category")
    if category not in CATEGORIES:
        category = None
    if cls is None:
        # An unknown code (newer daemon): keep the code; the class by category, else status.
        infra = category == "infra" if category else (status or 500) >= 500
        cls = InfraError if infra else CorralError
        return cls(str(body.get("message", "")), details=body.get("details"), code=code,
                   category=category)
    return cls(str(body.get("message", "")), details=body.get("details"), category=category)


def _rebuild(code: str, message: str, details: dict[str, Any],
             category: str | None = None) -> CorralError:
    return error_from_payload({"error": {"code": code, "message": message, "details": details,
                                         "category": category}})
