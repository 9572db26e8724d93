//! The `process` substrate's zygotes (run_code): the namespaces and the read-only root a
//! zygote builds around itself, and the lockdown a request's child applies to itself before it
//! runs untrusted code. Python (`corral.daemon.substrates.process`) decides paths and limits;
//! the syscalls are here. A zygote is a single-threaded Python process and every call acts on
//! the calling process (no clone, no CLONE_VM child), so ordinary Rust is fine here.

use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use libc::c_int;

use crate::harden::{self, CapPlan, HardenError, Rlimit};

#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    #[error("{0}")]
    Invalid(String),
    #[error("{step}: {msg}")]
    Os {
        step: String,
        errno: c_int,
        msg: String,
    },
    #[error(transparent)]
    Harden(#[from] HardenError),
}

impl ZygoteError {
    fn os(step: impl Into<String>, errno: c_int) -> Self {
        ZygoteError::Os {
            step: step.into(),
            errno,
            msg: harden::strerror(errno),
        }
    }

    fn io(step: impl Into<String>, e: std::io::Error) -> Self {
        Self::os(step, e.raw_os_error().unwrap_or(libc::EIO))
    }
}

fn cstr(s: &[u8]) -> Result<CString, ZygoteError> {
    CString::new(s).map_err(|_| ZygoteError::Invalid("a path contains a NUL byte".into()))
}

/// New mount, network (no interface up: no network at all), pid, IPC and UTS namespaces for
/// the caller: its next child is pid 1 of the new pid namespace.
pub fn unshare_namespaces() -> Result<(), ZygoteError> {
    let flags = libc::CLONE_NEWNS
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS;
    // SAFETY: unshare with integer flags only.
    if unsafe { libc::unshare(flags) } != 0 {
        return Err(ZygoteError::os("unshare", harden::errno()));
    }
    Ok(())
}

/// SIGKILL the caller when its parent dies (the zygote's parent is its launcher in the
/// daemon's namespaces: when that goes, the zygote and, as pid 1, its whole namespace go).
pub fn die_with_parent(parent: libc::pid_t) -> Result<(), ZygoteError> {
    // SAFETY: prctl with integer arguments only.
    if unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        )
    } != 0
    {
        return Err(ZygoteError::os("pdeathsig", harden::errno()));
    }
    // SAFETY: getppid has no arguments. The parent may have died before the prctl.
    if unsafe { libc::getppid() } != parent {
        return Err(ZygoteError::os("parent gone", libc::ESRCH));
    }
    Ok(())
}

fn mount(
    step: &str,
    src: &[u8],
    dst: &Path,
    fstype: &[u8],
    flags: libc::c_ulong,
    data: &[u8],
) -> Result<(), ZygoteError> {
    let (s, d, t, o) = (
        cstr(src)?,
        cstr(dst.as_os_str().as_bytes())?,
        cstr(fstype)?,
        cstr(data)?,
    );
    let o_ptr = if data.is_empty() {
        std::ptr::null()
    } else {
        o.as_ptr()
    };
    // SAFETY: every pointer is a valid NUL-terminated string (or NULL data) that outlives the
    // call.
    let rc = unsafe { libc::mount(s.as_ptr(), d.as_ptr(), t.as_ptr(), flags, o_ptr.cast()) };
    if rc != 0 {
        let e = harden::errno();
        return Err(ZygoteError::os(
            format!("{step} {}", dst.to_string_lossy()),
            e,
        ));
    }
    Ok(())
}

/// One entry of the new root, made in order. `kind`: `ro` (read-only bind of a host file or
/// directory), `dev` (bind of a host device node), `symlink` (src is the link's target),
/// `tmpfs` (src holds the mount options), `proc` (a procfs of the caller's pid namespace that
/// shows a process only to its own uid), `dir` (an empty directory).
pub struct Entry {
    pub kind: String,
    pub src: OsString,
    pub dst: OsString,
}

fn inside(root: &Path, dst: &OsStr) -> Result<PathBuf, ZygoteError> {
    let rel = Path::new(dst);
    if !rel.is_absolute()
        || rel
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(ZygoteError::Invalid(format!(
            "root entry {} is not an absolute path without ..",
            rel.to_string_lossy()
        )));
    }
    Ok(root.join(rel.strip_prefix("/").unwrap_or(rel)))
}

fn mountpoint(at: &Path, dir: bool) -> Result<(), ZygoteError> {
    let parent = at.parent().unwrap_or(at);
    std::fs::create_dir_all(parent).map_err(|e| ZygoteError::io("mkdir", e))?;
    if dir {
        std::fs::create_dir_all(at).map_err(|e| ZygoteError::io("mkdir", e))?;
    } else if !at.exists() {
        std::fs::File::create(at).map_err(|e| ZygoteError::io("mountpoint", e))?;
    }
    Ok(())
}

const NOSUID_NODEV: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;

