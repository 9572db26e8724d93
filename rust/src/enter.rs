//! A new process in a live sandbox, as a direct child of the daemon.
//!
//! No process that shares the daemon's memory, fds or credentials is ever in the sandbox:
//!
//! 1. The calling thread clones a helper (`CLONE_VM | CLONE_VFORK`, see child.rs) that stays in
//!    the daemon's pid namespace, where no process of the sandbox can see, signal or trace it.
//!    It enters the sandbox's namespaces with one `setns(pidfd, ...)` that also sets its
//!    pid_for_children to the sandbox's pid namespace, chroots into the init's root, sets up
//!    stdio (the report pipe on fd 3, the sandbox's cgroup files from fd 5), closes every other
//!    fd, hardens itself (rlimits, capabilities, user, no_new_privs, Landlock, seccomp) and
//!    execs the trampoline (init/corral-exec.c, from a sealed memfd). The exec ends the sharing
//!    of the daemon's memory, and the calling thread is free again. The helper stays in the
//!    daemon's cgroups throughout: nothing the sandbox does to its own CPU quota or memory
//!    (throttling, reclaim, OOM) can slow or stop it, so the vfork the calling thread waits in
//!    is bounded by the daemon's own resources.
//! 2. The trampoline, a process of a few pages, joins the sandbox's cgroups (writing "0" to the
//!    files on fd 5..), forks the command (`CLONE_PARENT`: a child of the daemon, born in the
//!    sandbox's pid namespace and cgroups, with the dropped credentials, stdio only, not
//!    dumpable until it execs), writes its pid to the pipe and exits. The command takes a
//!    session of its own and execs.
//!
//! The calling thread then reads the report (with a timeout: the trampoline is killed if it
//! does not answer; it runs under the sandbox's limits) and reaps the trampoline. Nothing it
//! waits for is reachable from the sandbox; the command may be stopped before it execs, the
//! daemon does not wait for that exec.

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
    "setns",
    "chroot",
    "stdio",
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
    "join_fork",
];

#[derive(Clone, Copy)]
#[repr(u32)]
enum Step {
    #[allow(dead_code)] // index 0 of STEPS: a failed clone is reported by the parent
    Clone = 0,
    FdTable,
    Setns,
    Chroot,
    Stdio,
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
    JoinFork,
}

fn step_name(step: u32) -> &'static str {
    STEPS.get(step as usize).copied().unwrap_or("unknown")
}

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

