//! Snapshot layers: copy a sandbox's overlay upper dirs to a new layer and hash them in one
//! pass (see corral/daemon/snapshots.py and docs/snapshots.md).
//!
//! The caller freezes the sandbox first, so the source does not change while we read it: the
//! content hash is then taken from the *source* while the copy is being made (no re-read of
//! the copy afterwards), and the manifest records exactly what was written to the copy. Big
//! files are copied in the kernel (copy_file_range) on this thread while a second thread
//! hashes them with pread, so the two run side by side on two cores; small files are read
//! once, hashed and written.
//!
//! The source is walked with *at syscalls from directory fds, never following a symlink
//! (O_NOFOLLOW, AT_SYMLINK_NOFOLLOW): even without a freezer (a best-effort copy of a live
//! tree), a directory swapped for a symlink by the sandbox cannot make the daemon copy a host
//! file into the layer.
//!
//! The walk is a loop over an explicit stack of directories, never a recursion, and it is
//! bounded: at most `Limits::max_depth` levels (two fds each), `max_entries` entries and
//! `max_bytes` of file content (apparent size; holes are kept as holes, found with
//! SEEK_DATA/SEEK_HOLE, so only data is written), and `MANIFEST_MAX` bytes of manifest (it
//! holds every entry's full path: deep trees of long names would otherwise make the daemon's
//! memory grow with what the sandbox holds), and no file whose xattr names the kernel cannot
//! list (more than 64 KiB of them: a copy without them would differ unseen). A tree past a
//! bound fails the capture with `LayerError::Limit`, never a crash.
//!
//! A stored layer must never hold anything that could run with privilege on the host: set-user
//! and set-group-ID bits are cleared on every non-directory and `security.capability` xattrs
//! (file capabilities) are not copied; the manifest records what was written.
//!
//! A capture reports and obeys a `Control` shared with its caller: the bytes of file data
//! copied so far (updated per copied chunk of at most `STEP` bytes), the bytes of disk it has
//! charged (that data, `ENTRY_COST` for each entry it makes and its xattrs: a one-byte file
//! takes a block, an empty directory too), a budget of them (its caller's disk claim: a write
//! that would pass it waits until the caller raises it or cancels), and a cancel flag checked before each entry and each chunk (copy and hash), so
//! a cancelled capture stops within one chunk and fails with `LayerError::Cancelled`; the
//! caller removes the partial copy.
//!
//! The digest is blake3 over a sorted manifest, byte for byte the one
//! `corral.daemon.snapshots.layer_digest` computes over the stored layer (the tests check
//! that): `MANIFEST_VERSION`, then per part `part N\n`, per entry, depth first, names sorted
//! bytewise,
//!   D<head><xattrs>\n | L<head><len>\0<target><xattrs>\n | O<head><xattrs>\n |
//!   F<head><size>\0<mtime_ns>\0<xattrs><blake3(content), 32 bytes>\n
//! and last the part's root, `R<head><xattrs>\n` (rel path empty), with
//! head = `<rel path>\0<st_mode octal>\0<uid>\0<gid>\0<rdev>\0` and xattrs =
//! `<count>\0` then `name\0<len>\0value` for each kept xattr, sorted by name. Every field a
//! sandbox chooses is either free of NUL and NUL-terminated (a path, an xattr name) or
//! length-prefixed (a symlink's target, an xattr's value): two different trees never share a
//! manifest, so a layer found by digest (a capture that reuses a stored layer) is the tree.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rustix::fs::{self as rfs, AtFlags, Dir, FileType, Mode, OFlags, Timespec, Timestamps};
use rustix::io::Errno;

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("{op} {path}: {msg}")]
    Os {
        op: &'static str,
        errno: i32,
        path: String,
        msg: String,
    },
    /// A bound of `Limits` was passed: `what` is "bytes", "entries" or "depth".
    #[error("the sandbox's files exceed the snapshot limit of {limit} {what}")]
    Limit { what: &'static str, limit: u64 },
    /// The caller set `Control::cancel`.
    #[error("the capture was cancelled")]
    Cancelled,
}

impl LayerError {
    pub fn errno(&self) -> i32 {
        match self {
            LayerError::Os { errno, .. } => *errno,
            LayerError::Limit { .. } => libc::EFBIG,
            LayerError::Cancelled => libc::ECANCELED,
        }
    }
}

/// Bounds of one capture (all parts together).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Apparent size of all regular files (what is hashed, holes included).
    pub max_bytes: u64,
    pub max_entries: u64,
    pub max_depth: usize,
}

/// Bytes of manifest (and of the paths of hard-linked files kept to link them again) one
/// capture may hold in memory.
pub const MANIFEST_MAX: usize = 128 << 20;

type Result<T> = std::result::Result<T, LayerError>;

/// What a running capture shares with its caller (another thread reads and sets it).
#[derive(Debug)]
pub struct Control {
    /// Bytes of file data copied so far.
    pub copied: AtomicU64,
    /// Bytes of disk the copy has taken: its file data, ENTRY_COST an entry, xattrs.
    charged: AtomicU64,
    /// Entries listed so far (each one the copy makes: its caller claims inodes for them),
    /// and a unit per KiB of xattrs copied.
    pub entries: AtomicU64,
    /// Set to stop the capture at its next entry or chunk.
    pub cancel: AtomicBool,
    /// Bytes of disk the copy may take in all (`allow`), counted as `charged`.
    budget: AtomicU64,
    /// What a copy blocked at its budget needs `charged` to reach (0: not blocked).
    wanted: AtomicU64,
    /// Wakes a blocked copy when the budget is raised or the capture cancelled.
    gate: Mutex<()>,
    raised: Condvar,
}

