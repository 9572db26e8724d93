//! rm -rf of trees a sandbox controls (its upper dir, a stored layer, a path in its root), at
//! any depth, with bounded memory and file descriptors.
//!
//! The walk is a loop over an explicit stack of directory fds, never a recursion: a tree
//! 100,000 levels deep costs no more stack than a flat one. At most `WINDOW` directories are
//! open at once; a subdirectory met at that depth is renamed up into the tree's own top
//! directory (same filesystem, so the rename cannot fail for lack of room) and removed from
//! there later. Each directory is read `BATCH` names at a time. Every step is an *at syscall
//! relative to an fd opened with O_NOFOLLOW, so a symlink is unlinked, never followed, and a
//! directory on another filesystem (a mount point) is refused with EXDEV, never descended.
//!
//! The removal of a tree a live sandbox can write to ends whatever the sandbox does meanwhile
//! (a daemon thread that never ends holds the sandbox's destroy and a worker of the daemon).
//! A directory is read in passes, each one stream from its start to its end (the kernel ends
//! a stream at the last entry there was when it was opened), `BATCH` names at a time. After a
//! first pass a new one is made only to find what was created meanwhile: a directory found
//! refilled more than `REFILLS` times fails the removal with ENOTEMPTY. A removal that
//! handles more than its `max_entries` names (one racing ahead of the walk, ever deeper)
//! fails with EFBIG.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{self as rfs, AtFlags, Dir, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Directory fds held open at once.
const WINDOW: usize = 32;
/// Names read from one directory before acting on them.
const BATCH: usize = 512;
/// Passes over a directory after its first, and names they may find in it, before the
/// removal gives up (ENOTEMPTY): a process that writes a last file or two while the directory
/// is removed is fine, one that keeps filling it is not waited for.
const REFILLS: u32 = 8;
const REFILL_NAMES: u64 = 1024;

