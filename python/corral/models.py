"""Wire models shared by the daemon and the SDK (pydantic v2).

These are the API's request and response bodies. The daemon validates requests with them (a
validation failure is ``invalid_request``) and the SDK parses responses with them, so both sides
agree by construction. Field limits here are the API's limits: absurd values are refused.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

# The substrates corral names; a daemon serves some of them (GET /v1/substrates). A create
# naming one it does not serve is unsupported (501); any other name, invalid_request.
SUBSTRATES = ("process", "container", "gvisor", "microvm", "vm")
SUBSTRATE_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
Substrate = Annotated[str, Field(pattern=SUBSTRATE_PATTERN, description=(
    "the substrate that runs the sandbox: container (default), or another one the daemon "
    "serves (GET /v1/substrates)"))]
NetworkMode = Literal["none", "disabled", "internet"]
# "none": a network namespace of the sandbox's own with only loopback. "disabled": no socket
# but AF_UNIX (seccomp), in one empty namespace shared by all such sandboxes (docs/isolation.md).
# "internet": egress through the daemon's NAT, minus what is always denied (docs/network.md).
# Any other name is one of the daemon's named allowlists; a NetworkPolicy lists rules.
NETWORK_MODES = ("none", "disabled", "internet")
NetworkKind = Literal["none", "disabled", "internet", "policy"]
NETWORK_NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
NetworkName = Annotated[str, Field(pattern=NETWORK_NAME_PATTERN, description=(
    "a mode (none, disabled, internet) or a named allowlist of the daemon's (GET /v1/networks)"))]
NetworkRule = Annotated[str, Field(min_length=1, max_length=300, description=(
    "name[:ports], *.suffix[:ports], a.b.c.d[/len][:ports], or @allowlist (allow only)"))]
SandboxState = Literal["starting", "running", "paused", "restoring", "stopping", "dead"]
PauseTTL = Literal["count", "stop"]

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_EXEC_TIMEOUT_S = 60.0
DEFAULT_MAX_OUTPUT_BYTES = 4 * 1024 * 1024
MAX_OUTPUT_BYTES = 256 * 1024 * 1024
LABEL_KEY_PATTERN = r"^[A-Za-z0-9_.\-/]{1,63}$"
# An absolute path inside a sandbox: components of at most 255 bytes (NAME_MAX), no NUL.
PATH_PATTERN = r"^(/[^/\x00]{0,255})+$"
MAX_PATH = 4095


_ABS_PATH = re.compile(PATH_PATTERN)


def _abs_path(v: Any) -> str:
    """An absolute path, validated by hand rather than as a pydantic ``str``: a name that is
    not UTF-8 (listed from the sandbox, decoded with surrogate escapes as os.fsdecode does)
    names that very file, and pydantic's own strings refuse surrogates."""
    if not isinstance(v, str):
        raise PydanticCustomError("string_type", "Input should be a valid string")
    if not _ABS_PATH.match(v):
        raise PydanticCustomError("string_pattern_mismatch",
                                  "String should match pattern '{pattern}'",
                                  {"pattern": PATH_PATTERN})
    # Not a maxLength in the schema: generators choke on it next to the pattern.
    if len(v.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise PydanticCustomError("value_error", "path longer than {max} bytes",
                                  {"max": MAX_PATH})
    return v


def _path_len(v: str) -> str:
    if len(v.encode()) > MAX_PATH:
        raise ValueError(f"path longer than {MAX_PATH} bytes")
    return v


AbsPath = Annotated[str, PlainValidator(_abs_path, json_schema_input_type=str), WithJsonSchema(
    {"type": "string", "pattern": PATH_PATTERN,
     "description": f"an absolute path, at most {MAX_PATH} bytes"})]
# A command's working directory: UTF-8 only, as the rest of a command (argv, env) is.
CwdPath = Annotated[str, Field(pattern=PATH_PATTERN, description=(
    f"an absolute path, at most {MAX_PATH} bytes")), AfterValidator(_path_len)]
ENV_NAME_PATTERN = r"^[^=\x00]+$"
# What a sandbox carries along (its spec is in every listing, info and log entry of it).
MAX_ENV_VARS = 4096
MAX_ENV_BYTES = 1 << 20  # half of execve's 2 MiB: each command's own argv and env need room
MAX_LABELS = 64
MAX_METADATA = 64
MAX_METADATA_KEY = 128
MAX_METADATA_VALUE = 4096
# The validation context of a stored spec (SandboxSpec's request bounds do not apply).
STORED = {"stored": True}


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))
NO_NUL_PATTERN = r"^[^\x00]*$"
# The JSON schema of a dict field whose keys and values the validators below restrict.
_ENV_SCHEMA: JsonDict = {"propertyNames": {"pattern": ENV_NAME_PATTERN, "minLength": 1},
               "additionalProperties": {"type": "string", "pattern": NO_NUL_PATTERN}}