struct Ctx {
    report: Report,
    /// The report pipe's write end and the trampoline's memfd (lent like the others).
    report_w: RawFd,
    exec_fd: RawFd,
    /// Owned here; the child writes to `cgroup_raw` (the same fds, or the slots lent them).
    _cgroup_fds: Vec<OwnedFd>,
    cgroup_raw: Vec<RawFd>,
    /// close_range start of the child's private fd table, or -1 (see child::Slots).
    hole: RawFd,
    pidfd: RawFd,
    root_fd: RawFd,
    cwd: CString,
    stdio: [RawFd; 3],
    /// The trampoline's argv: its name, flags, the candidates' count, the candidates, then
    /// the command's argv (see init/corral-exec.c).
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

/// The daemon's own process, at start: not dumpable (no one without CAP_SYS_PTRACE may
/// ptrace it, read its memory, environment or fds through /proc, or use process_vm_*; the flag
/// is copied to every process it forks), its environment block blanked (the variables live
/// on in heap copies), and the values of `secret_flags` (say `--token`) blanked in its
/// command line, which /proc/PID/cmdline shows to anyone. Call it before any other thread
/// runs (setenv).
pub fn harden_daemon(secret_flags: &[String]) -> Result<(), EnterError> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } < 0 {
        return Err(EnterError::os("set_dumpable", harden::errno()));
    }
    let stat = std::fs::read_to_string("/proc/self/stat").map_err(|e| EnterError::io("stat", e))?;
    // Fields after the command name (which may hold spaces): arg_start and arg_end are the
    // 48th and 49th fields, the 46th and 47th after ")".
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|x| x.parse::<usize>().ok()).unwrap_or(0);
    let (start, end) = (field(45), field(46));
    let (env_start, env_end) = (field(47), field(48));
    // The environment block on the initial stack is what /proc/PID/environ shows, and a
    // process forked from ours (exec_in's command, before it execs) has a copy of it where
    // its own /proc/PID/environ points; some kernels show that file to any process of the
    // same uid, dumpable or not. Give every variable a heap copy (setenv), then blank the
    // block: getenv() and Python's os.environ keep working.
    if env_start != 0 && env_end > env_start {
        for (k, v) in std::env::vars_os() {
            std::env::set_var(&k, &v);
        }
        // SAFETY: [env_start, env_end) is this process's own environment block (initial
        // stack, writable); no `environ` entry points into it any more (set_var above).
        unsafe { std::ptr::write_bytes(env_start as *mut u8, 0, env_end - env_start) };
    }
    if start == 0 || end <= start {
        return Ok(());
    }
    // SAFETY: [arg_start, arg_end) is this process's own argument block (on its initial
    // stack, writable); Python has copied what it needs from it at start-up.
    let args = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, end - start) };
    let mut blank_next = false;
    let mut i = 0;
    while i < args.len() {
        let len = args[i..]
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(args.len() - i);
        let arg = &mut args[i..i + len];
        let mut from = None;
        if blank_next {
            from = Some(0);
            blank_next = false;
        } else {
            for flag in secret_flags {
                let flag = flag.as_bytes();
                if arg == flag {
                    blank_next = true;
                } else if arg.len() > flag.len() && arg.starts_with(flag) && arg[flag.len()] == b'='
                {
                    from = Some(flag.len() + 1);
                }
            }
        }
        if let Some(k) = from {
            arg[k..].fill(b'*');
        }
        i += len + 1;
    }
    Ok(())
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
    let mut tramp = vec![
        c"corral-exec".to_owned(),
        cstring("flags", if cfg.tty { "t" } else { "-" })?,
        cstring("cgroups", &cfg.cgroup_procs.len().to_string())?,
        cstring("count", &candidates.len().to_string())?,
    ];
    tramp.extend(candidates);
    tramp.extend(argv);
    let argv = tramp;
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
    if cfg.cgroup_procs.len() > MAX_CGROUP_FDS {
        return Err(EnterError::Invalid(format!(
            "at most {MAX_CGROUP_FDS} cgroup files, not {}",
            cfg.cgroup_procs.len()
        )));
    }
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
        report_w: -1,
        exec_fd: -1,
        _cgroup_fds: cgroup_fds,
        cgroup_raw,
        hole: -1,
        pidfd: cfg.pidfd,
        root_fd,
        cwd: cstring("cwd", if cfg.cwd.is_empty() { "/" } else { &cfg.cwd })?,
        stdio: [cfg.stdin, cfg.stdout, cfg.stderr],
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

/// How long the trampoline may take to report the command's pid (it needs well under a
/// millisecond; only a sandbox at its CPU quota slows it, as it runs in its cgroups).
const REPORT_TIMEOUT_MS: c_int = 10_000;

/// The cgroup files the trampoline may join (one per v1 hierarchy, or one v2 file).
const MAX_CGROUP_FDS: usize = 16;