fn open_dir(parent: BorrowedFd<'_>, name: &CStr) -> rustix::io::Result<OwnedFd> {
    rfs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn ignore_noent(r: rustix::io::Result<()>) -> rustix::io::Result<()> {
    match r {
        Err(Errno::NOENT) => Ok(()),
        r => r,
    }
}

struct Frame {
    fd: OwnedFd,
    name: CString,
    /// Subdirectories of this one still to remove.
    pending: Vec<CString>,
    /// The pass being read (None: the next read starts one).
    pass: Option<Dir>,
    /// A pass has been read to its end: what a new one finds was made since.
    drained: bool,
    /// New passes made after the first, and the names they found (not moved up into it).
    refills: u32,
    refill_names: u64,
    /// Subdirectories moved up into it (the top dir) and not read back yet.
    moved_in: u64,
}

impl Frame {
    fn new(fd: OwnedFd, name: CString) -> Self {
        Frame {
            fd,
            name,
            pending: Vec::new(),
            pass: None,
            drained: false,
            refills: 0,
            refill_names: 0,
            moved_in: 0,
        }
    }

    /// The next batch of its current pass (a new pass if none is being read): unlinks the
    /// non-directories, keeps the subdirectories as pending. Returns how many names it held
    /// and whether the directory is empty (a new pass that found nothing). Names found by a
    /// pass after a drained one were made since (bar those moved up into it): too many such
    /// passes or names fail with ENOTEMPTY.
    fn read(&mut self) -> rustix::io::Result<(usize, bool)> {
        let fresh = self.pass.is_none();
        let pass = match &mut self.pass {
            Some(d) => d,
            None => self.pass.insert(Dir::read_from(&self.fd)?),
        };
        let (subdirs, seen, ended) = read_batch(self.fd.as_fd(), pass)?;
        if ended {
            self.pass = None;
        }
        let n = seen as u64;
        if self.drained && n > self.moved_in {
            self.refills += u32::from(fresh);
            self.refill_names += n - self.moved_in;
            if self.refills > REFILLS || self.refill_names > REFILL_NAMES {
                return Err(Errno::NOTEMPTY);
            }
        }
        self.moved_in = self.moved_in.saturating_sub(n);
        self.drained |= ended;
        self.pending = subdirs;
        Ok((seen, fresh && ended && seen == 0))
    }
}

/// Unlink the non-directories among the next `BATCH` entries of the pass `d` over `dir`;
/// returns the subdirectories among them, how many entries the batch held and whether the
/// pass reached its end.
fn read_batch(dir: BorrowedFd<'_>, d: &mut Dir) -> rustix::io::Result<(Vec<CString>, usize, bool)> {
    let mut subdirs = Vec::new();
    let mut seen = 0;
    while seen < BATCH {
        let Some(ent) = d.read() else {
            return Ok((subdirs, seen, true));
        };
        let ent = ent?;
        let n = ent.file_name();
        if n == c"." || n == c".." {
            continue;
        }
        seen += 1;
        let is_dir = match ent.file_type() {
            FileType::Directory => true,
            FileType::Unknown => matches!(
                rfs::statat(dir, n, AtFlags::SYMLINK_NOFOLLOW)
                    .map(|s| FileType::from_raw_mode(s.st_mode)),
                Ok(FileType::Directory)
            ),
            _ => false,
        };
        if is_dir {
            subdirs.push(n.to_owned());
            continue;
        }
        match rfs::unlinkat(dir, n, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(Errno::ISDIR) => subdirs.push(n.to_owned()),
            Err(e) => return Err(e),
        }
    }
    Ok((subdirs, seen, false))
}

/// Remove `name` in `parent` and everything under it (see the module doc). A missing `name`
/// is not an error; a non-directory is unlinked.
pub fn remove_at(parent: BorrowedFd<'_>, name: &CStr) -> rustix::io::Result<()> {
    remove_at_bounded(parent, name, u64::MAX)
}

/// `remove_at` that fails with EFBIG once it has handled more than `max_entries` names (a
/// tree a live sandbox may keep growing while it is removed).
pub fn remove_at_bounded(
    parent: BorrowedFd<'_>,
    name: &CStr,
    max_entries: u64,
) -> rustix::io::Result<()> {
    let top = match open_dir(parent, name) {
        Ok(fd) => fd,
        Err(Errno::NOTDIR) | Err(Errno::LOOP) => {
            return ignore_noent(rfs::unlinkat(parent, name, AtFlags::empty()))
        }
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    let dev = rfs::fstat(&top)?.st_dev;
    let mut stack = vec![Frame::new(top, name.to_owned())];
    let mut moved = 0u64;
    let mut handled = 0u64;
    while let Some(depth) = std::num::NonZeroUsize::new(stack.len()) {
        let i = depth.get() - 1;
        if let Some(sub) = stack[i].pending.pop() {
            if depth.get() >= WINDOW {
                // Too deep to open one more: move it up to the top dir, removed from there.
                loop {
                    let new = CString::new(format!(".corral-rm-{moved}")).expect("no NUL");
                    moved += 1;
                    match rfs::renameat_with(
                        &stack[i].fd,
                        &sub,
                        &stack[0].fd,
                        &new,
                        rfs::RenameFlags::NOREPLACE,
                    ) {
                        Err(Errno::EXIST) => continue,
                        r => break ignore_noent(r)?,
                    }
                }
                stack[0].moved_in += 1;
                continue;
            }
            match open_dir(stack[i].fd.as_fd(), &sub) {
                Ok(fd) => {
                    if rfs::fstat(&fd)?.st_dev != dev {
                        return Err(Errno::XDEV); // a mount point: never cross it
                    }
                    stack.push(Frame::new(fd, sub));
                }
                Err(Errno::NOTDIR) | Err(Errno::LOOP) => {
                    ignore_noent(rfs::unlinkat(&stack[i].fd, &sub, AtFlags::empty()))?
                }
                Err(Errno::NOENT) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        let (seen, empty) = stack[i].read()?;
        handled += seen as u64;
        if handled > max_entries {
            return Err(Errno::FBIG);
        }
        if !empty {
            continue;
        }
        // Empty now: remove it from its parent.
        let Frame { name: done, .. } = stack.pop().expect("not empty");
        let parent_fd = stack.last().map_or(parent, |f| f.fd.as_fd());
        ignore_noent(rfs::unlinkat(parent_fd, &done, AtFlags::REMOVEDIR))?;
    }
    Ok(())
}

/// Remove the tree at a host path (the last component is never followed).
pub fn remove_path(path: &CStr) -> rustix::io::Result<()> {
    let bytes = path.to_bytes();
    let (dir, base) = match bytes.iter().rposition(|&b| b == b'/') {
        Some(0) => (&b"/"[..], &bytes[1..]),
        Some(i) => (&bytes[..i], &bytes[i + 1..]),
        None => (&b"."[..], bytes),
    };
    if base.is_empty() || base == b"." || base == b".." {
        return Err(Errno::INVAL);
    }
    let dir = CString::new(dir).map_err(|_| Errno::INVAL)?;
    let base = CString::new(base).map_err(|_| Errno::INVAL)?;
    let pfd = rfs::open(
        dir.as_c_str(),
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    remove_at(pfd.as_fd(), &base)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The temp directory opened, and the name of `dir` (one of its entries) in it.
    fn parent_and_name(dir: &std::path::Path) -> (OwnedFd, CString) {
        let parent = rfs::open(
            std::env::temp_dir().as_path(),
            OFlags::DIRECTORY,
            Mode::empty(),
        )
        .unwrap();
        let name = CString::new(dir.file_name().unwrap().as_encoded_bytes()).unwrap();
        (parent, name)
    }

    #[test]
    fn removes_a_deep_tree_with_few_fds() {
        let tmp = std::env::temp_dir().join(format!("corral-tree-{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        let top = CString::new(tmp.as_os_str().as_encoded_bytes()).unwrap();
        let mut cur = rfs::open(top.as_c_str(), OFlags::DIRECTORY, Mode::empty()).unwrap();
        for i in 0..3000 {
            rfs::mkdirat(&cur, c"d", Mode::from_raw_mode(0o700)).unwrap();
            if i % 7 == 0 {
                let f = rfs::openat(&cur, c"f", OFlags::CREATE | OFlags::WRONLY, Mode::RUSR);
                drop(f.unwrap());
                rfs::symlinkat(c"/etc", &cur, c"l").unwrap();
            }
            cur = rfs::openat(&cur, c"d", OFlags::DIRECTORY, Mode::empty()).unwrap();
        }
        drop(cur);
        remove_path(top.as_c_str()).unwrap();
        assert!(!tmp.exists());
        assert!(std::path::Path::new("/etc").exists());
    }

    #[test]
    fn a_removal_past_its_names_fails_with_efbig() {
        let tmp = std::env::temp_dir().join(format!("corral-tree-max-{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        for i in 0..100 {
            std::fs::write(tmp.join(format!("f{i}")), b"").unwrap();
        }
        let (parent, name) = parent_and_name(&tmp);
        assert_eq!(
            remove_at_bounded(parent.as_fd(), &name, 50),
            Err(Errno::FBIG)
        );
        remove_at_bounded(parent.as_fd(), &name, 100).unwrap();
        assert!(!tmp.exists());
    }

    /// A writer that keeps adding files (or ever deeper directories) while the tree is removed
    /// cannot keep the removal going: it ends while the writer still writes.
    #[test]
    fn a_tree_that_keeps_growing_does_not_hold_its_removal() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        for deep in [false, true] {
            let tmp = std::env::temp_dir()
                .join(format!("corral-tree-grow-{}-{deep}", std::process::id()));
            std::fs::create_dir(&tmp).unwrap();
            let top = CString::new(tmp.as_os_str().as_encoded_bytes()).unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let started = Arc::new(AtomicBool::new(false));
            let writer = {
                let (stop, started) = (stop.clone(), started.clone());
                let top = top.clone();
                std::thread::spawn(move || {
                    let mut cur =
                        rfs::open(top.as_c_str(), OFlags::DIRECTORY, Mode::empty()).unwrap();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let name = CString::new(format!("f{i}")).unwrap();
                        i += 1;
                        if deep {
                            if rfs::mkdirat(&cur, &name, Mode::from_raw_mode(0o700)).is_ok() {
                                if let Ok(d) =
                                    rfs::openat(&cur, &name, OFlags::DIRECTORY, Mode::empty())
                                {
                                    cur = d;
                                }
                            }
                        } else {
                            let f = rfs::openat(
                                &cur,
                                &name,
                                OFlags::CREATE | OFlags::WRONLY,
                                Mode::RUSR,
                            );
                            drop(f);
                        }
                        if i == 1000 {
                            started.store(true, Ordering::Relaxed);
                        }
                    }
                })
            };
            while !started.load(Ordering::Relaxed) {
                std::thread::yield_now();
            }
            let (parent, name) = parent_and_name(&tmp);
            let r = remove_at_bounded(parent.as_fd(), &name, 20_000);
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
            // Ended: removed in a gap between two writes, or given up on.
            assert!(
                matches!(r, Ok(()) | Err(Errno::NOTEMPTY) | Err(Errno::FBIG)),
                "{deep}: {r:?}"
            );
            remove_path(top.as_c_str()).unwrap();
            assert!(!tmp.exists());
        }
    }
}