impl Default for Control {
    fn default() -> Self {
        Self {
            copied: AtomicU64::new(0),
            charged: AtomicU64::new(0),
            entries: AtomicU64::new(0),
            cancel: AtomicBool::new(false),
            budget: AtomicU64::new(u64::MAX),
            wanted: AtomicU64::new(0),
            gate: Mutex::new(()),
            raised: Condvar::new(),
        }
    }
}

/// How long a copy blocked at its budget sleeps between looks (a raise or a cancel wakes it
/// sooner).
const BLOCKED_LOOK: Duration = Duration::from_millis(50);

impl Control {
    fn check(&self) -> std::result::Result<(), Errno> {
        if self.cancel.load(Ordering::Relaxed) {
            return Err(Errno::CANCELED);
        }
        Ok(())
    }

    /// `n` bytes of file data written.
    fn add(&self, n: u64) {
        self.copied.fetch_add(n, Ordering::Relaxed);
        self.charged.fetch_add(n, Ordering::Relaxed);
    }

    /// Wait for room for `n` bytes of disk that are not file data (an entry, xattrs), then
    /// count them.
    fn take(&self, n: u64) -> std::result::Result<(), Errno> {
        self.room_for(n)?;
        self.charged.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }

    /// Bytes of disk taken so far (file data, entries, xattrs).
    pub fn charged(&self) -> u64 {
        self.charged.load(Ordering::Relaxed)
    }

    /// Set the bytes of disk the copy may take in all and wake it if it waits for them.
    pub fn allow(&self, total: u64) {
        self.budget.store(total, Ordering::SeqCst);
        let _held = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        self.raised.notify_all();
    }

    /// Stop the capture at its next entry or chunk, waking it if it waits for budget.
    pub fn stop(&self) {
        self.cancel.store(true, Ordering::SeqCst);
        let _held = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        self.raised.notify_all();
    }

    /// What a blocked copy needs `charged` to reach (0: it is not blocked).
    pub fn wanted(&self) -> u64 {
        self.wanted.load(Ordering::SeqCst)
    }

