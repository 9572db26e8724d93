//! A new sandbox: clone into new namespaces, join the cgroups, assemble the root inside the new
//! mount namespace, switch root, harden, exec the init.
//!
//! Order in the child (each one a `Step`, reported to the parent on failure):
//! cgroups -> cgroup ns -> (join a pooled netns) -> / rprivate -> overlays -> /proc, /dev, /tmp
//! -> /proc masking -> detach the copied daemon mounts -> MS_MOVE root onto / + chroot(".")
//! -> hostname -> lo up -> stdio on
//! /dev/null -> rlimits -> drop every capability -> no_new_privs -> seccomp -> execveat(init).
//!
//! The overlay is mounted *inside* the new mount namespace so the host's mount table does not
//! grow with every sandbox, and the root switch is MS_MOVE + chroot rather than pivot_root,
//! whose cost grows with the number of tasks on the host (see DESIGN.md). chroot leaves the
//! old root reachable to anyone who may chroot again, so the init keeps no capability at all
//! and the seccomp filter refuses chroot, mount, unshare, setns and namespace-making clones;
//! what stays below it is only the mounts on the way to the sandbox's root (`detach`).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use libc::{c_char, c_int, c_long, c_void};

use crate::child::{self, Report};
use crate::harden::{self, CapPlan, HardenError, Rlimit};

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Harden(#[from] HardenError),
    #[error("spawn_sandbox: {step}: {msg}")]
    Os {
        step: &'static str,
        errno: i32,
        msg: String,
    },
}

impl SpawnError {
    fn os(step: &'static str, errno: i32) -> Self {
        SpawnError::Os {
            step,
            errno,
            msg: harden::strerror(errno),
        }
    }
}

/// One overlay mount: `target` inside the sandbox ("/" first), lowerdirs top-first.
#[derive(Debug, Clone)]
pub struct Overlay {
    pub target: String,
    pub lower: Vec<String>,
    pub upper: String,
    pub work: String,
    /// Extra overlayfs options, e.g. "volatile" (see `EXTRA_OPTIONS`).
    pub options: Vec<String>,
}

/// overlayfs options a caller may add. `volatile` skips the sync of the upper filesystem that
/// every unmount (= every sandbox teardown) otherwise does; a sandbox's upper dir never needs
/// to survive a host crash.
const EXTRA_OPTIONS: &[&str] = &[
    "volatile",
    "index=off",
    "index=on",
    "xino=off",
    "xino=auto",
    "metacopy=off",
    "metacopy=on",
    "redirect_dir=off",
    "redirect_dir=on",
    "uuid=off",
    "uuid=null",
];

#[derive(Debug, Clone)]
pub struct SpawnConfig {
    pub init_fd: RawFd,
    pub root: String,
    pub overlays: Vec<Overlay>,
    pub hostname: String,
    pub cgroup_procs: Vec<String>,
    pub rlimits: Vec<Rlimit>,
    /// Join this network namespace (e.g. from a pool) instead of making a new one.
    pub netns_fd: Option<RawFd>,
    /// Network "disabled": only AF_UNIX sockets (seccomp), abstract unix sockets scoped to
    /// the sandbox (Landlock), loopback left alone (the namespace is shared and unused).
    pub unix_only: bool,
    /// An empty host directory, bound read-only over the /proc directories to mask
    /// (`proc_mask_dirs`), so that no sandbox mounts a tmpfs of its own for them: every
    /// superblock costs each memory cgroup of the host a slot in its shrinker table, for as
    /// long as the host runs (docs/daemon.md, "Recycled memory cgroups"). None: a tmpfs.
    pub mask_dir: Option<String>,
    /// The /proc policy, decided by the caller (paths relative to /proc; one this kernel
    /// lacks is skipped): entries bound read-only onto themselves,
    pub proc_readonly: Vec<String>,
    /// files covered by the sandbox's /dev/null,
    pub proc_mask_files: Vec<String>,
    /// and directories covered by `mask_dir` (read-only).
    pub proc_mask_dirs: Vec<String>,
    /// (host path, entry): a file bound read-only over /proc/<entry>, after the masks (the
    /// sandbox's own view of meminfo, cpuinfo... served by lxcfs). The host path must not
    /// be on a FUSE mount itself but a bind of one: a path walk that ends at a mount's root
    /// asks nothing of the filesystem, so a stalled server cannot stall the spawn.
    pub proc_binds: Vec<(String, String)>,
    /// A host directory bound read-only at /sys (the mountpoints of `cgroup_mounts`); None:
    /// no /sys (the image's directory, empty).
    pub sys_dir: Option<String>,
    /// Cgroup filesystems mounted read-only inside the new root, rooted at the cgroups the
    /// init joined (its cgroup namespace's root): (target relative to the root, fstype,
    /// options), e.g. ("sys/fs/cgroup/pids", "cgroup", "pids"). Needs `sys_dir`.
    pub cgroup_mounts: Vec<crate::cgview::CgMount>,
    /// size= of the sandbox's /tmp tmpfs, in MiB (its `disk_mb`); None: unbounded.
    pub tmp_size_mb: Option<u64>,
    /// Mount a tmpfs on /tmp. False: /tmp is the root overlay's own directory, on the
    /// sandbox's disk with its quota (the daemon makes it in the upper dir).
    pub tmp_tmpfs: bool,
    /// The daemon's shared /dev (device nodes, links, empty `pts` and `shm` mountpoints; see
    /// `DEVICES`, `DEV_LINKS`), bound read-only (nosuid, noexec) at every sandbox's /dev
    /// instead of a tmpfs each: one superblock fewer per sandbox. None: a tmpfs per sandbox.
    pub dev_dir: Option<String>,
    /// With `dev_dir`: the sandbox's own writable directory (on its disk layer) bound at
    /// /dev/shm (nosuid, nodev, noexec). None: a tmpfs of 64 MiB there.
    pub shm_dir: Option<String>,
    /// The daemon's mounts the new mount namespace copies but the sandbox never reaches (the
    /// top of each subtree not on the path to `root`), detached (recursively, one call each)
    /// once the new root is built, before the root switch: each copied mount costs kernel
    /// memory for as long as the sandbox lives. One that is no longer a mount is skipped.
    pub detach: Vec<String>,
}

