//! File operations resolved inside a sandbox's root.
//!
//! Every path is first normalized lexically (`..` pops a component and stops at the root), then
//! resolved from an O_PATH fd of the sandbox root with openat2(RESOLVE_IN_ROOT |
//! RESOLVE_NO_MAGICLINKS): symlinks, absolute or relative, resolve as they would for a process
//! chrooted there, and /proc magic links (/proc/self/root, /proc/1/cwd, ...) are refused. The
//! final component of a mutating operation is only ever used with an *at syscall on its parent
//! fd and never followed (O_NOFOLLOW, AT_SYMLINK_NOFOLLOW, unlinkat, renameat), so a symlink
//! swapped in by code in the sandbox cannot redirect a write, a removal or a rename.
//!
//! The daemon runs with every capability, so it also refuses to read or write through procfs
//! or sysfs (/proc/kmsg, /proc/<pid>/oom_score_adj, ...) and to read anything but regular
//! files: a FIFO or a device made by the sandbox must not block or steer a daemon thread.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use rustix::fs::{self as rfs, AtFlags, Dir, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("{0}")]
    Invalid(String),
    /// A directory with more entries than one listing returns (the daemon's memory must not
    /// grow with what a sandbox holds).
    #[error("{path:?} has more than {limit} entries")]
    TooMany { path: String, limit: usize },
    /// A path the files API never serves: a kernel pseudo-filesystem or a special file.
    #[error("{op} {path:?}: {msg}")]
    Forbidden {
        op: &'static str,
        path: String,
        msg: &'static str,
    },
    /// A cached-only call found a step that needs the disk (a lookup, or data not in the page
    /// cache) or an unbounded walk (a symlink, a long path): the caller does it again where
    /// blocking is allowed.
    #[error("not served from memory in bounded time: a thread must do this")]
    NotCached,
    #[error("{op} {path:?}: {msg}")]
    Os {
        op: &'static str,
        errno: i32,
        path: String,
        msg: String,
    },
}

impl FsError {
    fn os(op: &'static str, path: &Norm, e: Errno) -> Self {
        let errno = e.raw_os_error();
        let msg = match errno {
            libc::EXDEV => "resolves outside the sandbox root".to_string(),
            libc::ELOOP => {
                "too many levels of symbolic links, or a symlink where none is allowed".to_string()
            }
            _ => crate::harden::strerror(errno),
        };
        FsError::Os {
            op,
            errno,
            path: path.display(),
            msg,
        }
    }

    fn forbidden(op: &'static str, path: &Norm, msg: &'static str) -> Self {
        FsError::Forbidden {
            op,
            path: path.display(),
            msg,
        }
    }

    fn custom(op: &'static str, path: &Norm, errno: i32, msg: &str) -> Self {
        FsError::Os {
            op,
            errno,
            path: path.display(),
            msg: msg.to_string(),
        }
    }

    pub fn errno(&self) -> Option<i32> {
        match self {
            FsError::Os { errno, .. } => Some(*errno),
            FsError::Invalid(_) => None,
            FsError::Forbidden { .. } => Some(libc::EACCES),
            FsError::TooMany { .. } => Some(libc::EFBIG),
            FsError::NotCached => Some(libc::EAGAIN),
        }
    }
}

type Result<T> = std::result::Result<T, FsError>;

const PROC_SUPER_MAGIC: i64 = 0x9fa0;
const SYSFS_MAGIC: i64 = 0x6265_6572;
const CGROUP_SUPER_MAGIC: i64 = 0x27e0eb;
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
const DEBUGFS_MAGIC: i64 = 0x6462_6720;
const SECURITYFS_MAGIC: i64 = 0x7365_6373;
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const TRACEFS_MAGIC: i64 = 0x7472_6163;
const CONFIGFS_MAGIC: i64 = 0x6265_6570;
const PSTOREFS_MAGIC: i64 = 0x6165_676c;
const EFIVARFS_MAGIC: i64 = 0xde5e_81e4;
const BINFMTFS_MAGIC: i64 = 0x4249_4e4d;
const FUSECTL_MAGIC: i64 = 0x6573_5543;
/// FUSE: in a sandbox only lxcfs's views of /proc and /sys (the daemon's own process answers
/// them, with the daemon's view: not the sandbox's files).
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
const NSFS_MAGIC: i64 = 0x6e73_6673;
const SELINUX_MAGIC: i64 = 0xf97c_ff8c;
const SMACK_MAGIC: i64 = 0x4341_5d53;
const MQUEUE_MAGIC: i64 = 0x1980_0202;

/// A normalized path: its components, never "", "." or "..". Empty means the root.
struct Norm {
    comps: Vec<Vec<u8>>,
}

impl Norm {
    fn new(path: &OsStr) -> Result<Self> {
        let b = path.as_bytes();
        if b.is_empty() {
            return Err(FsError::Invalid("empty path".into()));
        }
        if b.contains(&0) {
            return Err(FsError::Invalid(format!("NUL byte in path {path:?}")));
        }
        let mut comps: Vec<Vec<u8>> = Vec::new();
        for c in b.split(|&x| x == b'/') {
            match c {
                b"" | b"." => {}
                b".." => {
                    comps.pop();
                }
                _ => comps.push(c.to_vec()),
            }
        }
        Ok(Norm { comps })
    }

