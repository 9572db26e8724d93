"""Types of the Rust core (rust/src/lib.rs), the only place where corral makes namespaces,
mounts, seccomp filters and exec. Every call releases the GIL. Errors are OSError with the
errno of the failed step (ValueError for a malformed config), unless named below."""

from typing import Literal

DEFAULT_PATH: str

class ForbiddenPath(PermissionError):
    """A path the files API never serves (kernel pseudo-filesystem, device, FIFO, socket)."""

class LayerLimit(Exception):
    """A capture passed one of its limits: args (what, limit), what in bytes, entries,
    depth."""

class NotCached(Exception):
    """A cached-only call needed the disk (a lookup, or data not in the page cache) or an
    unbounded walk (a symlink in the path, more than 64 components)."""

class CaptureCancelled(Exception):
    """A capture stopped because its CaptureControl was cancelled."""

class CaptureControl:
    """A running capture_layer as another thread sees it."""
    def __init__(self) -> None: ...
    def copied(self) -> int:
        """Bytes of file data copied so far."""
    def entries(self) -> int:
        """Entries listed so far (each one the copy makes)."""
    def cancel(self) -> None:
        """Stop the capture within one chunk (it raises CaptureCancelled)."""
    def cancelled(self) -> bool: ...
    def charged(self) -> int:
        """Bytes of disk taken so far: file data, a block for each entry made, xattrs."""
    def allow(self, total: int) -> None:
        """Let the copy take ``total`` bytes of disk in all (a write past it waits)."""
    def wanted(self) -> int:
        """What a copy blocked at its allowance needs charged() to reach (0: not blocked)."""

# An rlimit: one value (soft = hard) or (soft, hard); names as in `prlimit` (nofile, core, ...).
Rlimits = dict[str, int | tuple[int, int]]

class Overlay:
    """One overlay mount of a new sandbox: ``target`` inside it ("/" first), lowerdirs
    top-first; ``options``: extra overlayfs options (default none), e.g. "volatile"."""

    def __init__(self, *, target: str, lower: list[str], upper: str, work: str,
                 options: list[str] = ...) -> None: ...

class SpawnConfig:
    """spawn_sandbox's config: a new sandbox, its init started. Checked when made (ValueError
    for a bad rlimit, TypeError for a wrong type). Defaults: hostname "sandbox", every list
    empty."""

    def __init__(
        self, *, init_fd: int, root: str, overlays: list[Overlay], hostname: str = ...,
        cgroup_procs: list[str] = ..., rlimits: Rlimits | None = None,
        netns_fd: int | None = None, unix_only: bool = False, mask_dir: str | None = None,
        proc_readonly: list[str] = ..., proc_mask_files: list[str] = ...,
        proc_mask_dirs: list[str] = ...,
        proc_binds: list[tuple[str, str]] = ...,     # (host file, /proc entry), read-only
        sys_dir: str | None = None,                   # host skeleton bound at /sys
        cgroup_mounts: list[tuple[str, str, str]] = ...,  # (target, fstype, options)
        tmp_size_mb: int | None = None, tmp_tmpfs: bool = True, dev_dir: str | None = None,
        shm_dir: str | None = None, detach: list[str] = ...,
    ) -> None: ...

class ExecConfig:
    """exec_in's config: a command started in a live sandbox by the daemon's own path.
    Defaults: cwd "/", stdin/stdout/stderr -1 (/dev/null), every list empty."""

    def __init__(
        self, *, init_pid: int, pidfd: int, argv: list[str], root_fd: int | None = None,
        env: list[str] = ..., cwd: str = ..., uid: int = 0, gid: int = 0,
        groups: list[int] = ..., stdin: int = ..., stdout: int = ..., stderr: int = ...,
        cgroup_procs: list[str] = ..., rlimits: Rlimits | None = None, tty: bool = False,
        unix_only: bool = False,
    ) -> None: ...

FileType = Literal["file", "dir", "symlink", "other"]
# (type, size, mode, mtime)
StatInfo = tuple[FileType, int, int, float]
# (name, type, size, mode, mtime)
ListEntry = tuple[str, FileType, int, int, float]