// The steps, in order; the names are what an OSError says.
const STEPS: &[&str] = &[
    "clone",
    "fd_table",
    "join_cgroup",
    "unshare_cgroupns",
    "join_netns",
    "make_rprivate",
    "mount_root_overlay",
    "chdir_root",
    "mountpoint",
    "mount_overlay",
    "mount_proc",
    "mount_dev",
    "mknod_dev",
    "mount_devpts",
    "mount_dev_shm",
    "dev_symlinks",
    "mask_proc",
    "mount_sys",
    "mount_cgroup",
    "mount_tmp",
    "detach_host",
    "move_root",
    "chroot",
    "sethostname",
    "loopback_up",
    "stdio_devnull",
    "init_channel",
    "close_fds",
    "rlimits",
    "drop_caps",
    "no_new_privs",
    "landlock",
    "seccomp",
    "exec_init",
];

#[derive(Clone, Copy)]
#[repr(u32)]
enum Step {
    #[allow(dead_code)] // index 0 of STEPS: a failed clone is reported by the parent
    Clone = 0,
    FdTable,
    JoinCgroup,
    UnshareCgroupNs,
    JoinNetNs,
    MakeRprivate,
    MountRootOverlay,
    ChdirRoot,
    Mountpoint,
    MountOverlay,
    MountProc,
    MountDev,
    MknodDev,
    MountDevpts,
    MountDevShm,
    DevSymlinks,
    MaskProc,
    MountSys,
    MountCgroup,
    MountTmp,
    DetachHost,
    MoveRoot,
    Chroot,
    Sethostname,
    LoopbackUp,
    StdioDevnull,
    InitChannel,
    CloseFds,
    Rlimits,
    DropCaps,
    NoNewPrivs,
    Landlock,
    Seccomp,
    ExecInit,
}

fn step_name(step: u32) -> &'static str {
    STEPS.get(step as usize).copied().unwrap_or("unknown")
}

/// A mount target inside the new root, relative ("usr/local"), with each of its prefixes
/// ("usr", "usr/local") so the child can create missing directories without allocating.
struct Target {
    prefixes: Vec<CString>,
}

impl Target {
    fn new(rel: &str) -> Result<Self, SpawnError> {
        let mut prefixes = Vec::new();
        let mut acc = String::new();
        for comp in rel.split('/').filter(|c| !c.is_empty() && *c != ".") {
            if comp == ".." {
                return Err(SpawnError::Invalid(format!(
                    "mount target {rel:?} contains '..'"
                )));
            }
            if !acc.is_empty() {
                acc.push('/');
            }
            acc.push_str(comp);
            prefixes.push(cstring(&acc)?);
        }
        Ok(Target { prefixes })
    }

    fn path(&self) -> Option<&CString> {
        self.prefixes.last()
    }
}

/// Everything the child needs, prepared (allocated) before the clone.
struct Ctx {
    report: Report,
    /// Owned here; the child writes to `cgroup_raw` (the same fds, or the slots lent them).
    _cgroup_fds: Vec<OwnedFd>,
    cgroup_raw: Vec<RawFd>,
    /// close_range start of the child's private fd table, or -1 (see child::Slots).
    hole: RawFd,
    netns_fd: RawFd,
    root: CString,
    root_opts: CString,
    subs: Vec<(Target, CString)>,
    std_targets: [Target; 3], // proc, dev, tmp
    hostname: Vec<u8>,
    rlimits: Vec<Rlimit>,
    caps: CapPlan,
    seccomp: &'static [libc::sock_filter],
    unix_only: bool,
    mask_dir: Option<CString>,
    proc_readonly: Vec<CString>,
    proc_mask_files: Vec<CString>,
    proc_mask_dirs: Vec<CString>,
    proc_binds: Vec<(CString, CString)>,
    sys: Option<(Target, CString)>,
    cgroup_mounts: Vec<(CString, CString, CString)>,
    tmp_opts: Option<CString>,
    /// (shared /dev, the sandbox's /dev/shm or None: a tmpfs), see SpawnConfig::dev_dir.
    dev_bind: Option<(CString, Option<CString>)>,
    detach: Vec<CString>,
    init_fd: RawFd,
    /// Both ends of the init's exec channel; the child puts them on fds 3 and 4
    /// (corral-init.c, "Exec server").
    channel: [RawFd; 2],
    argv: [*const c_char; 2],
    envp: [*const c_char; 1],
}

fn cstring(s: &str) -> Result<CString, SpawnError> {
    CString::new(s).map_err(|_| SpawnError::Invalid(format!("NUL byte in {s:?}")))
}

/// (source, "proc/<entry>") for `proc_binds`: absolute sources, plain entries.
fn proc_bind_paths(binds: &[(String, String)]) -> Result<Vec<(CString, CString)>, SpawnError> {
    let entries: Vec<String> = binds.iter().map(|(_, e)| e.clone()).collect();
    let targets = proc_paths(&entries)?;
    binds
        .iter()
        .zip(targets)
        .map(|((src, _), t)| {
            if !src.starts_with('/') {
                return Err(SpawnError::Invalid(format!(
                    "proc bind source {src:?} must be an absolute path"
                )));
            }
            Ok((cstring(src)?, t))
        })
        .collect()
}

