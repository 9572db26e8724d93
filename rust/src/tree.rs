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

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{self as rfs, AtFlags, Dir, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Directory fds held open at once.
const WINDOW: usize = 32;
/// Names read from one directory before acting on them.
const BATCH: usize = 512;

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
}

/// Unlink the non-directories among the first `BATCH` entries of `dir`; returns the
/// subdirectories among them and whether the batch held any entry at all.
fn read_batch(dir: BorrowedFd<'_>) -> rustix::io::Result<(Vec<CString>, bool)> {
    let mut d = Dir::read_from(dir)?;
    let mut subdirs = Vec::new();
    let mut seen = 0;
    while seen < BATCH {
        let Some(ent) = d.read() else { break };
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
    Ok((subdirs, seen > 0))
}

/// Remove `name` in `parent` and everything under it (see the module doc). A missing `name`
/// is not an error; a non-directory is unlinked.
pub fn remove_at(parent: BorrowedFd<'_>, name: &CStr) -> rustix::io::Result<()> {
    let top = match open_dir(parent, name) {
        Ok(fd) => fd,
        Err(Errno::NOTDIR) | Err(Errno::LOOP) => {
            return ignore_noent(rfs::unlinkat(parent, name, AtFlags::empty()))
        }
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    let dev = rfs::fstat(&top)?.st_dev;
    let mut stack = vec![Frame {
        fd: top,
        name: name.to_owned(),
        pending: Vec::new(),
    }];
    let mut moved = 0u64;
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
                continue;
            }
            match open_dir(stack[i].fd.as_fd(), &sub) {
                Ok(fd) => {
                    if rfs::fstat(&fd)?.st_dev != dev {
                        return Err(Errno::XDEV); // a mount point: never cross it
                    }
                    stack.push(Frame {
                        fd,
                        name: sub,
                        pending: Vec::new(),
                    });
                }
                Err(Errno::NOTDIR) | Err(Errno::LOOP) => {
                    ignore_noent(rfs::unlinkat(&stack[i].fd, &sub, AtFlags::empty()))?
                }
                Err(Errno::NOENT) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        let (subdirs, any) = read_batch(stack[i].fd.as_fd())?;
        if any {
            stack[i].pending = subdirs;
            continue;
        }
        // Empty now: remove it from its parent.
        let done = stack.pop().expect("not empty");
        drop(done.fd);
        let parent_fd = stack.last().map_or(parent, |f| f.fd.as_fd());
        ignore_noent(rfs::unlinkat(parent_fd, &done.name, AtFlags::REMOVEDIR))?;
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
}