    /// Wait until `n` more bytes of disk fit the budget (or the capture is cancelled:
    /// ECANCELED). Only the copying thread charges, so what fits now still fits when it writes.
    fn room_for(&self, n: u64) -> std::result::Result<(), Errno> {
        let need = self.charged.load(Ordering::Relaxed).saturating_add(n);
        if need <= self.budget.load(Ordering::SeqCst) {
            return self.check();
        }
        let mut held = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        self.wanted.store(need, Ordering::SeqCst);
        let r = loop {
            if self.cancel.load(Ordering::SeqCst) {
                break Err(Errno::CANCELED);
            }
            if need <= self.budget.load(Ordering::SeqCst) {
                break Ok(());
            }
            held = match self.raised.wait_timeout(held, BLOCKED_LOOK) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        self.wanted.store(0, Ordering::SeqCst);
        r
    }
}

fn os_err(op: &'static str, path: &[u8], e: Errno) -> LayerError {
    LayerError::Os {
        op,
        errno: e.raw_os_error(),
        path: String::from_utf8_lossy(path).into_owned(),
        msg: std::io::Error::from_raw_os_error(e.raw_os_error()).to_string(),
    }
}

/// Files up to this size are read, hashed and written on the walking thread; bigger ones are
/// copied in the kernel while the hasher thread reads them.
const SMALL: u64 = 256 * 1024;
const CHUNK: usize = 256 * 1024;
/// The most one copy_file_range call copies: progress and a cancel are seen this often.
const STEP: usize = 16 << 20;
/// Disk charged for each entry a capture makes, whatever its data: a block (a one-byte file,
/// an empty directory and a long symlink each take one on the state dir's filesystem).
const ENTRY_COST: u64 = 4096;
/// overlayfs xattrs that describe a layer's content (the others describe one mount's upper).
const KEEP_OVL: [&[u8]; 5] = [
    b"trusted.overlay.opaque",
    b"trusted.overlay.redirect",
    b"trusted.overlay.metacopy",
    b"trusted.overlay.whiteout",
    b"trusted.overlay.whiteouts",
];

/// What every manifest starts with: a manifest of another encoding never hashes the same.
pub const MANIFEST_VERSION: &[u8] = b"corral layer manifest 2\n";

/// One upper dir to capture: manifest part `n`, copied from `src` to the new dir `dst`
/// (made here; nothing is made when `src` is empty or missing).
pub struct Part {
    pub n: u32,
    pub src: CString,
    pub dst: CString,
}

/// The digest (hex) of the captured parts and the bytes of file data copied.
pub fn capture(parts: &[Part], limits: Limits, ctl: &Arc<Control>) -> Result<(String, u64)> {
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let (res_tx, res_rx) = mpsc::channel::<(usize, std::result::Result<[u8; 32], Errno>)>();
    let mut w = Walker {
        manifest: Vec::with_capacity(4096),
        slots: Vec::new(),
        hashes: Vec::new(),
        links: HashMap::new(),
        link_bytes: 0,
        listed_bytes: 0,
        root: None,
        jobs: jobs_tx,
        bytes: 0,
        entries: 0,
        limits,
        ctl: ctl.clone(),
        buf: vec![0u8; CHUNK],
        xbuf: vec![0u8; 65536],
        vbuf: vec![0u8; 65536],
    };
    w.manifest.extend_from_slice(MANIFEST_VERSION);
    let hctl = ctl.clone();
    let walked = std::thread::scope(|s| {
        s.spawn(move || hasher(jobs_rx, res_tx, &hctl));
        let r = parts.iter().try_for_each(|p| w.part(p));
        drop(std::mem::replace(&mut w.jobs, mpsc::channel().0)); // ends the hasher's loop
        r
    });
    walked.map_err(|e| cancelled_or(e, ctl))?;
    for (idx, r) in res_rx.iter() {
        let r = r.map_err(|e| cancelled_or(os_err("read", b"(layer file)", e), ctl))?;
        w.hashes[idx] = Some(r);
    }
    let mut h = blake3::Hasher::new();
    let mut at = 0;
    for &(pos, idx) in &w.slots {
        h.update(&w.manifest[at..pos]);
        let digest = w.hashes[idx].ok_or_else(|| os_err("hash", b"(layer file)", Errno::IO))?;
        h.update(&digest);
        at = pos;
    }
    h.update(&w.manifest[at..]);
    Ok((h.finalize().to_hex().to_string(), w.bytes))
}

/// A failure after a cancel is the cancel (an aborted copy or hash fails with ECANCELED).
fn cancelled_or(e: LayerError, ctl: &Control) -> LayerError {
    if ctl.cancel.load(Ordering::Relaxed) {
        LayerError::Cancelled
    } else {
        e
    }
}

/// A big file for the hasher thread: the source fd (shared with the copy, which uses its own
/// offsets) and the index of its hash slot.
struct Job {
    idx: usize,
    size: u64,
    file: Arc<OwnedFd>,
}

fn hasher(
    jobs: mpsc::Receiver<Job>,
    out: mpsc::Sender<(usize, std::result::Result<[u8; 32], Errno>)>,
    ctl: &Control,
) {
    let mut buf = vec![0u8; CHUNK];
    for job in jobs {
        let r = hash_fd(job.file.as_fd(), job.size, &mut buf, ctl);
        if out.send((job.idx, r)).is_err() {
            return;
        }
    }
}

/// blake3 of `[0, size)` of `fd` (what the copy copies).
fn hash_fd(
    fd: BorrowedFd<'_>,
    size: u64,
    buf: &mut [u8],
    ctl: &Control,
) -> std::result::Result<[u8; 32], Errno> {
    static ZEROS: [u8; 65536] = [0u8; 65536];
    let mut h = blake3::Hasher::new();
    // Holes hash as the zeros they read as, without reading them.
    for_segments(fd, size, |start, end, data| {
        if !data {
            let mut left = end - start;
            while left > 0 {
                let n = left.min(ZEROS.len() as u64) as usize;
                h.update(&ZEROS[..n]);
                left -= n as u64;
            }
            return Ok(());
        }
        read_range(fd, buf, start, end, |chunk, _| {
            h.update(chunk);
            ctl.check()
        })
    })?;
    Ok(*h.finalize().as_bytes())
}

/// Split `[0, size)` of `fd` into data and hole segments (SEEK_DATA/SEEK_HOLE), in order;
/// `f(start, end, is_data)`. Where the filesystem cannot tell, all of it is data.
fn for_segments(
    fd: BorrowedFd<'_>,
    size: u64,
    mut f: impl FnMut(u64, u64, bool) -> std::result::Result<(), Errno>,
) -> std::result::Result<(), Errno> {
    let mut off = 0u64;
    while off < size {
        let start = match rfs::seek(fd, rfs::SeekFrom::Data(off)) {
            Ok(p) => p.min(size),
            Err(Errno::NXIO) => size, // only a hole from here on
            Err(_) => return f(off, size, true),
        };
        if start > off {
            f(off, start, false)?;
        }
        if start >= size {
            break;
        }
        let end = match rfs::seek(fd, rfs::SeekFrom::Hole(start)) {
            Ok(p) => p.min(size),
            Err(_) => size,
        };
        let end = end.max(start + 1).min(size);
        f(start, end, true)?;
        off = end;
    }
    Ok(())
}

/// pread `[start, end)` through `buf` (stops early at EOF).
fn read_range(
    fd: BorrowedFd<'_>,
    buf: &mut [u8],
    start: u64,
    end: u64,
    mut f: impl FnMut(&[u8], u64) -> std::result::Result<(), Errno>,
) -> std::result::Result<(), Errno> {
    let mut off = start;
    while off < end {
        let want = (end - off).min(buf.len() as u64) as usize;
        let n = match rustix::io::pread(fd, &mut buf[..want], off) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
        };
        f(&buf[..n], off)?;
        off += n as u64;
    }
    Ok(())
}

/// Set-user-ID and set-group-ID bits.
const SETID: u32 = 0o6000;

/// A directory being copied: its open source and copy, its manifest path, the names still to
/// copy (last = next) and its metadata, applied once its children are done (None: a root).
struct Frame {
    src: OwnedFd,
    dst: Arc<OwnedFd>,
    rel: Vec<u8>,
    names: Vec<CString>,
    st: Option<rfs::Stat>,
}

struct Walker {
    manifest: Vec<u8>,
    /// (position in the manifest, hash index): where each file's content hash goes.
    slots: Vec<(usize, usize)>,
    hashes: Vec<Option<[u8; 32]>>,
    /// Hard links: (dev, ino) of the source -> the first copy (its part's root fd and its path
    /// under it: directories only, made by us, so nothing in it is a symlink) and hash index.
    /// One fd per part, not per directory: a tree of many dirs with linked files costs no fds.
    links: HashMap<(u64, u64), (Arc<OwnedFd>, CString, usize)>,
    /// Bytes of the paths in `links` (counted with the manifest against MANIFEST_MAX).
    link_bytes: usize,
    /// Bytes of the names listed and not yet copied (held in the stack's frames, counted with
    /// the manifest against MANIFEST_MAX: each enters the manifest when it is copied, and a
    /// directory of a million 255-byte names held ~280 MB of them before any was).
    listed_bytes: usize,
    /// The dst root fd of the part being copied.
    root: Option<Arc<OwnedFd>>,
    jobs: mpsc::Sender<Job>,
    bytes: u64,
    entries: u64,
    limits: Limits,
    ctl: Arc<Control>,
    buf: Vec<u8>,
    xbuf: Vec<u8>,
    vbuf: Vec<u8>,
}