/// "proc/<rel>" for an entry of the /proc policy: relative, no "..", nothing empty.
fn proc_paths(rels: &[String]) -> Result<Vec<CString>, SpawnError> {
    rels.iter()
        .map(|rel| {
            let ok = !rel.is_empty()
                && !rel.starts_with('/')
                && rel
                    .split('/')
                    .all(|c| !c.is_empty() && c != "." && c != "..");
            if !ok {
                return Err(SpawnError::Invalid(format!(
                    "/proc entry {rel:?} must be a plain relative path"
                )));
            }
            cstring(&format!("proc/{rel}"))
        })
        .collect()
}

fn check_overlay_path(what: &str, p: &str, extra_forbidden: &[char]) -> Result<(), SpawnError> {
    if !p.starts_with('/') {
        return Err(SpawnError::Invalid(format!(
            "overlay {what} {p:?} must be an absolute path"
        )));
    }
    if let Some(c) = p
        .chars()
        .find(|c| *c == ',' || *c == '\\' || extra_forbidden.contains(c))
    {
        return Err(SpawnError::Invalid(format!(
            "overlay {what} {p:?} contains {c:?}"
        )));
    }
    Ok(())
}

fn overlay_opts(o: &Overlay) -> Result<CString, SpawnError> {
    if o.lower.is_empty() {
        return Err(SpawnError::Invalid(format!(
            "overlay {:?} has no lowerdir",
            o.target
        )));
    }
    for l in &o.lower {
        check_overlay_path("lowerdir", l, &[':'])?;
    }
    check_overlay_path("upperdir", &o.upper, &[':'])?;
    check_overlay_path("workdir", &o.work, &[':'])?;
    let mut s = format!(
        "lowerdir={},upperdir={},workdir={}",
        o.lower.join(":"),
        o.upper,
        o.work
    );
    for opt in &o.options {
        if !EXTRA_OPTIONS.contains(&opt.as_str()) {
            return Err(SpawnError::Invalid(format!(
                "overlay option {opt:?} is not allowed (allowed: {})",
                EXTRA_OPTIONS.join(" ")
            )));
        }
        s.push(',');
        s.push_str(opt);
    }
    if s.len() >= 4096 {
        return Err(SpawnError::Invalid(format!(
            "overlay options for {:?} are {} bytes, the kernel takes at most 4095",
            o.target,
            s.len()
        )));
    }
    cstring(&s)
}

fn open_cgroup_procs(paths: &[String]) -> Result<Vec<OwnedFd>, SpawnError> {
    open_write_fds(paths).map_err(|(p, e)| SpawnError::Os {
        step: "open_cgroup_procs",
        errno: e.raw_os_error().unwrap_or(libc::EIO),
        msg: format!("{p}: {e}"),
    })
}

