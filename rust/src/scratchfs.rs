//! The sandboxes' disk: a btrfs filesystem on a loop device over a sparse image file, one
//! subvolume per sandbox with a quota of its `disk_mb` (btrfs simple quotas where the kernel
//! has them, full qgroups otherwise). Each call here is a few ioctls; the policy (sizes,
//! paths, when to fall back to a tmpfs) is the daemon's (corral.daemon.scratch).
//!
//! A loop device is attached with `LO_FLAGS_AUTOCLEAR` and mounted before this module closes
//! its own fd, so the mount is its only user: unmounting the filesystem detaches the device,
//! and nothing else can leak it.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use libc::{c_int, c_ulong};

#[derive(Debug, thiserror::Error)]
pub enum ScratchError {
    #[error("{0}")]
    Invalid(String),
    #[error("{step}: {source}")]
    Os {
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

impl ScratchError {
    pub fn errno(&self) -> i32 {
        match self {
            ScratchError::Invalid(_) => libc::EINVAL,
            ScratchError::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

fn last(step: &'static str) -> ScratchError {
    ScratchError::Os {
        step,
        source: io::Error::last_os_error(),
    }
}

fn cstr(what: &str, s: &[u8]) -> Result<CString, ScratchError> {
    CString::new(s).map_err(|_| ScratchError::Invalid(format!("{what} contains a NUL byte")))
}

fn open(path: &CStr, flags: c_int, step: &'static str) -> Result<OwnedFd, ScratchError> {
    // SAFETY: a valid NUL-terminated path; the returned fd is owned below.
    let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(last(step));
    }
    // SAFETY: open(2) just returned this fd; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

// ---- loop devices (linux/loop.h) -------------------------------------------------------------

const LOOP_CTL_GET_FREE: c_ulong = 0x4C82;
const LOOP_CONFIGURE: c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Attach `image` to a free loop device (autoclear; direct I/O if asked and the backing file
/// allows it, so its pages are not cached twice) and mount it on `target` as `fstype` with
/// `options` (nosuid, nodev, noexec, noatime). Returns the device's path, e.g. "/dev/loop3".
pub fn mount_loop(
    image: &OsStr,
    target: &OsStr,
    fstype: &str,
    options: &str,
    direct_io: bool,
) -> Result<String, ScratchError> {
    let img = cstr("image", image.as_bytes())?;
    let tgt = cstr("target", target.as_bytes())?;
    let fst = cstr("fstype", fstype.as_bytes())?;
    let opts = cstr("options", options.as_bytes())?;
    let backing = open(&img, libc::O_RDWR, "open_image")?;
    let ctl = open(c"/dev/loop-control", libc::O_RDWR, "open_loop_control")?;
    // Another process may take the free device between GET_FREE and CONFIGURE: EBUSY, retry.
    'device: for _ in 0..64 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        if n < 0 {
            return Err(last("loop_get_free"));
        }
        let path = format!("/dev/loop{n}");
        let dev = open(&cstr("device", path.as_bytes())?, libc::O_RDWR, "open_loop")?;
        let mut dio = direct_io;
        loop {
            let flags = LO_FLAGS_AUTOCLEAR | if dio { LO_FLAGS_DIRECT_IO } else { 0 };
            match configure(&dev, &backing, flags) {
                Ok(()) => break,
                // the backing file's filesystem has no direct I/O: buffered then
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && dio => dio = false,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => continue 'device,
                Err(e) => {
                    return Err(ScratchError::Os {
                        step: "loop_configure",
                        source: e,
                    })
                }
            }
        }
        let devc = cstr("device", path.as_bytes())?;
        let mflags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_NOATIME;
        // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
        let r = unsafe {
            libc::mount(
                devc.as_ptr(),
                tgt.as_ptr(),
                fst.as_ptr(),
                mflags,
                opts.as_ptr().cast(),
            )
        };
        // On failure `dev` closes on return and autoclear detaches the device.
        if r != 0 {
            return Err(last("mount"));
        }
        return Ok(path);
    }
    Err(ScratchError::Os {
        step: "loop_get_free",
        source: io::Error::from_raw_os_error(libc::EBUSY),
    })
}

/// Mount the filesystem image in the regular file `image` on `target` read-only (nosuid,
/// nodev) with no loop device: the kernel's file-backed mounts (EROFS on Linux >= 6.12).
/// Fails (ENOTBLK) where the kernel needs a block device.
pub fn mount_file_ro(image: &OsStr, target: &OsStr, fstype: &str) -> Result<(), ScratchError> {
    let img = cstr("image", image.as_bytes())?;
    let tgt = cstr("target", target.as_bytes())?;
    let fst = cstr("fstype", fstype.as_bytes())?;
    let mflags = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call; no data.
    let r = unsafe {
        libc::mount(
            img.as_ptr(),
            tgt.as_ptr(),
            fst.as_ptr(),
            mflags,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(last("mount"));
    }
    Ok(())
}

fn configure(dev: &OwnedFd, backing: &OwnedFd, flags: u32) -> io::Result<()> {
    // SAFETY: LoopConfig is plain old data; all-zero is its documented "unset" value.
    let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
    cfg.fd = backing.as_raw_fd() as u32;
    cfg.info.lo_flags = flags;
    // SAFETY: LOOP_CONFIGURE reads one struct loop_config, which `cfg` is (repr(C)).
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

// ---- btrfs (linux/btrfs.h) -------------------------------------------------------------------

const fn iow(nr: c_ulong, size: usize) -> c_ulong {
    (1 << 30) | ((size as c_ulong) << 16) | (0x94 << 8) | nr
}
const fn ior(nr: c_ulong, size: usize) -> c_ulong {
    (2 << 30) | ((size as c_ulong) << 16) | (0x94 << 8) | nr
}
const fn iowr(nr: c_ulong, size: usize) -> c_ulong {
    (3 << 30) | ((size as c_ulong) << 16) | (0x94 << 8) | nr
}

const BTRFS_SUPER_MAGIC: i64 = 0x9123_683E;
/// The inode number of every subvolume's root directory (BTRFS_FIRST_FREE_OBJECTID).
const SUBVOL_ROOT_INO: u64 = 256;
const VOL_NAME_MAX: usize = 4087;

#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; 4088],
}

#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    size: u64,
    qgroup_inherit: u64,
    unused: [u64; 2],
    name: [u8; 4040],
}

#[repr(C)]
#[derive(Default)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

#[repr(C)]
#[derive(Default)]
struct QgroupInherit {
    flags: u64,
    num_qgroups: u64,
    num_ref_copies: u64,
    num_excl_copies: u64,
    lim: QgroupLimit,
}

#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    lim: QgroupLimit,
}

#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

const SUBVOL_CREATE: c_ulong = iow(14, std::mem::size_of::<VolArgs>());
const SNAP_DESTROY: c_ulong = iow(15, std::mem::size_of::<VolArgs>());
const SUBVOL_CREATE_V2: c_ulong = iow(24, std::mem::size_of::<VolArgsV2>());
const QUOTA_CTL: c_ulong = iowr(40, std::mem::size_of::<QuotaCtlArgs>());
const INO_LOOKUP: c_ulong = iowr(18, std::mem::size_of::<InoLookupArgs>());
const QGROUP_LIMIT: c_ulong = ior(43, std::mem::size_of::<QgroupLimitArgs>());
const SUBVOL_QGROUP_INHERIT: u64 = 1 << 2;
const QGROUP_INHERIT_SET_LIMITS: u64 = 1;
const QGROUP_LIMIT_MAX_RFER: u64 = 1;
const QGROUP_LIMIT_MAX_EXCL: u64 = 2;
const QUOTA_CTL_ENABLE: u64 = 1;
const QUOTA_CTL_ENABLE_SIMPLE: u64 = 4;

fn open_dir(path: &OsStr, step: &'static str) -> Result<OwnedFd, ScratchError> {
    open(
        &cstr("path", path.as_bytes())?,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        step,
    )
}

fn check_name(name: &OsStr, max: usize) -> Result<&[u8], ScratchError> {
    let b = name.as_bytes();
    if b.is_empty()
        || b.len() > max
        || b.contains(&b'/')
        || b.contains(&0)
        || b == b"."
        || b == b".."
    {
        return Err(ScratchError::Invalid(format!(
            "bad subvolume name {:?}",
            name.to_string_lossy()
        )));
    }
    Ok(b)
}

/// Turn quotas on for the filesystem mounted at `mnt`: simple quotas (extent ownership, no
/// backref walks at commit) if `simple`, else full qgroups.
pub fn quota_enable(mnt: &OsStr, simple: bool) -> Result<(), ScratchError> {
    let fd = open_dir(mnt, "open_mount")?;
    let mut a = QuotaCtlArgs {
        cmd: if simple {
            QUOTA_CTL_ENABLE_SIMPLE
        } else {
            QUOTA_CTL_ENABLE
        },
        status: 0,
    };
    // SAFETY: BTRFS_IOC_QUOTA_CTL reads/writes one struct btrfs_ioctl_quota_ctl_args.
    if unsafe { libc::ioctl(fd.as_raw_fd(), QUOTA_CTL as _, &mut a) } < 0 {
        return Err(last("quota_ctl"));
    }
    Ok(())
}

/// Create the subvolume `parent/name` with its qgroup limited to `limit` bytes (referenced
/// and exclusive: the two are the same for a subvolume that shares nothing), in one ioctl.
pub fn subvol_create(parent: &OsStr, name: &OsStr, limit: Option<u64>) -> Result<(), ScratchError> {
    let n = check_name(name, 4039)?;
    let dir = open_dir(parent, "open_parent")?;
    let lim = |bytes: u64| QgroupLimit {
        flags: QGROUP_LIMIT_MAX_RFER | QGROUP_LIMIT_MAX_EXCL,
        max_rfer: bytes,
        max_excl: bytes,
        ..Default::default()
    };
    let inherit = limit.map(|bytes| QgroupInherit {
        flags: QGROUP_INHERIT_SET_LIMITS,
        lim: lim(bytes),
        ..Default::default()
    });
    let mut a = VolArgsV2 {
        fd: 0,
        transid: 0,
        flags: 0,
        size: 0,
        qgroup_inherit: 0,
        unused: [0; 2],
        name: [0; 4040],
    };
    a.name[..n.len()].copy_from_slice(n);
    if let Some(inh) = &inherit {
        a.flags = SUBVOL_QGROUP_INHERIT;
        a.size = std::mem::size_of::<QgroupInherit>() as u64;
        a.qgroup_inherit = inh as *const QgroupInherit as u64;
    }
    // SAFETY: BTRFS_IOC_SUBVOL_CREATE_V2 reads one struct btrfs_ioctl_vol_args_v2 and, with
    // BTRFS_SUBVOL_QGROUP_INHERIT, `size` bytes at `qgroup_inherit` (`inherit`, alive here).
    if unsafe { libc::ioctl(dir.as_raw_fd(), SUBVOL_CREATE_V2 as _, &a) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if limit.is_none() || e.raw_os_error() != Some(libc::EINVAL) {
        return Err(ScratchError::Os {
            step: "subvol_create",
            source: e,
        });
    }
    // A kernel without limits in qgroup_inherit: create, then limit.
    let mut v = VolArgs {
        fd: 0,
        name: [0; 4088],
    };
    v.name[..n.len()].copy_from_slice(n);
    // SAFETY: BTRFS_IOC_SUBVOL_CREATE reads one struct btrfs_ioctl_vol_args.
    if unsafe { libc::ioctl(dir.as_raw_fd(), SUBVOL_CREATE as _, &v) } < 0 {
        return Err(last("subvol_create"));
    }
    let mut path = parent.as_bytes().to_vec();
    path.push(b'/');
    path.extend_from_slice(n);
    let sub = open_dir(OsStr::from_bytes(&path), "open_subvol")?;
    let mut la = QgroupLimitArgs {
        qgroupid: 0, // the subvolume of the fd
        lim: lim(limit.unwrap_or(0)),
    };
    // SAFETY: BTRFS_IOC_QGROUP_LIMIT reads one struct btrfs_ioctl_qgroup_limit_args.
    if unsafe { libc::ioctl(sub.as_raw_fd(), QGROUP_LIMIT as _, &mut la) } < 0 {
        let err = last("qgroup_limit");
        drop(sub);
        let _ = destroy_in(&dir, n);
        return Err(err);
    }
    Ok(())
}

/// The id of the subvolume that holds `path` (its qgroup is `0/<id>`: the kernel's usage
/// counters for it are in /sys/fs/btrfs/<fsid>/qgroups/0_<id>/).
pub fn subvol_id(path: &OsStr) -> Result<u64, ScratchError> {
    let dir = open_dir(path, "open_subvol")?;
    let mut a = InoLookupArgs {
        treeid: 0, // the subvolume of the fd: the kernel fills it in
        objectid: SUBVOL_ROOT_INO,
        name: [0; 4080],
    };
    // SAFETY: BTRFS_IOC_INO_LOOKUP reads and writes one struct btrfs_ioctl_ino_lookup_args.
    if unsafe { libc::ioctl(dir.as_raw_fd(), INO_LOOKUP as _, &mut a) } < 0 {
        return Err(last("ino_lookup"));
    }
    Ok(a.treeid)
}

fn destroy_in(dir: &OwnedFd, name: &[u8]) -> io::Result<()> {
    let mut v = VolArgs {
        fd: 0,
        name: [0; 4088],
    };
    v.name[..name.len()].copy_from_slice(name);
    // SAFETY: BTRFS_IOC_SNAP_DESTROY reads one struct btrfs_ioctl_vol_args.
    if unsafe { libc::ioctl(dir.as_raw_fd(), SNAP_DESTROY as _, &v) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// If `path` is the root of a btrfs subvolume, delete the subvolume (the kernel's cleaner
/// frees its extents in the background) and return true; false if it is anything else (the
/// caller removes it as a tree). Never follows a symlink in the last component.
pub fn subvol_delete(path: &OsStr) -> Result<bool, ScratchError> {
    let b = path.as_bytes();
    let (parent, name) = match b.iter().rposition(|&c| c == b'/') {
        Some(0) => (&b"/"[..], &b[1..]),
        Some(i) => (&b[..i], &b[i + 1..]),
        None => (&b"."[..], b),
    };
    let name = check_name(OsStr::from_bytes(name), VOL_NAME_MAX)?;
    let dir = match open_dir(OsStr::from_bytes(b), "open_subvol") {
        Ok(d) => d,
        Err(ScratchError::Os { source, .. })
            if matches!(
                source.raw_os_error(),
                Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP)
            ) =>
        {
            return Ok(false)
        }
        Err(e) => return Err(e),
    };
    if !is_subvol(&dir)? {
        return Ok(false);
    }
    drop(dir);
    let pdir = open_dir(OsStr::from_bytes(parent), "open_parent")?;
    destroy_in(&pdir, name).map_err(|e| ScratchError::Os {
        step: "subvol_destroy",
        source: e,
    })?;
    Ok(true)
}

fn is_subvol(fd: &OwnedFd) -> Result<bool, ScratchError> {
    // SAFETY: plain old data, zero is valid.
    let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one struct statfs.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut sfs) } < 0 {
        return Err(last("fstatfs"));
    }
    if sfs.f_type as i64 != BTRFS_SUPER_MAGIC {
        return Ok(false);
    }
    // SAFETY: plain old data, zero is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one struct stat.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(last("fstat"));
    }
    Ok(st.st_ino == SUBVOL_ROOT_INO)
}