_LABELS_SCHEMA: JsonDict = {"propertyNames": {"pattern": LABEL_KEY_PATTERN},
                  "additionalProperties": {"type": "string", "maxLength": 256}}


# A user name (as useradd(8) takes them, upper case too) or a uid of up to nine digits.
USER_PATTERN = r"^([A-Za-z_][A-Za-z0-9_.\-]{0,31}\$?|[0-9]{1,9})$"
_USER = re.compile(USER_PATTERN)
SandboxId = Annotated[str, Field(min_length=1, max_length=200)]


def check_user(v: str | int | None) -> str | int | None:
    if isinstance(v, int) and not 0 <= v < 2**32 - 1:
        raise ValueError("user id out of range")
    if isinstance(v, str) and not _USER.match(v):
        raise ValueError(f"user must be a uid or a user name matching {USER_PATTERN}")
    return v


def check_env(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if not k or "=" in k or "\0" in k or "\0" in val:
            raise ValueError(f"bad environment variable name or value: {k!r}")
    return v


class _Model(BaseModel):
    """A request body: an unknown field is the client's mistake, refused."""

    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    """A response body: unknown fields are ignored, so an older SDK keeps working against a
    newer daemon that answers with more."""

    model_config = ConfigDict(extra="ignore")


class NetworkPolicy(_Model):
    """Default-deny egress: what ``allow`` names (domains through the sandbox's DNS, CIDRs,
    named allowlists), minus what ``deny`` names, minus what is always denied
    (docs/network.md)."""

    allow: list[NetworkRule] = Field(default_factory=list, max_length=256)
    deny: list[NetworkRule] = Field(default_factory=list, max_length=256)


Network = NetworkPolicy  # the SDK's name: corral.Network(allow=[...], deny=[...])
NetworkSpec = NetworkName | NetworkPolicy


def network_kind(network: NetworkSpec) -> NetworkKind:
    """What a spec's network asks of a substrate: a mode, or "policy" (a named allowlist or
    rules)."""
    if isinstance(network, str) and network in NETWORK_MODES:
        return network  # type: ignore[return-value]
    return "policy"


DEFAULT_DISK_MB = 10240


# `at` of a layer: absolute, its first component none of proc, dev, tmp, ".", ".." (those are
# the sandbox's own mounts; spelled without lookaround so JSON-schema tools can use it).
LAYER_AT_PATTERN = (
    r"^/(?:[^pdt\./\x00][^/\x00]*"
    r"|p(?:|[^r/\x00][^/\x00]*|r(?:|[^o/\x00][^/\x00]*|o(?:|[^c/\x00][^/\x00]*|c(?:[^/\x00]+))))"
    r"|d(?:|[^e/\x00][^/\x00]*|e(?:|[^v/\x00][^/\x00]*|v(?:[^/\x00]+)))"
    r"|t(?:|[^m/\x00][^/\x00]*|m(?:|[^p/\x00][^/\x00]*|p(?:[^/\x00]+)))"
    r"|\.(?:[^\./\x00][^/\x00]*|\.(?:[^/\x00]+)))(?:/[^/\x00]{0,255})*$")


class LayerSpec(_Model):
    """One layer composed over the sandbox's image at create time: an image's files
    (a toolkit) or a host directory's (a workspace, content-hashed and cached), at ``at``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["image"], "properties": {"image": {"type": "string"},
                                               "dir": {"type": "null"}}},
        {"required": ["dir"], "properties": {"dir": {"type": "string"},
                                             "image": {"type": "null"}}}]})

    image: str | None = Field(None, min_length=1, max_length=512,
                              description="an image (a registry reference is pulled)")
    dir: str | None = Field(None, min_length=1, max_length=MAX_PATH,
                            json_schema_extra={"pattern": r"^/[^\x00]*$"},
                            description="absolute host path of a directory: the local socket "
                                        "or the daemon's import directory only")
    at: Annotated[str, AfterValidator(_path_len)] = Field(
        pattern=LAYER_AT_PATTERN, description="where it appears in the sandbox (not / nor "
                                              "under /proc, /dev, /tmp); writable, "
                                              "copy-on-write")
    digest: str | None = Field(None, max_length=80, description=(
        "set by the daemon: the layer a dir resolved to (dir:<sha256 of its contents>)"))

    @model_validator(mode="after")
    def _one_source(self) -> LayerSpec:
        if (self.image is None) == (self.dir is None):
            raise ValueError("a layer names exactly one of image or dir")
        if self.at.rstrip("/") == "" or self.at.split("/")[1] in ("proc", "dev", "tmp", ".",
                                                                  ".."):
            raise ValueError(f"layer target {self.at!r} must not be / nor under /proc, /dev, "
                             "/tmp")
        return self


class SandboxSpec(_Model):
    """What a client asks for when it creates a sandbox."""

    image: str = Field("host", min_length=1, max_length=512, description=(
        "host, a local image's name, or a registry reference (pulled on first use)"))
    substrate: Substrate = "container"
    cpu: float = Field(1.0, gt=0, le=256, description="CPU cores (CFS quota)")
    memory_mb: int = Field(512, ge=16, le=1024 * 1024)
    disk_mb: int = Field(DEFAULT_DISK_MB, ge=1, le=16 * 1024 * 1024,
                         description="bound on the sandbox's disk use: the size of its /tmp "
                                     "and the bytes the daemon writes into it (uploads, "
                                     "files.write, tar extraction); see docs/daemon.md")
    pids: int = Field(512, ge=8, le=1_000_000, description="max processes/threads")
    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S,
                           description="TTL in seconds from creation")
    idle_timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S,
                                       description="kill after this long with no API call")
    env: dict[str, str] = Field(default_factory=dict,
                                json_schema_extra={**_ENV_SCHEMA, "maxProperties": MAX_ENV_VARS},
                                description="names without '=' or NUL, values without NUL; "
                                            f"at most {MAX_ENV_VARS} and {MAX_ENV_BYTES} "
                                            "bytes in all (every command gets them)")
    labels: dict[str, str] = Field(default_factory=dict,
                                   json_schema_extra={**_LABELS_SCHEMA,
                                                      "maxProperties": MAX_LABELS},
                                   description=f"keys match {LABEL_KEY_PATTERN}, values of "
                                               f"at most 256 characters; at most {MAX_LABELS}")
    metadata: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={"maxProperties": MAX_METADATA,
                           "propertyNames": {"maxLength": MAX_METADATA_KEY},
                           "additionalProperties": {"type": "string",
                                                    "maxLength": MAX_METADATA_VALUE}},
        description=f"at most {MAX_METADATA} entries, keys of at most {MAX_METADATA_KEY} and "
                    f"values of at most {MAX_METADATA_VALUE} characters")
    network: NetworkSpec = "none"
    network_group: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
                                      description="networked sandboxes of one group reach "
                                                  "each other (by sandbox id as a DNS name)")
    expose: list[Annotated[int, Field(ge=1, le=65535)]] = Field(
        default_factory=list, max_length=64,
        description="a networked sandbox's TCP ports to reach from the host (info().net."
                    "exposed: 127.0.0.1:<port> each)")
    bandwidth_mbit: float | None = Field(None, gt=0, le=100_000,
                                         description="a networked sandbox's rate, each way "
                                                     "(Mbit/s; tc tbf on both ends of its link)")
    hostname: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9\-.]{0,62}$")
    cwd: CwdPath = Field("/root", description="absolute working directory for commands "
                                              "(must exist, unless it is the default; an "
                                              "OCI image's WorkingDir when not given)")
    user: str | int | None = Field(None, description=(
        "who commands run as unless an exec names a user: a uid or a user name of the "
        "sandbox's /etc/passwd (default: the OCI image's User, else root)"),
        json_schema_extra={"anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 4294967294},
            {"type": "string", "pattern": USER_PATTERN}, {"type": "null"}]})
    snapshot: str | None = Field(None, min_length=1, max_length=200,
                                 description="start on a snapshot (id or name); the image is "
                                             "the snapshot's")
    layers: list[LayerSpec] = Field(default_factory=list, max_length=16, description=(
        "composed over the image at create time, in order (docs/images.md)"))
    pause_ttl: PauseTTL = Field("count", description="while paused, the TTL and idle clocks "
                                                     "keep counting (count) or stop (stop)")

    # The bounds on env, labels and metadata are a request's: a stored spec (a sandbox's record
    # read back at a restart, made before a bound existed or merged with an image's env) is
    # validated with the context STORED and keeps what it has.
    @field_validator("env")
    @classmethod
    def _env_ok(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if not _stored(info):
            if len(v) > MAX_ENV_VARS:
                raise ValueError(f"more than {MAX_ENV_VARS} environment variables")
            if sum(len(k.encode()) + len(val.encode()) + 2 for k, val in v.items()) \
                    > MAX_ENV_BYTES:
                raise ValueError(f"the environment takes more than {MAX_ENV_BYTES} bytes")
        return check_env(v)

    @field_validator("metadata")
    @classmethod
    def _metadata_ok(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if _stored(info):
            return v
        if len(v) > MAX_METADATA:
            raise ValueError(f"more than {MAX_METADATA} metadata entries")
        for k, val in v.items():
            if len(k) > MAX_METADATA_KEY or len(val) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata {k[:40]!r}: keys of at most {MAX_METADATA_KEY}, "
                                 f"values of at most {MAX_METADATA_VALUE} characters")
        return v

    @field_validator("user")
    @classmethod
    def _spec_user_ok(cls, v: str | int | None) -> str | int | None:
        return check_user(v)

    @field_validator("labels")
    @classmethod
    def _labels_ok(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        import re

        if len(v) > MAX_LABELS and not _stored(info):
            raise ValueError(f"more than {MAX_LABELS} labels")
        # fullmatch: "$" also matches before a final newline ("corral.tenant\n" looked like
        # the tenant label in a listing); a stored spec is read as it was written.
        matches = re.match if _stored(info) else re.fullmatch
        for k, val in v.items():
            if not matches(LABEL_KEY_PATTERN, k) or len(val) > 256:
                raise ValueError(f"bad label {k!r}: keys match {LABEL_KEY_PATTERN}, values <= 256")
        return v


class NetworkState(_Response):
    """A networked sandbox's address and what it sent and was refused."""

    address: str
    gateway: str | None = None
    address6: str | None = Field(None, description="its IPv6 address (None: IPv4 only)")
    gateway6: str | None = None
    group: str | None = None
    policy: Any = None
    tx_bytes: int = 0
    tx_packets: int = 0
    rx_bytes: int = 0
    rx_packets: int = 0
    denied_packets: int = Field(0, description="packets rejected by the always-deny list or "
                                               "the policy")
    denied_destinations: dict[str, int] = Field(
        default_factory=dict, description="packets rejected by destination address (the 50 "
                                          "most refused, each kept 10 min after its last)")
    refused_names: dict[str, int] = Field(default_factory=dict,
                                          description="names its DNS refused, with counts")
    pinned: list[str] = Field(default_factory=list,
                              description="addresses its DNS answers opened, unexpired")
    pins_refused: int = Field(0, description="DNS answers refused: they would have taken it "
                                             "past its cap of pinned addresses")
    exposed: dict[str, str] = Field(default_factory=dict,
                                    description="sandbox port -> host address reaching it")


class NetworkUpdate(_Model):
    network: NetworkSpec = Field(description="internet, a named allowlist or a policy")


class ExposeRequest(_Model):
    port: int = Field(ge=1, le=65535, description="a TCP port in the sandbox")


class ExposedPort(_Response):
    port: int
    host: str = Field(description="host:port on the host's loopback that reaches it")


class AllowlistInfo(_Response):
    name: str
    rules: list[str]


class BlockedUpdate(_Model):
    blocked: list[Annotated[str, Field(max_length=64)]] = Field(
        max_length=4096, description="addresses or CIDRs (host bits ignored) no sandbox may "
        "reach whatever its policy, replacing the live ones (a cluster's other nodes)")


class BlockedInfo(_Response):
    configured: list[str] = Field(description="from the settings (CORRAL_NET_BLOCKED)")
    live: list[str] = Field(description="the last PUT /v1/network/blocked's")


class SandboxInfo(_Response):
    id: str
    state: SandboxState
    image: str
    substrate: Substrate
    cpu: float
    memory_mb: int
    pids: int
    network: NetworkSpec
    network_group: str | None = None
    bandwidth_mbit: float | None = None
    net: NetworkState | None = Field(None, description="a networked sandbox's address and "
                                                       "counters")
    hostname: str
    labels: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    created_at: float
    expires_at: float
    idle_timeout: float | None = None
    last_active_at: float
    init_pid: int | None = None
    snapshot: str | None = None
    pause_ttl: PauseTTL = "count"
    paused_at: float | None = None
    trajectory_id: str | None = Field(None, description="the trajectory it was made for (a "
                                      "create keyed {trajectory_id}:create, or a fork's child)")
    node: str | None = Field(None, description="the cluster node (Ray node id) the sandbox "
                             "runs on; null on a standalone daemon")
    endpoint: str | None = Field(None, description="set by a cluster gateway on create: the "
                                 "node's URL, which every later call of the sandbox goes to")


class CreateManyRequest(_Model):
    count: int = Field(ge=1, le=10_000)
    spec: SandboxSpec = Field(default_factory=SandboxSpec)


MAX_BATCH = 10_000


class ErrorInfo(_Response):
    code: str = Field(description="stable error code (corral/errors.py)")
    message: str
    details: dict[str, Any] = Field(default_factory=dict)
    category: Literal["infra", "limit", "task"] = Field(
        "task", description="infra: outside the sandbox and the agent (mask the rollout); "
        "limit: the agent's own resource limits; task: the request's or command's own failure")
    infra: bool = Field(False, description='category == "infra"')


class ItemError(_Response):
    """One item of a batch that failed (the others are unaffected)."""

    error: ErrorInfo


class SetTimeoutRequest(_Model):
    timeout: float = Field(gt=0, le=MAX_TIMEOUT_S, description="new TTL in seconds from now")


class SnapshotRequest(_Model):
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class ForkRequest(_Model):
    count: int = Field(ge=1, le=10_000)
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
    keep_snapshot: bool = Field(False, description="keep the fork's snapshot listed (else it "
                                                   "is removed once the children exist; its "
                                                   "layers live as long as they do)")


class RestoreRequest(_Model):
    snapshot: str = Field(min_length=1, max_length=200, description="snapshot id or name")


class SnapshotInfo(_Response):
    id: str
    name: str | None = None
    parent: str | None = Field(None, description="the snapshot the sandbox was started from")
    image: str
    digest: str = Field(description="content digest (blake3) of this snapshot's own layer")
    layers: list[str] = Field(default_factory=list, description="layer digests, bottom first")
    size: int = Field(description="bytes of file data in this snapshot's own layer")
    created_at: float
    sandbox_id: str | None = Field(None, description="the sandbox it was taken from")
    node: str | None = Field(None, description="set by a cluster gateway: the node (Ray node "
                                               "id) that holds it")
    endpoint: str | None = Field(None, description="set by a cluster gateway: that node's "
                                                   "URL, where calls on it go")


class ForkResult(_Response):
    snapshot: SnapshotInfo
    sandboxes: list[SandboxInfo]


class ExecRequest(_Model):
    """Run a command. ``cmd`` as a string runs under ``/bin/sh -c``; as a list it is the argv."""

    cmd: str | list[str] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "pattern": r"^[^\x00]*[^\x00\s][^\x00]*$",
         "description": "a shell command line (/bin/sh -c), not blank"},
        {"type": "array", "minItems": 1, "description": "argv (argv[0] not empty)",
         "prefixItems": [{"type": "string", "minLength": 1, "pattern": NO_NUL_PATTERN}],
         "items": {"type": "string", "pattern": NO_NUL_PATTERN}}]})
    timeout: float | None = Field(DEFAULT_EXEC_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    env: dict[str, str] = Field(default_factory=dict, json_schema_extra=_ENV_SCHEMA)
    cwd: CwdPath | None = Field(None, description="an existing directory in the sandbox "
                                                  "(default: the sandbox's cwd)")
    user: str | int | None = Field(None, description=(
        "a uid (0 to 4294967294; one not in /etc/passwd runs with gid = uid) or a user "
        "name from the sandbox's /etc/passwd (an unknown name is user_not_found)"),
        json_schema_extra={"anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 4294967294},
            {"type": "string", "pattern": USER_PATTERN}, {"type": "null"}]})
    stdin: str | None = Field(None, description="text written to stdin, then stdin is closed")
    background: bool = False
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT_BYTES, ge=0, le=MAX_OUTPUT_BYTES)

    @field_validator("env")
    @classmethod
    def _env_ok(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @field_validator("user")
    @classmethod
    def _user_ok(cls, v: str | int | None) -> str | int | None:
        return check_user(v)

    @field_validator("cmd")
    @classmethod
    def _cmd_ok(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and (not v or not v[0]):
            raise ValueError("cmd must not be an empty list, nor start with an empty string")
        if isinstance(v, str) and not v.strip():
            raise ValueError("cmd must not be empty")
        items = v if isinstance(v, list) else [v]
        if any("\0" in s for s in items):
            raise ValueError("cmd must not contain NUL bytes")
        return v


class BatchExecRequest(ExecRequest):
    """A command of a batch: foreground only."""

    background: bool = Field(False, json_schema_extra={"const": False})

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool) -> bool:
        if v:
            raise ValueError("background commands are not supported in a batch")
        return v


class ExecManyRequest(_Model):
    """The same command in many sandboxes; one result per id, in order."""

    ids: list[SandboxId] = Field(min_length=1, max_length=MAX_BATCH)
    exec: BatchExecRequest
    concurrency: int = Field(64, ge=1, le=1024,
                             description="commands running at once (the rest wait)")


class KillManyRequest(_Model):
    ids: list[SandboxId] = Field(min_length=1, max_length=MAX_BATCH)


class KillResult(_Response):
    id: str
    killed: bool = Field(description="false: it had already ended")


class ExecResult(_Response):
    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    truncated: bool = False
    timed_out: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    signal: int | None = Field(None, description="the signal that ended the command (9 for "
                               "SIGKILL: an OOM kill, its timeout, a kill -9), or null if it "
                               "exited")
    oom_killed: bool = Field(False, description="the kernel's OOM killer killed a process in "
                             "the sandbox while the command ran (the command itself or one of "
                             "its children, or a concurrent command's): its memory limit, not "
                             "the command's own exit")


class ExecManyResponse(_Response):
    results: list[ExecResult | ItemError]


class KillOutcome(_Response):
    """One id of a batch destroy that was not killed by it: already ended, or an error."""

    index: int = Field(description="the id's position in the request")
    id: str
    killed: Literal[False] = False
    error: ErrorInfo | None = Field(None, description="why not, if not already ended")


class KillManyResponse(_Response):
    """Counts, and only the ids that were not killed (the rest were): a batch of 10,000
    live sandboxes answers in a few bytes."""

    killed: int = Field(description="ids whose sandbox this call destroyed")
    already_ended: int = Field(description="ids whose sandbox had ended before")
    failed: int = Field(description="ids that are errors (unknown sandbox ...)")
    not_killed: list[KillOutcome] = Field(description="the ids not killed, in request order")


class ProcessHandle(_Response):
    """A background command: poll, wait, stream, write stdin, kill."""

    sandbox_id: str
    pid: int
    cmd: str | list[str]
    started_at: float


class ProcessStatus(_Response):
    pid: int
    running: bool
    exit_code: int | None = None
    timed_out: bool = False
    signal: int | None = None
    oom_killed: bool = False


class StdinRequest(_Model):
    data: str = ""
    eof: bool = False


class KillProcessRequest(_Model):
    signal: int = Field(9, ge=1, le=64)


class WaitRequest(_Model):
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)