const NOFOLLOW: AtFlags = AtFlags::SYMLINK_NOFOLLOW;

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// /proc/self/fd/N/name: a path for the l*xattr calls on an entry that cannot be opened (a
/// symlink, a whiteout); the directory is the fd's, the last component is not followed.
fn fd_path(dir: BorrowedFd<'_>, name: &CStr) -> CString {
    use std::os::fd::AsRawFd;
    let mut p = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
    p.extend_from_slice(name.to_bytes());
    CString::new(p).expect("no NUL in a dir entry name")
}

impl Walker {
    fn part(&mut self, p: &Part) -> Result<()> {
        let src = match rfs::open(p.src.as_c_str(), dir_flags(), Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(()),
            Err(e) => return Err(os_err("open", p.src.to_bytes(), e)),
        };
        let mut names = self.list(src.as_fd(), p.src.to_bytes())?;
        if names.is_empty() {
            return Ok(());
        }
        names.reverse(); // popped from the end: smallest first
        self.manifest
            .extend_from_slice(format!("part {}\n", p.n).as_bytes());
        // The daemon may have made the part dir ahead (a spare layer dir, off the request
        // path); it is under the daemon's own new dir, so an existing one is ours and empty.
        match rfs::mkdir(p.dst.as_c_str(), Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(os_err("mkdir", p.dst.to_bytes(), e)),
        }
        let dst = rfs::open(p.dst.as_c_str(), dir_flags(), Mode::empty())
            .map_err(|e| os_err("open", p.dst.to_bytes(), e))?;
        let dst = Arc::new(dst);
        self.root = Some(dst.clone());
        // Depth first, names sorted, one frame per open directory: a loop, never a recursion.
        let mut stack = vec![Frame {
            src,
            dst,
            rel: Vec::new(),
            names,
            st: None,
        }];
        while let Some(top) = stack.last_mut() {
            let Some(name) = top.names.pop() else {
                let done = stack.pop().expect("not empty");
                if let Some(st) = done.st {
                    // Owner, mode and times after the children: the dir's mtime is the source's.
                    self.meta_fd(done.dst.as_fd(), &st, &done.rel)?;
                }
                continue;
            };
            self.listed_bytes = self.listed_bytes.saturating_sub(name_cost(&name));
            let mut r = Vec::with_capacity(top.rel.len() + 1 + name.as_bytes().len());
            r.extend_from_slice(&top.rel);
            r.push(b'/');
            r.extend_from_slice(name.as_bytes());
            let (src, dst) = (top.src.as_fd(), top.dst.clone());
            if let Some(frame) = self.entry(src, &dst, &name, r)? {
                if stack.len() >= self.limits.max_depth {
                    return Err(LayerError::Limit {
                        what: "depth",
                        limit: self.limits.max_depth as u64,
                    });
                }
                stack.push(frame);
            }
        }
        // The root's own metadata, last in the part's manifest.
        let src = rfs::open(p.src.as_c_str(), dir_flags(), Mode::empty())
            .map_err(|e| os_err("open", p.src.to_bytes(), e))?;
        let st = rfs::fstat(&src).map_err(|e| os_err("stat", p.src.to_bytes(), e))?;
        let dst = self.root.clone().expect("set above");
        let x = self.copy_xattrs_fd(src.as_fd(), dst.as_fd())?;
        self.meta_fd(dst.as_fd(), &st, p.dst.to_bytes())?;
        self.head(b'R', b"", &st);
        self.manifest.extend_from_slice(&x);
        self.manifest.push(b'\n');
        Ok(())
    }

    /// The entry names of an opened dir, counted against the entry limit.
    fn list(&mut self, dir: BorrowedFd<'_>, r: &[u8]) -> Result<Vec<CString>> {
        let left = self.limits.max_entries.saturating_sub(self.entries);
        let room =
            MANIFEST_MAX.saturating_sub(self.manifest.len() + self.link_bytes + self.listed_bytes);
        let (names, cost) = list(dir, r, left, room).map_err(|e| match e {
            LayerError::Limit {
                what: "entries", ..
            } => LayerError::Limit {
                what: "entries",
                limit: self.limits.max_entries,
            },
            e => e,
        })?;
        self.entries += names.len() as u64;
        self.ctl
            .entries
            .fetch_add(names.len() as u64, Ordering::Relaxed);
        self.listed_bytes += cost;
        Ok(names)
    }

