//! A new process in a live sandbox, as a direct child of the daemon.
//!
//! Technique: the calling thread does `setns(pidfd, CLONE_NEWPID)`, which changes only *its*
//! pid_for_children (nsproxy is per thread, so other daemon threads are unaffected), clones the
//! child (CLONE_VM | CLONE_VFORK, see child.rs), then switches its pid_for_children back to the
//! daemon's own pid namespace. The child is therefore in the sandbox's pid namespace *and* a
//! direct child of the daemon (waitable, SIGCHLD to the daemon, no intermediate process): one
//! clone instead of the two a CLONE_PARENT-from-an-intermediate scheme needs. The child then
//! joins the sandbox's cgroups, enters its other namespaces with one `setns(pidfd, ...)`,
//! chroots into the init's root (an O_PATH fd of /proc/<init>/root opened before the clone),
//! and hardens itself before execve.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use libc::{c_char, c_int, c_long, c_void};

use crate::child::{self, Report};
use crate::harden::{self, CapPlan, HardenError, Rlimit};

#[derive(Debug, thiserror::Error)]
pub enum EnterError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Harden(#[from] HardenError),
    #[error("exec_in: {step}: {msg}")]
    Os {
        step: &'static str,
        errno: i32,
        msg: String,
    },
}

impl EnterError {
    fn os(step: &'static str, errno: i32) -> Self {
        EnterError::Os {
            step,
            errno,
            msg: harden::strerror(errno),
        }
    }

    fn io(step: &'static str, e: std::io::Error) -> Self {
        Self::os(step, e.raw_os_error().unwrap_or(libc::EIO))
    }
}

#[derive(Debug, Clone)]
pub struct ExecConfig {
    pub init_pid: i32,
    pub pidfd: RawFd,
    /// An O_PATH fd of the sandbox root (from `root_fd`), to skip opening /proc/PID/root.
    pub root_fd: Option<RawFd>,
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub stdin: RawFd,
    pub stdout: RawFd,
    pub stderr: RawFd,
    pub cgroup_procs: Vec<String>,
    pub rlimits: Vec<Rlimit>,
    /// Make stdin the controlling terminal (PTY sessions).
    pub tty: bool,
    /// The sandbox's network is "disabled" (see SpawnConfig::unix_only).
    pub unix_only: bool,
}

const STEPS: &[&str] = &[
    "clone",
    "fd_table",
    "join_cgroup",
    "setns",
    "chroot",
    "setsid",
    "stdio",
    "controlling_tty",
    "close_fds",
    "rlimits",
    "drop_caps",
    "set_ids",
    "set_caps",
    "chdir",
    "no_new_privs",
    "landlock",
    "seccomp",
    "exec",
];

#[derive(Clone, Copy)]
#[repr(u32)]
enum Step {
    #[allow(dead_code)] // index 0 of STEPS: a failed clone is reported by the parent
    Clone = 0,
    FdTable,
    JoinCgroup,
    Setns,
    Chroot,
    Setsid,
    Stdio,
    ControllingTty,
    CloseFds,
    Rlimits,
    DropCaps,
    SetIds,
    SetCaps,
    Chdir,
    NoNewPrivs,
    Landlock,
    Seccomp,
    Exec,
}

fn step_name(step: u32) -> &'static str {
    STEPS.get(step as usize).copied().unwrap_or("unknown")
}

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

struct Ctx {
    report: Report,
    /// Owned here; the child writes to `cgroup_raw` (the same fds, or the slots lent them).
    _cgroup_fds: Vec<OwnedFd>,
    cgroup_raw: Vec<RawFd>,
    /// close_range start of the child's private fd table, or -1 (see child::Slots).
    hole: RawFd,
    pidfd: RawFd,
    root_fd: RawFd,
    cwd: CString,
    stdio: [RawFd; 3],
    tty: bool,
    candidates: Vec<CString>,
    _argv: Vec<CString>,
    _envp: Vec<CString>,
    argv_ptrs: Vec<*const c_char>,
    envp_ptrs: Vec<*const c_char>,
    groups: Vec<libc::gid_t>,
    uid: u32,
    gid: u32,
    caps: CapPlan,
    rlimits: Vec<Rlimit>,
    seccomp: &'static [libc::sock_filter],
    unix_only: bool,
}

fn cstring(what: &str, s: &str) -> Result<CString, EnterError> {
    CString::new(s).map_err(|_| EnterError::Invalid(format!("NUL byte in {what} {s:?}")))
}