class FileEntry(_Response):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class FileTree(_Response):
    entries: list[FileEntry] = Field(description="breadth first; each directory's by name")
    truncated: bool = Field(description="more entries than the limit: these are the first")


class MkdirRequest(_Model):
    path: AbsPath
    parents: bool = True


class RemoveRequest(_Model):
    path: AbsPath
    recursive: bool = False


class RenameRequest(_Model):
    src: AbsPath
    dst: AbsPath


class ImageInfo(_Response):
    name: str = Field(description="a local name, or the reference an OCI image was pulled by")
    kind: Literal["builtin", "rootfs", "oci"]
    created_at: float
    size_bytes: int | None = None
    digest: str | None = Field(None, description="OCI images: the manifest's digest")
    layers: list[str] | None = Field(None, description="OCI images: layer digests, base first")
    config: dict[str, Any] | None = Field(None, description=(
        "OCI images: what a sandbox uses of the image config (Env, WorkingDir, User, "
        "Entrypoint, Cmd, Labels, ExposedPorts, StopSignal)"))
    source: str | None = None


_COMP = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
# [registry[:port]/]repo[:tag][@sha256:hex], the grammar of corral.daemon.oci.ref.
# A first component is the registry only if it looks like a host (a dot, a port, localhost,
# an IPv6 literal), as the parser decides; else it is part of the repository (lowercase).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_REGISTRY = (r"(?:(?:\[[0-9a-fA-F:]+\]|localhost|" + _LABEL + r"(?:\." + _LABEL + r")+)"
             r"(?::[0-9]{1,5})?|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?:[0-9]{1,5})")