    #[cfg(test)]
    fn is_root(&self) -> bool {
        self.comps.is_empty()
    }

    /// Relative form of the first `n` components ("." for none).
    fn rel(&self, n: usize) -> CString {
        if n == 0 {
            return CString::new(".").expect("no NUL");
        }
        CString::new(self.comps[..n].join(&b'/')).expect("checked for NUL")
    }

    fn full(&self) -> CString {
        self.rel(self.comps.len())
    }

    fn parent(&self) -> CString {
        self.rel(self.comps.len().saturating_sub(1))
    }

    fn base(&self) -> Option<CString> {
        self.comps
            .last()
            .map(|c| CString::new(c.clone()).expect("checked for NUL"))
    }

    fn display(&self) -> String {
        let mut s = String::from("/");
        s.push_str(&String::from_utf8_lossy(&self.comps.join(&b'/')));
        s
    }
}

fn borrow(fd: RawFd) -> Result<BorrowedFd<'static>> {
    if fd < 0 {
        return Err(FsError::Invalid(format!("bad root fd {fd}")));
    }
    // SAFETY: the caller (Python) owns the fd and keeps it open for the duration of the call;
    // the 'static borrow never escapes the call.
    Ok(unsafe { BorrowedFd::borrow_raw(fd) })
}

/// openat2(root, rel, flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS), retrying the EAGAIN
/// RESOLVE_IN_ROOT returns when a concurrent rename races a `..` lookup.
fn open_in(
    root: BorrowedFd<'_>,
    rel: &CStr,
    flags: OFlags,
    mode: Mode,
) -> rustix::io::Result<OwnedFd> {
    let resolve = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS;
    let mut tries = 0;
    loop {
        match rfs::openat2(root, rel, flags | OFlags::CLOEXEC, mode, resolve) {
            Err(Errno::AGAIN) | Err(Errno::INTR) if tries < 64 => tries += 1,
            r => return r,
        }
    }
}

/// The most components a cached-only call resolves. The walk's cost on the caller's thread
/// (an event loop) is then bounded: no symlink is followed (each may name 4,095 bytes of
/// path, and 40 of them chained made one short path cost ~10 ms of lookups), and at most this
/// many lookups from the dentry cache, a few microseconds.
pub const CACHED_MAX_COMPONENTS: usize = 64;

/// openat2 of `rel` below `dir` (in the sandbox root when `dir` is it) for a cached-only call:
/// from the dentry cache only, no symlink followed (a trailing one is opened itself with
/// O_PATH | O_NOFOLLOW), at most CACHED_MAX_COMPONENTS; anything else is NotCached.
fn open_cached(dir: BorrowedFd<'_>, rel: &CStr, flags: OFlags) -> Result<OwnedFd> {
    let comps = rel.to_bytes().split(|&b| b == b'/').count();
    if comps > CACHED_MAX_COMPONENTS {
        return Err(FsError::NotCached);
    }
    let resolve = ResolveFlags::IN_ROOT
        | ResolveFlags::NO_MAGICLINKS
        | ResolveFlags::NO_SYMLINKS
        | ResolveFlags::CACHED;
    rfs::openat2(dir, rel, flags | OFlags::CLOEXEC, Mode::empty(), resolve)
        .map_err(|_| FsError::NotCached)
}

fn open_dir_path(root: BorrowedFd<'_>, rel: &CStr) -> rustix::io::Result<OwnedFd> {
    open_in(root, rel, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())
}

/// Refuse procfs, sysfs, cgroupfs, devpts and the other kernel pseudo-filesystems (see the
/// module doc): a deny list of filesystem types, checked on the opened fd.
fn check_fs_type(fd: BorrowedFd<'_>, op: &'static str, path: &Norm) -> Result<()> {
    let st = rfs::fstatfs(fd).map_err(|e| FsError::os(op, path, e))?;
    let t = st.f_type as i64;
    if [
        PROC_SUPER_MAGIC,
        SYSFS_MAGIC,
        CGROUP_SUPER_MAGIC,
        CGROUP2_SUPER_MAGIC,
        DEBUGFS_MAGIC,
        SECURITYFS_MAGIC,
        BPF_FS_MAGIC,
        DEVPTS_SUPER_MAGIC,
        TRACEFS_MAGIC,
        CONFIGFS_MAGIC,
        PSTOREFS_MAGIC,
        EFIVARFS_MAGIC,
        BINFMTFS_MAGIC,
        FUSECTL_MAGIC,
        FUSE_SUPER_MAGIC,
        NSFS_MAGIC,
        SELINUX_MAGIC,
        SMACK_MAGIC,
        MQUEUE_MAGIC,
    ]
    .contains(&t)
    {
        return Err(FsError::forbidden(
            op,
            path,
            "kernel pseudo-filesystems (/proc, /sys, cgroupfs, ...) are not reachable through \
             the files API",
        ));
    }
    Ok(())
}

