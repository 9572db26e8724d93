//! The `process` substrate's zygotes (run_code): the namespaces and the read-only root a
//! zygote builds around itself, and the lockdown a request's child applies to itself before it
//! runs untrusted code. Python (`corral.daemon.substrates.process`) decides paths and limits;
//! the syscalls are here. A zygote is a single-threaded Python process and every call acts on
//! the calling process (no clone, no CLONE_VM child), so ordinary Rust is fine here.

use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, Ordering};

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
/// shows a process only to its own uid), `mask` (a host file or empty directory bound over an
/// entry of that procfs: read-only for a directory; an entry this kernel lacks is skipped),
/// `dir` (an empty directory).
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
            "mask" => {
                // Over an existing entry only: nothing is made inside a procfs.
                if let Err(e) = mount("mask", src, &at, b"", libc::MS_BIND, b"") {
                    match e {
                        ZygoteError::Os { errno, .. } if errno == libc::ENOENT => continue,
                        e => return Err(e),
                    }
                }
                if at.is_dir() {
                    let flags = libc::MS_RDONLY | NOSUID_NODEV | libc::MS_NOEXEC;
                    let remount = libc::MS_BIND | libc::MS_REMOUNT | flags;
                    mount("remount", b"none", &at, b"", remount, b"")?;
                }
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

/// Seal the zygote itself once its root is built: no_new_privs and the process tier's seccomp
/// filter (the sandbox's, only AF_UNIX sockets, no file watches: `harden::host_view_program`),
/// which every request's child then inherits at its fork instead of
/// attaching its own (the kernel's per-attach cost stays out of the request path). The zygote
/// needs nothing the filter refuses once its namespaces and mounts are made. With `landlock`
/// (a session's zygote) the zygote also enters a Landlock domain (abstract unix socket scope)
/// that every child shares: a session's commands see and signal each other, which separate
/// domains (run_code's requests) would forbid.
pub fn seal(landlock: bool) -> Result<(), ZygoteError> {
    let prog = harden::host_view_program()?;
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
/// the seccomp filter is inherited) that has joined its cgroups: a cgroup namespace of its own
/// rooted at them (its /proc/self/cgroup shows "/", not the host's path of its cgroups; the
/// process tier's filter allows exactly `unshare(CLONE_NEWCGROUP)`, which needs the
/// CAP_SYS_ADMIN dropped just after), oom_score_adj as a sandbox, no capability left in any set
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
        step(
            "cgroup namespace",
            harden::check(libc::unshare(libc::CLONE_NEWCGROUP) as libc::c_long),
        )?;
        step("oom_score_adj", harden::set_sandbox_oom_score_adj())?;
        if !BOUNDING_EMPTY.load(Ordering::Relaxed) {
            step("drop_bounding", harden::drop_bounding(&plan))?;
        }
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

/// Everything a request's child does to itself between the fork and its request, prepared
/// once per slot by the zygote so that the child runs no Python for it: each Python object a
/// child touches is a page it copies from the zygote, and these steps touched ~90 a child.
pub struct ChildEntry {
    /// open, writable membership files of the slot's cgroups (`tasks` or `cgroup.procs`),
    /// owned by the zygote
    pub join: Vec<c_int>,
    /// the working directory (the slot's scratch dir)
    pub dir: CString,
    pub umask: libc::mode_t,
    pub lockdown: Lockdown,
}

const MAX_STDIO: usize = 8;

/// One fd to put in place: `src` becomes `dst`, close-on-exec when `cloexec`.
#[derive(Clone, Copy)]
pub struct Stdio {
    pub src: c_int,
    pub dst: c_int,
    pub cloexec: bool,
}

impl ChildEntry {
    /// In the freshly forked (single-threaded) child: join the slot's cgroups, start a
    /// session, put `stdio` in place (targets 0..n, each target once), close every fd from n
    /// on, chdir, umask, then `lockdown`.
    pub fn enter(&self, stdio: &[Stdio]) -> Result<(), ZygoteError> {
        if stdio.len() > MAX_STDIO {
            return Err(ZygoteError::Invalid(format!(
                "at most {MAX_STDIO} stdio fds"
            )));
        }
        let n = stdio.len() as c_int;
        if stdio.iter().any(|s| s.dst < 0 || s.dst >= n || s.src < 0)
            || (0..n).any(|d| stdio.iter().filter(|s| s.dst == d).count() != 1)
        {
            return Err(ZygoteError::Invalid(
                "stdio must name each target 0..n once".into(),
            ));
        }
        let fail = |step: &str| ZygoteError::os(step, harden::errno());
        for &fd in &self.join {
            // SAFETY: a write of a 1-byte literal to an fd the zygote holds open.
            if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
                return Err(fail("cgroup join"));
            }
        }
        // SAFETY: setsid has no arguments.
        if unsafe { libc::setsid() } < 0 {
            return Err(fail("setsid"));
        }
        // A source below n would be overwritten by an earlier target: move it above first.
        let mut srcs = [0 as c_int; MAX_STDIO];
        for (i, s) in stdio.iter().enumerate() {
            srcs[i] = if s.src < n {
                // SAFETY: fcntl on an fd number; the kernel checks it.
                let fd = unsafe { libc::fcntl(s.src, libc::F_DUPFD_CLOEXEC, n) };
                if fd < 0 {
                    return Err(fail("dup"));
                }
                fd
            } else {
                s.src
            };
        }
        for (i, s) in stdio.iter().enumerate() {
            let flags = if s.cloexec { libc::O_CLOEXEC } else { 0 };
            // SAFETY: dup3 of fd numbers; srcs[i] >= n > s.dst, so they differ.
            if unsafe { libc::dup3(srcs[i], s.dst, flags) } < 0 {
                return Err(fail("dup3"));
            }
        }
        // SAFETY: close_range on a range of fd numbers above the ones just placed.
        if unsafe {
            libc::syscall(
                libc::SYS_close_range,
                n as libc::c_uint,
                libc::c_uint::MAX,
                0,
            )
        } != 0
        {
            return Err(fail("close_range"));
        }
        // SAFETY: a NUL-terminated path owned by self.
        if unsafe { libc::chdir(self.dir.as_ptr()) } != 0 {
            return Err(fail("chdir"));
        }
        // SAFETY: umask takes a mode and cannot fail.
        unsafe { libc::umask(self.umask) };
        lockdown(&self.lockdown)
    }
}

/// A request child's ends of its pipes, as `fork_server` returns them in the child. The
/// fourth pipe, its exit status, is written by the server, never by the child: see
/// `write_status`.
pub struct Forked {
    pub slot: u32,
    /// the request (read end)
    pub ctl: c_int,
    pub out: c_int,
    pub err: c_int,
    /// the write end of its "started" pipe: the child writes one byte to it once it has its
    /// request, before the request's code gets control, and closes it (`write_status`)
    pub go: c_int,
}

/// The three calls an embedding interpreter makes around a fork (CPython's `PyOS_*Fork*`).
pub struct ForkHooks {
    pub before: fn(),
    pub after_parent: fn(),
    pub after_child: fn(),
}

/// Set in a fork server once it has dropped every capability from its bounding set and cleared
/// its ambient set: its children inherit both (and this flag), so their lockdown skips the
/// ~40 prctl calls of the drop.
static BOUNDING_EMPTY: AtomicBool = AtomicBool::new(false);

/// A command from the zygote: fork slot N's next child.
const CMD_FORK: u8 = b'f';
/// To the zygote: forked (slot u32, pid i32; the four daemon-side pipe ends attached).
const MSG_FORKED: u8 = b'F';
/// To the zygote: a child exited (pid i32, wait status i32, CLOCK_MONOTONIC f64 seconds,
/// started u8).
const MSG_EXITED: u8 = b'X';
/// On a child's status pipe, to the daemon: its wait status (i32), when it was reaped
/// (CLOCK_MONOTONIC f64 seconds) and whether it had started its request (u8), native byte
/// order, in one write.
pub const STATUS_LEN: usize = 13;

fn pipe_pair(step: &str) -> Result<[c_int; 2], ZygoteError> {
    pipe_with(step, libc::O_CLOEXEC)
}

fn pipe_with(step: &str, flags: c_int) -> Result<[c_int; 2], ZygoteError> {
    let mut p = [-1 as c_int; 2];
    // SAFETY: pipe2 fills the two-element array it is given.
    if unsafe { libc::pipe2(p.as_mut_ptr(), flags) } != 0 {
        return Err(ZygoteError::os(step, harden::errno()));
    }
    Ok(p)
}

/// Whether a reaped child had started its request: the byte it writes to its "started" pipe
/// once it has the request, before the request's code runs. Read after the child has ended
/// (no writer is left: the child closed its end before that code ran, and none of its
/// processes holds it), so an empty pipe means it never got that far: killed or failed
/// while it waited, which is the host's doing, never the request's.
fn started(go: c_int) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: a read of at most one byte into a stack buffer from a non-blocking pipe end
    // this server owns.
    unsafe { libc::read(go, b.as_mut_ptr().cast(), 1) == 1 }
}

