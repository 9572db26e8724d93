//! Mounts the daemon itself makes in the host's mount namespace (not inside a sandbox): the
//! tmpfs that holds every sandbox's scratch directories (overlay upper/work dirs, meta.json).
//! One superblock for all sandboxes: ext4 inode allocation for each sandbox's dirs (and the
//! overlay workdir checks) was the largest cost of a sandbox's create and destroy.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::unix::ffi::OsStrExt;

#[derive(Debug, thiserror::Error)]
pub enum HostMountError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Os(#[from] io::Error),
}

fn cstr(what: &str, s: &[u8]) -> Result<CString, HostMountError> {
    CString::new(s).map_err(|_| HostMountError::Invalid(format!("{what} contains a NUL byte")))
}

/// Mount a tmpfs on `target` (nosuid, nodev, noexec: nothing on it is run or opened as a device
/// from the host side; sandboxes see its files only through their overlays) with `options`
/// (e.g. "size=50%,mode=0700").
pub fn mount_tmpfs(target: &OsStr, options: &str) -> Result<(), HostMountError> {
    let t = cstr("target", target.as_bytes())?;
    let o = cstr("options", options.as_bytes())?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
    let r = unsafe {
        libc::mount(
            c"corral-scratch".as_ptr(),
            t.as_ptr(),
            c"tmpfs".as_ptr(),
            flags,
            o.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(())
}

/// Unmount `target` (not lazily: a busy mount stays and the caller hears EBUSY).
pub fn umount(target: &OsStr) -> Result<(), HostMountError> {
    let t = cstr("target", target.as_bytes())?;
    // SAFETY: a valid NUL-terminated path.
    let r = unsafe { libc::umount2(t.as_ptr(), libc::UMOUNT_NOFOLLOW) };
    if r != 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(())
}

/// Bind `source` onto `target`, then make the bind read-only (a bind mount takes its flags
/// only from a remount).
pub fn bind_readonly(source: &OsStr, target: &OsStr) -> Result<(), HostMountError> {
    let s = cstr("source", source.as_bytes())?;
    let t = cstr("target", target.as_bytes())?;
    // SAFETY: valid NUL-terminated paths; null fstype and data are allowed for a bind.
    let r = unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error().into());
    }
    let flags = libc::MS_BIND
        | libc::MS_REMOUNT
        | libc::MS_RDONLY
        | libc::MS_NOSUID
        | libc::MS_NODEV
        | libc::MS_NOEXEC;
    // SAFETY: as above.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            t.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        // SAFETY: a valid path; undo the bind made above.
        unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
        return Err(e.into());
    }
    Ok(())
}

/// Detach `target` at once (MNT_DETACH): for a mount whose server may be gone or stalled.
pub fn umount_detach(target: &OsStr) -> Result<(), HostMountError> {
    let t = cstr("target", target.as_bytes())?;
    // SAFETY: a valid NUL-terminated path.
    let r = unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) };
    if r != 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(())
}