REFERENCE_PATTERN = (r"^(?:" + _REGISTRY + "/)?" + _COMP + "(?:/" + _COMP + ")*"
                     r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")


class PullImageRequest(_Model):
    reference: str = Field(min_length=1, max_length=512, pattern=REFERENCE_PATTERN,
                           description=(
        "[registry[:port]/]repository[:tag][@sha256:digest]; no registry means docker.io"))
    progress: bool = Field(False, description=(
        "answer with NDJSON progress events (resolved, layer), then one line "
        "{\"event\": \"done\", \"image\": ImageInfo} or {\"error\": {...}}"))


class PruneResult(_Response):
    layers_removed: list[str]


class ImportImageRequest(_Model):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.\-]{0,62}$")
    source: str = Field(min_length=1, max_length=MAX_PATH,
                        json_schema_extra={"pattern": r"^/[^\x00]*$"},
                        description="absolute host path of a rootfs directory or tarball, "
                                    "an OCI image layout (directory or tar) or a docker "
                                    "save archive: on "
                                    "the local socket, or under the daemon's import directory "
                                    "(else forbidden); anything else is a registry reference "
                                    "(unsupported)")


# A local name, or a registry reference; "host" and the routes' names (pull, prune, tag,
# push) are refused by the daemon (invalid_request).
IMAGE_NAME_PATTERN = r"(?:^[a-z0-9][a-z0-9_.\-]{0,62}$)|(?:" + REFERENCE_PATTERN + ")"
_ARGV = list[Annotated[str, Field(max_length=65536)]]