/// Refuse everything but regular files and directories (devices, FIFOs, sockets: opening one
/// can block a daemon thread or act on a device).
fn check_kind(st: &rfs::Stat, op: &'static str, path: &Norm) -> Result<FileType> {
    match FileType::from_raw_mode(mode_of(st)) {
        t @ (FileType::RegularFile | FileType::Directory) => Ok(t),
        _ => Err(FsError::forbidden(
            op,
            path,
            "device nodes, FIFOs and sockets are not reachable through the files API",
        )),
    }
}

/// An O_PATH fd of `base` in `dir`, the last component not followed (a symlink is itself).
fn open_entry(dir: BorrowedFd<'_>, base: &CStr) -> rustix::io::Result<OwnedFd> {
    rfs::openat(
        dir,
        base,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Open the inode behind an O_PATH fd for real I/O, through the daemon's own /proc/self/fd
/// (the inode was checked on the O_PATH fd first, so nothing is opened before it is known).
fn reopen(fd: BorrowedFd<'_>, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    let p = format!("/proc/self/fd/{}", fd.as_raw_fd());
    rfs::open(
        p.as_str(),
        flags | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
}

/// The error for a failed resolution of `path`: ForbiddenPath when its nearest ancestor is on
/// a pseudo-filesystem (a dangling /proc/self, a pid that is gone: the answer is the same as
/// for what exists there), else the syscall's own.
fn failed(root: BorrowedFd<'_>, op: &'static str, path: &Norm, e: Errno) -> FsError {
    // The nearest ancestor that resolves decides.
    if let Some((_, dir)) = deepest_dir(root, path, path.comps.len()) {
        if let Err(forbidden) = check_fs_type(dir.as_fd(), op, path) {
            return forbidden;
        }
    }
    FsError::os(op, path, e)
}

/// The deepest of `path`'s first `below` prefixes (`path.rel(k)`, k < `below`) that resolves
/// to a directory, with an O_PATH fd of it; None if not even the root does. A prefix resolves
/// only if every shorter one does (each is resolved on the way), so a binary search finds it
/// in a few dozen resolutions: trying each prefix from the deepest, each a walk from the root,
/// cost a path of 2,000 components ~2 million lookups (0.2 s, on the daemon's event loop for
/// a read). A sandbox changing the tree meanwhile can only make the answer one that was true
/// a moment before or after.
fn deepest_dir(root: BorrowedFd<'_>, path: &Norm, below: usize) -> Option<(usize, OwnedFd)> {
    let (mut lo, mut hi) = (0, below); // the answer is lo - 1 once lo == hi
    let mut found = None;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match open_dir_path(root, &path.rel(mid)) {
            Ok(fd) => {
                found = Some((mid, fd));
                lo = mid + 1;
            }
            Err(_) => hi = mid,
        }
    }
    found
}

/// A checked, readable fd of the regular file at `path` and its size.
pub fn open_read(root: RawFd, path: &OsStr) -> Result<(OwnedFd, u64)> {
    open_read_from(root, path, false)
}

/// open_read; `cached`: only as open_cached resolves, any failure NotCached (the caller asks
/// again without it, from a thread, and gets the exact error there).
fn open_read_from(root: RawFd, path: &OsStr, cached: bool) -> Result<(OwnedFd, u64)> {
    const OP: &str = "read";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    let pfd = if cached {
        open_cached(root, &p.full(), OFlags::PATH)?
    } else {
        open_in(root, &p.full(), OFlags::PATH, Mode::empty())
            .map_err(|e| failed(root, OP, &p, e))?
    };
    check_fs_type(pfd.as_fd(), OP, &p)?;
    let st = rfs::fstat(&pfd).map_err(|e| FsError::os(OP, &p, e))?;
    if check_kind(&st, OP, &p)? == FileType::Directory {
        return Err(FsError::os(OP, &p, Errno::ISDIR));
    }
    // O_NONBLOCK: a lease a process in the sandbox holds on the file makes the open fail with
    // EWOULDBLOCK, where it would wait out the lease-break time (45 s) in a daemon thread.
    let fd = reopen(pfd.as_fd(), OFlags::RDONLY | OFlags::NONBLOCK)
        .map_err(|e| FsError::os(OP, &p, e))?;
    Ok((fd, st.st_size.max(0) as u64))
}

/// Whether the first `len` bytes of `fd`'s file are all in the page cache: mincore of a
/// read-only shared mapping of them, never touched (nothing is read or faulted in). False
/// when the file cannot be mapped.
fn resident(fd: BorrowedFd<'_>, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let page = rustix::param::page_size();
    // SAFETY: a new read-only shared mapping of a file the caller holds open, at an address
    // the kernel picks; it is never dereferenced, only passed to mincore, and unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return false;
    }
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `addr..addr + len` is the mapping made above; `vec` has a byte for each of its
    // pages, as mincore writes.
    let rc = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
    // SAFETY: the mapping made above, not used after this.
    unsafe { libc::munmap(addr, len) };
    rc == 0 && vec.iter().all(|b| b & 1 == 1)
}

/// Create every missing directory of `path[..n]`; returns an O_PATH fd of it.
fn mkdir_p(
    root: BorrowedFd<'_>,
    path: &Norm,
    n: usize,
    mode: u32,
    op: &'static str,
) -> Result<OwnedFd> {
    if let Ok(fd) = open_dir_path(root, &path.rel(n)) {
        check_fs_type(fd.as_fd(), op, path)?;
        return Ok(fd);
    }
    // From the deepest existing directory, each missing one is made in its parent and
    // entered by name (resolving each prefix from the root again cost a path of 2,000 new
    // components ~2 million lookups). What is not a directory there (a file, a symlink: the
    // sandbox's, made meanwhile) is resolved from the root, for its error.
    let (have, mut cur) = match deepest_dir(root, path, n) {
        Some(found) => found,
        None => (
            0,
            open_dir_path(root, c".").map_err(|e| FsError::os(op, path, e))?,
        ),
    };
    for i in have + 1..=n {
        check_fs_type(cur.as_fd(), op, path)?;
        let name = CString::new(path.comps[i - 1].clone()).expect("checked for NUL");
        match rfs::mkdirat(&cur, &name, Mode::from_raw_mode(mode)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(FsError::os(op, path, e)),
        }
        cur = match rfs::openat(
            &cur,
            &name,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(_) => open_dir_path(root, &path.rel(i)).map_err(|e| FsError::os(op, path, e))?,
        };
    }
    Ok(cur)
}

/// An O_PATH fd of the parent directory, refused on a pseudo-filesystem.
fn parent_fd(root: BorrowedFd<'_>, path: &Norm, op: &'static str) -> Result<OwnedFd> {
    let fd = open_dir_path(root, &path.parent()).map_err(|e| FsError::os(op, path, e))?;
    check_fs_type(fd.as_fd(), op, path)?;
    Ok(fd)
}

#[allow(clippy::unnecessary_cast)] // st_mode's type differs between architectures
fn mode_of(st: &rfs::Stat) -> u32 {
    st.st_mode as u32
}

fn kind_of(mode: u32) -> &'static str {
    match FileType::from_raw_mode(mode) {
        FileType::RegularFile => "file",
        FileType::Directory => "dir",
        FileType::Symlink => "symlink",
        _ => "other",
    }
}