/// An fd of the daemon's own pid namespace, to switch pid_for_children back after the clone.
fn host_pidns() -> Result<RawFd, EnterError> {
    static FD: OnceLock<Result<OwnedFd, i32>> = OnceLock::new();
    let r = FD.get_or_init(|| {
        // SAFETY: open with a valid C string; checked below.
        let fd = unsafe {
            libc::open(
                c"/proc/self/ns/pid".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            Err(harden::errno())
        } else {
            // SAFETY: fresh fd we own forever (a static).
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    });
    match r {
        Ok(fd) => Ok(fd.as_raw_fd()),
        Err(e) => Err(EnterError::os("open_host_pidns", *e)),
    }
}

/// O_PATH fd of /proc/PID/root.
pub fn open_proc_root(pid: i32) -> std::io::Result<OwnedFd> {
    let p = CString::new(format!("/proc/{pid}/root")).expect("no NUL in a number");
    // SAFETY: open with a valid C string; checked below.
    let fd = unsafe {
        libc::open(
            p.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The init's fd the spawner left for the daemon's end of its exec channel (corral-init.c).
pub const INIT_CHANNEL_FD: RawFd = 4;

/// The daemon's copy of a sandbox init's exec channel (pidfd_getfd of its fd 4), close-on-exec.
pub fn init_channel(pidfd: RawFd) -> Result<OwnedFd, EnterError> {
    // SAFETY: the caller passes an open pidfd it keeps open for the duration of the call.
    let pidfd = unsafe { std::os::fd::BorrowedFd::borrow_raw(pidfd) };
    rustix::process::pidfd_getfd(
        pidfd,
        INIT_CHANNEL_FD,
        rustix::process::PidfdGetfdFlags::empty(),
    )
    .map_err(|e| EnterError::os("pidfd_getfd", e.raw_os_error()))
}

/// pidfd_send_signal(pidfd, 0): is the process still there?
pub fn pidfd_alive(pidfd: RawFd) -> Result<(), i32> {
    // SAFETY: integer arguments only.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd as c_long,
            0 as c_long,
            0 as c_long,
            0 as c_long,
        )
    };
    harden::check(rc)
}

fn prepare(cfg: &ExecConfig) -> Result<(Ctx, Option<OwnedFd>), EnterError> {
    if cfg.argv.is_empty() || cfg.argv[0].is_empty() {
        return Err(EnterError::Invalid("argv must not be empty".into()));
    }
    if cfg.pidfd < 0 {
        return Err(EnterError::Invalid("pidfd must be an open pidfd".into()));
    }
    for e in &cfg.env {
        if !e.contains('=') {
            return Err(EnterError::Invalid(format!(
                "env entry {e:?} is not KEY=VALUE"
            )));
        }
    }
    let argv: Vec<CString> = cfg
        .argv
        .iter()
        .map(|a| cstring("argv", a))
        .collect::<Result<_, _>>()?;
    let envp: Vec<CString> = cfg
        .env
        .iter()
        .map(|a| cstring("env", a))
        .collect::<Result<_, _>>()?;
    let arg0 = &cfg.argv[0];
    let candidates = if arg0.contains('/') {
        vec![cstring("argv", arg0)?]
    } else {
        let path = cfg
            .env
            .iter()
            .rev()
            .find_map(|e| e.strip_prefix("PATH="))
            .unwrap_or(DEFAULT_PATH);
        path.split(':')
            .map(|d| {
                let d = if d.is_empty() {
                    "."
                } else {
                    d.trim_end_matches('/')
                };
                cstring("PATH entry", &format!("{d}/{arg0}"))
            })
            .collect::<Result<_, _>>()?
    };
    let mut argv_ptrs: Vec<*const c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const c_char> = envp.iter().map(|a| a.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());

    let (root_fd, owned_root) = match cfg.root_fd {
        Some(fd) if fd >= 0 => (fd, None),
        _ => {
            let fd = open_proc_root(cfg.init_pid).map_err(|e| EnterError::io("open_root", e))?;
            (fd.as_raw_fd(), Some(fd))
        }
    };
    // The pidfd's process is alive after we opened /proc/PID/root, so PID was still its pid
    // then (a pid is not reused while its process exists): the root is the sandbox's.
    pidfd_alive(cfg.pidfd).map_err(|e| EnterError::os("check_init", e))?;
    let cgroup_fds =
        crate::spawn::open_write_fds(&cfg.cgroup_procs).map_err(|(p, e)| EnterError::Os {
            step: "open_cgroup_procs",
            errno: e.raw_os_error().unwrap_or(libc::EIO),
            msg: format!(
                "{p}: {}",
                harden::strerror(e.raw_os_error().unwrap_or(libc::EIO))
            ),
        })?;
    let cgroup_raw = cgroup_fds.iter().map(|f| f.as_raw_fd()).collect();
    let ctx = Ctx {
        report: Report::new(),
        _cgroup_fds: cgroup_fds,
        cgroup_raw,
        hole: -1,
        pidfd: cfg.pidfd,
        root_fd,
        cwd: cstring("cwd", if cfg.cwd.is_empty() { "/" } else { &cfg.cwd })?,
        stdio: [cfg.stdin, cfg.stdout, cfg.stderr],
        tty: cfg.tty,
        candidates,
        _argv: argv,
        _envp: envp,
        argv_ptrs,
        envp_ptrs,
        groups: cfg.groups.clone(),
        uid: cfg.uid,
        gid: cfg.gid,
        caps: CapPlan::shell(cfg.uid),
        rlimits: harden::clamp_rlimits(&cfg.rlimits),
        seccomp: harden::seccomp_program(cfg.unix_only)?,
        unix_only: cfg.unix_only,
    };
    Ok((ctx, owned_root))
}

/// Start `cfg.argv` inside the sandbox; returns the child's host pid.
pub fn exec_in(cfg: &ExecConfig) -> Result<i32, EnterError> {
    let (mut ctx, _owned_root) = prepare(cfg)?;
    let host_ns = host_pidns()?;
    let lent = match child::slots() {
        Some(slots) => {
            let [s0, s1, s2] = &mut ctx.stdio;
            let mut fds: Vec<&mut RawFd> = ctx.cgroup_raw.iter_mut().collect();
            fds.extend([&mut ctx.pidfd, &mut ctx.root_fd, s0, s1, s2]);
            let lent = slots
                .lend(&mut fds)
                .map_err(|e| EnterError::io("lend_fds", e))?;
            ctx.hole = lent.hole();
            Some(lent)
        }
        None => None,
    };
    let flags = if lent.is_some() { libc::CLONE_FILES } else { 0 };
    let t0 = child::now_ns();
    let res = child::with_stack(|stack| {
        let _block = harden::SignalBlock::new();
        // SAFETY: setns on the calling thread with a pidfd we were given.
        if unsafe { libc::setns(cfg.pidfd, libc::CLONE_NEWPID) } < 0 {
            return Err(EnterError::os("setns_pid_for_children", harden::errno()));
        }
        // SAFETY: `enter_child` is async-signal-safe and never unwinds; `ctx` outlives the clone
        // (CLONE_VFORK); signals are blocked by `_block`.
        let res = unsafe {
            child::clone_vfork(enter_child, &ctx as *const Ctx as *mut c_void, flags, stack)
        };
        restore_pid_ns(host_ns);
        res.map_err(|e| EnterError::io("clone", e))
    })
    .map_err(|e| EnterError::io("alloc_stack", e))??;
    drop(lent); // the child has exec'd or exited: reset the slots (no pipe end stays open)
    let (pid, _) = res;
    let (step, errno) = (ctx.report.step(), ctx.report.errno());
    child::set_last_profile("exec_in", ctx.report.profile(t0, STEPS));
    if errno != 0 || step != Step::Exec as u32 {
        child::reap(pid);
        if errno != 0 {
            return Err(EnterError::os(step_name(step), errno));
        }
        return Err(EnterError::Os {
            step: step_name(step),
            errno: libc::ECHILD,
            msg: "the child died before exec (killed?)".into(),
        });
    }
    Ok(pid)
}

/// Switch the calling thread's pid_for_children back to the daemon's pid namespace. Entering
/// one's own active pid namespace cannot fail short of a kernel bug; if it ever did, every
/// later fork on this thread would land in a sandbox, so abort instead of going on.
fn restore_pid_ns(host_ns: RawFd) {
    for _ in 0..3 {
        // SAFETY: setns on the calling thread with our own pid-namespace fd.
        if unsafe { libc::setns(host_ns, libc::CLONE_NEWPID) } == 0 {
            return;
        }
    }
    let msg = b"corral._core: cannot restore the daemon's pid namespace; aborting\n";
    // SAFETY: write to stderr from a static buffer, then abort.
    unsafe {
        libc::write(2, msg.as_ptr() as *const c_void, msg.len());
        libc::abort();
    }
}

// ---------------------------------------------------------------------------------------------
// child side: async-signal-safe only (see child.rs)

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

extern "C" fn enter_child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `Ctx`, alive and untouched until we exec or exit.
    let c = unsafe { &*(arg as *const Ctx) };
    // SAFETY: raw syscalls / async-signal-safe wrappers on prepared data only.
    unsafe { run_child(c) }
}

unsafe fn run_child(c: &Ctx) -> c_int {
    let r = &c.report;
    let at = |s: Step| r.at(s as u32);
    // SAFETY: (whole body) raw syscalls on prepared data; see enter_child.
    unsafe {
        // Before anything else: the fd table is still the daemon's (CLONE_FILES).
        at(Step::FdTable);
        ck(r, child::unshare_small_table(c.hole));
        harden::reset_signal_dispositions();

        at(Step::JoinCgroup);
        for &fd in &c.cgroup_raw {
            ck(
                r,
                libc::write(fd, b"0".as_ptr() as *const c_void, 1) as c_long,
            );
        }
        // Still with every capability and the host's /proc: the OOM killer's preference.
        ck_res(r, harden::set_sandbox_oom_score_adj());

        at(Step::Setns);
        let ns = libc::CLONE_NEWNS
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWCGROUP;
        ck(r, libc::setns(c.pidfd, ns) as c_long);

        at(Step::Chroot);
        ck(r, libc::fchdir(c.root_fd) as c_long);
        ck(r, libc::chroot(c".".as_ptr()) as c_long);
        ck(r, libc::chdir(c"/".as_ptr()) as c_long);

        at(Step::Setsid);
        ck(r, libc::setsid() as c_long);

        at(Step::Stdio);
        let mut src = c.stdio;
        if src.iter().any(|&fd| fd < 0) {
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            ck(r, null as c_long);
            for s in src.iter_mut() {
                if *s < 0 {
                    *s = null;
                }
            }
        }
        // Move sources that sit on 0..2 out of the way first so no dup2 clobbers another.
        for (i, s) in src.iter_mut().enumerate() {
            if *s < 3 && *s != i as c_int {
                let moved = libc::fcntl(*s, libc::F_DUPFD_CLOEXEC, 3);
                ck(r, moved as c_long);
                *s = moved;
            }
        }
        for (i, &s) in src.iter().enumerate() {
            let i = i as c_int;
            if s == i {
                ck(r, libc::fcntl(i, libc::F_SETFD, 0) as c_long);
            } else {
                ck(r, libc::dup2(s, i) as c_long);
            }
        }
        if c.tty {
            at(Step::ControllingTty);
            ck(r, libc::ioctl(0, libc::TIOCSCTTY as _, 0) as c_long);
        }

        at(Step::CloseFds);
        ck(
            r,
            libc::syscall(
                libc::SYS_close_range,
                3 as c_long,
                !0u32 as c_long,
                0 as c_long,
            ),
        );

        at(Step::Rlimits);
        ck_res(r, harden::apply_rlimits(&c.rlimits));
        at(Step::DropCaps);
        ck_res(r, harden::drop_bounding(&c.caps));
        at(Step::SetIds);
        ck_res(r, harden::set_ids(c.uid, c.gid, &c.groups));
        at(Step::SetCaps);
        ck_res(r, harden::apply_caps(&c.caps));
        // As the final user, so a directory it may not enter falls back to / like a login.
        at(Step::Chdir);
        if libc::chdir(c.cwd.as_ptr()) < 0 {
            ck(r, libc::chdir(c"/".as_ptr()) as c_long);
        }
        at(Step::NoNewPrivs);
        ck_res(r, harden::no_new_privs());
        if c.unix_only {
            // A domain of its own per exec'd process tree (a process cannot join the init's):
            // abstract sockets connect within one exec's processes, never across sandboxes.
            at(Step::Landlock);
            ck_res(r, harden::landlock_scope_unix());
        }
        at(Step::Seccomp);
        ck_res(r, harden::apply_seccomp(c.seccomp));

        libc::umask(0o022);
        harden::unblock_all_signals();
        at(Step::Exec);
        let mut denied = false;
        for cand in &c.candidates {
            libc::execve(cand.as_ptr(), c.argv_ptrs.as_ptr(), c.envp_ptrs.as_ptr());
            match harden::errno() {
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ELOOP | libc::ENAMETOOLONG => {}
                libc::EACCES => denied = true,
                _ => libc::_exit(126),
            }
        }
        libc::_exit(if denied { 126 } else { 127 })
    }
}
