//! The fork machinery shared by `spawn` and `enter`.
//!
//! Both create their child with `clone(CLONE_VM | CLONE_VFORK, own stack)`, the way
//! posix_spawn does, instead of fork() (only `enter`'s command is a fork, of that child): the daemon is a big Python process and a fork would copy
//! its page tables (cost grows with its RSS; with thousands of sandboxes the daemon is large),
//! while a CLONE_VM child shares them and the calling thread sleeps until the child execs or
//! exits. Consequences the child code must respect:
//!
//! * it runs on a private stack (`Stack`) but in the daemon's memory, while the daemon's other
//!   threads keep running: no allocation, no locks, no glibc call that touches process-wide
//!   state (set*id wrappers, malloc, stdio), no panics. Everything it needs is prepared by the
//!   parent before the clone and passed by pointer;
//! * it reports progress by writing the current step into a `Report` that the parent reads after
//!   the clone returns (vfork semantics give the ordering). The last step before execve is
//!   marked so that a child killed before reaching exec is told apart from a successful exec.
//!   This replaces the classic CLOEXEC error pipe: same information, two syscalls cheaper, and
//!   it also catches a child killed by a signal;
//! * every signal is blocked in the parent thread around the clone (`SignalBlock`), so no
//!   handler of the daemon can ever run on the child's stack;
//! * the child never runs in a sandbox's pid namespace: no process of a sandbox may ever see,
//!   signal or trace a process that shares the daemon's memory. `spawn`'s child is PID 1 of a
//!   namespace nothing else lives in yet; `enter`'s (the helper) stays in the daemon's pid
//!   namespace and forks the command, with its own memory, into the sandbox's (enter.rs);
//! * the child joins the sandbox's memory cgroup while it still shares the daemon's memory. The
//!   OOM killer kills every process sharing its victim's memory, so were the child picked in an
//!   OOM of that cgroup, the daemon would die with it. The kernel never picks it: oom_badness()
//!   skips tasks `in_vfork()` (CLONE_VFORK child sharing its parent's mm), exactly this case
//!   (tests/test_container_substrate.py::test_exec_survives_oom_in_the_sandbox).

use std::io;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use libc::{c_int, c_void};

const MAX_EVENTS: usize = 64;

/// Progress of a child, written by the child, read by the parent after the clone returns.
/// Each `at()` also logs (step, CLOCK_MONOTONIC ns) — a vDSO read — which gives a free
/// per-step profile (`profile`).
#[derive(Debug)]
pub struct Report {
    step: AtomicU32,
    errno: AtomicI32,
    n: AtomicUsize,
    ev_step: [AtomicU32; MAX_EVENTS],
    ev_t: [AtomicU64; MAX_EVENTS],
}