/// (name, kind, size, permission bits, mtime)
pub type ListEntry = (OsString, &'static str, u64, u32, f64);

/// (kind, size, permission bits, mtime)
pub type StatInfo = (&'static str, u64, u32, f64);

fn stat_info(st: &rfs::Stat) -> StatInfo {
    let mode = mode_of(st);
    (
        kind_of(mode),
        st.st_size as u64,
        mode & 0o7777,
        st.st_mtime as f64 + st.st_mtime_nsec as f64 / 1e9,
    )
}

// ---------------------------------------------------------------------------------------------
// public API

/// O_PATH fd of /proc/PID/root.
pub fn root_fd(pid: i32) -> std::io::Result<OwnedFd> {
    crate::enter::open_proc_root(pid)
}

/// At most `max_bytes` of the regular file at `path`. `cached`: only if that needs no disk
/// read and no unbounded walk (the path resolved as open_cached does, the bytes in the page
/// cache), else NotCached, so an event loop can try it first and hand the rest to a thread.
pub fn read(root: RawFd, path: &OsStr, max_bytes: u64, cached: bool) -> Result<Vec<u8>> {
    const OP: &str = "read";
    let (fd, size) = open_read_from(root, path, cached)?;
    let p = Norm::new(path)?;
    let st_size = size;
    // At most `max_bytes`: the caller compares the length with its limit to spot truncation.
    let max = usize::try_from(max_bytes).unwrap_or(usize::MAX);
    let want = usize::try_from(st_size).unwrap_or(usize::MAX).min(max);
    if cached && !resident(fd.as_fd(), want) {
        return Err(FsError::NotCached);
    }
    let mut buf = vec![0u8; want];
    let mut len = 0;
    loop {
        if len == buf.len() {
            if len >= max {
                break;
            }
            // The file grew, or st_size lied (some filesystems): keep going in chunks.
            buf.resize((len + (1 << 16)).min(max), 0);
        }
        match rustix::io::read(&fd, &mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(FsError::os(OP, &p, e)),
        }
    }
    buf.truncate(len);
    Ok(buf)
}

pub fn write(root: RawFd, path: &OsStr, data: &[u8], mode: u32, make_parents: bool) -> Result<()> {
    const OP: &str = "write";
    let fd = open_write(root, path, mode, make_parents)?;
    let p = Norm::new(path)?;
    let mut off = 0;
    while off < data.len() {
        match rustix::io::write(&fd, &data[off..]) {
            Ok(n) => off += n,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(FsError::os(OP, &p, e)),
        }
    }
    Ok(())
}

/// Create or truncate the regular file at `path` (a new one gets exactly `mode`); returns an
/// fd to write it through (the caller writes in chunks and closes it).
pub fn open_write(root: RawFd, path: &OsStr, mode: u32, make_parents: bool) -> Result<OwnedFd> {
    const OP: &str = "write";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    let Some(base) = p.base() else {
        return Err(FsError::os(OP, &p, Errno::ISDIR));
    };
    let dir = if make_parents {
        mkdir_p(root, &p, p.comps.len() - 1, 0o755, OP)?
    } else {
        parent_fd(root, &p, OP)?
    };
    check_fs_type(dir.as_fd(), OP, &p)?;
    let base_flags =
        OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let perm = Mode::from_raw_mode(mode & 0o7777);
    // Create exclusively first so a new file gets exactly `mode` (fchmod beats the umask);
    // an existing file keeps its mode and is truncated.
    let (fd, created) = match rfs::openat(
        &dir,
        &base,
        base_flags | OFlags::CREATE | OFlags::EXCL,
        perm,
    ) {
        Ok(fd) => (fd, true),
        Err(Errno::EXIST) => {
            let pfd = open_entry(dir.as_fd(), &base).map_err(|e| FsError::os(OP, &p, e))?;
            let st = rfs::fstat(&pfd).map_err(|e| FsError::os(OP, &p, e))?;
            if FileType::from_raw_mode(mode_of(&st)) == FileType::Symlink {
                return Err(FsError::os(OP, &p, Errno::LOOP)); // never followed
            }
            match check_kind(&st, OP, &p)? {
                FileType::Directory => return Err(FsError::os(OP, &p, Errno::ISDIR)),
                _ => {
                    let fd = reopen(pfd.as_fd(), OFlags::WRONLY | OFlags::NONBLOCK)
                        .map_err(|e| FsError::os(OP, &p, e))?;
                    (fd, false)
                }
            }
        }
        Err(e) => return Err(FsError::os(OP, &p, e)),
    };
    let st = rfs::fstat(&fd).map_err(|e| FsError::os(OP, &p, e))?;
    if FileType::from_raw_mode(mode_of(&st)) != FileType::RegularFile {
        return Err(FsError::custom(OP, &p, libc::EINVAL, "not a regular file"));
    }
    if created {
        rfs::fchmod(&fd, perm).map_err(|e| FsError::os(OP, &p, e))?;
    } else {
        rfs::ftruncate(&fd, 0).map_err(|e| FsError::os(OP, &p, e))?;
    }
    Ok(fd)
}

/// Entries one listing returns at most.
pub const LIST_MAX: usize = 100_000;

/// Entries of a directory: (name, kind, size, mode, mtime), sorted by name; symlinks are not
/// followed. More than `LIST_MAX` entries: `TooMany`.
pub fn list(root: RawFd, path: &OsStr) -> Result<Vec<ListEntry>> {
    Ok(list_page(root, path, None, LIST_MAX)?.0)
}

/// One page of a directory's entries, sorted by name: those after `after` (by bytes), at
/// most `limit`, and the next page's cursor (the page's last name) when more follow, also
/// when every entry of the page was removed before its stat. Only the page's entries are
/// stat'ed: paging through a big directory costs its names once per page, not every stat.
pub fn list_page(
    root: RawFd,
    path: &OsStr,
    after: Option<&OsStr>,
    limit: usize,
) -> Result<(Vec<ListEntry>, Option<OsString>)> {
    const OP: &str = "list";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    let fd = open_in(
        root,
        &p.full(),
        OFlags::RDONLY | OFlags::DIRECTORY,
        Mode::empty(),
    )
    .map_err(|e| failed(root, OP, &p, e))?;
    check_fs_type(fd.as_fd(), OP, &p)?;
    let mut dir = Dir::new(fd).map_err(|e| FsError::os(OP, &p, e))?;
    let mut names = Vec::new();
    while let Some(ent) = dir.read() {
        let ent = ent.map_err(|e| FsError::os(OP, &p, e))?;
        let name = ent.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        if names.len() >= LIST_MAX {
            return Err(FsError::TooMany {
                path: p.display(),
                limit: LIST_MAX,
            });
        }
        names.push(name.to_owned());
    }
    if let Some(after) = after {
        names.retain(|n| n.as_bytes() > after.as_bytes());
    }
    let more = names.len() > limit;
    if more {
        // The page's names, without sorting the rest.
        names.select_nth_unstable(limit);
        names.truncate(limit);
    }
    names.sort_unstable();
    let cursor = if more {
        names
            .last()
            .map(|n| OsString::from_vec(n.as_bytes().to_vec()))
    } else {
        None
    };
    let dfd = dir.fd().map_err(|e| FsError::os(OP, &p, e))?;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        match rfs::statat(dfd, &name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => {
                let (k, size, mode, mtime) = stat_info(&st);
                out.push((OsString::from_vec(name.into_bytes()), k, size, mode, mtime));
            }
            Err(Errno::NOENT) => {} // removed meanwhile
            Err(e) => return Err(FsError::os(OP, &p, e)),
        }
    }
    Ok((out, cursor))
}

/// lstat semantics: a symlink is reported as one. `cached`: only as open_cached resolves,
/// else NotCached (as `read`).
/// Whether `path` is a directory once its symlinks are followed inside the root, as a process
/// of the sandbox would chdir to it: a missing path, a dangling symlink, a symlink loop or any
/// other kind of file is `false`.
pub fn is_dir(root: RawFd, path: &OsStr) -> Result<bool> {
    const OP: &str = "is_dir";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    match open_dir_path(root, &p.full()) {
        Ok(fd) => {
            check_fs_type(fd.as_fd(), OP, &p)?;
            Ok(true)
        }
        Err(e) if [Errno::NOENT, Errno::NOTDIR, Errno::LOOP].contains(&e) => Ok(false),
        Err(e) => Err(FsError::os(OP, &p, e)),
    }
}

pub fn stat(root: RawFd, path: &OsStr, cached: bool) -> Result<StatInfo> {
    const OP: &str = "stat";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    let st = match p.base() {
        Some(_) if cached && p.comps.len() > CACHED_MAX_COMPONENTS => {
            return Err(FsError::NotCached);
        }
        Some(base) if cached => {
            let dir = open_cached(root, &p.parent(), OFlags::PATH | OFlags::DIRECTORY)?;
            check_fs_type(dir.as_fd(), OP, &p)?;
            let fd = open_cached(dir.as_fd(), &base, OFlags::PATH | OFlags::NOFOLLOW)?;
            check_fs_type(fd.as_fd(), OP, &p)?; // a pseudo-filesystem mounted there
            rfs::fstat(&fd)
        }
        None => {
            let fd = open_dir_path(root, c".").map_err(|e| FsError::os(OP, &p, e))?;
            check_fs_type(fd.as_fd(), OP, &p)?;
            rfs::fstat(&fd)
        }
        Some(base) => {
            let dir = parent_fd(root, &p, OP)?;
            check_fs_type(dir.as_fd(), OP, &p)?;
            let fd = open_entry(dir.as_fd(), &base).map_err(|e| FsError::os(OP, &p, e))?;
            check_fs_type(fd.as_fd(), OP, &p)?; // a pseudo-filesystem mounted there
            rfs::fstat(&fd)
        }
    }
    .map_err(|e| FsError::os(OP, &p, e))?;
    Ok(stat_info(&st))
}

pub fn mkdir(root: RawFd, path: &OsStr, parents: bool, mode: u32) -> Result<()> {
    const OP: &str = "mkdir";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    if parents {
        mkdir_p(root, &p, p.comps.len(), mode & 0o7777, OP)?;
        return Ok(());
    }
    let Some(base) = p.base() else {
        return Err(FsError::os(OP, &p, Errno::EXIST));
    };
    let dir = parent_fd(root, &p, OP)?;
    rfs::mkdirat(&dir, &base, Mode::from_raw_mode(mode & 0o7777))
        .map_err(|e| FsError::os(OP, &p, e))
}

/// Remove `path`; `recursive`: with everything under it, failing with `TooMany` past
/// `max_entries` names (a tree the sandbox keeps growing meanwhile: tree.rs).
pub fn remove(root: RawFd, path: &OsStr, recursive: bool, max_entries: u64) -> Result<()> {
    const OP: &str = "remove";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    let Some(base) = p.base() else {
        return Err(FsError::Invalid(
            "refusing to remove the sandbox's root directory".into(),
        ));
    };
    let dir = parent_fd(root, &p, OP)?;
    let st =
        rfs::statat(&dir, &base, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| FsError::os(OP, &p, e))?;
    if FileType::from_raw_mode(mode_of(&st)) != FileType::Directory {
        return rfs::unlinkat(&dir, &base, AtFlags::empty()).map_err(|e| FsError::os(OP, &p, e));
    }
    if recursive {
        // A pseudo-filesystem mounted there (/proc, /dev/pts) is refused, not walked.
        let top = open_entry(dir.as_fd(), &base).map_err(|e| FsError::os(OP, &p, e))?;
        check_fs_type(top.as_fd(), OP, &p)?;
        drop(top);
        crate::tree::remove_at_bounded(dir.as_fd(), &base, max_entries).map_err(|e| match e {
            Errno::FBIG => FsError::TooMany {
                path: p.display(),
                limit: usize::try_from(max_entries).unwrap_or(usize::MAX),
            },
            e => FsError::os(OP, &p, e),
        })
    } else {
        rfs::unlinkat(&dir, &base, AtFlags::REMOVEDIR).map_err(|e| FsError::os(OP, &p, e))
    }
}

pub fn rename(root: RawFd, src: &OsStr, dst: &OsStr) -> Result<()> {
    const OP: &str = "rename";
    let root = borrow(root)?;
    let s = Norm::new(src)?;
    let d = Norm::new(dst)?;
    let (Some(sb), Some(db)) = (s.base(), d.base()) else {
        return Err(FsError::Invalid(
            "cannot rename the sandbox's root directory".into(),
        ));
    };
    let sd = parent_fd(root, &s, OP)?;
    let dd = parent_fd(root, &d, OP)?;
    rfs::renameat(&sd, &sb, &dd, &db).map_err(|e| FsError::os(OP, &s, e))
}

pub fn symlink(root: RawFd, target: &OsStr, linkpath: &OsStr) -> Result<()> {
    const OP: &str = "symlink";
    let root = borrow(root)?;
    let p = Norm::new(linkpath)?;
    if target.is_empty() || target.as_bytes().contains(&0) {
        return Err(FsError::Invalid(format!("bad symlink target {target:?}")));
    }
    let Some(base) = p.base() else {
        return Err(FsError::os(OP, &p, Errno::EXIST));
    };
    let dir = parent_fd(root, &p, OP)?;
    rfs::symlinkat(target.as_bytes(), &dir, &base).map_err(|e| FsError::os(OP, &p, e))
}

pub fn readlink(root: RawFd, path: &OsStr) -> Result<OsString> {
    const OP: &str = "readlink";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    let Some(base) = p.base() else {
        return Err(FsError::os(OP, &p, Errno::INVAL));
    };
    let dir = parent_fd(root, &p, OP)?;
    let t = rfs::readlinkat(&dir, &base, Vec::new()).map_err(|e| FsError::os(OP, &p, e))?;
    Ok(OsString::from_vec(t.into_bytes()))
}

/// An O_PATH fd of `p` itself (a final symlink is not followed; the root for an empty path).
fn open_final_path(root: BorrowedFd<'_>, p: &Norm, op: &'static str) -> Result<OwnedFd> {
    match p.base() {
        None => open_dir_path(root, c"."),
        Some(base) => {
            let dir = parent_fd(root, p, op)?;
            rfs::openat(
                &dir,
                &base,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
        }
    }
    .map_err(|e| FsError::os(op, p, e))
}

/// chmod without following a final symlink (a symlink itself has no mode: EOPNOTSUPP).
pub fn chmod(root: RawFd, path: &OsStr, mode: u32) -> Result<()> {
    const OP: &str = "chmod";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    let fd = open_final_path(root, &p, OP)?;
    let st = rfs::fstat(&fd).map_err(|e| FsError::os(OP, &p, e))?;
    if FileType::from_raw_mode(mode_of(&st)) == FileType::Symlink {
        return Err(FsError::os(OP, &p, Errno::OPNOTSUPP));
    }
    check_fs_type(fd.as_fd(), OP, &p)?;
    // A bind-mounted host device node is the host's inode.
    check_kind(&st, OP, &p)?;
    // fchmod refuses O_PATH fds; the fd's /proc/self/fd magic link reaches the same inode.
    let proc_path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    rfs::chmod(proc_path.as_str(), Mode::from_raw_mode(mode & 0o7777))
        .map_err(|e| FsError::os(OP, &p, e))
}

/// Give the file or directory at `path` (a symlink itself, never its target) to `uid`:`gid`.
pub fn chown(root: RawFd, path: &OsStr, uid: u32, gid: u32) -> Result<()> {
    const OP: &str = "chown";
    let root = borrow(root)?;
    let p = Norm::new(path)?;
    let fd = open_final_path(root, &p, OP)?;
    let st = rfs::fstat(&fd).map_err(|e| FsError::os(OP, &p, e))?;
    check_fs_type(fd.as_fd(), OP, &p)?;
    if FileType::from_raw_mode(mode_of(&st)) != FileType::Symlink {
        check_kind(&st, OP, &p)?;
    }
    if uid == u32::MAX || gid == u32::MAX {
        return Err(FsError::os(OP, &p, Errno::INVAL));
    }
    // AT_EMPTY_PATH: the fd's own inode (for an O_PATH fd of a symlink, the link itself).
    rfs::chownat(
        &fd,
        c"",
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
        rfs::AtFlags::EMPTY_PATH | rfs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(|e| FsError::os(OP, &p, e))
}

const DEVPTS_SUPER_MAGIC: i64 = 0x1cd1;

/// A new pseudo-terminal pair from the sandbox's own devpts instance: (master, slave), both
/// close-on-exec. The master is opened at dev/pts/ptmx inside the root without following any
/// symlink and must be a character device on a devpts filesystem; the slave comes from
/// TIOCGPTPEER, never from a path the sandbox could swap.
pub fn pty_open(root: RawFd) -> Result<(OwnedFd, OwnedFd)> {
    const OP: &str = "pty_open";
    let root = borrow(root)?;
    let p = Norm::new(OsStr::new("/dev/pts/ptmx"))?;
    let resolve = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_SYMLINKS;
    let flags = OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC;
    let master = rfs::openat2(root, c"dev/pts/ptmx", flags, Mode::empty(), resolve)
        .map_err(|e| FsError::os(OP, &p, e))?;
    let st = rfs::fstat(&master).map_err(|e| FsError::os(OP, &p, e))?;
    let fst = rfs::fstatfs(&master).map_err(|e| FsError::os(OP, &p, e))?;
    if FileType::from_raw_mode(mode_of(&st)) != FileType::CharacterDevice
        || fst.f_type as i64 != DEVPTS_SUPER_MAGIC
    {
        return Err(FsError::custom(
            OP,
            &p,
            libc::EINVAL,
            "not the sandbox's devpts ptmx",
        ));
    }
    let unlock: libc::c_int = 0;
    // SAFETY: ioctl(TIOCSPTLCK, &int) on our master fd with a valid pointer.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) } < 0 {
        return Err(FsError::os(
            OP,
            &p,
            Errno::from_raw_os_error(crate::harden::errno()),
        ));
    }
    let peer_flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: ioctl(TIOCGPTPEER, flags) returns a new fd or -1.
    let slave = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, peer_flags) };
    if slave < 0 {
        return Err(FsError::os(
            OP,
            &p,
            Errno::from_raw_os_error(crate::harden::errno()),
        ));
    }
    // SAFETY: a fresh fd returned by the kernel, owned by nobody else.
    let slave = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(slave) };
    Ok((master, slave))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize() {
        let n = Norm::new(OsStr::new("/a/./b/../../../c//d/")).unwrap();
        assert_eq!(n.full().as_bytes(), b"c/d");
        assert_eq!(n.parent().as_bytes(), b"c");
        assert_eq!(n.base().unwrap().as_bytes(), b"d");
        let r = Norm::new(OsStr::new("/..")).unwrap();
        assert!(r.is_root());
        assert_eq!(r.full().as_bytes(), b".");
        assert!(Norm::new(OsStr::new("")).is_err());
    }

    #[test]
    fn cached_calls_refuse_symlinks_and_long_paths() {
        let top = std::env::temp_dir().join(format!("corral-fs-cached-{}", std::process::id()));
        let deep = (0..CACHED_MAX_COMPONENTS).fold(top.clone(), |p, _| p.join("d"));
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(top.join("f"), b"x").unwrap();
        std::fs::write(deep.join("f"), b"y").unwrap();
        std::os::unix::fs::symlink("f", top.join("l")).unwrap();
        std::os::unix::fs::symlink("d", top.join("dl")).unwrap();
        let root = rfs::open(&top, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        let fd = root.as_raw_fd();
        let stat = |p: &str| stat(fd, OsStr::new(p), true).map(|s| s.0);
        let read = |p: &str| read(fd, OsStr::new(p), 16, true);
        // just written: in memory, and a few components
        assert_eq!(read("/f").unwrap(), b"x");
        assert_eq!(stat("/f").unwrap(), "file");
        // a trailing symlink is stat'ed itself, never followed
        assert_eq!(stat("/l").unwrap(), "symlink");
        assert!(matches!(read("/l"), Err(FsError::NotCached)));
        assert!(matches!(stat("/dl/d"), Err(FsError::NotCached)));
        // 65 components: one too many for the loop, whole for a thread
        let long = format!("{}/f", "/d".repeat(CACHED_MAX_COMPONENTS));
        assert!(matches!(read(&long), Err(FsError::NotCached)));
        assert!(matches!(stat(&long), Err(FsError::NotCached)));
        assert_eq!(super::read(fd, OsStr::new(&long), 16, false).unwrap(), b"y");
        assert_eq!(super::stat(fd, OsStr::new(&long), false).unwrap().0, "file");
        std::fs::remove_dir_all(&top).unwrap();
    }

    #[test]
    fn is_dir_follows_symlinks_inside_the_root() {
        let top = std::env::temp_dir().join(format!("corral-fs-isdir-{}", std::process::id()));
        std::fs::create_dir_all(top.join("r/d")).unwrap();
        std::fs::write(top.join("r/f"), b"x").unwrap();
        std::fs::create_dir_all(top.join("outside")).unwrap();
        for (target, link) in [
            ("d", "ld"),
            ("ld", "ld2"),
            ("f", "lf"),
            ("nowhere", "dangling"),
            ("loop", "loop"),
            ("../../outside", "up"),
            ("/outside", "abs"),
        ] {
            std::os::unix::fs::symlink(target, top.join("r").join(link)).unwrap();
        }
        let root = rfs::open(
            top.join("r"),
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
        )
        .unwrap();
        let is = |p: &str| is_dir(root.as_raw_fd(), OsStr::new(p)).unwrap();
        assert!(is("/") && is("/d") && is("/ld") && is("/ld2") && is("/ld2/../d"));
        // `up` and `abs` name `/outside` inside the root (RESOLVE_IN_ROOT), which is not
        // there: never the directory beside the root
        assert!(!is("/up") && !is("/abs"));
        for p in ["/f", "/lf", "/dangling", "/loop", "/missing", "/d/missing"] {
            assert!(!is(p), "{p}");
        }
        std::fs::remove_dir_all(&top).unwrap();
    }
}