    /// Copy one entry; a directory is made and returned as a frame whose children come next.
    fn entry(
        &mut self,
        src: BorrowedFd<'_>,
        dst: &Arc<OwnedFd>,
        name: &CStr,
        r: Vec<u8>,
    ) -> Result<Option<Frame>> {
        self.ctl
            .take(ENTRY_COST)
            .map_err(|_| LayerError::Cancelled)?;
        if self.manifest.len() + self.link_bytes + self.listed_bytes > MANIFEST_MAX {
            return Err(LayerError::Limit {
                what: "manifest bytes",
                limit: MANIFEST_MAX as u64,
            });
        }
        let mut st = rfs::statat(src, name, NOFOLLOW).map_err(|e| os_err("stat", &r, e))?;
        let ft = FileType::from_raw_mode(st.st_mode);
        if ft != FileType::Directory {
            st.st_mode &= !SETID; // nothing in a stored layer runs with privilege
        }
        match ft {
            FileType::Directory => {
                let sfd = rfs::openat(src, name, dir_flags(), Mode::empty())
                    .map_err(|e| os_err("open", &r, e))?;
                let st = rfs::fstat(&sfd).map_err(|e| os_err("stat", &r, e))?;
                rfs::mkdirat(dst, name, Mode::from_raw_mode(0o700))
                    .map_err(|e| os_err("mkdir", &r, e))?;
                let dfd = rfs::openat(dst, name, dir_flags(), Mode::empty())
                    .map_err(|e| os_err("open", &r, e))?;
                let dfd = Arc::new(dfd);
                // xattrs first (they go in the manifest before the children).
                let x = self.copy_xattrs_fd(sfd.as_fd(), dfd.as_fd())?;
                self.head(b'D', &r, &st);
                self.manifest.extend_from_slice(&x);
                self.manifest.push(b'\n');
                let mut names = self.list(sfd.as_fd(), &r)?;
                names.reverse(); // popped from the end: smallest first
                return Ok(Some(Frame {
                    src: sfd,
                    dst: dfd,
                    rel: r,
                    names,
                    st: Some(st),
                }));
            }
            FileType::RegularFile => self.file(src, dst, name, &r, &st)?,
            FileType::Symlink => {
                let target = rfs::readlinkat(src, name, Vec::new())
                    .map_err(|e| os_err("readlink", &r, e))?;
                rfs::symlinkat(target.as_c_str(), dst, name)
                    .map_err(|e| os_err("symlink", &r, e))?;
                let x = self.copy_xattrs_path(src, dst.as_fd(), name)?;
                self.meta_at(dst.as_fd(), name, &st, false, &r)?;
                self.head(b'L', &r, &st);
                let target = target.as_bytes();
                self.manifest
                    .extend_from_slice(format!("{}\0", target.len()).as_bytes());
                self.manifest.extend_from_slice(target);
                self.manifest.extend_from_slice(&x);
                self.manifest.push(b'\n');
            }
            FileType::CharacterDevice
            | FileType::BlockDevice
            | FileType::Fifo
            | FileType::Socket => {
                // Whiteouts are char 0/0; a sandbox cannot make other devices (no CAP_MKNOD).
                let dev = matches!(ft, FileType::CharacterDevice | FileType::BlockDevice);
                if dev && st.st_rdev != 0 {
                    return Ok(None);
                }
                rfs::mknodat(
                    dst,
                    name,
                    ft,
                    Mode::from_raw_mode(st.st_mode & 0o7777),
                    st.st_rdev,
                )
                .map_err(|e| os_err("mknod", &r, e))?;
                let x = self.copy_xattrs_path(src, dst.as_fd(), name)?;
                self.meta_at(dst.as_fd(), name, &st, true, &r)?;
                self.head(b'O', &r, &st);
                self.manifest.extend_from_slice(&x);
                self.manifest.push(b'\n');
            }
            FileType::Unknown => {}
        }
        Ok(None)
    }