/// Start `cfg.argv` inside the sandbox; returns the command's host pid (a child of the
/// caller's process). See the module comment.
pub fn exec_in(cfg: &ExecConfig) -> Result<i32, EnterError> {
    let (mut ctx, _owned_root) = prepare(cfg)?;
    let (report_r, report_w) = pipe().map_err(|e| EnterError::io("pipe", e))?;
    ctx.report_w = report_w.as_raw_fd();
    ctx.exec_fd = exec_memfd()?;
    // Lend the fds to a set of slots only if one is free now: never wait for another exec's
    // or create's set (a full copy of the fd table is slower, not blocked).
    let lent = match child::slots() {
        Some(slots) => {
            let [s0, s1, s2] = &mut ctx.stdio;
            let mut fds: Vec<&mut RawFd> = ctx.cgroup_raw.iter_mut().collect();
            fds.extend([&mut ctx.pidfd, &mut ctx.root_fd, s0, s1, s2]);
            fds.extend([&mut ctx.report_w, &mut ctx.exec_fd]);
            let lent = slots
                .try_lend(&mut fds)
                .map_err(|e| EnterError::io("lend_fds", e))?;
            if let Some(l) = &lent {
                ctx.hole = l.hole();
            }
            lent
        }
        None => None,
    };
    let flags = libc::CLONE_PIDFD | if lent.is_some() { libc::CLONE_FILES } else { 0 };
    let t0 = child::now_ns();
    let res = child::with_stack(|stack| {
        let _block = harden::SignalBlock::new();
        // SAFETY: `helper` is async-signal-safe and never unwinds; `ctx` outlives the clone
        // (CLONE_VFORK); signals are blocked by `_block`.
        unsafe { child::clone_vfork(helper, &ctx as *const Ctx as *mut c_void, flags, stack) }
            .map_err(|e| EnterError::io("clone", e))
    })
    .map_err(|e| EnterError::io("alloc_stack", e))??;
    drop(lent); // the helper has exec'd or exited: reset the slots (no pipe end stays open)
    drop(report_w); // the trampoline holds the only write end: EOF if it dies
    let (helper_pid, helper_pidfd) = res;
    let helper = Helper {
        pid: helper_pid,
        // SAFETY: CLONE_PIDFD gave us this fresh fd; nothing else owns it.
        pidfd: unsafe { OwnedFd::from_raw_fd(helper_pidfd) },
    };
    let (step, errno) = (ctx.report.step(), ctx.report.errno());
    if errno != 0 || step != Step::Exec as u32 {
        helper.reap();
        child::set_last_profile("exec_in", ctx.report.profile(t0, STEPS));
        if errno != 0 {
            return Err(EnterError::os(step_name(step), errno));
        }
        return Err(EnterError::Os {
            step: step_name(step),
            errno: libc::ECHILD,
            msg: "the helper died before exec (killed?)".into(),
        });
    }
    ctx.report.at(Step::JoinFork as u32);
    let got = read_report(&report_r);
    if got.is_err() {
        // SAFETY: pidfd_send_signal on our own child's pidfd.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                helper.pidfd.as_raw_fd() as c_long,
                libc::SIGKILL as c_long,
                0 as c_long,
                0 as c_long,
            )
        };
    }
    helper.reap();
    child::set_last_profile("exec_in", ctx.report.profile(t0, STEPS));
    match got {
        Ok((TRAMPOLINE_FORK, pid)) if pid > 0 => Ok(pid),
        Ok((TRAMPOLINE_FORK, neg)) => Err(EnterError::os("fork", -neg)),
        Ok((TRAMPOLINE_JOIN, neg)) => Err(EnterError::os("join_cgroup", -neg)),
        Ok((stage, _)) => Err(EnterError::Os {
            step: "join_fork",
            errno: libc::EPROTO,
            msg: format!("the trampoline reported an unknown stage {stage}"),
        }),
        Err(errno) => Err(EnterError::Os {
            step: "join_fork",
            errno,
            msg: if errno == libc::ETIMEDOUT {
                "the trampoline did not report the command's pid in time (killed)".into()
            } else {
                format!("no report from the trampoline: {}", harden::strerror(errno))
            },
        }),
    }
}

/// The helper, then the trampoline it became: our child, reaped when it exits.
struct Helper {
    pid: libc::pid_t,
    pidfd: OwnedFd,
}

/// How long the calling thread waits for the trampoline to exit once it has reported (it exits
/// right after) or been killed; longer only if it is frozen (a pause raced the exec: a frozen
/// task does not die of SIGKILL until thawed).
const EXIT_WAIT_MS: c_int = 1_000;

impl Helper {
    /// Reap now if it exits within EXIT_WAIT_MS, else in a thread of its own (blocking
    /// waitpid), so the calling thread never waits on anything the sandbox's state can hold.
    fn reap(self) {
        let mut pfd = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let deadline = child::now_ns() + EXIT_WAIT_MS as u64 * 1_000_000;
        loop {
            let left_ms = (deadline.saturating_sub(child::now_ns()) / 1_000_000) as c_int;
            // SAFETY: poll on one valid pollfd (a pidfd is readable once its process exits).
            let rc = unsafe { libc::poll(&mut pfd, 1, left_ms) };
            if rc < 0 && harden::errno() == libc::EINTR {
                continue;
            }
            if rc > 0 {
                child::reap(self.pid);
                return;
            }
            break;
        }
        let pid = self.pid;
        let spawned = std::thread::Builder::new()
            .name("corral-reap".into())
            .spawn(move || {
                child::reap(pid);
                drop(self.pidfd);
            });
        if spawned.is_err() {
            child::reap(pid); // no thread to spare: wait here rather than leave a zombie
        }
    }
}

/// The trampoline's report: (stage, value), two native i32s (see init/corral-exec.c).
const TRAMPOLINE_JOIN: i32 = 0; // joining a cgroup failed: value = -errno
const TRAMPOLINE_FORK: i32 = 1; // value = the command's pid, or -errno if the fork failed