/// Open each file write-only, close-on-exec.
pub(crate) fn open_write_fds(paths: &[String]) -> Result<Vec<OwnedFd>, (String, std::io::Error)> {
    let mut fds = Vec::with_capacity(paths.len());
    for p in paths {
        let c = CString::new(p.as_str())
            .map_err(|_| (p.clone(), std::io::Error::from_raw_os_error(libc::EINVAL)))?;
        // SAFETY: open with a valid C string; the result is checked.
        let mut fd = unsafe { libc::open(c.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err((p.clone(), std::io::Error::last_os_error()));
        }
        if fd < 3 {
            // A daemon started with stdio closed: keep these off 0..2, which children remap.
            // SAFETY: fcntl/close on the fd we just opened.
            unsafe {
                let high = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3);
                libc::close(fd);
                if high < 0 {
                    return Err((p.clone(), std::io::Error::last_os_error()));
                }
                fd = high;
            }
        }
        // SAFETY: fd was just returned by open and is owned by nobody else.
        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    Ok(fds)
}

static INIT_ARGV0: &[u8] = b"corral-init\0";

fn prepare(cfg: &SpawnConfig) -> Result<Ctx, SpawnError> {
    if cfg.overlays.is_empty() {
        return Err(SpawnError::Invalid("overlays must not be empty".into()));
    }
    if cfg.overlays[0].target != "/" {
        return Err(SpawnError::Invalid(format!(
            "the first overlay must target \"/\", not {:?}",
            cfg.overlays[0].target
        )));
    }
    if !cfg.root.starts_with('/') {
        return Err(SpawnError::Invalid(format!(
            "root {:?} must be an absolute path",
            cfg.root
        )));
    }
    if cfg.init_fd < 0 {
        return Err(SpawnError::Invalid(
            "init_fd must be an open fd (see init_memfd())".into(),
        ));
    }
    if cfg.hostname.is_empty() || cfg.hostname.len() > 64 || cfg.hostname.contains('\0') {
        return Err(SpawnError::Invalid(format!(
            "bad hostname {:?}",
            cfg.hostname
        )));
    }
    let mut subs = Vec::new();
    for o in &cfg.overlays[1..] {
        if !o.target.starts_with('/') {
            return Err(SpawnError::Invalid(format!(
                "overlay target {:?} must be absolute",
                o.target
            )));
        }
        let t = Target::new(&o.target)?;
        let Some(rel) = t.path() else {
            return Err(SpawnError::Invalid(
                "only the first overlay may target \"/\"".into(),
            ));
        };
        let top = rel
            .to_bytes()
            .split(|&b| b == b'/')
            .next()
            .unwrap_or_default();
        if [&b"proc"[..], b"dev", b"tmp"].contains(&top) {
            return Err(SpawnError::Invalid(format!(
                "overlay target {:?} would be hidden by the sandbox's own /{}",
                o.target,
                String::from_utf8_lossy(top)
            )));
        }
        subs.push((t, overlay_opts(o)?));
    }
    let root_opts = overlay_opts(&cfg.overlays[0])?;
    let seccomp = harden::seccomp_program(cfg.unix_only)?;
    let cgroup_fds = open_cgroup_procs(&cfg.cgroup_procs)?;
    let cgroup_raw = cgroup_fds.iter().map(|f| f.as_raw_fd()).collect();
    Ok(Ctx {
        report: Report::new(),
        _cgroup_fds: cgroup_fds,
        cgroup_raw,
        hole: -1,
        netns_fd: cfg.netns_fd.unwrap_or(-1),
        root: cstring(&cfg.root)?,
        root_opts,
        subs,
        std_targets: [
            Target::new("proc")?,
            Target::new("dev")?,
            Target::new("tmp")?,
        ],
        hostname: cfg.hostname.as_bytes().to_vec(),
        rlimits: harden::clamp_rlimits(&cfg.rlimits),
        // The shell set a root command gets: the init's children (exec through the init)
        // start with it, and a non-root command's child drops it when it switches users.
        caps: CapPlan::shell(0),
        seccomp,
        unix_only: cfg.unix_only,
        mask_dir: match &cfg.mask_dir {
            Some(m) if !m.starts_with('/') => {
                return Err(SpawnError::Invalid(format!(
                    "mask_dir {m:?} must be an absolute path"
                )))
            }
            Some(m) => Some(cstring(m)?),
            None => None,
        },
        proc_readonly: proc_paths(&cfg.proc_readonly)?,
        proc_mask_files: proc_paths(&cfg.proc_mask_files)?,
        proc_mask_dirs: proc_paths(&cfg.proc_mask_dirs)?,
        proc_binds: proc_bind_paths(&cfg.proc_binds)?,
        sys: match &cfg.sys_dir {
            Some(d) if !d.starts_with('/') => {
                return Err(SpawnError::Invalid(format!(
                    "sys_dir {d:?} must be an absolute path"
                )))
            }
            Some(d) => Some((Target::new("sys")?, cstring(d)?)),
            None => None,
        },
        cgroup_mounts: {
            if cfg.sys_dir.is_none() && !cfg.cgroup_mounts.is_empty() {
                return Err(SpawnError::Invalid("cgroup_mounts need sys_dir".into()));
            }
            for (t, _, _) in &cfg.cgroup_mounts {
                if !t.starts_with("sys/") {
                    return Err(SpawnError::Invalid(format!(
                        "cgroup mount {t:?} must be below sys/"
                    )));
                }
            }
            crate::cgview::prepare_mounts(&cfg.cgroup_mounts, false)
                .map_err(|e| SpawnError::Invalid(e.to_string()))?
        },
        tmp_opts: match (cfg.tmp_tmpfs, cfg.tmp_size_mb) {
            (false, _) => None,
            (true, Some(mb)) => Some(cstring(&format!("mode=1777,size={mb}m"))?),
            (true, None) => Some(cstring("mode=1777")?),
        },
        dev_bind: match (&cfg.dev_dir, &cfg.shm_dir) {
            (None, None) => None,
            (None, Some(_)) => return Err(SpawnError::Invalid("shm_dir needs dev_dir".into())),
            (Some(d), shm) => {
                for p in std::iter::once(d).chain(shm) {
                    if !p.starts_with('/') {
                        return Err(SpawnError::Invalid(format!(
                            "{p:?} must be an absolute path"
                        )));
                    }
                }
                Some((cstring(d)?, shm.as_deref().map(cstring).transpose()?))
            }
        },
        detach: cfg
            .detach
            .iter()
            .map(|d| {
                if d.starts_with('/') {
                    cstring(d)
                } else {
                    Err(SpawnError::Invalid(format!(
                        "detach {d:?} must be absolute"
                    )))
                }
            })
            .collect::<Result<_, _>>()?,
        init_fd: cfg.init_fd,
        channel: [-1, -1],
        argv: [INIT_ARGV0.as_ptr() as *const c_char, std::ptr::null()],
        envp: [std::ptr::null()],
    })
}

/// Create a sandbox; returns (init host pid, pidfd).
pub fn spawn_sandbox(cfg: &SpawnConfig) -> Result<(i32, OwnedFd), SpawnError> {
    let mut ctx = prepare(cfg)?;
    // Both ends go to the init, none stays here: the daemon takes its end with pidfd_getfd
    // when it needs it, so the channel outlives a daemon restart.
    let (end_a, end_b) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| SpawnError::os("socketpair", e.raw_os_error()))?;
    ctx.channel = [end_a.as_raw_fd(), end_b.as_raw_fd()];
    let lent = match child::slots() {
        Some(slots) => {
            let mut fds: Vec<&mut RawFd> = ctx.cgroup_raw.iter_mut().collect();
            fds.push(&mut ctx.netns_fd);
            fds.push(&mut ctx.init_fd);
            let [a, b] = &mut ctx.channel;
            fds.extend([a, b]);
            let lent = slots
                .lend(&mut fds)
                .map_err(|e| SpawnError::os("lend_fds", e.raw_os_error().unwrap_or(libc::EIO)))?;
            ctx.hole = lent.hole();
            Some(lent)
        }
        None => None,
    };
    let mut flags = libc::CLONE_PIDFD
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWIPC;
    if ctx.netns_fd < 0 {
        flags |= libc::CLONE_NEWNET;
    }
    if lent.is_some() {
        flags |= libc::CLONE_FILES;
    }
    let t0 = child::now_ns();
    let res = child::with_stack(|stack| {
        let _block = harden::SignalBlock::new();
        // SAFETY: `spawn_child` is async-signal-safe and never unwinds; `ctx` lives on our stack
        // until after the clone returns (the child has exec'd or exited by then: CLONE_VFORK);
        // signals are blocked by `_block`.
        unsafe { child::clone_vfork(spawn_child, &ctx as *const Ctx as *mut c_void, flags, stack) }
    })
    .map_err(|e| SpawnError::os("alloc_stack", e.raw_os_error().unwrap_or(libc::ENOMEM)))?;
    drop(lent); // the child has exec'd or exited: reset the slots
    let (pid, pidfd) = res.map_err(|e| SpawnError::os("clone", e.raw_os_error().unwrap_or(0)))?;
    // SAFETY: CLONE_PIDFD gave us this fd; we own it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let (step, errno) = (ctx.report.step(), ctx.report.errno());
    child::set_last_profile("spawn_sandbox", ctx.report.profile(t0, STEPS));
    if errno != 0 || step != Step::ExecInit as u32 {
        child::reap(pid);
        if errno != 0 {
            return Err(SpawnError::os(step_name(step), errno));
        }
        return Err(SpawnError::Os {
            step: step_name(step),
            errno: libc::ECHILD,
            msg: "the sandbox's child process died before exec (killed?)".into(),
        });
    }
    Ok((pid, pidfd))
}