    fn file(
        &mut self,
        src: BorrowedFd<'_>,
        dst: &Arc<OwnedFd>,
        name: &CStr,
        r: &[u8],
        st0: &rfs::Stat,
    ) -> Result<()> {
        let key = (st0.st_dev, st0.st_ino);
        if st0.st_nlink > 1 {
            if let Some((lroot, lpath, idx)) = self.links.get(&key).cloned() {
                // A link that cannot be made (too many links to one inode, ...) is a copy of
                // its own: the same content and metadata, so the same manifest line.
                if link_again(lroot.as_fd(), &lpath, dst.as_fd(), name).is_ok() {
                    // Same inode as the first copy: same metadata, same content hash.
                    let x = self.read_xattrs_at(dst.as_fd(), name);
                    let mut st = *st0;
                    if !mtime_safe(&st) {
                        let got =
                            rfs::statat(dst, name, NOFOLLOW).map_err(|e| os_err("stat", r, e))?;
                        (st.st_mtime, st.st_mtime_nsec) = (got.st_mtime, got.st_mtime_nsec);
                    }
                    self.file_line(r, &st, &x, idx);
                    return Ok(());
                }
            }
        }
        // NONBLOCK: a FIFO swapped in (no freezer) must not block the open; the fstat below
        // checks what was opened.
        let sfd = rfs::openat(
            src,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
        )
        .map_err(|e| os_err("open", r, e))?;
        let mut st = rfs::fstat(&sfd).map_err(|e| os_err("stat", r, e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Ok(()); // changed under us (no freezer): skip it
        }
        st.st_mode &= !SETID;
        let size = st.st_size.max(0) as u64;
        if self.bytes.saturating_add(size) > self.limits.max_bytes {
            return Err(LayerError::Limit {
                what: "bytes",
                limit: self.limits.max_bytes,
            });
        }
        let dfd = rfs::openat(
            dst,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
            Mode::from_raw_mode(st.st_mode & 0o777),
        )
        .map_err(|e| os_err("create", r, e))?;
        let idx = self.hashes.len();
        self.hashes.push(None);
        let sfd = Arc::new(sfd);
        if size <= SMALL {
            self.hashes[idx] = Some(self.copy_small(sfd.as_fd(), dfd.as_fd(), size, r)?);
        } else {
            // The hasher reads while the kernel copies: two cores, one pass each.
            let _ = self.jobs.send(Job {
                idx,
                size,
                file: sfd.clone(),
            });
            copy_big(sfd.as_fd(), dfd.as_fd(), size, &mut self.buf, &self.ctl)
                .map_err(|e| os_err("copy", r, e))?;
        }
        self.bytes += size;
        let x = self.copy_xattrs_fd(sfd.as_fd(), dfd.as_fd())?;
        self.meta_fd(dfd.as_fd(), &st, r)?;
        if !mtime_safe(&st) {
            // The copy's filesystem may hold a narrower range of times (ext4: 1901 to 2446, or
            // 2038) and clamps without an error: the manifest records the copy's, else the
            // stored layer would not hash to its digest (an export refused on arrival).
            let got = rfs::fstat(&dfd).map_err(|e| os_err("stat", r, e))?;
            (st.st_mtime, st.st_mtime_nsec) = (got.st_mtime, got.st_mtime_nsec);
        }
        self.file_line(r, &st, &x, idx);
        if st.st_nlink > 1 && !self.links.contains_key(&key) {
            if let (Some(root), Ok(rel)) = (&self.root, CString::new(&r[1..])) {
                self.link_bytes += rel.as_bytes().len() + 64;
                self.links.insert(key, (root.clone(), rel, idx));
            }
        }
        Ok(())
    }

    fn file_line(&mut self, r: &[u8], st: &rfs::Stat, x: &[u8], idx: usize) {
        self.head(b'F', r, st);
        let mtime_ns = st.st_mtime as i128 * 1_000_000_000 + st.st_mtime_nsec as i128;
        self.manifest
            .extend_from_slice(format!("{}\0{}\0", st.st_size, mtime_ns).as_bytes());
        self.manifest.extend_from_slice(x);
        self.slots.push((self.manifest.len(), idx));
        self.manifest.push(b'\n');
    }

    /// Read the whole (small) file once: hash it and write it.
    fn copy_small(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        size: u64,
        r: &[u8],
    ) -> Result<[u8; 32]> {
        let mut h = blake3::Hasher::new();
        let mut off = 0u64;
        loop {
            let want = (size - off.min(size)) as usize;
            if want == 0 {
                return Ok(*h.finalize().as_bytes());
            }
            let want = want.min(self.buf.len());
            let n = match rustix::io::pread(src, &mut self.buf[..want], off) {
                Ok(n) => n,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(os_err("read", r, e)),
            };
            if n == 0 {
                return Ok(*h.finalize().as_bytes());
            }
            h.update(&self.buf[..n]);
            self.ctl
                .room_for(n as u64)
                .map_err(|_| LayerError::Cancelled)?;
            write_all(dst, &self.buf[..n], off).map_err(|e| os_err("write", r, e))?;
            self.ctl.add(n as u64);
            off += n as u64;
        }
    }

    fn head(&mut self, kind: u8, r: &[u8], st: &rfs::Stat) {
        self.manifest.push(kind);
        self.manifest.extend_from_slice(r);
        self.manifest.extend_from_slice(
            format!(
                "\0{:o}\0{}\0{}\0{}\0",
                st.st_mode, st.st_uid, st.st_gid, st.st_rdev
            )
            .as_bytes(),
        );
    }

    /// Owner, mode, times of an opened copy (the order matters: chown clears set-id bits).
    fn meta_fd(&self, fd: BorrowedFd<'_>, st: &rfs::Stat, r: &[u8]) -> Result<()> {
        rfs::fchown(
            fd,
            Some(rfs::Uid::from_raw(st.st_uid)),
            Some(rfs::Gid::from_raw(st.st_gid)),
        )
        .map_err(|e| os_err("chown", r, e))?;
        rfs::fchmod(fd, Mode::from_raw_mode(st.st_mode & 0o7777))
            .map_err(|e| os_err("chmod", r, e))?;
        rfs::futimens(fd, &times(st)).map_err(|e| os_err("utimes", r, e))
    }

    /// The same for an entry that is not opened (symlink, whiteout, FIFO).
    fn meta_at(
        &self,
        dir: BorrowedFd<'_>,
        name: &CStr,
        st: &rfs::Stat,
        chmod: bool,
        r: &[u8],
    ) -> Result<()> {
        rfs::chownat(
            dir,
            name,
            Some(rfs::Uid::from_raw(st.st_uid)),
            Some(rfs::Gid::from_raw(st.st_gid)),
            NOFOLLOW,
        )
        .map_err(|e| os_err("chown", r, e))?;
        if chmod {
            rfs::chmodat(
                dir,
                name,
                Mode::from_raw_mode(st.st_mode & 0o7777),
                AtFlags::empty(),
            )
            .map_err(|e| os_err("chmod", r, e))?;
        }
        rfs::utimensat(dir, name, &times(st), NOFOLLOW).map_err(|e| os_err("utimes", r, e))
    }

    /// The disk an xattr takes, charged before it is set: its name and value, and a block
    /// for an entry's first (ext4 and xfs keep xattrs that do not fit in the inode in a
    /// block of their own, one per inode when their values differ). A unit of `entries` per
    /// KiB of it too: tmpfs counts xattrs against its inodes.
    fn take_xattr(&self, name: &CStr, len: usize, first: bool) -> Result<()> {
        let bytes = (name.to_bytes().len() + len) as u64;
        self.ctl
            .entries
            .fetch_add(bytes.div_ceil(1024), Ordering::Relaxed);
        let n = bytes + if first { ENTRY_COST } else { 0 };
        self.ctl.take(n).map_err(|_| LayerError::Cancelled)
    }

    /// Copy the kept xattrs of an opened source to an opened copy; returns the manifest bytes
    /// of those that were set.
    fn copy_xattrs_fd(&mut self, src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> Result<Vec<u8>> {
        let names = match rfs::flistxattr(src, &mut self.xbuf[..]) {
            Ok(n) => split_names(&self.xbuf[..n]),
            Err(e) => return unlisted(e),
        };
        let mut out = Xattrs::default();
        for n in names {
            let Ok(len) = rfs::fgetxattr(src, n.as_c_str(), &mut self.vbuf[..]) else {
                continue;
            };
            self.take_xattr(&n, len, out.count == 0)?;
            let v = &self.vbuf[..len];
            let set = rfs::fsetxattr(dst, n.as_c_str(), v, rfs::XattrFlags::empty());
            if kept(set, dst, len)? {
                out.push(&n, v);
            }
        }
        Ok(out.section())
    }

    /// The same for entries that cannot be opened: through /proc/self/fd/N/name, not following.
    fn copy_xattrs_path(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        name: &CStr,
    ) -> Result<Vec<u8>> {
        let sp = fd_path(src, name);
        let names = match rfs::llistxattr(sp.as_c_str(), &mut self.xbuf[..]) {
            Ok(n) => split_names(&self.xbuf[..n]),
            Err(e) => return unlisted(e),
        };
        let mut out = Xattrs::default();
        if names.is_empty() {
            return Ok(out.section());
        }
        let dp = fd_path(dst, name);
        for n in names {
            let Ok(len) = rfs::lgetxattr(sp.as_c_str(), n.as_c_str(), &mut self.vbuf[..]) else {
                continue;
            };
            self.take_xattr(&n, len, out.count == 0)?;
            let v = &self.vbuf[..len];
            let set = rfs::lsetxattr(dp.as_c_str(), n.as_c_str(), v, rfs::XattrFlags::empty());
            if kept(set, dst, len)? {
                out.push(&n, v);
            }
        }
        Ok(out.section())
    }

    /// The kept xattrs of a copy already made (a second hard link to it).
    fn read_xattrs_at(&mut self, dir: BorrowedFd<'_>, name: &CStr) -> Vec<u8> {
        let p = fd_path(dir, name);
        let mut out = Xattrs::default();
        let names = match rfs::llistxattr(p.as_c_str(), &mut self.xbuf[..]) {
            Ok(n) => split_names(&self.xbuf[..n]),
            Err(_) => return out.section(),
        };
        for n in names {
            if let Ok(len) = rfs::lgetxattr(p.as_c_str(), n.as_c_str(), &mut self.vbuf[..]) {
                out.push(&n, &self.vbuf[..len]);
            }
        }
        out.section()
    }
}

/// An xattr list that could not be read: none there to copy (no support), or more names than
/// the kernel lists (E2BIG past 64 KiB: a copy without them would differ unseen).
fn unlisted(e: Errno) -> Result<Vec<u8>> {
    match e {
        Errno::TOOBIG | Errno::RANGE => Err(LayerError::Limit {
            what: "bytes of xattr names on one file",
            limit: 65536,
        }),
        _ => Ok(Xattrs::default().section()),
    }
}

/// Link `dst/name` to the first copy at `rel` under `root` (a path of directories this
/// capture made). Past PATH_MAX the kernel refuses the path whole: then its directories are
/// opened one name at a time.
fn link_again(
    root: BorrowedFd<'_>,
    rel: &CStr,
    dst: BorrowedFd<'_>,
    name: &CStr,
) -> std::result::Result<(), Errno> {
    match rfs::linkat(root, rel, dst, name, AtFlags::empty()) {
        Err(Errno::NAMETOOLONG) => {}
        other => return other,
    }
    let bytes = rel.to_bytes();
    let (dirs, base) = match bytes.iter().rposition(|&b| b == b'/') {
        Some(i) => (&bytes[..i], &bytes[i + 1..]),
        None => (&b""[..], bytes),
    };
    let mut cur: Option<OwnedFd> = None;
    for comp in dirs.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
        let c = CString::new(comp).map_err(|_| Errno::INVAL)?;
        let at = cur.as_ref().map_or(root, |f| f.as_fd());
        cur = Some(rfs::openat(at, c.as_c_str(), dir_flags(), Mode::empty())?);
    }
    let base = CString::new(base).map_err(|_| Errno::INVAL)?;
    let at = cur.as_ref().map_or(root, |f| f.as_fd());
    rfs::linkat(at, base.as_c_str(), dst, name, AtFlags::empty())
}

/// An mtime every filesystem a layer is stored on holds as it is (1970 to 2038).
fn mtime_safe(st: &rfs::Stat) -> bool {
    (0..i64::from(i32::MAX)).contains(&st.st_mtime)
}

fn times(st: &rfs::Stat) -> Timestamps {
    Timestamps {
        last_access: Timespec {
            tv_sec: st.st_atime as _,
            tv_nsec: st.st_atime_nsec as _,
        },
        last_modification: Timespec {
            tv_sec: st.st_mtime as _,
            tv_nsec: st.st_mtime_nsec as _,
        },
    }
}

/// The NUL-separated xattr name list, kept names only, sorted.
fn split_names(list: &[u8]) -> Vec<CString> {
    let mut out: Vec<CString> = list
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .filter(|n| !n.starts_with(b"trusted.overlay.") || KEEP_OVL.contains(n))
        .filter(|n| *n != b"security.capability")
        .filter_map(|n| CString::new(n).ok())
        .collect();
    out.sort();
    out
}

/// An entry's kept xattrs in manifest form (module docs): counted, each value
/// length-prefixed.
#[derive(Default)]
struct Xattrs {
    count: usize,
    body: Vec<u8>,
}

impl Xattrs {
    fn push(&mut self, name: &CStr, value: &[u8]) {
        self.count += 1;
        self.body.extend_from_slice(name.to_bytes());
        self.body
            .extend_from_slice(format!("\0{}\0", value.len()).as_bytes());
        self.body.extend_from_slice(value);
    }