fn close_all(fds: &[c_int]) {
    for &fd in fds {
        // SAFETY: closing fds this function's caller owns.
        unsafe { libc::close(fd) };
    }
}

fn monotonic() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Tell the daemon, on the status pipe it holds the other end of, how a child ended: the wait
/// status the kernel gave this server's waitpid and when. The child never holds this end (it
/// is closed in the child at the fork), so code a request runs cannot write a status of its
/// choosing, nor one before it has really ended. A daemon that has closed its end already
/// makes this an EPIPE (SIGPIPE is ignored here: `serve_forks`), which is nothing to report.
fn write_status(fd: c_int, status: c_int, t_exit: f64, started: bool) {
    let mut msg = [0u8; STATUS_LEN];
    msg[0..4].copy_from_slice(&status.to_ne_bytes());
    msg[4..12].copy_from_slice(&t_exit.to_ne_bytes());
    msg[12] = started as u8;
    // SAFETY: a write of a stack buffer to a pipe this server owns; under PIPE_BUF, so one
    // write lands whole, and the pipe is fresh (nothing else in it) so it does not block.
    unsafe { libc::write(fd, msg.as_ptr().cast(), msg.len()) };
}

fn send_exited(
    sock: c_int,
    pid: libc::pid_t,
    status: c_int,
    t_exit: f64,
    started: bool,
) -> Result<(), ZygoteError> {
    let mut msg = [0u8; 18];
    msg[0] = MSG_EXITED;
    msg[1..5].copy_from_slice(&pid.to_ne_bytes());
    msg[5..9].copy_from_slice(&status.to_ne_bytes());
    msg[9..17].copy_from_slice(&t_exit.to_ne_bytes());
    msg[17] = started as u8;
    // SAFETY: a send of a stack buffer on a socket fd.
    if unsafe { libc::send(sock, msg.as_ptr().cast(), msg.len(), libc::MSG_NOSIGNAL) } < 0 {
        return Err(ZygoteError::os("send", harden::errno()));
    }
    Ok(())
}