// ---------------------------------------------------------------------------------------------
// child side: async-signal-safe only (see child.rs)

/// Fail the current step with errno unless `rc >= 0`.
#[inline]
fn ck(r: &Report, rc: c_long) {
    if rc < 0 {
        r.fail(harden::errno());
    }
}

#[inline]
fn ck_res(r: &Report, res: Result<(), c_int>) {
    if let Err(e) = res {
        r.fail(e);
    }
}

/// mount(2) with optional C-string arguments.
///
/// # Safety
/// Async-signal-safe; the pointers come from live C strings.
unsafe fn mount(
    src: Option<&std::ffi::CStr>,
    target: &std::ffi::CStr,
    fstype: Option<&std::ffi::CStr>,
    flags: libc::c_ulong,
    data: Option<&std::ffi::CStr>,
) -> c_long {
    let p = |s: Option<&std::ffi::CStr>| s.map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every pointer is NULL or a valid NUL-terminated string.
    unsafe {
        libc::mount(
            p(src),
            target.as_ptr(),
            p(fstype),
            flags,
            p(data) as *const c_void,
        ) as c_long
    }
}

/// Make sure `t` (relative to the cwd, which is the new root) is a real directory reached
/// without following any symlink, creating missing components. A component that is a symlink
/// or a file (from an image, or a snapshot of a sandbox's writes) is never followed: it is
/// unlinked (in the sandbox's own writable root) and a directory made in its place. A mount
/// goes on top of it anyway, hiding whatever was there; a symlink must not steer a mount or a
/// mkdir onto a host path, and a stray file must not make the sandbox fail to start.
///
/// # Safety
/// Async-signal-safe: openat2/unlinkat/mkdirat/close syscalls on prepared strings.
unsafe fn ensure_dir(r: &Report, t: &Target) {
    let Some(full) = t.path() else { return };
    // SAFETY: raw syscalls on valid C strings (see open_beneath).
    unsafe {
        let fd = open_beneath(full);
        if fd >= 0 {
            libc::close(fd as c_int);
            return;
        }
        let e = harden::errno();
        if e != libc::ENOENT && e != libc::ENOTDIR && e != libc::ELOOP {
            r.fail(e);
        }
        for p in &t.prefixes {
            let fd = open_beneath(p);
            if fd >= 0 {
                libc::close(fd as c_int);
                continue;
            }
            let e = harden::errno();
            if e == libc::ENOTDIR || e == libc::ELOOP {
                // Not a directory (every earlier prefix is one): unlinkat never follows it.
                if libc::unlinkat(libc::AT_FDCWD, p.as_ptr(), 0) < 0 {
                    r.fail(harden::errno());
                }
            } else if e != libc::ENOENT {
                r.fail(e);
            }
            if libc::mkdirat(libc::AT_FDCWD, p.as_ptr(), 0o755) < 0 {
                let e = harden::errno();
                if e != libc::EEXIST {
                    r.fail(e);
                }
            }
            let fd = open_beneath(p);
            if fd < 0 {
                r.fail(harden::errno());
            }
            libc::close(fd as c_int);
        }
    }
}

/// The kernel's `struct open_how` (libc's is non-exhaustive).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// openat2(AT_FDCWD, p, O_PATH|O_DIRECTORY, RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS).
///
/// # Safety
/// Async-signal-safe raw syscall.
unsafe fn open_beneath(p: &std::ffi::CStr) -> c_long {
    let how = OpenHow {
        flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64,
        mode: 0,
        resolve: libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS,
    };
    // SAFETY: openat2 with a valid path and open_how of the right size.
    unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD as c_long,
            p.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    }
}

const DEVICES: &[(&std::ffi::CStr, u32, u32)] = &[
    (c"dev/null", 1, 3),
    (c"dev/zero", 1, 5),
    (c"dev/full", 1, 7),
    (c"dev/random", 1, 8),
    (c"dev/urandom", 1, 9),
    (c"dev/tty", 5, 0),
];

const DEV_LINKS: &[(&std::ffi::CStr, &std::ffi::CStr)] = &[
    (c"pts/ptmx", c"dev/ptmx"),
    (c"/proc/self/fd", c"dev/fd"),
    (c"/proc/self/fd/0", c"dev/stdin"),
    (c"/proc/self/fd/1", c"dev/stdout"),
    (c"/proc/self/fd/2", c"dev/stderr"),
];