# ---- sandboxes ---------------------------------------------------------------------------------
def init_memfd() -> int:
    """A sealed, close-on-exec memfd holding the static init."""

def lockdown_binary() -> bytes:
    """The gvisor substrate's static lock-down binary (rust/init/corral-lockdown.c)."""

def seccomp_filter(unix_only: bool) -> bytes:
    """The sandbox seccomp filter as a raw BPF program (native-endian sock_filter entries)."""

def spawn_sandbox(cfg: SpawnConfig) -> tuple[int, int]:
    """A new sandbox: (init pid, pidfd)."""

def exec_in(cfg: ExecConfig) -> int:
    """Start a command in a live sandbox: the host pid of our child."""

def init_channel(pidfd: int) -> int:
    """A copy of the init's exec channel (its fd 4, pidfd_getfd); EBADF if it has none."""

def root_fd(pid: int) -> int:
    """An O_PATH fd of the root of ``pid``'s mount namespace."""

def harden_daemon(secret_flags: list[str]) -> None: ...
def netns_new() -> int: ...
def netns_of(pidfd: int) -> int: ...
def netns_fingerprint(netns_fd: int) -> bytes: ...
def netns_socket(netns: int, domain: int, ty: int, proto: int) -> int: ...
def veth_setup(netns: int, host: str, gateway: str, addr: str, gateway6: str | None = None,
               addr6: str | None = None) -> None: ...
def nft_destroy_elements(table: str,
                         sets: list[tuple[str, list[tuple[bytes, bytes | None]]]]) -> None: ...
def nft_get_counter(table: str, set: str, key: bytes) -> tuple[int, int] | None: ...
def nft_dump_counters(table: str, set: str, prefix: bytes) -> list[tuple[bytes, int, int]]: ...
def nft_add_elements(table: str,
                     sets: list[tuple[str, list[tuple[bytes, bytes | None, int | None,
                                                      str | None]]]]) -> None: ...
def nft_swap_elements(table: str,
                      gone: list[tuple[str, list[tuple[bytes, bytes | None]]]],
                      added: list[tuple[str, list[tuple[bytes, bytes | None, int | None,
                                                        str | None]]]]) -> None: ...
def mount_tmpfs(target: str, options: str) -> None: ...
def umount(target: str) -> None: ...
def mount_loop(image: str, target: str, fstype: str, options: str,
               direct_io: bool = True) -> str:
    """Attach ``image`` to a free loop device (autoclear) and mount it; returns the device."""
def mount_file_ro(image: str, target: str, fstype: str) -> None:
    """Mount the filesystem image file ``image`` read-only (nosuid, nodev) on ``target``,
    file-backed (no loop device)."""
def mount_cgroups_in(pidfd: int, tasks: list[str],
                     mounts: list[tuple[str, str, str]]) -> None:
    """Mount (target, fstype, options) read-only in the init's mount namespace, rooted at the
    cgroups of the ``tasks`` files."""
def rebind_in(pidfd: int, binds: list[tuple[str, str]]) -> None:
    """Bind each (host source, target) read-only in the init's mount namespace."""
def bind_readonly(source: str, target: str) -> None: ...
def umount_detach(target: str) -> None: ...
def btrfs_quota_enable(mnt: str, simple: bool) -> None: ...
def btrfs_subvol_create(parent: str, name: str, limit: int | None = None) -> None: ...
def btrfs_subvol_id(path: str) -> int: ...
def btrfs_subvol_delete(path: str) -> bool:
    """True if ``path`` was a subvolume's root (deleted); False if it is anything else."""
def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 or less when unavailable."""

def shell_capabilities() -> list[str]: ...
def last_profile(what: str = "spawn_sandbox") -> list[tuple[str, int]]:
    """Timings (ns) of the last call's steps, for the bench."""

# ---- files, every path resolved inside ``root_fd`` (openat2 RESOLVE_IN_ROOT) -------------------
def fs_read(root_fd: int, path: str, max_bytes: int = ..., cached: bool = False) -> bytes: ...
def fs_open_read(root_fd: int, path: str) -> tuple[int, int]:
    """(fd, size) of a regular file."""

