//! `corral._core`: the privileged, syscall-heavy hot path of corral (see docs/architecture.md,
//! "The Rust core contract"). Python passes typed config classes (configs.rs), lists and
//! ints; every call releases the GIL around its syscalls; kernel errors become `OSError(errno, "<step>: <reason>")`, bad
//! arguments `ValueError`.

#![deny(clippy::undocumented_unsafe_blocks)]

mod cgview;
mod child;
mod configs;
mod enter;
mod fs;
mod harden;
mod hostmount;
mod layer;
mod netlink;
mod netprobe;
mod nftset;
mod scratchfs;
mod spawn;
mod tree;
mod zygote;

use std::ffi::OsString;
use std::os::fd::{IntoRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use configs::{PyExecConfig, PyOverlay, PySpawnConfig};
use enter::EnterError;
use fs::FsError;
use harden::{HardenError, Rlimit};
use hostmount::HostMountError;
use layer::LayerError;
use scratchfs::ScratchError;
use spawn::SpawnError;
use zygote::ZygoteError;

// ---- errors -----------------------------------------------------------------------------------

fn os_error(errno: i32, msg: String) -> PyErr {
    PyOSError::new_err((errno, msg))
}

impl From<HardenError> for PyErr {
    fn from(e: HardenError) -> PyErr {
        match e {
            HardenError::Seccomp(_) => os_error(libc::EINVAL, e.to_string()),
            _ => PyValueError::new_err(e.to_string()),
        }
    }
}

impl From<HostMountError> for PyErr {
    fn from(e: HostMountError) -> PyErr {
        match e {
            HostMountError::Invalid(m) => PyValueError::new_err(m),
            HostMountError::Os(e) => io_err("mount", e),
        }
    }
}

impl From<ScratchError> for PyErr {
    fn from(e: ScratchError) -> PyErr {
        match e {
            ScratchError::Invalid(m) => PyValueError::new_err(m),
            e => os_error(e.errno(), e.to_string()),
        }
    }
}

impl From<SpawnError> for PyErr {
    fn from(e: SpawnError) -> PyErr {
        match e {
            SpawnError::Invalid(m) => PyValueError::new_err(m),
            SpawnError::Harden(h) => h.into(),
            SpawnError::Os { step, errno, msg } => {
                os_error(errno, format!("spawn_sandbox: {step}: {msg}"))
            }
        }
    }
}

impl From<EnterError> for PyErr {
    fn from(e: EnterError) -> PyErr {
        match e {
            EnterError::Invalid(m) => PyValueError::new_err(m),
            EnterError::Harden(h) => h.into(),
            EnterError::Os { step, errno, msg } => {
                os_error(errno, format!("exec_in: {step}: {msg}"))
            }
        }
    }
}

impl From<FsError> for PyErr {
    fn from(e: FsError) -> PyErr {
        match e {
            FsError::Invalid(m) => PyValueError::new_err(m),
            FsError::TooMany { limit, .. } => LayerLimit::new_err(("entries", limit as u64)),
            FsError::NotCached => NotCached::new_err("not served from memory in bounded time"),
            FsError::Forbidden { op, path, msg } => {
                ForbiddenPath::new_err((libc::EACCES, format!("{op}: {msg}"), path))
            }
            FsError::Os {
                op,
                errno,
                path,
                msg,
            } => PyOSError::new_err((errno, format!("{op}: {msg}"), path)),
        }
    }
}

impl From<LayerError> for PyErr {
    fn from(e: LayerError) -> PyErr {
        match e {
            LayerError::Limit { what, limit } => LayerLimit::new_err((what, limit)),
            LayerError::Cancelled => CaptureCancelled::new_err("the capture was cancelled"),
            e => os_error(e.errno(), format!("capture_layer: {e}")),
        }
    }
}

impl From<ZygoteError> for PyErr {
    fn from(e: ZygoteError) -> PyErr {
        match e {
            ZygoteError::Invalid(m) => PyValueError::new_err(m),
            ZygoteError::Harden(h) => h.into(),
            ZygoteError::Os { step, errno, msg } => {
                os_error(errno, format!("zygote: {step}: {msg}"))
            }
        }
    }
}

pyo3::create_exception!(
    _core,
    LayerLimit,
    pyo3::exceptions::PyException,
    "A capture passed one of its limits: args (what, limit), what in bytes, entries, depth."
);

pyo3::create_exception!(
    _core,
    NotCached,
    pyo3::exceptions::PyException,
    "A cached-only call needed the disk or an unbounded walk (a symlink, a long path): ask again
     from a thread."
);

pyo3::create_exception!(
    _core,
    CaptureCancelled,
    pyo3::exceptions::PyException,
    "A capture stopped because its CaptureControl was cancelled (its partial copy is left)."
);

pyo3::create_exception!(
    _core,
    ForbiddenPath,
    pyo3::exceptions::PyPermissionError,
    "A path the files API never serves (kernel pseudo-filesystem, device, FIFO, socket)."
);

fn io_err(what: &str, e: std::io::Error) -> PyErr {
    let errno = e.raw_os_error().unwrap_or(libc::EIO);
    os_error(errno, format!("{what}: {}", harden::strerror(errno)))
}

// ---- functions ------------------------------------------------------------------------------

/// A sealed (F_SEAL_WRITE|SHRINK|GROW|SEAL), close-on-exec memfd holding the static init.
#[pyfunction]
fn init_memfd(py: Python<'_>) -> PyResult<RawFd> {
    py.detach(spawn::init_memfd)
        .map(IntoRawFd::into_raw_fd)
        .map_err(|e| io_err("init_memfd", e))
}

static LOCKDOWN_BIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/corral-lockdown"));

/// The static lock-down binary of the gvisor substrate (init/corral-lockdown.c).
#[pyfunction]
fn lockdown_binary(py: Python<'_>) -> Bound<'_, PyBytes> {
    PyBytes::new(py, LOCKDOWN_BIN)
}

/// The sandbox seccomp filter (the one every container exec installs) as its raw BPF program:
/// `struct sock_filter` entries in native byte order, for a process that installs it itself.
#[pyfunction]
fn seccomp_filter(py: Python<'_>, unix_only: bool) -> PyResult<Bound<'_, PyBytes>> {
    let prog = harden::seccomp_program(unix_only)?;
    let mut out = Vec::with_capacity(prog.len() * 8);
    for f in prog {
        out.extend_from_slice(&f.code.to_ne_bytes());
        out.push(f.jt);
        out.push(f.jf);
        out.extend_from_slice(&f.k.to_ne_bytes());
    }
    Ok(PyBytes::new(py, &out))
}

/// The kernel's Landlock ABI version, or -errno if Landlock is unavailable (network
/// "disabled" needs >= 6 for abstract unix socket scoping).
#[pyfunction]
fn landlock_abi() -> i64 {
    harden::landlock_abi()
}

/// A new network namespace (loopback up) as an fd, for `netns_fd` of spawn_sandbox: pools of
/// these take netns creation off the sandbox-creation path.
#[pyfunction]
fn netns_new(py: Python<'_>) -> PyResult<RawFd> {
    py.detach(spawn::netns_new)
        .map(IntoRawFd::into_raw_fd)
        .map_err(|e| io_err("netns_new", e))
}

/// The network namespace of a live process as an fd, from its pidfd (ESRCH once it exited).
#[pyfunction]
fn netns_of(pidfd: RawFd) -> PyResult<RawFd> {
    netprobe::netns_of(pidfd)
        .map(IntoRawFd::into_raw_fd)
        .map_err(|e| os_error(e.errno(), format!("netns_of: {e}")))
}

/// What a network namespace shows of its past (counters, socket counts): equal for every
/// fresh namespace, so a namespace whose sandbox did nothing in it can be told apart.
#[pyfunction]
fn netns_fingerprint(py: Python<'_>, netns_fd: RawFd) -> PyResult<Py<PyBytes>> {
    let v = py
        .detach(|| netprobe::fingerprint(netns_fd))
        .map_err(|e| os_error(e.errno(), format!("netns_fingerprint: {e}")))?;
    Ok(PyBytes::new(py, &v).unbind())
}

/// A socket made in the network namespace `netns` (an fd), e.g. netlink (NETLINK_ROUTE) to
/// set up a sandbox's links and addresses from the daemon's namespace.
#[pyfunction]
fn netns_socket(py: Python<'_>, netns: RawFd, domain: i32, ty: i32, proto: i32) -> PyResult<RawFd> {
    py.detach(|| spawn::netns_socket(netns, domain, ty, proto))
        .map(IntoRawFd::into_raw_fd)
        .map_err(|e| io_err("netns_socket", e))
}

/// A networked sandbox's veth pair (docs/network.md): host end `host` with the gateway
/// address and a /32 route to `addr`; `eth0` in the namespace `netns` with `addr`/32 and a
/// default route via `gateway`; the same for IPv6 with `gateway6` and `addr6` (/128), or IPv6
/// off on both ends without them. The GIL is released meanwhile.
#[pyfunction]
#[pyo3(signature = (netns, host, gateway, addr, gateway6=None, addr6=None))]
fn veth_setup(
    py: Python<'_>,
    netns: RawFd,
    host: String,
    gateway: String,
    addr: String,
    gateway6: Option<String>,
    addr6: Option<String>,
) -> PyResult<()> {
    let parse = |s: &str| {
        s.parse::<std::net::Ipv4Addr>()
            .map_err(|_| PyValueError::new_err(format!("not an IPv4 address: {s:?}")))
    };
    let parse6 = |s: &str| {
        s.parse::<std::net::Ipv6Addr>()
            .map_err(|_| PyValueError::new_err(format!("not an IPv6 address: {s:?}")))
    };
    let (gw, a) = (parse(&gateway)?, parse(&addr)?);
    let v6 = match (gateway6, addr6) {
        (Some(g), Some(a)) => Some((parse6(&g)?, parse6(&a)?)),
        (None, None) => None,
        _ => return Err(PyValueError::new_err("gateway6 and addr6 go together")),
    };
    py.detach(|| netlink::veth_setup(netns, &host, gw, a, v6))
        .map_err(|e| os_error(e.errno(), format!("veth_setup: {e}")))
}

/// Elements to remove, as they cross from Python: [(set name, [(key, key_end or None)])],
/// each key the concatenated register data of the element.
type GoneElems = Vec<(String, Vec<(Vec<u8>, Option<Vec<u8>>)>)>;

fn gone_elems(sets: GoneElems) -> Vec<nftset::SetElems> {
    sets.into_iter()
        .map(|(set, elems)| nftset::SetElems { set, elems })
        .collect()
}

/// Remove set elements of the inet table `table` in one nf_tables batch, straight over
/// netlink (an element already gone is fine).
#[pyfunction]
fn nft_destroy_elements(py: Python<'_>, table: String, sets: GoneElems) -> PyResult<()> {
    let sets = gone_elems(sets);
    py.detach(|| nftset::destroy_elements(&table, &sets))
        .map_err(|e| os_error(e.errno(), format!("nft_destroy_elements: {e}")))
}

/// Elements to add, as they cross from Python:
/// [(set, [(key, end key or None, timeout in ms or None, chain to jump to or None)])].
#[allow(clippy::type_complexity)]
type NewElems = Vec<(
    String,
    Vec<(Vec<u8>, Option<Vec<u8>>, Option<u64>, Option<String>)>,
)>;

fn new_elems(sets: NewElems) -> Vec<(String, Vec<nftset::NewElem>)> {
    sets.into_iter()
        .map(|(set, elems)| {
            let elems = elems
                .into_iter()
                .map(|(key, end, timeout_ms, jump)| nftset::NewElem {
                    key,
                    end,
                    timeout_ms,
                    jump,
                })
                .collect();
            (set, elems)
        })
        .collect()
}

/// Add elements to sets of nftables table `table` (family inet) in one transaction:
/// [(set, [(key, end key or None, timeout in ms or None, chain to jump to or None)])].
#[pyfunction]
fn nft_add_elements(py: Python<'_>, table: String, sets: NewElems) -> PyResult<()> {
    let sets = new_elems(sets);
    py.detach(|| nftset::add_elements(&table, &sets))
        .map_err(|e| os_error(e.errno(), format!("nft_add_elements: {e}")))
}

/// Remove elements (as `nft_destroy_elements` takes them) and add others (as
/// `nft_add_elements` takes them) in one transaction. Pass only the difference: an element
/// removed and added again in one transaction can be missed by an interval set's lookup for
/// an instant.
#[pyfunction]
fn nft_swap_elements(
    py: Python<'_>,
    table: String,
    gone: GoneElems,
    added: NewElems,
) -> PyResult<()> {
    let gone = gone_elems(gone);
    let added = new_elems(added);
    py.detach(|| nftset::swap_elements(&table, &gone, &added))
        .map_err(|e| os_error(e.errno(), format!("nft_swap_elements: {e}")))
}

/// The counter (packets, bytes) of the element `key` of set `set` in nftables table `table`
/// (family inet); None if there is no such element.
#[pyfunction]
fn nft_get_counter(
    py: Python<'_>,
    table: String,
    set: String,
    key: Vec<u8>,
) -> PyResult<Option<(u64, u64)>> {
    py.detach(|| nftset::get_counter(&table, &set, &key))
        .map_err(|e| os_error(e.errno(), format!("nft_get_counter: {e}")))
}

/// The counters (key, packets, bytes) of the elements of set `set` in nftables table `table`
/// (family inet) whose key starts with `prefix`.
#[pyfunction]
fn nft_dump_counters(
    py: Python<'_>,
    table: String,
    set: String,
    prefix: Vec<u8>,
) -> PyResult<Vec<(Vec<u8>, u64, u64)>> {
    py.detach(|| nftset::dump_counters(&table, &set, &prefix))
        .map_err(|e| os_error(e.errno(), format!("nft_dump_counters: {e}")))
}

/// Mount a tmpfs (nosuid, nodev, noexec) on `target` in the caller's mount namespace, for the
/// sandboxes' scratch dirs; `options` as for mount(8) -o ("size=50%,mode=0700").
#[pyfunction]
fn mount_tmpfs(py: Python<'_>, target: OsString, options: String) -> PyResult<()> {
    Ok(py.detach(|| hostmount::mount_tmpfs(&target, &options))?)
}

/// Unmount `target` (EBUSY if in use; never lazy).
#[pyfunction]
fn umount(py: Python<'_>, target: OsString) -> PyResult<()> {
    Ok(py.detach(|| hostmount::umount(&target))?)
}

/// Attach `image` to a free loop device (autoclear, direct I/O if `direct_io` and possible)
/// and mount it on `target` (nosuid, nodev, noexec); returns the device path. Unmounting
/// detaches the device.
#[pyfunction]
#[pyo3(signature = (image, target, fstype, options, direct_io = true))]
fn mount_loop(
    py: Python<'_>,
    image: OsString,
    target: OsString,
    fstype: String,
    options: String,
    direct_io: bool,
) -> PyResult<String> {
    Ok(py.detach(|| scratchfs::mount_loop(&image, &target, &fstype, &options, direct_io))?)
}

/// Mount the filesystem image file `image` read-only on `target` (file-backed, no loop device).
#[pyfunction]
fn mount_file_ro(
    py: Python<'_>,
    image: OsString,
    target: OsString,
    fstype: String,
) -> PyResult<()> {
    Ok(py.detach(|| scratchfs::mount_file_ro(&image, &target, &fstype))?)
}

/// Turn btrfs quotas on for the filesystem mounted at `mnt` (simple quotas if `simple`).
#[pyfunction]
fn btrfs_quota_enable(py: Python<'_>, mnt: OsString, simple: bool) -> PyResult<()> {
    Ok(py.detach(|| scratchfs::quota_enable(&mnt, simple))?)
}

/// Create the btrfs subvolume `parent/name`, its quota `limit` bytes (None: no limit).
#[pyfunction]
#[pyo3(signature = (parent, name, limit = None))]
fn btrfs_subvol_create(
    py: Python<'_>,
    parent: OsString,
    name: OsString,
    limit: Option<u64>,
) -> PyResult<()> {
    Ok(py.detach(|| scratchfs::subvol_create(&parent, &name, limit))?)
}

/// The id of the btrfs subvolume that holds `path`.
#[pyfunction]
fn btrfs_subvol_id(py: Python<'_>, path: OsString) -> PyResult<u64> {
    Ok(py.detach(|| scratchfs::subvol_id(&path))?)
}

/// Delete `path` if it is a btrfs subvolume's root (True); False if it is anything else.
#[pyfunction]
fn btrfs_subvol_delete(py: Python<'_>, path: OsString) -> PyResult<bool> {
    Ok(py.detach(|| scratchfs::subvol_delete(&path))?)
}

/// Mount `mounts` ((target, fstype, options), absolute in the sandbox) read-only in the mount
/// namespace of the init `pidfd`, rooted at the cgroups of the `tasks` files.
#[pyfunction]
fn mount_cgroups_in(
    py: Python<'_>,
    pidfd: RawFd,
    tasks: Vec<String>,
    mounts: Vec<cgview::CgMount>,
) -> PyResult<()> {
    py.detach(|| cgview::mount_cgroups_in(pidfd, &tasks, &mounts))
        .map_err(|e| match e {
            cgview::CgViewError::Invalid(m) => PyValueError::new_err(m),
            cgview::CgViewError::Os { step, source } => io_err(step, source),
        })
}

/// Bind each (host source, target in the sandbox) read-only in the mount namespace of the init
/// `pidfd`, over what is mounted at the target now (lxcfs's files after a restart).
#[pyfunction]
fn rebind_in(py: Python<'_>, pidfd: RawFd, binds: Vec<(String, String)>) -> PyResult<()> {
    py.detach(|| cgview::rebind_in(pidfd, &binds))
        .map_err(|e| match e {
            cgview::CgViewError::Invalid(m) => PyValueError::new_err(m),
            cgview::CgViewError::Os { step, source } => io_err(step, source),
        })
}

/// Bind `source` onto `target` (read-only) in the caller's mount namespace.
#[pyfunction]
fn bind_readonly(py: Python<'_>, source: OsString, target: OsString) -> PyResult<()> {
    Ok(py.detach(|| hostmount::bind_readonly(&source, &target))?)
}

/// Detach `target` now; the kernel unmounts it once nothing uses it (MNT_DETACH).
#[pyfunction]
fn umount_detach(py: Python<'_>, target: OsString) -> PyResult<()> {
    Ok(py.detach(|| hostmount::umount_detach(&target))?)
}

/// Create a sandbox; returns (init host pid, pidfd). See docs/architecture.md for `cfg`.
#[pyfunction]
fn spawn_sandbox(py: Python<'_>, cfg: &Bound<'_, PySpawnConfig>) -> PyResult<(i32, RawFd)> {
    let c = &cfg.get().0;
    let (pid, pidfd) = py.detach(|| spawn::spawn_sandbox(c))?;
    Ok((pid, pidfd.into_raw_fd()))
}

/// Start a process inside a live sandbox as a direct child of the caller; returns its pid.
#[pyfunction]
fn exec_in(py: Python<'_>, cfg: &Bound<'_, PyExecConfig>) -> PyResult<i32> {
    let c = &cfg.get().0;
    Ok(py.detach(|| enter::exec_in(c))?)
}

/// At the daemon's start: not dumpable, `secret_flags`' values blanked in its command line.
#[pyfunction]
fn harden_daemon(secret_flags: Vec<String>) -> PyResult<()> {
    Ok(enter::harden_daemon(&secret_flags)?)
}

/// The daemon's end of a sandbox init's exec channel (see corral-init.c), from its pidfd.
#[pyfunction]
fn init_channel(pidfd: RawFd) -> PyResult<RawFd> {
    Ok(enter::init_channel(pidfd)?.into_raw_fd())
}

/// O_PATH fd of /proc/PID/root (the sandbox's root).
#[pyfunction]
fn root_fd(py: Python<'_>, pid: i32) -> PyResult<RawFd> {
    py.detach(|| fs::root_fd(pid))
        .map(IntoRawFd::into_raw_fd)
        .map_err(|e| io_err("root_fd", e))
}

/// At most `max_bytes` of the regular file at `path`; `cached`: NotCached unless it is all
/// in memory (fs::read).
#[pyfunction]
#[pyo3(signature = (root_fd, path, max_bytes = 64 * 1024 * 1024, cached = false))]
fn fs_read<'py>(
    py: Python<'py>,
    root_fd: RawFd,
    path: OsString,
    max_bytes: u64,
    cached: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let data = py.detach(|| fs::read(root_fd, &path, max_bytes, cached))?;
    Ok(PyBytes::new(py, &data))
}

/// (fd, size): a readable fd of the regular file at `path`, checked as fs_read checks it
/// (the caller reads it in bounded chunks and closes it).
#[pyfunction]
fn fs_open_read(py: Python<'_>, root_fd: RawFd, path: OsString) -> PyResult<(RawFd, u64)> {
    let (fd, size) = py.detach(|| fs::open_read(root_fd, &path))?;
    Ok((fd.into_raw_fd(), size))
}

/// An fd to write the regular file at `path` through (made with `mode`, or truncated),
/// checked as fs_write checks it; the caller writes in chunks and closes it.
#[pyfunction]
#[pyo3(signature = (root_fd, path, mode = 0o644, make_parents = true))]
fn fs_open_write(
    py: Python<'_>,
    root_fd: RawFd,
    path: OsString,
    mode: u32,
    make_parents: bool,
) -> PyResult<RawFd> {
    let fd = py.detach(|| fs::open_write(root_fd, &path, mode, make_parents))?;
    Ok(fd.into_raw_fd())
}

/// rm -rf of a host path a sandbox controlled: iterative at any depth, bounded fds, never
/// following a symlink, never crossing a mount (see tree.rs).
#[pyfunction]
fn remove_tree(py: Python<'_>, path: OsString) -> PyResult<()> {
    let c = std::ffi::CString::new(path.into_encoded_bytes())
        .map_err(|_| PyValueError::new_err("a path holds a NUL byte"))?;
    py.detach(|| tree::remove_path(&c)).map_err(|e| {
        os_error(
            e.raw_os_error(),
            format!("remove_tree: {}", harden::strerror(e.raw_os_error())),
        )
    })
}

#[pyfunction]
#[pyo3(signature = (root_fd, path, data, mode = 0o644, make_parents = true))]
fn fs_write(
    py: Python<'_>,
    root_fd: RawFd,
    path: OsString,
    data: &[u8],
    mode: u32,
    make_parents: bool,
) -> PyResult<()> {
    Ok(py.detach(|| fs::write(root_fd, &path, data, mode, make_parents))?)
}

/// list of (name, kind, size, mode, mtime); kind is file, dir, symlink or other.
#[pyfunction]
fn fs_list(py: Python<'_>, root_fd: RawFd, path: OsString) -> PyResult<Vec<fs::ListEntry>> {
    Ok(py.detach(|| fs::list(root_fd, &path))?)
}

/// One page of a listing: the entries after `after`, at most `limit`, and the next page's
/// cursor (None on the last page).
#[pyfunction]
#[pyo3(signature = (root_fd, path, after, limit))]
fn fs_list_page(
    py: Python<'_>,
    root_fd: RawFd,
    path: OsString,
    after: Option<OsString>,
    limit: usize,
) -> PyResult<(Vec<fs::ListEntry>, Option<OsString>)> {
    Ok(py.detach(|| fs::list_page(root_fd, &path, after.as_deref(), limit))?)
}

/// (kind, size, mode, mtime), lstat semantics; `cached`: NotCached unless the path resolves
/// from memory in bounded time (fs::stat).
#[pyfunction]
#[pyo3(signature = (root_fd, path, cached = false))]
fn fs_stat(
    py: Python<'_>,
    root_fd: RawFd,
    path: OsString,
    cached: bool,
) -> PyResult<(&'static str, u64, u32, f64)> {
    Ok(py.detach(|| fs::stat(root_fd, &path, cached))?)
}

/// Whether `path` is a directory with its symlinks followed inside the root (fs::is_dir).
#[pyfunction]
fn fs_is_dir(py: Python<'_>, root_fd: RawFd, path: OsString) -> PyResult<bool> {
    Ok(py.detach(|| fs::is_dir(root_fd, &path))?)
}

#[pyfunction]
#[pyo3(signature = (root_fd, path, parents = true, mode = 0o755))]
fn fs_mkdir(
    py: Python<'_>,
    root_fd: RawFd,
    path: OsString,
    parents: bool,
    mode: u32,
) -> PyResult<()> {
    Ok(py.detach(|| fs::mkdir(root_fd, &path, parents, mode))?)
}

/// `max_entries`: a recursive removal that handles more names fails with LayerLimit (None:
/// no bound, for trees no sandbox writes to any more).
#[pyfunction]
#[pyo3(signature = (root_fd, path, recursive = false, max_entries = None))]
fn fs_remove(
    py: Python<'_>,
    root_fd: RawFd,
    path: OsString,
    recursive: bool,
    max_entries: Option<u64>,
) -> PyResult<()> {
    let max = max_entries.unwrap_or(u64::MAX);
    Ok(py.detach(|| fs::remove(root_fd, &path, recursive, max))?)
}

#[pyfunction]
fn fs_rename(py: Python<'_>, root_fd: RawFd, src: OsString, dst: OsString) -> PyResult<()> {
    Ok(py.detach(|| fs::rename(root_fd, &src, &dst))?)
}

#[pyfunction]
fn fs_symlink(
    py: Python<'_>,
    root_fd: RawFd,
    target: OsString,
    linkpath: OsString,
) -> PyResult<()> {
    Ok(py.detach(|| fs::symlink(root_fd, &target, &linkpath))?)
}

#[pyfunction]
fn fs_readlink(py: Python<'_>, root_fd: RawFd, path: OsString) -> PyResult<OsString> {
    Ok(py.detach(|| fs::readlink(root_fd, &path))?)
}

#[pyfunction]
fn fs_chmod(py: Python<'_>, root_fd: RawFd, path: OsString, mode: u32) -> PyResult<()> {
    Ok(py.detach(|| fs::chmod(root_fd, &path, mode))?)
}

#[pyfunction]
fn fs_chown(py: Python<'_>, root_fd: RawFd, path: OsString, uid: u32, gid: u32) -> PyResult<()> {
    Ok(py.detach(|| fs::chown(root_fd, &path, uid, gid))?)
}

/// A running capture_layer as another thread sees it: `copied()` bytes of file data so far,
/// `entries()` listed so far, `charged()` the bytes of disk it has taken (data, a block an
/// entry, xattrs), `allow(total)` how many it may take (a write past them waits, `wanted()`
/// tells for how many), and `cancel()`, which stops it within one chunk (it then
/// raises CaptureCancelled).
#[pyclass(name = "CaptureControl", module = "corral._core", frozen)]
struct PyCaptureControl(Arc<layer::Control>);

#[pymethods]
impl PyCaptureControl {
    #[new]
    fn new() -> Self {
        Self(Arc::new(layer::Control::default()))
    }

    fn copied(&self) -> u64 {
        self.0.copied.load(Ordering::Relaxed)
    }

    fn entries(&self) -> u64 {
        self.0.entries.load(Ordering::Relaxed)
    }

    fn cancel(&self) {
        self.0.stop();
    }

    /// Let the copy take `total` bytes of disk in all (a write past it waits).
    fn allow(&self, total: u64) {
        self.0.allow(total);
    }

    /// What a copy blocked at its allowance needs charged() to reach (0: not blocked).
    fn wanted(&self) -> u64 {
        self.0.wanted()
    }

    /// Bytes of disk the copy has taken: its file data, a block for each entry, xattrs.
    fn charged(&self) -> u64 {
        self.0.charged()
    }

    fn cancelled(&self) -> bool {
        self.0.cancel.load(Ordering::Relaxed)
    }
}

/// Copy a frozen sandbox's overlay upper dirs to a new snapshot layer and hash it in one pass:
/// `parts` is [(n, upper dir, new dir)], a dir is made only for a non-empty upper. Returns
/// (blake3 digest hex of the layer's manifest, bytes of file data). See layer.rs.
/// Bounds: `max_bytes` of file content (apparent size), `max_entries`, `max_depth` levels;
/// passing one raises LayerLimit(what, limit). `control` (a CaptureControl) reports the bytes
/// copied while it runs and cancels it; a cancelled capture raises CaptureCancelled.
#[pyfunction]
#[pyo3(signature = (parts, max_bytes = u64::MAX, max_entries = 1_000_000, max_depth = 512,
                    control = None))]