/// /dev as a tmpfs of the sandbox's own: device nodes, devpts, /dev/shm as a directory of
/// the tmpfs (one superblock fewer than a tmpfs of its own; its size is shm's), links.
///
/// # Safety
/// In the spawn child, cwd at the new root, "dev" a directory there.
unsafe fn mount_own_dev(r: &Report) {
    // SAFETY: raw syscalls on static C strings, see the caller.
    unsafe {
        ck(
            r,
            mount(
                Some(c"tmpfs"),
                c"dev",
                Some(c"tmpfs"),
                libc::MS_NOSUID | libc::MS_NOEXEC,
                Some(c"mode=755,size=65536k,nr_inodes=16384"),
            ),
        );
        r.at(Step::MknodDev as u32);
        for (path, maj, min) in DEVICES {
            let dev = libc::makedev(*maj, *min);
            ck(
                r,
                libc::mknodat(libc::AT_FDCWD, path.as_ptr(), libc::S_IFCHR | 0o666, dev) as c_long,
            );
        }
        ck(
            r,
            libc::mkdirat(libc::AT_FDCWD, c"dev/pts".as_ptr(), 0o755) as c_long,
        );
        mount_devpts(r);
        r.at(Step::MountDevShm as u32);
        ck(
            r,
            libc::mkdirat(libc::AT_FDCWD, c"dev/shm".as_ptr(), 0o1777) as c_long,
        );
        r.at(Step::DevSymlinks as u32);
        for (target, link) in DEV_LINKS {
            ck(
                r,
                libc::symlinkat(target.as_ptr(), libc::AT_FDCWD, link.as_ptr()) as c_long,
            );
        }
    }
}

/// /dev as a read-only bind of the daemon's shared directory (nodes, links, mountpoints),
/// then the sandbox's own devpts and /dev/shm on its mountpoints: no superblock but devpts.
/// The bind is nosuid and noexec but not nodev (its nodes must open); read-only, so no
/// sandbox can add, remove or change an entry every sandbox sees.
///
/// # Safety
/// As `mount_own_dev`.
unsafe fn mount_shared_dev(r: &Report, dev_dir: &CString, shm_dir: Option<&CString>) {
    // SAFETY: raw syscalls on C strings prepared by the parent, see the caller.
    unsafe {
        let ro = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID;
        ck(r, mount(Some(dev_dir), c"dev", None, libc::MS_BIND, None));
        ck(r, mount(None, c"dev", None, ro | libc::MS_NOEXEC, None));
        mount_devpts(r);
        r.at(Step::MountDevShm as u32);
        let nse = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        match shm_dir {
            Some(d) => {
                ck(r, mount(Some(d), c"dev/shm", None, libc::MS_BIND, None));
                ck(
                    r,
                    mount(
                        None,
                        c"dev/shm",
                        None,
                        libc::MS_BIND | libc::MS_REMOUNT | nse,
                        None,
                    ),
                );
            }
            None => ck(
                r,
                mount(
                    Some(c"tmpfs"),
                    c"dev/shm",
                    Some(c"tmpfs"),
                    nse,
                    Some(c"mode=1777,size=65536k"),
                ),
            ),
        }
    }
}

/// A devpts instance of the sandbox's own on dev/pts (its ptys and nobody else's), of at most
/// 256 ptys: every instance but the host's draws on one pool (`kernel.pty.max` less the
/// host's reserve, 3,071 at the defaults), which one sandbox otherwise took from all others.
///
/// # Safety
/// As `mount_own_dev`.
unsafe fn mount_devpts(r: &Report) {
    r.at(Step::MountDevpts as u32);
    // SAFETY: mount(2) on static C strings.
    unsafe {
        ck(
            r,
            mount(
                Some(c"devpts"),
                c"dev/pts",
                Some(c"devpts"),
                libc::MS_NOSUID | libc::MS_NOEXEC,
                Some(c"newinstance,ptmxmode=0666,mode=0620,gid=5,max=256"),
            ),
        );
    }
}

extern "C" fn spawn_child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `Ctx`, alive and untouched until we exec or exit.
    let c = unsafe { &*(arg as *const Ctx) };
    // SAFETY: every call below is a raw syscall (or an async-signal-safe libc wrapper) on data
    // prepared by the parent; nothing allocates, locks or unwinds.
    unsafe { run_child(c) }
}