fn send_forked(
    sock: c_int,
    slot: u32,
    pid: libc::pid_t,
    fds: [c_int; 4],
) -> Result<(), ZygoteError> {
    let mut msg = [0u8; 9];
    msg[0] = MSG_FORKED;
    msg[1..5].copy_from_slice(&slot.to_ne_bytes());
    msg[5..9].copy_from_slice(&pid.to_ne_bytes());
    let mut iov = libc::iovec {
        iov_base: msg.as_mut_ptr().cast(),
        iov_len: msg.len(),
    };
    // Room for the control message of four fds, aligned as cmsghdr wants.
    let mut cbuf = [0u64; 8];
    // SAFETY: CMSG_SPACE is arithmetic on a length.
    let space = unsafe { libc::CMSG_SPACE((4 * std::mem::size_of::<c_int>()) as u32) } as usize;
    debug_assert!(space <= std::mem::size_of_val(&cbuf));
    // SAFETY: msghdr is plain data; every field used is set below.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.as_mut_ptr().cast();
    mh.msg_controllen = space as _;
    // SAFETY: mh points at cbuf, which holds one cmsghdr of `space` bytes; CMSG_FIRSTHDR and
    // CMSG_DATA stay inside it, and the data written is the four fds.
    unsafe {
        let cm = libc::CMSG_FIRSTHDR(&mh);
        (*cm).cmsg_level = libc::SOL_SOCKET;
        (*cm).cmsg_type = libc::SCM_RIGHTS;
        (*cm).cmsg_len = libc::CMSG_LEN((4 * std::mem::size_of::<c_int>()) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cm).cast::<c_int>(), 4);
        if libc::sendmsg(sock, &mh, libc::MSG_NOSIGNAL) < 0 {
            return Err(ZygoteError::os("sendmsg", harden::errno()));
        }
    }
    Ok(())
}

/// The fork server of a run_code zygote, run by a process forked from the zygote once its
/// interpreter is ready: it forks each request's child on the zygote's command (`f` + slot,
/// on the SOCK_SEQPACKET `sock`), sends back the daemon's ends of the child's pipes, reaps
/// its children (pidfds) and tells each exit: to the daemon on the child's status pipe, whose
/// write end only this server holds (`write_status`), and to the zygote. It runs no Python between forks, so the pages
/// it shares with its waiting children stay shared: when the zygote's Python loop forked,
/// every page it wrote between two forks was copied again (~100 page faults a request).
///
/// Returns only in a child (with its ends of the pipes); in the server it never returns but
/// by error, and exits when the zygote closes `sock`.
pub fn fork_server(sock: c_int, hooks: &ForkHooks) -> Result<Forked, ZygoteError> {
    match serve_forks(sock, hooks) {
        // The zygote is gone (it ended, or the daemon stopped it): so is this server, quietly;
        // its children die with the zygote, pid 1 of their namespace.
        Err(ZygoteError::Os { errno, .. }) if errno == libc::EPIPE || errno == libc::ECONNRESET => {
            // SAFETY: _exit ends this process; nothing of it is shared with another.
            unsafe { libc::_exit(0) }
        }
        other => other,
    }
}

