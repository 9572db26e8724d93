"""The wire models of ``run_code`` (the ``process`` substrate's function-call tier), shared by
the daemon and the SDK."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

LANGUAGES = ("python", "bash")
STATUSES = ("ok", "error", "timeout", "memory_exceeded", "output_truncated")
DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 300.0
DEFAULT_MEMORY_MB = 256
MIN_MEMORY_MB = 16
MAX_MEMORY_MB = 8192
DEFAULT_OUTPUT_BYTES = 1024 * 1024       # per stream
MAX_OUTPUT_BYTES = 16 * 1024 * 1024
MAX_CODE_BYTES = 4 * 1024 * 1024
MAX_FILES = 256
MAX_FILES_BYTES = 16 * 1024 * 1024       # stdin + every file, together
MAX_MANY = 1000
# A file name relative to the scratch dir: segments of visible characters, no "." or "..".
FILE_PATTERN = r"^(?!/)(?!.*(^|/)\.\.?(/|$))[^\x00]{1,1024}$"
_FILE = re.compile(FILE_PATTERN)


class _Model(BaseModel):
    """A request body: an unknown field is refused."""

    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    """A response body: unknown fields are ignored (an older SDK, a newer daemon)."""

    model_config = ConfigDict(extra="ignore")


class RunCodeRequest(_Model):
    """Run a snippet in a fresh, locked-down process (docs/substrates.md, run_code)."""

    code: str = Field(max_length=MAX_CODE_BYTES, pattern=r"^[^\x00]*$",
                      description="the program text (python: run as __main__; bash: bash -c)")
    language: Literal["python", "bash"] = "python"
    stdin: str | None = Field(None, max_length=MAX_FILES_BYTES,
                              description="text on stdin (default: empty)")
    files: dict[str, str] | None = Field(None, json_schema_extra={
        "propertyNames": {"pattern": FILE_PATTERN}, "maxProperties": MAX_FILES}, description=(
        "files written into the scratch dir (the working directory) before the code runs: "
        "relative path -> text; parents are created"))
    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S,
                           description="wall-clock seconds; then the whole process tree is "
                                       "killed (status timeout)")
    memory_mb: int = Field(DEFAULT_MEMORY_MB, ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB,
                           description="memory limit of the request's processes, scratch "
                                       "files included (status memory_exceeded)")
    max_output_bytes: int = Field(DEFAULT_OUTPUT_BYTES, ge=0, le=MAX_OUTPUT_BYTES,
                                  description="kept per stream; the rest is read and dropped "
                                              "(status output_truncated)")

    @field_validator("files")
    @classmethod
    def _files_ok(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_FILES:
            raise ValueError(f"at most {MAX_FILES} files")
        total = 0
        for name, text in v.items():
            if not _FILE.match(name):
                raise ValueError(f"file name {name[:100]!r}: a relative path without . or .. "
                                 f"segments")
            # What the pattern lets through but no file can be: an empty segment ("a/",
            # "a//b"), a segment longer than a name may be, a name that another one needs as
            # a directory ("a" and "a/b"). Refused here, they are the request's mistake;
            # found while the files are written, they looked like the program's failure.
            parts = name.split("/")
            if "" in parts or any(len(p.encode()) > 255 for p in parts):
                raise ValueError(f"file name {name[:100]!r}: an empty segment, or one of more "
                                 f"than 255 bytes")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in v:
                    raise ValueError(f"file name {name[:100]!r}: {'/'.join(parts[:i])!r} is "
                                     f"a file too")
            total += len(text)
        if total > MAX_FILES_BYTES:
            raise ValueError(f"files hold more than {MAX_FILES_BYTES} characters")
        return v


class RunCodeResult(_Response):
    status: Literal["ok", "error", "timeout", "memory_exceeded", "output_truncated"] = Field(
        description="ok: exit 0; error: another exit or a signal; timeout: killed at its "
                    "timeout; memory_exceeded: a process of the request was killed at its "
                    "memory limit; output_truncated: ran to its end but printed more than "
                    "max_output_bytes")
    stdout: str
    stderr: str
    exit_code: int = Field(description="the exit status; 128 + n when killed by signal n")
    signal: int | None = Field(None, description="the signal that ended it, or null")
    duration_s: float = Field(description="from the fork of its process to its exit")
    truncated: bool = False
    language: Literal["python", "bash"] = "python"


class RunCodeManyRequest(_Model):
    requests: list[RunCodeRequest] = Field(min_length=1, max_length=MAX_MANY)


class RunCodeItemError(_Response):
    """One request of a batch that did not run (the pool was full, the zygote died...)."""

    error: dict[str, object]


class RunCodeManyResponse(_Response):
    results: list[RunCodeResult | RunCodeItemError]


class RunCodePool(_Response):
    name: str = Field(description="python (the standard library preloaded), python-numpy "
                                  "(numpy too: python code that imports numpy, scipy, pandas "
                                  "or sklearn) or bash")
    language: str
    zygotes: int = Field(description="zygotes running now")
    slots: int = Field(description="requests that can run at once")
    busy: int
    queued: int
    max_queue: int
    started: int = Field(description="zygotes started since the daemon started (restarts "
                                     "included)")
    preloaded: list[str] = Field(default_factory=list)
    served: int = 0


class RunCodeStatus(_Response):
    pools: list[RunCodePool]