unsafe fn run_child(c: &Ctx) -> c_int {
    let r = &c.report;
    let at = |s: Step| r.at(s as u32);
    // SAFETY: (whole body) raw syscalls on prepared data; see spawn_child.
    unsafe {
        // Before anything else: the fd table is still the daemon's (CLONE_FILES).
        at(Step::FdTable);
        ck(r, child::unshare_small_table(c.hole));
        harden::reset_signal_dispositions();
        // Exact modes for the device nodes and mountpoints below; the init creates no files.
        libc::umask(0);

        at(Step::JoinCgroup);
        for &fd in &c.cgroup_raw {
            ck(
                r,
                libc::write(fd, b"0".as_ptr() as *const c_void, 1) as c_long,
            );
        }
        // Still with every capability and the host's /proc: the OOM killer's preference.
        ck_res(r, harden::set_sandbox_oom_score_adj());
        at(Step::UnshareCgroupNs);
        ck(r, libc::unshare(libc::CLONE_NEWCGROUP) as c_long);
        if c.netns_fd >= 0 {
            at(Step::JoinNetNs);
            ck(r, libc::setns(c.netns_fd, libc::CLONE_NEWNET) as c_long);
        }

        at(Step::MakeRprivate);
        ck(
            r,
            mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None),
        );

        at(Step::MountRootOverlay);
        let ovl_flags = libc::MS_NODEV | libc::MS_NOSUID;
        ck(
            r,
            mount(
                Some(c"overlay"),
                &c.root,
                Some(c"overlay"),
                ovl_flags,
                Some(&c.root_opts),
            ),
        );
        at(Step::ChdirRoot);
        ck(r, libc::chdir(c.root.as_ptr()) as c_long);

        for (t, opts) in &c.subs {
            at(Step::Mountpoint);
            ensure_dir(r, t);
            at(Step::MountOverlay);
            if let Some(p) = t.path() {
                ck(
                    r,
                    mount(Some(c"overlay"), p, Some(c"overlay"), ovl_flags, Some(opts)),
                );
            }
        }

        let [proc_t, dev_t, tmp_t] = &c.std_targets;
        let nse = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

        at(Step::Mountpoint);
        ensure_dir(r, dev_t);
        at(Step::MountDev);
        if let Some((dev_dir, shm_dir)) = &c.dev_bind {
            mount_shared_dev(r, dev_dir, shm_dir.as_ref());
        } else {
            mount_own_dev(r);
        }

        at(Step::Mountpoint);
        ensure_dir(r, proc_t);
        at(Step::MountProc);
        ck(r, mount(Some(c"proc"), c"proc", Some(c"proc"), nse, None));
        at(Step::MaskProc);
        let ro = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | nse;
        for p in &c.proc_readonly {
            if mount(Some(p), p, None, libc::MS_BIND, None) < 0 {
                let e = harden::errno();
                if e == libc::ENOENT {
                    continue; // not on this kernel
                }
                r.fail(e);
            }
            ck(r, mount(None, p, None, ro, None));
        }
        for p in &c.proc_mask_files {
            if mount(Some(c"dev/null"), p, None, libc::MS_BIND, None) < 0 {
                let e = harden::errno();
                if e != libc::ENOENT {
                    r.fail(e);
                }
            }
        }
        // The first directory gets the mask dir, made read-only; the others a bind of that
        // first one, which copies its read-only flag: one mount call each, not two.
        let mut ro_mask: Option<&CString> = None;
        for p in &c.proc_mask_dirs {
            let src = ro_mask.or(c.mask_dir.as_ref());
            let rc = match src {
                Some(src) => mount(Some(src), p, None, libc::MS_BIND, None),
                None => mount(
                    Some(c"tmpfs"),
                    p,
                    Some(c"tmpfs"),
                    nse | libc::MS_RDONLY,
                    None,
                ),
            };
            if rc < 0 {
                let e = harden::errno();
                if e == libc::ENOENT {
                    continue;
                }
                r.fail(e);
            }
            if ro_mask.is_none() && src.is_some() {
                ck(r, mount(None, p, None, ro, None));
                ro_mask = Some(p);
            }
        }
        for (src, p) in &c.proc_binds {
            ck(r, mount(Some(src), p, None, libc::MS_BIND, None));
            ck(r, mount(None, p, None, ro, None));
        }

        if let Some((sys_t, sys_dir)) = &c.sys {
            at(Step::Mountpoint);
            ensure_dir(r, sys_t);
            at(Step::MountSys);
            ck(r, mount(Some(sys_dir), c"sys", None, libc::MS_BIND, None));
            ck(r, mount(None, c"sys", None, ro, None));
            at(Step::MountCgroup);
            let e = crate::cgview::mount_all(&c.cgroup_mounts);
            if e != 0 {
                r.fail(e);
            }
        }

        if let Some(tmp_opts) = &c.tmp_opts {
            at(Step::Mountpoint);
            ensure_dir(r, tmp_t);
            at(Step::MountTmp);
            ck(
                r,
                mount(
                    Some(c"tmpfs"),
                    c"tmp",
                    Some(c"tmpfs"),
                    libc::MS_NOSUID | libc::MS_NODEV,
                    Some(tmp_opts.as_c_str()),
                ),
            );
        }

        at(Step::DetachHost);
        for p in &c.detach {
            if libc::umount2(p.as_ptr(), libc::MNT_DETACH) < 0 {
                let e = harden::errno();
                if e != libc::EINVAL && e != libc::ENOENT {
                    r.fail(e);
                }
            }
        }

        at(Step::MoveRoot);
        ck(r, mount(Some(c"."), c"/", None, libc::MS_MOVE, None));
        at(Step::Chroot);
        ck(r, libc::chroot(c".".as_ptr()) as c_long);
        ck(r, libc::chdir(c"/".as_ptr()) as c_long);

        at(Step::Sethostname);
        ck(
            r,
            libc::sethostname(c.hostname.as_ptr() as *const c_char, c.hostname.len()) as c_long,
        );

        if !c.unix_only {
            at(Step::LoopbackUp);
            ck_res(r, set_lo_up());
        }

        at(Step::StdioDevnull);
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        ck(r, null as c_long);
        for fd in 0..3 {
            if null != fd {
                ck(r, libc::dup2(null, fd) as c_long);
            }
        }
        if null > 2 {
            libc::close(null);
        }

        at(Step::InitChannel);
        // Move both ends above 4 first so neither dup2 clobbers the other's source, then onto
        // 3 and 4 (dup2 clears close-on-exec on the copy; the init sets it again itself).
        let mut ends = c.channel;
        for e in ends.iter_mut() {
            let moved = libc::fcntl(*e, libc::F_DUPFD_CLOEXEC, 5);
            ck(r, moved as c_long);
            *e = moved;
        }
        ck(r, libc::dup2(ends[0], 3) as c_long);
        ck(r, libc::dup2(ends[1], 4) as c_long);

        at(Step::CloseFds);
        // Every other inherited fd (the daemon's, the cgroup files, the pidfd...) closes at
        // exec; the init memfd too, which execveat tolerates for an ELF binary.
        ck(
            r,
            libc::syscall(
                libc::SYS_close_range,
                5 as c_long,
                !0u32 as c_long,
                libc::CLOSE_RANGE_CLOEXEC as c_long,
            ),
        );

        at(Step::Rlimits);
        ck_res(r, harden::apply_rlimits(&c.rlimits));
        at(Step::DropCaps);
        ck_res(r, harden::drop_bounding(&c.caps));
        ck_res(r, harden::apply_caps(&c.caps));
        at(Step::NoNewPrivs);
        ck_res(r, harden::no_new_privs());
        if c.unix_only {
            at(Step::Landlock);
            ck_res(r, harden::landlock_scope_unix());
        }
        at(Step::Seccomp);
        ck_res(r, harden::apply_seccomp(c.seccomp));

        // Signals stay blocked across the exec: the init takes them with sigwaitinfo.
        at(Step::ExecInit);
        libc::syscall(
            libc::SYS_execveat,
            c.init_fd as c_long,
            c"".as_ptr(),
            c.argv.as_ptr(),
            c.envp.as_ptr(),
            libc::AT_EMPTY_PATH as c_long,
        );
        r.fail(harden::errno())
    }
}