/// The trampoline's (stage, value) from its pipe, within REPORT_TIMEOUT_MS.
fn read_report(r: &OwnedFd) -> Result<(i32, i32), i32> {
    let mut pfd = libc::pollfd {
        fd: r.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let deadline = child::now_ns() + REPORT_TIMEOUT_MS as u64 * 1_000_000;
    let mut buf = [0u8; 8];
    let mut got = 0;
    while got < buf.len() {
        let left_ms = (deadline.saturating_sub(child::now_ns()) / 1_000_000) as c_int;
        // SAFETY: poll on one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, left_ms) };
        if rc < 0 && harden::errno() == libc::EINTR {
            continue;
        }
        if rc <= 0 {
            return Err(if rc == 0 {
                libc::ETIMEDOUT
            } else {
                harden::errno()
            });
        }
        // SAFETY: read into our own buffer within its bounds.
        let n = unsafe {
            libc::read(
                r.as_raw_fd(),
                buf[got..].as_mut_ptr() as *mut c_void,
                buf.len() - got,
            )
        };
        if n < 0 && harden::errno() == libc::EINTR {
            continue;
        }
        if n <= 0 {
            return Err(if n == 0 { libc::EPIPE } else { harden::errno() });
        }
        got += n as usize;
    }
    let (stage, value) = buf.split_at(4);
    let int = |b: &[u8]| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    Ok((int(stage), int(value)))
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1; 2];
    // SAFETY: pipe2 with a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: two fresh fds we own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

static EXEC_BIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/corral-exec"));

/// The trampoline's sealed memfd, made once per process.
fn exec_memfd() -> Result<RawFd, EnterError> {
    static FD: OnceLock<Result<OwnedFd, i32>> = OnceLock::new();
    let r = FD.get_or_init(|| {
        child::sealed_exec_memfd(c"corral-exec", EXEC_BIN)
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
    });
    match r {
        Ok(fd) => Ok(fd.as_raw_fd()),
        Err(e) => Err(EnterError::os("exec_memfd", *e)),
    }
}

// ---------------------------------------------------------------------------------------------
// helper side: async-signal-safe only (see child.rs)

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

extern "C" fn helper(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `Ctx`, alive and untouched until we exit.
    let c = unsafe { &*(arg as *const Ctx) };
    // SAFETY: raw syscalls / async-signal-safe wrappers on prepared data only.
    unsafe { run_helper(c) }
}

unsafe fn run_helper(c: &Ctx) -> c_int {
    let r = &c.report;
    let at = |s: Step| r.at(s as u32);
    // SAFETY: (whole body) raw syscalls on prepared data; see helper.
    unsafe {
        // Before anything else: the fd table is still the daemon's (CLONE_FILES).
        at(Step::FdTable);
        ck(r, child::unshare_small_table(c.hole));
        harden::reset_signal_dispositions();

        // Still with every capability and the host's /proc: the OOM killer's preference.
        ck_res(r, harden::set_sandbox_oom_score_adj());

        // CLONE_NEWPID: our pid_for_children only; we stay in the daemon's pid namespace.
        at(Step::Setns);
        let ns = libc::CLONE_NEWNS
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWCGROUP
            | libc::CLONE_NEWPID;
        ck(r, libc::setns(c.pidfd, ns) as c_long);

        at(Step::Chroot);
        ck(r, libc::fchdir(c.root_fd) as c_long);
        ck(r, libc::chroot(c".".as_ptr()) as c_long);
        ck(r, libc::chdir(c"/".as_ptr()) as c_long);

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

        // The report pipe on fd 3 and the cgroup files on 5.. (inherited by the trampoline),
        // the trampoline on fd 4 (close-on-exec: execveat of an ELF binary tolerates it);
        // nothing else above 2. Every source goes above the target range first, so no dup3
        // clobbers another's source.
        at(Step::CloseFds);
        let n = c.cgroup_raw.len() as c_int;
        let above = 5 + n;
        let w = libc::fcntl(c.report_w, libc::F_DUPFD_CLOEXEC, above);
        ck(r, w as c_long);
        let x = libc::fcntl(c.exec_fd, libc::F_DUPFD_CLOEXEC, above);
        ck(r, x as c_long);
        let mut cg = [0 as c_int; MAX_CGROUP_FDS];
        for (i, &fd) in c.cgroup_raw.iter().enumerate() {
            cg[i] = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, above);
            ck(r, cg[i] as c_long);
        }
        ck(r, libc::dup3(w, 3, 0) as c_long);
        ck(r, libc::dup3(x, 4, libc::O_CLOEXEC) as c_long);
        for (i, &fd) in cg[..n as usize].iter().enumerate() {
            ck(r, libc::dup3(fd, 5 + i as c_int, 0) as c_long);
        }
        ck(
            r,
            libc::syscall(
                libc::SYS_close_range,
                above as c_long,
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
        libc::syscall(
            libc::SYS_execveat,
            4 as c_long,
            c"".as_ptr(),
            c.argv_ptrs.as_ptr(),
            c.envp_ptrs.as_ptr(),
            libc::AT_EMPTY_PATH as c_long,
        );
        r.fail(harden::errno())
    }
}