/// Build a new root on a tmpfs at `root` from `entries`, switch to it (the old root detached:
/// nothing of the host stays reachable but what was bound) and make it read-only.
pub fn build_root(root: &Path, entries: &[Entry]) -> Result<(), ZygoteError> {
    mount(
        "make-private",
        b"none",
        Path::new("/"),
        b"",
        libc::MS_REC | libc::MS_PRIVATE,
        b"",
    )?;
    mount(
        "root",
        b"corral-rc",
        root,
        b"tmpfs",
        NOSUID_NODEV,
        b"mode=0755,size=1m",
    )?;
    for e in entries {
        let at = inside(root, &e.dst)?;
        let src = e.src.as_bytes();
        match e.kind.as_str() {
            "ro" | "dev" => {
                let meta = std::fs::metadata(&e.src).map_err(|x| ZygoteError::io("stat", x))?;
                mountpoint(&at, meta.is_dir())?;
                mount("bind", src, &at, b"", libc::MS_BIND | libc::MS_REC, b"")?;
                let flags = if e.kind == "ro" {
                    libc::MS_RDONLY | NOSUID_NODEV
                } else {
                    libc::MS_NOSUID | libc::MS_NOEXEC
                };
                mount(
                    "remount",
                    b"none",
                    &at,
                    b"",
                    libc::MS_BIND | libc::MS_REMOUNT | flags,
                    b"",
                )?;
            }
            "symlink" => {
                mountpoint(at.parent().unwrap_or(root), true)?;
                std::os::unix::fs::symlink(&e.src, &at)
                    .map_err(|x| ZygoteError::io("symlink", x))?;
            }
            "tmpfs" => {
                mountpoint(&at, true)?;
                mount("tmpfs", b"corral-rc", &at, b"tmpfs", NOSUID_NODEV, src)?;
            }
            "proc" => {
                mountpoint(&at, true)?;
                let flags = NOSUID_NODEV | libc::MS_NOEXEC;
                mount("proc", b"proc", &at, b"proc", flags, b"hidepid=2")?;
            }
            "dir" => mountpoint(&at, true)?,
            k => {
                return Err(ZygoteError::Invalid(format!(
                    "unknown root entry kind {k:?}"
                )))
            }
        }
    }
    let r = cstr(root.as_os_str().as_bytes())?;
    // SAFETY: chdir/pivot_root/umount2 with valid NUL-terminated paths that outlive the calls.
    // pivot_root(".", ".") stacks the old root under the new one; the detach removes it.
    unsafe {
        if libc::chdir(r.as_ptr()) != 0 {
            return Err(ZygoteError::os("chdir root", harden::errno()));
        }
        if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0 {
            return Err(ZygoteError::os("pivot_root", harden::errno()));
        }
        if libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0 {
            return Err(ZygoteError::os("detach old root", harden::errno()));
        }
        if libc::chdir(c"/".as_ptr()) != 0 {
            return Err(ZygoteError::os("chdir /", harden::errno()));
        }
    }
    mount(
        "remount root",
        b"none",
        Path::new("/"),
        b"",
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | NOSUID_NODEV,
        b"",
    )
}

/// Seal the zygote itself once its root is built: no_new_privs and the sandbox seccomp filter
/// (only AF_UNIX sockets), which every request's child then inherits at its fork instead of
/// attaching its own (the kernel's per-attach cost stays out of the request path). The zygote
/// needs nothing the filter refuses once its namespaces and mounts are made. With `landlock`
/// (a session's zygote) the zygote also enters a Landlock domain (abstract unix socket scope)
/// that every child shares: a session's commands see and signal each other, which separate
/// domains (run_code's requests) would forbid.
pub fn seal(landlock: bool) -> Result<(), ZygoteError> {
    let prog = harden::seccomp_program(true)?;
    // SAFETY: prctl, seccomp and landlock on data that outlives the calls; single-threaded
    // caller.
    unsafe {
        harden::no_new_privs().map_err(|e| ZygoteError::os("no_new_privs", e))?;
        harden::apply_seccomp(prog).map_err(|e| ZygoteError::os("seccomp", e))?;
        if landlock && harden::landlock_abi() >= 6 {
            harden::landlock_scope_unix().map_err(|e| ZygoteError::os("landlock", e))?;
        }
    }
    Ok(())
}

/// What a request's child becomes before it runs untrusted code.
pub struct Lockdown {
    pub uid: u32,
    pub gid: u32,
    pub rlimits: Vec<Rlimit>,
    /// a Landlock domain of its own (run_code's requests); a session's commands share the
    /// zygote's (`seal`)
    pub landlock: bool,
}

/// Apply `l` to the calling (single-threaded) process, a child of a sealed zygote (`seal`:
/// the seccomp filter is inherited): oom_score_adj as a sandbox, no capability left in any set
/// (bounding and ambient included), the unprivileged uid/gid with no supplementary group, the
/// rlimits, no_new_privs, and Landlock's abstract unix socket scope in a domain of its own
/// where the kernel has it (all requests of a zygote share its network namespace).
pub fn lockdown(l: &Lockdown) -> Result<(), ZygoteError> {
    let plan = CapPlan {
        bounding: 0,
        sets: 0,
        last_cap: harden::last_cap(),
    };
    let step = |name: &str, r: Result<(), c_int>| r.map_err(|e| ZygoteError::os(name, e));
    // SAFETY: each call is a handful of raw syscalls on data that lives on our stack or in
    // `l`/`prog` for the duration of the call; the caller is single-threaded.
    unsafe {
        step("oom_score_adj", harden::set_sandbox_oom_score_adj())?;
        step("drop_bounding", harden::drop_bounding(&plan))?;
        step("set_ids", harden::set_ids(l.uid, l.gid, &[]))?;
        step("capset", harden::apply_caps(&plan))?;
        step("rlimits", harden::apply_rlimits(&l.rlimits))?;
        step("no_new_privs", harden::no_new_privs())?;
        if l.landlock && harden::landlock_abi() >= 6 {
            step("landlock", harden::landlock_scope_unix())?;
        }
    }
    Ok(())
}
