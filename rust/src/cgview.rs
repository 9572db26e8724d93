//! A sandbox's own cgroups under its /sys/fs/cgroup, mounted after its init has joined them.
//!
//! A cgroup filesystem mounted inside a cgroup namespace shows that namespace's root: the
//! cgroups the sandbox's init was in when it unshared it. The spawn mounts the hierarchies the
//! init joined before that (spawn.rs, `cgroup_mounts`). Those made at the first exec (v1
//! memory, cpu, cpuacct, cpuset: see ContainerSubstrate.lazy_memcg) are mounted then, by a
//! helper that joins them, unshares a cgroup namespace of its own (rooted at them), enters the
//! sandbox's mount namespace and mounts them there, read-only.
//!
//! `rebind_in` uses the same kind of helper to replace lxcfs's files in a live sandbox's /proc
//! after lxcfs restarted (the old binds point at the dead server).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use libc::{c_int, c_long, c_void};

use crate::child::{self, Report};
use crate::harden;

#[derive(Debug, thiserror::Error)]
pub enum CgViewError {
    #[error("{0}")]
    Invalid(String),
    #[error("mount_cgroups_in: {step}: {source}")]
    Os {
        step: &'static str,
        source: io::Error,
    },
}

const STEPS: &[&str] = &[
    "clone",
    "join_cgroup",
    "unshare_cgroupns",
    "setns",
    "mount",
    "done",
];

/// One cgroup filesystem to mount: target path, fstype ("cgroup", "cgroup2"), options.
pub type CgMount = (String, String, String);

struct Ctx {
    report: Report,
    tasks: Vec<RawFd>,
    pidfd: RawFd,
    mounts: Vec<(CString, CString, CString)>,
}

fn cstring(s: &str) -> Result<CString, CgViewError> {
    CString::new(s).map_err(|_| CgViewError::Invalid(format!("NUL byte in {s:?}")))
}

/// Prepared (target, fstype, options) C strings; targets must be absolute, no "..".
pub fn prepare_mounts(
    mounts: &[CgMount],
    absolute: bool,
) -> Result<Vec<(CString, CString, CString)>, CgViewError> {
    mounts
        .iter()
        .map(|(t, f, o)| {
            let ok = t.starts_with('/') == absolute
                && t.split('/').all(|c| c != ".." && c != ".")
                && (f == "cgroup" || f == "cgroup2");
            if !ok {
                return Err(CgViewError::Invalid(format!(
                    "bad cgroup mount ({t:?}, {f:?})"
                )));
            }
            Ok((cstring(t)?, cstring(f)?, cstring(o)?))
        })
        .collect()
}

/// Child side (spawn's child and the helper below): mount each cgroup filesystem, then make
/// the mount read-only. Returns 0 or the errno.
///
/// # Safety
/// Async-signal-safe raw syscalls on prepared strings.
pub unsafe fn mount_all(mounts: &[(CString, CString, CString)]) -> c_int {
    let nse = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    for (t, f, o) in mounts {
        // SAFETY: valid NUL-terminated strings prepared by the parent.
        let rc = unsafe {
            libc::mount(
                c"cgroup".as_ptr(),
                t.as_ptr(),
                f.as_ptr(),
                nse,
                o.as_ptr() as *const c_void,
            )
        };
        if rc < 0 {
            return harden::errno();
        }
        let ro = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | nse;
        // SAFETY: as above; null source, fstype and data are allowed for a remount.
        let rc = unsafe {
            libc::mount(
                std::ptr::null(),
                t.as_ptr(),
                std::ptr::null(),
                ro,
                std::ptr::null(),
            )
        };
        if rc < 0 {
            return harden::errno();
        }
    }
    0
}

extern "C" fn helper(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `Ctx`, alive until the child exits (CLONE_VFORK).
    let c = unsafe { &*(arg as *const Ctx) };
    let r = &c.report;
    let fail = |rc: c_long| {
        if rc < 0 {
            r.fail(harden::errno());
        }
    };
    // SAFETY: raw syscalls on data the parent prepared; nothing allocates or unwinds.
    unsafe {
        r.at(1);
        for &fd in &c.tasks {
            fail(libc::write(fd, b"0".as_ptr() as *const c_void, 1) as c_long);
        }
        r.at(2);
        fail(libc::unshare(libc::CLONE_NEWCGROUP) as c_long);
        r.at(3);
        fail(libc::setns(c.pidfd, libc::CLONE_NEWNS) as c_long);
        r.at(4);
        let e = mount_all(&c.mounts);
        if e != 0 {
            r.fail(e);
        }
        r.at(5);
    }
    0
}