class ConfigChanges(_Model):
    """Changes to an image config over the base image's; a key given as null is removed."""

    Env: list[Annotated[str, Field(pattern=r"^[^=\x00]+=[^\x00]*$", max_length=65536)]] | None \
        = Field(None, description="NAME=VALUE entries; they replace the base's of the same "
                                  "names")
    WorkingDir: str | None = Field(None, pattern=r"^/[^\x00]*$", max_length=MAX_PATH)
    User: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[^\x00]+$")
    Entrypoint: _ARGV | None = None
    Cmd: _ARGV | None = None
    Labels: dict[str, str] | None = Field(None, description="merged into the base's")
    ExposedPorts: list[Annotated[str, Field(pattern=r"^[0-9]{1,5}(?:/(?:tcp|udp|sctp))?$")]] \
        | None = None
    StopSignal: str | None = Field(None, min_length=1, max_length=32,
                                   pattern=r"^[A-Z0-9+]+$")


_CONFIG_CHANGES = Field(None, description="image config changes over the base image's")


class CommitRequest(_Model):
    name: str = Field(min_length=1, max_length=512, pattern=IMAGE_NAME_PATTERN, description=(
        "the new image: a local name, or a registry reference to push it to"))
    config: ConfigChanges | None = _CONFIG_CHANGES
    replace: bool = Field(False, description="replace an OCI image of that name (else "
                                             "conflict)")