// ---------------------------------------------------------------------------------------------
// network namespaces for a pool

/// A new network namespace with its loopback up, as an fd (for `netns_fd` of a later spawn).
///
/// Made by the calling thread: unshare(CLONE_NEWNET) changes only this thread's namespace
/// (nsproxy is per thread), the fd is taken, lo is brought up, and the thread goes back to the
/// namespace it was in. A pool of these takes the ~0.8 ms a netns costs to make (and as much
/// to tear down, if the pool reuses them) off the sandbox-creation path.
pub fn netns_new() -> std::io::Result<OwnedFd> {
    let open_ns = || -> std::io::Result<OwnedFd> {
        // SAFETY: open with a valid C string; checked below.
        let fd = unsafe {
            libc::open(
                c"/proc/thread-self/ns/net".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fresh fd we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    let orig = open_ns()?;
    // SAFETY: unshare of the calling thread's network namespace only.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let made = open_ns().and_then(|fd| {
        // SAFETY: socket/ioctl/close on stack data.
        unsafe { set_lo_up() }.map_err(std::io::Error::from_raw_os_error)?;
        Ok(fd)
    });
    for _ in 0..3 {
        // SAFETY: setns of the calling thread back to its own namespace.
        if unsafe { libc::setns(orig.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
            return made;
        }
    }
    let msg = b"corral._core: cannot return to the daemon's network namespace; aborting\n";
    // SAFETY: write to stderr from a static buffer, then abort.
    unsafe {
        libc::write(2, msg.as_ptr() as *const c_void, msg.len());
        libc::abort();
    }
}

/// A socket (`domain`, `ty`, `proto`; close-on-exec) made in the network namespace `netns`: the
/// calling thread enters it, makes the socket and returns. A netlink socket made this way
/// configures that namespace's links from the daemon's, with no process started.
pub fn netns_socket(netns: RawFd, domain: i32, ty: i32, proto: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: open with a valid C string; checked below.
    let orig = unsafe {
        libc::open(
            c"/proc/thread-self/ns/net".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if orig < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh fd we own.
    let orig = unsafe { OwnedFd::from_raw_fd(orig) };
    // SAFETY: setns of the calling thread only, to a namespace fd the caller owns.
    if unsafe { libc::setns(netns, libc::CLONE_NEWNET) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: socket(2) with plain integer arguments; checked below.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) };
    let made = if fd < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        // SAFETY: fresh fd we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    for _ in 0..3 {
        // SAFETY: setns of the calling thread back to its own namespace.
        if unsafe { libc::setns(orig.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
            return made;
        }
    }
    let msg = b"corral._core: cannot return to the daemon's network namespace; aborting\n";
    // SAFETY: write to stderr from a static buffer, then abort.
    unsafe {
        libc::write(2, msg.as_ptr() as *const c_void, msg.len());
        libc::abort();
    }
}

/// `ip link set lo up` in the current network namespace.
///
/// # Safety
/// Async-signal-safe: socket/ioctl/close on a stack ifreq.
unsafe fn set_lo_up() -> Result<(), c_int> {
    // SAFETY: raw socket/ioctl/close; ifreq is plain data on our stack.
    unsafe {
        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if s < 0 {
            return Err(harden::errno());
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        ifr.ifr_name[0] = b'l' as c_char;
        ifr.ifr_name[1] = b'o' as c_char;
        ifr.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        let rc = libc::ioctl(s, libc::SIOCSIFFLAGS as _, &ifr as *const libc::ifreq);
        let e = harden::errno();
        libc::close(s);
        if rc < 0 {
            return Err(e);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// the init binary

static INIT_BIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/corral-init"));

/// A sealed, close-on-exec memfd holding the init binary.
pub fn init_memfd() -> std::io::Result<OwnedFd> {
    let name = c"corral-init";
    let base = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: memfd_create with a valid name; MFD_EXEC (6.3+) first, so a vm.memfd_noexec
    // sysctl cannot make it unexecutable; older kernels reject the flag with EINVAL.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), base | libc::MFD_EXEC) };
    if fd < 0 && harden::errno() == libc::EINVAL {
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(name.as_ptr(), base) };
    }
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut off = 0;
    while off < INIT_BIN.len() {
        // SAFETY: writing from a valid slice.
        let n = unsafe {
            libc::write(
                fd.as_raw_fd(),
                INIT_BIN[off..].as_ptr() as *const c_void,
                INIT_BIN.len() - off,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        off += n as usize;
    }
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on our fd with integer arguments.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}