/// Mount `mounts` (absolute paths in the sandbox) in the mount namespace of the sandbox whose
/// init `pidfd` is, rooted at the cgroups whose `tasks` files are `tasks` (the helper joins
/// them first: each is then the root of its cgroup namespace).
pub fn mount_cgroups_in(
    pidfd: RawFd,
    tasks: &[String],
    mounts: &[CgMount],
) -> Result<(), CgViewError> {
    let mounts = prepare_mounts(mounts, true)?;
    let mut owned = Vec::new();
    for t in tasks {
        let p = cstring(t)?;
        // SAFETY: open of a valid path; the fd is owned below.
        let fd = unsafe { libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(CgViewError::Os {
                step: "open_tasks",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: a fresh fd we own.
        owned.push(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    let ctx = Ctx {
        report: Report::new(),
        tasks: owned.iter().map(|f| f.as_raw_fd()).collect(),
        pidfd,
        mounts,
    };
    let res = child::with_stack(|stack| {
        let _block = harden::SignalBlock::new();
        // SAFETY: `helper` is async-signal-safe and never unwinds; `ctx` outlives the clone
        // (CLONE_VFORK); signals are blocked by `_block`.
        unsafe { child::clone_vfork(helper, &ctx as *const Ctx as *mut c_void, 0, stack) }
    })
    .map_err(|e| CgViewError::Os {
        step: "alloc_stack",
        source: e,
    })?;
    let (pid, _) = res.map_err(|e| CgViewError::Os {
        step: "clone",
        source: e,
    })?;
    child::reap(pid);
    let (step, errno) = (ctx.report.step(), ctx.report.errno());
    if errno != 0 || step != 5 {
        return Err(CgViewError::Os {
            step: STEPS.get(step as usize).copied().unwrap_or("?"),
            source: io::Error::from_raw_os_error(if errno != 0 { errno } else { libc::ECHILD }),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// lxcfs's files bound again into a live sandbox (after an lxcfs restart)

const OPEN_TREE_CLONE: u32 = 1;
const MOVE_MOUNT_F_EMPTY_PATH: u32 = 0x4;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

struct RebindCtx {
    report: Report,
    pidfd: RawFd,
    /// (detached read-only copy of the source, target in the sandbox)
    binds: Vec<(RawFd, CString)>,
}

extern "C" fn rebind_helper(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `RebindCtx`, alive until the child exits (CLONE_VFORK).
    let c = unsafe { &*(arg as *const RebindCtx) };
    let r = &c.report;
    // SAFETY: raw syscalls on data the parent prepared; nothing allocates or unwinds.
    unsafe {
        r.at(3);
        if libc::setns(c.pidfd, libc::CLONE_NEWNS) < 0 {
            r.fail(harden::errno());
        }
        r.at(4);
        for (fd, target) in &c.binds {
            // The old bind (a dead connection's) goes first; none there is fine (EINVAL).
            if libc::umount2(target.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) < 0
                && harden::errno() != libc::EINVAL
            {
                r.fail(harden::errno());
            }
            let rc = libc::syscall(
                libc::SYS_move_mount,
                *fd as c_long,
                c"".as_ptr(),
                libc::AT_FDCWD as c_long,
                target.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH as c_long,
            );
            if rc < 0 {
                r.fail(harden::errno());
            }
        }
        r.at(5);
    }
    0
}

/// Bind each `(source, target)` read-only in the mount namespace of the init `pidfd`, over
/// whatever is mounted at `target` now (detached first): `source` is a host path, `target` a
/// path in the sandbox. The sources are cloned here (open_tree) before entering the sandbox.
pub fn rebind_in(pidfd: RawFd, binds: &[(String, String)]) -> Result<(), CgViewError> {
    let mut owned = Vec::new();
    let mut prepared = Vec::new();
    for (src, target) in binds {
        if !src.starts_with('/') || !target.starts_with('/') || target.split('/').any(|c| c == "..")
        {
            return Err(CgViewError::Invalid(format!(
                "bad bind ({src:?}, {target:?})"
            )));
        }
        let s = cstring(src)?;
        // SAFETY: open_tree with a valid path; the fd is owned below.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD as c_long,
                s.as_ptr(),
                (OPEN_TREE_CLONE | libc::O_CLOEXEC as u32) as c_long,
            )
        } as RawFd;
        if fd < 0 {
            return Err(CgViewError::Os {
                step: "open_tree",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: a fresh fd we own.
        owned.push(unsafe { OwnedFd::from_raw_fd(fd) });
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        };
        // SAFETY: mount_setattr on our detached mount with a valid attr struct and its size.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                fd as c_long,
                c"".as_ptr(),
                libc::AT_EMPTY_PATH as c_long,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>() as c_long,
            )
        };
        if rc < 0 {
            return Err(CgViewError::Os {
                step: "mount_setattr",
                source: io::Error::last_os_error(),
            });
        }
        prepared.push((fd, cstring(target)?));
    }
    let ctx = RebindCtx {
        report: Report::new(),
        pidfd,
        binds: prepared,
    };
    let res = child::with_stack(|stack| {
        let _block = harden::SignalBlock::new();
        // SAFETY: `rebind_helper` is async-signal-safe and never unwinds; `ctx` outlives the
        // clone (CLONE_VFORK); signals are blocked by `_block`.
        unsafe {
            child::clone_vfork(
                rebind_helper,
                &ctx as *const RebindCtx as *mut c_void,
                0,
                stack,
            )
        }
    })
    .map_err(|e| CgViewError::Os {
        step: "alloc_stack",
        source: e,
    })?;
    let (pid, _) = res.map_err(|e| CgViewError::Os {
        step: "clone",
        source: e,
    })?;
    child::reap(pid);
    drop(owned);
    let (step, errno) = (ctx.report.step(), ctx.report.errno());
    if errno != 0 || step != 5 {
        return Err(CgViewError::Os {
            step: STEPS.get(step as usize).copied().unwrap_or("?"),
            source: io::Error::from_raw_os_error(if errno != 0 { errno } else { libc::ECHILD }),
        });
    }
    Ok(())
}