    fn section(self) -> Vec<u8> {
        let mut out = format!("{}\0", self.count).into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

/// Whether an xattr was set on the copy (`on`: a fd on the copy's filesystem; `len`: the
/// value's bytes). One the copy's filesystem cannot hold fails the capture, since a layer
/// silently without it would hash as complete: for want of room the daemon's disk's; too big
/// for it the sandbox's files (ext4 and btrfs answer ENOSPC for that too: with room left it
/// is the size); one of a namespace or kind it does not take is left out, as the manifest
/// then records.
fn kept(r: std::result::Result<(), Errno>, on: BorrowedFd<'_>, len: usize) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(e @ (Errno::NOSPC | Errno::DQUOT)) => {
            let room = rfs::fstatvfs(on).map_or(0, |v| v.f_bavail.saturating_mul(v.f_frsize));
            if room > XATTR_ROOM {
                return Err(LayerError::Limit {
                    what: "bytes in one xattr (the daemon's disk refuses one this big)",
                    limit: len as u64,
                });
            }
            Err(os_err("setxattr", b"(an xattr of the layer)", e))
        }
        Err(e @ (Errno::TOOBIG | Errno::RANGE)) => {
            Err(os_err("setxattr", b"(an xattr of the layer)", e))
        }
        Err(_) => Ok(false),
    }
}

/// Room on the copy's filesystem above which an ENOSPC setting an xattr is its size's.
const XATTR_ROOM: u64 = 16 << 20;

/// What a listed name costs the daemon's memory until it is copied: its bytes, its NUL and
/// about what its allocation and its place in the list take.
fn name_cost(n: &CStr) -> usize {
    n.to_bytes().len() + 1 + 32
}

/// The entry names of an opened dir (without . and ..), sorted bytewise, and their cost
/// (`name_cost`): at most `max` names, of at most `room` bytes.
fn list(dir: BorrowedFd<'_>, r: &[u8], max: u64, room: usize) -> Result<(Vec<CString>, usize)> {
    let mut d = Dir::read_from(dir).map_err(|e| os_err("opendir", r, e))?;
    let mut names = Vec::new();
    let mut cost = 0usize;
    while let Some(ent) = d.read() {
        let ent = ent.map_err(|e| os_err("readdir", r, e))?;
        let n = ent.file_name();
        if n == c"." || n == c".." {
            continue;
        }
        if names.len() as u64 >= max {
            return Err(LayerError::Limit {
                what: "entries",
                limit: max,
            });
        }
        cost += name_cost(n);
        if cost > room {
            return Err(LayerError::Limit {
                what: "manifest bytes",
                limit: MANIFEST_MAX as u64,
            });
        }
        names.push(n.to_owned());
    }
    names.sort();
    Ok((names, cost))
}

/// Copy `[0, size)`: data segments in the kernel (copy_file_range; a plain read/write where
/// that is refused), holes left as holes (the copy is truncated to `size`).
fn copy_big(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    size: u64,
    buf: &mut [u8],
    ctl: &Control,
) -> std::result::Result<(), Errno> {
    let mut in_kernel = true;
    for_segments(src, size, |start, end, data| {
        if !data {
            return Ok(());
        }
        let (mut off_in, mut off_out) = (start, start);
        while in_kernel && off_in < end {
            let len = (end - off_in).min(STEP as u64) as usize;
            ctl.room_for(len as u64)?;
            match rfs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), len) {
                Ok(0) => return Ok(()), // EOF: the file shrank
                Ok(n) => ctl.add(n as u64),
                Err(Errno::INTR) => {}
                Err(Errno::XDEV | Errno::OPNOTSUPP | Errno::NOSYS | Errno::INVAL) => {
                    in_kernel = false
                }
                Err(e) => return Err(e),
            }
        }
        read_range(src, buf, off_in, end, |chunk, off| {
            ctl.room_for(chunk.len() as u64)?;
            write_all(dst, chunk, off)?;
            ctl.add(chunk.len() as u64);
            Ok(())
        })
    })?;
    rfs::ftruncate(dst, size)
}