def fs_open_write(root_fd: int, path: str, mode: int = 0o644, make_parents: bool = True) -> int: ...
def fs_write(root_fd: int, path: str, data: bytes, mode: int = 0o644,
             make_parents: bool = True) -> None: ...
def fs_list(root_fd: int, path: str) -> list[ListEntry]: ...
def fs_list_page(root_fd: int, path: str, after: str | None,
                 limit: int) -> tuple[list[ListEntry], str | None]: ...
def fs_stat(root_fd: int, path: str, cached: bool = False) -> StatInfo: ...
def fs_is_dir(root_fd: int, path: str) -> bool: ...
def fs_mkdir(root_fd: int, path: str, parents: bool = True, mode: int = 0o755) -> None: ...
def fs_remove(root_fd: int, path: str, recursive: bool = False,
              max_entries: int | None = None) -> None: ...
def fs_rename(root_fd: int, src: str, dst: str) -> None: ...
def fs_symlink(root_fd: int, target: str, linkpath: str) -> None: ...
def fs_readlink(root_fd: int, path: str) -> str: ...
def fs_chmod(root_fd: int, path: str, mode: int) -> None: ...
def fs_chown(root_fd: int, path: str, uid: int, gid: int) -> None: ...
def pty_open(root_fd: int) -> tuple[int, int]:
    """(master, slave) of a new pty in the sandbox's devpts."""

def remove_tree(path: str) -> None:
    """rm -rf, iterative at any depth, never following a symlink."""

def capture_layer(parts: list[tuple[int, str, str]], max_bytes: int = ...,
                  max_entries: int = 1_000_000, max_depth: int = 512,
                  control: CaptureControl | None = None) -> tuple[str, int]:
    """Copy each (n, src, dst) tree and hash it on the way: (hex digest, bytes).
    LayerLimit past a limit; CaptureCancelled once ``control`` is cancelled."""

# ---- the run_code zygote (rust/src/zygote.rs) ---------------------------------------------
def zygote_unshare() -> None:
    """New mount, network, pid, IPC and UTS namespaces for the caller."""
def zygote_die_with_parent(parent: int) -> None:
    """SIGKILL the caller when ``parent`` (its launcher) dies."""
def zygote_build_root(root: str, entries: list[tuple[str, str, str]]) -> None:
    """Switch to a new read-only root on a tmpfs at ``root`` made of (kind, src, dst)."""
def zygote_seal(landlock: bool = False) -> None:
    """no_new_privs and the seccomp filter, inherited by every request's child; with
    ``landlock`` a Landlock domain all children share (a session's commands)."""
def zygote_lockdown(uid: int, gid: int, rlimits: list[tuple[str, int, int]],
                    landlock: bool = True) -> None:
    """A request's child: ``uid``/``gid``, no capability, rlimits, no_new_privs, Landlock."""
def zygote_fork_server(sock: int) -> tuple[int, int, int, int, int]:
    """The zygote's fork server on the SOCK_SEQPACKET ``sock``: forks a request's child on
    each command; returns only in a child: (slot, request fd, stdout, stderr, started fd:
    one byte written to it once the child has its request). The child's exit status, and
    whether it had started, go to the daemon from the server, which reaps it."""

class ZygoteEntry:
    """What a request's child of one slot does to itself before its request, made once per
    slot by the zygote (rust/src/zygote.rs ``ChildEntry``)."""
    def __init__(self, *, join: list[int], dir: str, umask: int, uid: int, gid: int,
                 rlimits: list[tuple[str, int, int]], landlock: bool = True) -> None: ...
    def enter(self, stdio: list[tuple[int, int, bool]]) -> None:
        """In the forked child: join the cgroups (``join``: open membership files), setsid,
        place ``stdio`` ((src, dst, cloexec), targets 0..n), close the fds from n on, chdir
        to ``dir``, umask, then the lockdown of ``zygote_lockdown``."""