fn capture_layer(
    py: Python<'_>,
    parts: Vec<(u32, OsString, OsString)>,
    max_bytes: u64,
    max_entries: u64,
    max_depth: usize,
    control: Option<Py<PyCaptureControl>>,
) -> PyResult<(String, u64)> {
    let parts = parts
        .into_iter()
        .map(|(n, src, dst)| {
            let c = |p: OsString| {
                std::ffi::CString::new(p.into_encoded_bytes())
                    .map_err(|_| PyValueError::new_err("a path holds a NUL byte"))
            };
            Ok(layer::Part {
                n,
                src: c(src)?,
                dst: c(dst)?,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let limits = layer::Limits {
        max_bytes,
        max_entries,
        max_depth: max_depth.max(1),
    };
    let ctl = match control {
        Some(c) => c.get().0.clone(),
        None => Arc::new(layer::Control::default()),
    };
    Ok(py.detach(|| layer::capture(&parts, limits, &ctl))?)
}

/// Step timings (name, ns) of the calling thread's last spawn_sandbox or exec_in ("exec_in").
#[pyfunction]
#[pyo3(signature = (what = "spawn_sandbox"))]
fn last_profile(what: &str) -> Vec<(&'static str, u64)> {
    child::last_profile(what)
}

/// A pseudo-terminal pair (master, slave) from the sandbox's devpts, for PTY sessions: pass
/// the slave as stdin/stdout/stderr of exec_in with `tty: True`.
#[pyfunction]
fn pty_open(py: Python<'_>, root_fd: RawFd) -> PyResult<(RawFd, RawFd)> {
    let (m, s) = py.detach(|| fs::pty_open(root_fd))?;
    Ok((m.into_raw_fd(), s.into_raw_fd()))
}

/// The capability names a process started with exec_in keeps (uid 0).
#[pyfunction]
fn shell_capabilities() -> Vec<String> {
    harden::SHELL_CAPS.iter().map(|c| c.to_string()).collect()
}

/// run_code zygote: new mount, network, pid, IPC and UTS namespaces for the caller.
#[pyfunction]
fn zygote_unshare() -> PyResult<()> {
    Ok(zygote::unshare_namespaces()?)
}

/// run_code zygote: SIGKILL the caller when `parent` (its launcher) dies.
#[pyfunction]
fn zygote_die_with_parent(parent: i32) -> PyResult<()> {
    Ok(zygote::die_with_parent(parent)?)
}

/// run_code zygote: switch to a new read-only root on a tmpfs at `root` made of `entries`
/// (kind, src, dst); see zygote.rs for the kinds.
#[pyfunction]
fn zygote_build_root(
    py: Python<'_>,
    root: OsString,
    entries: Vec<(String, OsString, OsString)>,
) -> PyResult<()> {
    let entries: Vec<zygote::Entry> = entries
        .into_iter()
        .map(|(kind, src, dst)| zygote::Entry { kind, src, dst })
        .collect();
    Ok(py.detach(|| zygote::build_root(std::path::Path::new(&root), &entries))?)
}

/// run_code zygote, once its root is built: no_new_privs and the seccomp filter, inherited by
/// every request's child; with `landlock`, also a Landlock domain (abstract unix scope) that
/// all its children share (a session's commands, which must see and signal each other).
#[pyfunction]
#[pyo3(signature = (landlock = false))]
fn zygote_seal(landlock: bool) -> PyResult<()> {
    Ok(zygote::seal(landlock)?)
}

/// run_code request child (of a sealed zygote): become `uid`/`gid` with no capability,
/// `rlimits` ((name, soft, hard), negative = unlimited), no_new_privs, and with `landlock` a
/// Landlock domain of its own (abstract unix scope).
#[pyfunction]
#[pyo3(signature = (uid, gid, rlimits, landlock = true))]
fn zygote_lockdown(
    uid: u32,
    gid: u32,
    rlimits: Vec<(String, i128, i128)>,
    landlock: bool,
) -> PyResult<()> {
    let rlimits = rlimits
        .iter()
        .map(|(n, s, h)| harden::rlimit(n, *s, *h))
        .collect::<Result<Vec<Rlimit>, HardenError>>()?;
    Ok(zygote::lockdown(&zygote::Lockdown {
        uid,
        gid,
        rlimits,
        landlock,
    })?)
}

/// run_code: what a request's child of one slot does to itself before its request (see
/// zygote.rs `ChildEntry`), made once per slot by the zygote; `enter` runs in the child.
#[pyclass(name = "ZygoteEntry", module = "corral._core", frozen)]
struct PyZygoteEntry(zygote::ChildEntry);

#[pymethods]
impl PyZygoteEntry {
    /// `join`: open membership files of the slot's cgroups (the caller keeps them open);
    /// `dir`: the working directory; the rest as for `zygote_lockdown`.
    #[new]
    #[pyo3(signature = (*, join, dir, umask, uid, gid, rlimits, landlock = true))]
    fn new(
        join: Vec<RawFd>,
        dir: OsString,
        umask: u32,
        uid: u32,
        gid: u32,
        rlimits: Vec<(String, i128, i128)>,
        landlock: bool,
    ) -> PyResult<Self> {
        let rlimits = rlimits
            .iter()
            .map(|(n, s, h)| harden::rlimit(n, *s, *h))
            .collect::<Result<Vec<Rlimit>, HardenError>>()?;
        let dir = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(dir.as_os_str()))
            .map_err(|_| PyValueError::new_err("dir contains a NUL byte"))?;
        Ok(Self(zygote::ChildEntry {
            join,
            dir,
            umask: umask as libc::mode_t,
            lockdown: zygote::Lockdown {
                uid,
                gid,
                rlimits,
                landlock,
            },
        }))
    }

    /// In the forked child: join the cgroups, setsid, place `stdio` ((src, dst, cloexec),
    /// targets 0..n), close the fds from n on, chdir, umask, lock down.
    fn enter(&self, stdio: Vec<(RawFd, RawFd, bool)>) -> PyResult<()> {
        let stdio: Vec<zygote::Stdio> = stdio
            .into_iter()
            .map(|(src, dst, cloexec)| zygote::Stdio { src, dst, cloexec })
            .collect();
        Ok(self.0.enter(&stdio)?)
    }
}

fn before_fork() {
    // SAFETY: called with the GIL held (the fork server runs inside a Python call).
    unsafe { pyo3::ffi::PyOS_BeforeFork() }
}

fn after_fork_parent() {
    // SAFETY: as above, after a fork in the parent.
    unsafe { pyo3::ffi::PyOS_AfterFork_Parent() }
}

fn after_fork_child() {
    // SAFETY: as above, first thing in the child.
    unsafe { pyo3::ffi::PyOS_AfterFork_Child() }
}

/// run_code: the zygote's fork server (zygote.rs `fork_server`) on the SOCK_SEQPACKET
/// `sock`. Returns only in a request's child: (slot, request fd, stdout, stderr, started fd).
#[pyfunction]
fn zygote_fork_server(sock: RawFd) -> PyResult<(u32, RawFd, RawFd, RawFd, RawFd)> {
    let hooks = zygote::ForkHooks {
        before: before_fork,
        after_parent: after_fork_parent,
        after_child: after_fork_child,
    };
    let f = zygote::fork_server(sock, &hooks)?;
    Ok((f.slot, f.ctl, f.out, f.err, f.go))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Reserve the low fd slots children borrow while the importer holds few fds (child.rs).
    child::slots();
    m.add_class::<PySpawnConfig>()?;
    m.add_class::<PyExecConfig>()?;
    m.add_class::<PyOverlay>()?;
    m.add_class::<PyCaptureControl>()?;
    m.add_class::<PyZygoteEntry>()?;
    m.add_function(wrap_pyfunction!(init_memfd, m)?)?;
    m.add_function(wrap_pyfunction!(lockdown_binary, m)?)?;
    m.add_function(wrap_pyfunction!(seccomp_filter, m)?)?;
    m.add_function(wrap_pyfunction!(spawn_sandbox, m)?)?;
    m.add_function(wrap_pyfunction!(exec_in, m)?)?;
    m.add_function(wrap_pyfunction!(harden_daemon, m)?)?;
    m.add_function(wrap_pyfunction!(netns_new, m)?)?;
    m.add_function(wrap_pyfunction!(netns_of, m)?)?;
    m.add_function(wrap_pyfunction!(netns_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(netns_socket, m)?)?;
    m.add_function(wrap_pyfunction!(veth_setup, m)?)?;
    m.add_function(wrap_pyfunction!(nft_destroy_elements, m)?)?;
    m.add_function(wrap_pyfunction!(nft_add_elements, m)?)?;
    m.add_function(wrap_pyfunction!(nft_swap_elements, m)?)?;
    m.add_function(wrap_pyfunction!(nft_get_counter, m)?)?;
    m.add_function(wrap_pyfunction!(nft_dump_counters, m)?)?;
    m.add_function(wrap_pyfunction!(mount_tmpfs, m)?)?;
    m.add_function(wrap_pyfunction!(umount, m)?)?;
    m.add_function(wrap_pyfunction!(mount_loop, m)?)?;
    m.add_function(wrap_pyfunction!(mount_file_ro, m)?)?;
    m.add_function(wrap_pyfunction!(btrfs_quota_enable, m)?)?;
    m.add_function(wrap_pyfunction!(btrfs_subvol_create, m)?)?;
    m.add_function(wrap_pyfunction!(btrfs_subvol_delete, m)?)?;
    m.add_function(wrap_pyfunction!(bind_readonly, m)?)?;
    m.add_function(wrap_pyfunction!(mount_cgroups_in, m)?)?;
    m.add_function(wrap_pyfunction!(rebind_in, m)?)?;
    m.add_function(wrap_pyfunction!(umount_detach, m)?)?;
    m.add_function(wrap_pyfunction!(landlock_abi, m)?)?;
    m.add_function(wrap_pyfunction!(root_fd, m)?)?;
    m.add_function(wrap_pyfunction!(init_channel, m)?)?;
    m.add_function(wrap_pyfunction!(fs_read, m)?)?;
    m.add_function(wrap_pyfunction!(fs_open_read, m)?)?;
    m.add_function(wrap_pyfunction!(fs_open_write, m)?)?;
    m.add_function(wrap_pyfunction!(remove_tree, m)?)?;
    m.add("ForbiddenPath", m.py().get_type::<ForbiddenPath>())?;
    m.add("LayerLimit", m.py().get_type::<LayerLimit>())?;
    m.add("NotCached", m.py().get_type::<NotCached>())?;
    m.add("CaptureCancelled", m.py().get_type::<CaptureCancelled>())?;
    m.add_function(wrap_pyfunction!(fs_write, m)?)?;
    m.add_function(wrap_pyfunction!(fs_list, m)?)?;
    m.add_function(wrap_pyfunction!(fs_list_page, m)?)?;
    m.add_function(wrap_pyfunction!(btrfs_subvol_id, m)?)?;
    m.add_function(wrap_pyfunction!(fs_stat, m)?)?;
    m.add_function(wrap_pyfunction!(fs_is_dir, m)?)?;
    m.add_function(wrap_pyfunction!(fs_mkdir, m)?)?;
    m.add_function(wrap_pyfunction!(fs_remove, m)?)?;
    m.add_function(wrap_pyfunction!(fs_rename, m)?)?;
    m.add_function(wrap_pyfunction!(fs_symlink, m)?)?;
    m.add_function(wrap_pyfunction!(fs_readlink, m)?)?;
    m.add_function(wrap_pyfunction!(fs_chmod, m)?)?;
    m.add_function(wrap_pyfunction!(fs_chown, m)?)?;
    m.add_function(wrap_pyfunction!(pty_open, m)?)?;
    m.add_function(wrap_pyfunction!(capture_layer, m)?)?;
    m.add_function(wrap_pyfunction!(shell_capabilities, m)?)?;
    m.add_function(wrap_pyfunction!(last_profile, m)?)?;
    m.add_function(wrap_pyfunction!(zygote_unshare, m)?)?;
    m.add_function(wrap_pyfunction!(zygote_die_with_parent, m)?)?;
    m.add_function(wrap_pyfunction!(zygote_build_root, m)?)?;
    m.add_function(wrap_pyfunction!(zygote_lockdown, m)?)?;
    m.add_function(wrap_pyfunction!(zygote_fork_server, m)?)?;
    m.add_function(wrap_pyfunction!(zygote_seal, m)?)?;
    m.add("DEFAULT_PATH", enter::DEFAULT_PATH)?;
    Ok(())
}