fn write_all(fd: BorrowedFd<'_>, mut data: &[u8], mut off: u64) -> std::result::Result<(), Errno> {
    while !data.is_empty() {
        match rustix::io::pwrite(fd, data, off) {
            Ok(0) => return Err(Errno::IO),
            Ok(n) => {
                data = &data[n..];
                off += n as u64;
            }
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread asking room for `n` more bytes, returned once it waits for them.
    fn waiting(
        ctl: &Arc<Control>,
        n: u64,
    ) -> std::thread::JoinHandle<std::result::Result<(), Errno>> {
        let waiter = {
            let ctl = ctl.clone();
            std::thread::spawn(move || ctl.room_for(n))
        };
        while ctl.wanted() == 0 {
            std::thread::yield_now();
        }
        waiter
    }

    #[test]
    fn a_copy_past_its_budget_waits_for_a_raise() {
        let ctl = Arc::new(Control::default());
        ctl.allow(10);
        assert!(ctl.room_for(10).is_ok());
        ctl.add(10);
        let waiter = waiting(&ctl, 5);
        assert_eq!(ctl.wanted(), 15);
        ctl.allow(15);
        assert!(waiter.join().unwrap().is_ok());
        assert_eq!(ctl.wanted(), 0);
    }

    #[test]
    fn a_cancel_ends_the_wait() {
        let ctl = Arc::new(Control::default());
        ctl.allow(0);
        let waiter = waiting(&ctl, 1);
        ctl.stop();
        assert_eq!(waiter.join().unwrap(), Err(Errno::CANCELED));
    }

    #[test]
    fn an_xattr_the_copy_cannot_hold_fails_the_capture() {
        let dir = rfs::open(".", OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap();
        for e in [Errno::NOSPC, Errno::DQUOT, Errno::TOOBIG, Errno::RANGE] {
            assert!(kept(Err(e), dir.as_fd(), 8000).is_err(), "{e:?}");
        }
        // ENOSPC with room left (the build's disk here) is the xattr's size: a limit.
        assert!(matches!(
            kept(Err(Errno::NOSPC), dir.as_fd(), 8000),
            Err(LayerError::Limit { limit: 8000, .. })
        ));
        assert!(!kept(Err(Errno::OPNOTSUPP), dir.as_fd(), 1).unwrap()); // a namespace it lacks
        assert!(kept(Ok(()), dir.as_fd(), 1).unwrap());
    }

    #[test]
    fn entries_and_xattrs_are_charged_apart_from_data() {
        let ctl = Control::default();
        ctl.add(100);
        ctl.take(ENTRY_COST).unwrap();
        assert_eq!(ctl.copied.load(Ordering::Relaxed), 100);
        assert_eq!(ctl.charged(), 100 + ENTRY_COST);
    }
}