fn serve_forks(sock: c_int, hooks: &ForkHooks) -> Result<Forked, ZygoteError> {
    let plan = CapPlan {
        bounding: 0,
        sets: 0,
        last_cap: harden::last_cap(),
    };
    // SAFETY: prctl calls with integer arguments; the server never execs, so it needs no
    // bounding set of its own.
    unsafe { harden::drop_bounding(&plan) }.map_err(|e| ZygoteError::os("drop_bounding", e))?;
    BOUNDING_EMPTY.store(true, Ordering::Relaxed);
    // A status write to a daemon that has closed its end must not end the server. Its python
    // children inherit this disposition, as they would from the zygote (CPython ignores
    // SIGPIPE); a bash child resets it before its exec.
    // SAFETY: signal() with a valid signal number and SIG_IGN.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    // Each live child: its pid, its pidfd, the write end of its status pipe and the read end
    // of its "started" pipe.
    let mut live: Vec<(libc::pid_t, c_int, c_int, c_int)> = Vec::with_capacity(256);
    let mut pfds: Vec<libc::pollfd> = Vec::with_capacity(257);
    loop {
        pfds.clear();
        pfds.push(libc::pollfd {
            fd: sock,
            events: libc::POLLIN,
            revents: 0,
        });
        pfds.extend(live.iter().map(|&(_, fd, _, _)| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: poll on a vector of pollfds it may write revents into.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = harden::errno();
            if e == libc::EINTR {
                continue;
            }
            return Err(ZygoteError::os("poll", e));
        }
        for i in (1..pfds.len()).rev() {
            if pfds[i].revents == 0 {
                continue;
            }
            let (pid, pidfd, st, go) = live[i - 1];
            let mut status: c_int = 0;
            // SAFETY: waitpid on our own child, writing into a local.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                let t_exit = monotonic();
                let began = started(go);
                // The daemon first: it answers the request on this word, the zygote then
                // cleans the slot.
                write_status(st, status, t_exit, began);
                close_all(&[pidfd, st, go]);
                live.swap_remove(i - 1);
                send_exited(sock, pid, status, t_exit, began)?;
            }
        }
        if pfds[0].revents == 0 {
            continue;
        }
        let mut cmd = [0u8; 16];
        // SAFETY: a recv into a stack buffer.
        let got =
            unsafe { libc::recv(sock, cmd.as_mut_ptr().cast(), cmd.len(), libc::MSG_DONTWAIT) };
        if got == 0 {
            // SAFETY: the zygote is gone; so is this server (its children die with pid 1).
            unsafe { libc::_exit(0) };
        }
        if got < 0 {
            let e = harden::errno();
            if e == libc::EAGAIN || e == libc::EINTR {
                continue;
            }
            return Err(ZygoteError::os("recv", e));
        }
        if got != 5 || cmd[0] != CMD_FORK {
            return Err(ZygoteError::Invalid("fork server: a bad command".into()));
        }
        let slot = u32::from_ne_bytes([cmd[1], cmd[2], cmd[3], cmd[4]]);
        let ctl = pipe_pair("pipe")?;
        let out = pipe_pair("pipe")?;
        let err = pipe_pair("pipe")?;
        let st = pipe_pair("pipe")?;
        let go = pipe_with("pipe", libc::O_CLOEXEC | libc::O_NONBLOCK)?;
        (hooks.before)();
        // SAFETY: fork of a single-threaded process; the child only returns to the caller.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            (hooks.after_child)();
            // No status pipe's write end stays in a child, its own or another's: only this
            // server tells how a child ended. (The entry's close_range would close the
            // others too; these are closed here, before anything else runs.)
            close_all(&[ctl[1], out[0], err[0], st[0], st[1], go[0]]);
            for &(_, pidfd, their_st, their_go) in &live {
                close_all(&[pidfd, their_st, their_go]);
            }
            return Ok(Forked {
                slot,
                ctl: ctl[0],
                out: out[1],
                err: err[1],
                go: go[1],
            });
        }
        (hooks.after_parent)();
        close_all(&[ctl[0], out[1], err[1], go[1]]);
        let theirs = [ctl[1], out[0], err[0], st[0]];
        if pid < 0 {
            let e = harden::errno();
            close_all(&theirs);
            close_all(&[st[1], go[0]]);
            return Err(ZygoteError::os("fork", e));
        }
        // SAFETY: pidfd_open of our own unreaped child.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as c_int;
        if pidfd < 0 {
            let e = harden::errno();
            close_all(&theirs);
            close_all(&[st[1], go[0]]);
            return Err(ZygoteError::os("pidfd_open", e));
        }
        live.push((pid, pidfd, st[1], go[0]));
        let sent = send_forked(sock, slot, pid, theirs);
        close_all(&theirs);
        sent?;
    }
}