class TagImageRequest(_Model):
    source: str = Field(min_length=1, max_length=512, description="an existing image")
    name: str = Field(min_length=1, max_length=512, pattern=IMAGE_NAME_PATTERN)
    config: ConfigChanges | None = _CONFIG_CHANGES
    replace: bool = False


class PushImageRequest(_Model):
    name: str = Field(min_length=1, max_length=512, description="the image to push")
    reference: str | None = Field(None, max_length=512, pattern=REFERENCE_PATTERN,
                                  description="where to push it (default: its name, "
                                              "which must then be a registry reference)")


class PushResult(_Response):
    reference: str
    digest: str = Field(description="the pushed manifest's digest")
    layers: list[str] = Field(description="the layer blobs' digests, base first")
    uploaded: int = Field(description="layer blobs sent (the others were in the registry)")
    bytes: int = Field(description="compressed bytes sent")


class DaemonStatus(_Response):
    version: str
    pid: int
    started_at: float
    sandboxes: int
    created: int = Field(0, description="sandboxes created since the daemon started (a "
                                        "cluster gateway matches its placements to it)")
    capacity: int
    capacity_bound_by: str = Field("config", description=(
        "what set the admission limit: config (CORRAL_MAX_SANDBOXES), or when derived from "
        "the machine, memory or the kernel limit that binds (max_net_namespaces, pid_max...)"))
    state_dir: str
    cgroup_version: Literal[1, 2] | None = Field(None, description=(
        "the host's cgroup version, when a substrate that uses cgroups is served"))
    shared_rlimits: list[str] = Field(default_factory=list, description=(
        "per-user rlimits (msgqueue, memlock, sigpending) the daemon cannot lift for its "
        "container sandboxes (it lacks CAP_SYS_RESOURCE): every sandbox is uid 0 on the "
        "host, so one can take those sums from the others (docs/security.md)"))
    substrates: list[str]