/// CLOCK_MONOTONIC in ns (async-signal-safe).
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime with a valid timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Default for Report {
    fn default() -> Self {
        Report {
            step: AtomicU32::new(0),
            errno: AtomicI32::new(0),
            n: AtomicUsize::new(0),
            ev_step: std::array::from_fn(|_| AtomicU32::new(0)),
            ev_t: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Report {
    pub fn new() -> Self {
        Self::default()
    }

    /// Child: entering `step`.
    #[inline]
    pub fn at(&self, step: u32) {
        let i = self.n.load(Ordering::Relaxed);
        if i < MAX_EVENTS {
            self.ev_step[i].store(step, Ordering::Relaxed);
            self.ev_t[i].store(now_ns(), Ordering::Relaxed);
            self.n.store(i + 1, Ordering::Relaxed);
        }
        self.step.store(step, Ordering::SeqCst);
    }

    /// Parent, after the clone returned: how long each step took, in order. The first entry
    /// ("clone") runs from `start_ns` to the child's first step; the last step runs until the
    /// parent resumed (for the exec step: the execve itself).
    pub fn profile(&self, start_ns: u64, names: &[&'static str]) -> Profile {
        let end = now_ns();
        let n = self.n.load(Ordering::SeqCst).min(MAX_EVENTS);
        let mut out = Vec::with_capacity(n + 1);
        let mut prev_name = "clone";
        let mut prev_t = start_ns;
        for i in 0..n {
            let t = self.ev_t[i].load(Ordering::Relaxed);
            out.push((prev_name, t.saturating_sub(prev_t)));
            prev_name = names
                .get(self.ev_step[i].load(Ordering::Relaxed) as usize)
                .copied()
                .unwrap_or("?");
            prev_t = t;
        }
        out.push((prev_name, end.saturating_sub(prev_t)));
        out
    }

    /// Child: `step` failed with `errno`; never returns.
    #[inline]
    pub fn fail(&self, errno: c_int) -> ! {
        self.errno
            .store(if errno == 0 { libc::EIO } else { errno }, Ordering::SeqCst);
        // SAFETY: _exit is async-signal-safe and ends only this child (its own thread group).
        unsafe { libc::_exit(125) }
    }

    pub fn step(&self) -> u32 {
        self.step.load(Ordering::SeqCst)
    }

    pub fn errno(&self) -> c_int {
        self.errno.load(Ordering::SeqCst)
    }
}

/// A private stack for a CLONE_VM child, with a guard page below it.
pub struct Stack {
    base: *mut c_void,
    len: usize,
}

const PAGE: usize = 4096;

impl Stack {
    pub fn new(len: usize) -> io::Result<Self> {
        let len = len.div_ceil(PAGE) * PAGE + PAGE;
        // SAFETY: a fresh anonymous private mapping; checked for MAP_FAILED below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Stack { base, len };
        // SAFETY: the lowest page of our own mapping becomes the guard page.
        if unsafe { libc::mprotect(base, PAGE, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// Initial stack pointer (stacks grow down on every supported arch), 16-byte aligned.
    pub fn top(&self) -> *mut c_void {
        // SAFETY: one past the end of our mapping, which is how clone() wants it.
        unsafe { (self.base as *mut u8).add(self.len) as *mut c_void }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; the child has exec'd or exited
        // (CLONE_VFORK) before the parent can get here.
        unsafe {
            libc::munmap(self.base, self.len);
        }
    }
}

pub const CHILD_STACK_SIZE: usize = 256 * 1024;

thread_local! {
    static STACK: std::cell::RefCell<Option<Stack>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` with this thread's child stack (made on first use, unmapped when the thread ends).
/// One per thread is enough: with CLONE_VFORK the child is done with it (exec'd or exited)
/// before clone returns, and nothing here re-enters.
pub fn with_stack<R>(f: impl FnOnce(&Stack) -> R) -> io::Result<R> {
    STACK.with(|cell| {
        let mut slot = cell.borrow_mut();
        let stack = match slot.take() {
            Some(s) => s,
            None => Stack::new(CHILD_STACK_SIZE)?,
        };
        let r = f(&stack);
        *slot = Some(stack);
        Ok(r)
    })
}

/// `clone(cb, stack, flags | CLONE_VM | CLONE_VFORK | SIGCHLD, arg, &pidfd)`.
///
/// Returns the child's pid (the child has exec'd or exited when this returns) and, with
/// CLONE_PIDFD in `flags`, its pidfd (else -1).
///
/// # Safety
/// `cb` must be async-signal-safe, must not unwind, and must only use `arg`, which must point
/// to data that outlives this call. The caller must hold a `SignalBlock`.
pub unsafe fn clone_vfork(
    cb: extern "C" fn(*mut c_void) -> c_int,
    arg: *mut c_void,
    flags: c_int,
    stack: &Stack,
) -> io::Result<(libc::pid_t, c_int)> {
    let mut pidfd: c_int = -1;
    let flags = flags | libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD;
    // SAFETY: glibc's clone wrapper runs `cb(arg)` on `stack` in the child and `_exit`s with its
    // return value; with CLONE_PIDFD the kernel stores the pidfd through the parent_tid pointer.
    // Validity of cb/arg is the caller's contract.
    let pid = unsafe { libc::clone(cb, stack.top(), flags, arg, &mut pidfd as *mut c_int) };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((pid, pidfd))
}

/// A sealed, close-on-exec memfd holding a static binary to execveat (exec_in's trampoline).
pub fn sealed_exec_memfd(name: &std::ffi::CStr, bin: &[u8]) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let base = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: memfd_create with a valid name; MFD_EXEC (6.3+) first, so a vm.memfd_noexec
    // sysctl cannot make it unexecutable; older kernels reject the flag with EINVAL.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), base | libc::MFD_EXEC) };
    if fd < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(name.as_ptr(), base) };
    }
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut off = 0;
    while off < bin.len() {
        // SAFETY: writing from a valid slice.
        let n = unsafe {
            libc::write(
                fd.as_raw_fd(),
                bin[off..].as_ptr() as *const c_void,
                bin.len() - off,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        off += n as usize;
    }
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on our fd with integer arguments.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Reap a child we know has exited or is about to (blocking waitpid, EINTR retried).
pub fn reap(pid: libc::pid_t) -> Option<c_int> {
    let mut status: c_int = 0;
    loop {
        // SAFETY: waitpid on our own child with a valid status pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
        if rc == pid {
            return Some(status);
        }
        if rc < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return None;
    }
}

/// Per-thread record of the last spawn/exec's step timings (for benchmarks and debugging).
pub type Profile = Vec<(&'static str, u64)>;

thread_local! {
    static LAST_PROFILE: std::cell::RefCell<Vec<(&'static str, Profile)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

pub fn set_last_profile(what: &'static str, p: Profile) {
    LAST_PROFILE.with(|l| {
        let mut l = l.borrow_mut();
        l.retain(|(w, _)| *w != what);
        l.push((what, p));
    });
}

pub fn last_profile(what: &str) -> Profile {
    LAST_PROFILE.with(|l| {
        l.borrow()
            .iter()
            .find(|(w, _)| *w == what)
            .map(|(_, p)| p.clone())
            .unwrap_or_default()
    })
}

// ---------------------------------------------------------------------------------------------
// A small fd table for the child: CLONE_FILES + close_range(CLOSE_RANGE_UNSHARE)

/// How many fds one child may be lent (exec_in: 6 cgroups (v1 memory, pids, cpu, cpuacct,
/// cpuset, freezer) + pidfd + root + 3 stdio + report pipe + trampoline = 13).
pub const MAX_LENT: usize = 16;

/// Low fd numbers reserved once, early, each holding /dev/null until a clone lends it a fd the
/// child needs.
///
/// Without this a child inherits a *copy* of the daemon's fd table (in the worst case an fd or
/// two per live sandbox) — the clone copies every entry and the execve (or close_range) closes
/// them all again, so creating a sandbox and exec'ing in one got slower with every sandbox
/// alive (~1 ms each at 2,000). Instead the child is cloned with CLONE_FILES (nothing copied)
/// and its first syscall is `close_range(hole, ~0, CLOSE_RANGE_UNSHARE)`: the kernel gives it a
/// private table holding only fds `0..hole` (the daemon's first few: stdio, epoll, the slots),
/// whatever the daemon holds above. The fds the child needs are dup3'ed onto the slots first,
/// and the slots are reset to /dev/null once the clone returns (the child has exec'd or
/// exited: CLONE_VFORK), so no pipe end stays open in the daemon.
///
/// There are `SETS` independent sets of slots, each behind its own mutex, so clones from
/// different threads (a warm-pool refill, creates in worker threads) run in parallel.
pub struct Slots {
    sets: Vec<SlotSet>,
    null: RawFd,
    /// First fd number the child's private table leaves out.
    pub hole: RawFd,
}

struct SlotSet {
    slots: [RawFd; MAX_LENT],
    lock: std::sync::Mutex<()>,
}

const SETS: usize = 4;

use std::os::fd::RawFd;

static SLOTS: std::sync::OnceLock<Option<Slots>> = std::sync::OnceLock::new();

/// The process's slots, reserved on first call (the module's init does it, while the daemon
/// holds few fds). None if they could not be reserved: children then copy the whole table
/// (correct, only slower).
pub fn slots() -> Option<&'static Slots> {
    SLOTS.get_or_init(Slots::reserve).as_ref()
}

impl Slots {
    fn reserve() -> Option<Slots> {
        // SAFETY: open/fcntl/close with valid arguments; every result is checked.
        unsafe {
            let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if fd < 0 {
                return None;
            }
            // Never 0..2: a daemon started with closed stdio must not have them taken.
            let null = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3);
            libc::close(fd);
            if null < 0 {
                return None;
            }
            let mut sets = Vec::with_capacity(SETS);
            let mut hole = null + 1;
            for _ in 0..SETS {
                let mut slots = [-1; MAX_LENT];
                for s in slots.iter_mut() {
                    *s = libc::fcntl(null, libc::F_DUPFD_CLOEXEC, 3);
                    if *s < 0 {
                        let all = sets.iter().flat_map(|x: &SlotSet| x.slots.iter());
                        for &t in all.chain(slots.iter()).filter(|&&t| t >= 0) {
                            libc::close(t);
                        }
                        libc::close(null);
                        return None;
                    }
                    hole = hole.max(*s + 1);
                }
                sets.push(SlotSet {
                    slots,
                    lock: std::sync::Mutex::new(()),
                });
            }
            Some(Slots { sets, null, hole })
        }
    }

    /// Lend `fds` to the next child: each one (>= 0) is dup'ed onto a slot and replaced by the
    /// slot's number, in place. Negative entries stay as they are. The returned guard holds
    /// one set's lock and resets its slots when dropped (after the clone returned).
    pub fn lend(&'static self, fds: &mut [&mut RawFd]) -> std::io::Result<Lent> {
        if fds.len() > MAX_LENT {
            return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
        }
        let (set, guard) = self.acquire();
        self.fill(set, guard, fds)
    }

    /// Like `lend`, but only with a set that is free now, never the first one: None if every
    /// other set is busy (the caller then clones without CLONE_FILES). For `exec_in`, whose
    /// helper runs in a sandbox's cgroups (a sandbox at its CPU quota slows it): it never
    /// waits for a set, and never holds the one `lend` waits for.
    pub fn try_lend(&'static self, fds: &mut [&mut RawFd]) -> std::io::Result<Option<Lent>> {
        if fds.len() > MAX_LENT {
            return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
        }
        for set in &self.sets[1..] {
            if let Ok(guard) = set.lock.try_lock() {
                return self.fill(set, guard, fds).map(Some);
            }
        }
        Ok(None)
    }

    fn fill(
        &'static self,
        set: &'static SlotSet,
        guard: std::sync::MutexGuard<'static, ()>,
        fds: &mut [&mut RawFd],
    ) -> std::io::Result<Lent> {
        let mut lent = Lent {
            null: self.null,
            hole: self.hole,
            slots: &set.slots,
            used: 0,
            _guard: guard,
        };
        for fd in fds.iter_mut() {
            if **fd < 0 {
                continue;
            }
            let slot = set.slots[lent.used];
            // SAFETY: dup3 onto a slot we own (its set's lock is held); both fds are valid or
            // the call fails with EBADF, which is returned.
            if unsafe { libc::dup3(**fd, slot, libc::O_CLOEXEC) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
            lent.used += 1;
            **fd = slot;
        }
        Ok(lent)
    }

    /// A free set if there is one, else wait for the first (which `try_lend` never takes:
    /// only `lend`'s callers, whose children no sandbox can slow, hold it).
    fn acquire(&'static self) -> (&'static SlotSet, std::sync::MutexGuard<'static, ()>) {
        for set in &self.sets {
            if let Ok(g) = set.lock.try_lock() {
                return (set, g);
            }
        }
        let set = &self.sets[0];
        (set, set.lock.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Slots lent to one child; reset to /dev/null on drop.
pub struct Lent {
    null: RawFd,
    hole: RawFd,
    slots: &'static [RawFd; MAX_LENT],
    used: usize,
    _guard: std::sync::MutexGuard<'static, ()>,
}

impl Lent {
    /// The `close_range` start for the child's CLOSE_RANGE_UNSHARE.
    pub fn hole(&self) -> RawFd {
        self.hole
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        for &slot in &self.slots[..self.used] {
            // SAFETY: dup3 of our /dev/null fd onto our own slot.
            unsafe { libc::dup3(self.null, slot, libc::O_CLOEXEC) };
        }
    }
}

/// Child, first thing: a private fd table holding only `0..hole` (see `Slots`). A no-op when
/// `hole` < 0 (no slots: the child was cloned without CLONE_FILES and has its own copy).
///
/// # Safety
/// Async-signal-safe raw syscall.
#[inline]
pub unsafe fn unshare_small_table(hole: RawFd) -> libc::c_long {
    if hole < 0 {
        return 0;
    }
    // SAFETY: close_range with integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            hole as libc::c_long,
            !0u32 as libc::c_long,
            libc::CLOSE_RANGE_UNSHARE as libc::c_long,
        )
    }
}