class SubstrateCapabilities(_Response):
    """What a substrate can do beyond create, exec and kill; an operation it lacks answers
    ``unsupported`` (501) before anything is done."""

    files: bool = Field(description="file and tar operations")
    snapshot: bool = Field(description="snapshot and fork")
    restore: bool = Field(description="restore in place to a snapshot")
    pause: bool = Field(description="pause and resume (freeze every process)")
    oom_kills: bool = Field(description="counts OOM kills (oom_killed, sandbox_crashed)")
    exit_watch: bool = Field(description="learns of dead sandboxes without a pidfd each")
    warm_pool: bool = Field(description="sandboxes can be made ahead of demand")
    networks: list[NetworkKind] = Field(description="the network modes it can give "
                                                    "(policy: allowlists and rules)")


class SubstrateInfo(_Response):
    name: str
    available: bool = Field(True, description="false: asked for, but this host cannot run it")
    reason: str | None = Field(None, description="why it is not available")
    capabilities: SubstrateCapabilities
    operations: list[str] = Field(description="the API operations it takes")


class LogEntry(_Response):
    """One call in a sandbox's trajectory log (docs/trajectory.md)."""

    index: int = Field(description="position in this sandbox's log, from 0")
    seq: int = Field(description="global commit order across sandboxes")
    sandbox_id: str
    op: str = Field(description="create, exec, wait, read, write, list, stat, mkdir, remove, "
                                "rename, upload, download, snapshot, fork, restore, pause, "
                                "resume, kill")
    status: Literal["done", "started", "interrupted"] = Field(
        "done", description="done: finished (result or error); started: in flight; "
                            "interrupted: in flight when the daemon died, outcome unknown")
    idempotency_key: str | None = None
    request: dict[str, Any]
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    started_at: float
    ended_at: float | None = Field(None, description="null unless done")
    duration_s: float | None = Field(None, description="null unless done")
    snapshot_ids: list[str] = Field(default_factory=list, description=(
        "snapshots the call made or used: snapshot (the new one), fork (the one the children "
        "start from), restore (the one restored), create (the one it starts on)"))


class Layer:
    """Builders of :class:`LayerSpec`: ``Sandbox(image=base, layers=[Layer.from_image(
    "tools:1", at="/opt/tools"), Layer.from_dir("./repo", at="/workspace")])``."""

    @staticmethod
    def _make(**fields: str) -> LayerSpec:
        from pydantic import ValidationError

        from corral.errors import InvalidRequest

        try:
            return LayerSpec(**fields)
        except ValidationError as e:
            msgs = "; ".join(str(d["msg"]) for d in e.errors(include_url=False)[:3])
            raise InvalidRequest(f"invalid layer: {msgs}") from None

    @staticmethod
    def from_image(image: str, at: str) -> LayerSpec:
        return Layer._make(image=image, at=at)

    @staticmethod
    def from_dir(path: str, at: str) -> LayerSpec:
        """A host directory (the daemon's host: the local socket or its import directory),
        content-hashed and cached, so every sandbox of one task shares one copy."""
        import os

        return Layer._make(dir=os.path.abspath(path), at=at)
