//! Hardening shared by the sandbox init (`spawn`) and every process started in a sandbox
//! (`enter`): capabilities, no_new_privs, the seccomp filter and rlimits.
//!
//! Everything is split in two halves. The *prepare* half (plain Rust, may allocate, runs in the
//! daemon before the fork) parses names, computes capability masks and compiles the BPF program.
//! The *apply* half (`unsafe fn`s taking only plain data) runs in the forked child, where only
//! async-signal-safe work is allowed: each is a handful of raw syscalls, no allocation, no locks,
//! no glibc wrappers that talk to other threads (see `set_ids`).

use std::sync::OnceLock;

use caps::Capability;
use libc::{c_int, c_long};

#[derive(Debug, thiserror::Error)]
pub enum HardenError {
    #[error("unknown rlimit {0:?} (known: {known})", known = RLIMIT_NAMES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(" "))]
    UnknownRlimit(String),
    #[error("rlimit {name}: soft limit {soft} is above the hard limit {hard}")]
    RlimitOrder { name: String, soft: u64, hard: u64 },
    #[error("building the seccomp filter: {0}")]
    Seccomp(String),
}

// ---------------------------------------------------------------------------------------------
// rlimits

/// One resource limit, ready for `prlimit64` in the child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rlimit {
    pub resource: c_int,
    pub soft: u64,
    pub hard: u64,
}

/// Infinity as the kernel spells it.
pub const RLIM_INFINITY: u64 = u64::MAX;

const RLIMIT_NAMES: &[(&str, c_int)] = &[
    ("as", libc::RLIMIT_AS as c_int),
    ("core", libc::RLIMIT_CORE as c_int),
    ("cpu", libc::RLIMIT_CPU as c_int),
    ("data", libc::RLIMIT_DATA as c_int),
    ("fsize", libc::RLIMIT_FSIZE as c_int),
    ("locks", libc::RLIMIT_LOCKS as c_int),
    ("memlock", libc::RLIMIT_MEMLOCK as c_int),
    ("msgqueue", libc::RLIMIT_MSGQUEUE as c_int),
    ("nice", libc::RLIMIT_NICE as c_int),
    ("nofile", libc::RLIMIT_NOFILE as c_int),
    ("nproc", libc::RLIMIT_NPROC as c_int),
    ("rss", libc::RLIMIT_RSS as c_int),
    ("rtprio", libc::RLIMIT_RTPRIO as c_int),
    ("rttime", libc::RLIMIT_RTTIME as c_int),
    ("sigpending", libc::RLIMIT_SIGPENDING as c_int),
    ("stack", libc::RLIMIT_STACK as c_int),
];

/// `name` is `nofile`, `RLIMIT_NOFILE` or `NOFILE`; a negative value means unlimited.
pub fn rlimit(name: &str, soft: i128, hard: i128) -> Result<Rlimit, HardenError> {
    let lower = name.to_ascii_lowercase();
    let short = lower.strip_prefix("rlimit_").unwrap_or(&lower);
    let resource = RLIMIT_NAMES
        .iter()
        .find(|(n, _)| *n == short)
        .map(|(_, r)| *r)
        .ok_or_else(|| HardenError::UnknownRlimit(name.to_string()))?;
    let conv = |v: i128| {
        if v < 0 || v >= u64::MAX as i128 {
            RLIM_INFINITY
        } else {
            v as u64
        }
    };
    let (soft, hard) = (conv(soft), conv(hard));
    if soft > hard {
        return Err(HardenError::RlimitOrder {
            name: name.to_string(),
            soft,
            hard,
        });
    }
    Ok(Rlimit {
        resource,
        soft,
        hard,
    })
}

/// Parent half: without CAP_SYS_RESOURCE a hard limit cannot be raised above our own, so
/// clamp each request to the current hard limit (soft follows) instead of failing the spawn.
pub fn clamp_rlimits(limits: &[Rlimit]) -> Vec<Rlimit> {
    let can_raise =
        caps::has_cap(None, caps::CapSet::Effective, Capability::CAP_SYS_RESOURCE).unwrap_or(false);
    limits
        .iter()
        .map(|l| {
            if can_raise {
                return *l;
            }
            let mut cur = [0u64; 2];
            // SAFETY: prlimit64(0, resource, NULL, &cur) reads our limit into a valid buffer.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_prlimit64,
                    0 as c_long,
                    l.resource as c_long,
                    std::ptr::null::<u64>(),
                    cur.as_mut_ptr(),
                )
            };
            if rc < 0 || l.hard <= cur[1] {
                return *l;
            }
            Rlimit {
                resource: l.resource,
                soft: l.soft.min(cur[1]),
                hard: cur[1],
            }
        })
        .collect()
}

/// `strerror` without std's " (os error N)" suffix.
pub fn strerror(errno: c_int) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.rfind(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// Child half: set every limit. Returns the errno of the first failure.
///
/// # Safety
/// Async-signal-safe: raw `prlimit64` syscalls only.
pub unsafe fn apply_rlimits(limits: &[Rlimit]) -> Result<(), c_int> {
    for l in limits {
        let new = [l.soft, l.hard];
        // SAFETY: prlimit64(0 = self, resource, new, NULL): `new` is a valid struct rlimit64
        // (two u64) on our stack for the duration of the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_prlimit64,
                0 as c_long,
                l.resource as c_long,
                new.as_ptr(),
                std::ptr::null_mut::<u64>(),
            )
        };
        check(rc)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// capabilities

/// The capabilities of a normal root shell in a sandbox (cf. the Docker default set, minus
/// MKNOD, NET_RAW and SYS_CHROOT). Never SYS_CHROOT: the root switch is a chroot, and a second
/// chroot is the classic way out of one.
pub const SHELL_CAPS: &[Capability] = &[
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FOWNER,
    Capability::CAP_FSETID,
    Capability::CAP_KILL,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_AUDIT_WRITE,
    Capability::CAP_SETFCAP,
];

pub fn shell_caps_mask() -> u64 {
    SHELL_CAPS.iter().fold(0u64, |m, c| m | c.bitmask())
}

/// Highest capability number this kernel knows (read once).
pub fn last_cap() -> u32 {
    static LAST: OnceLock<u32> = OnceLock::new();
    *LAST.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .or_else(|| {
                caps::runtime::thread_all_supported()
                    .iter()
                    .map(|c| u32::from(c.index()))
                    .max()
            })
            .unwrap_or(40)
            .min(63)
    })
}

/// What the child does with its capabilities, computed before the fork.
#[derive(Debug, Clone, Copy)]
pub struct CapPlan {
    /// Bounding-set bits to keep; every other capability up to `last_cap` is dropped.
    pub bounding: u64,
    /// Effective = permitted = inheritable after the credentials switch (0 for non-root users).
    pub sets: u64,
    pub last_cap: u32,
}

impl CapPlan {
    /// The normal-shell set for uid 0; nothing but the bounding set for other users.
    pub fn shell(uid: u32) -> Self {
        let mask = shell_caps_mask();
        CapPlan {
            bounding: mask,
            sets: if uid == 0 { mask } else { 0 },
            last_cap: last_cap(),
        }
    }
}

/// Child half, step 1: shrink the bounding set and clear the ambient set. Needs CAP_SETPCAP,
/// so it runs before the credentials switch.
///
/// # Safety
/// Async-signal-safe: raw prctl calls only.
pub unsafe fn drop_bounding(plan: &CapPlan) -> Result<(), c_int> {
    for cap in 0..=plan.last_cap {
        if plan.bounding & (1u64 << cap) != 0 {
            continue;
        }
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            let e = errno();
            // EINVAL: a capability this kernel does not have; nothing to drop.
            if e != libc::EINVAL {
                return Err(e);
            }
        }
    }
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    check(rc as c_long)
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Child half, step 2 (after `set_ids`): effective = permitted = inheritable = `plan.sets`.
///
/// # Safety
/// Async-signal-safe: one raw capset syscall.
pub unsafe fn apply_caps(plan: &CapPlan) -> Result<(), c_int> {
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let lo = plan.sets as u32;
    let hi = (plan.sets >> 32) as u32;
    let data = [
        CapData {
            effective: lo,
            permitted: lo,
            inheritable: lo,
        },
        CapData {
            effective: hi,
            permitted: hi,
            inheritable: hi,
        },
    ];
    // SAFETY: capset(header, data[2]) with valid pointers to our stack for the call's duration.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) };
    check(rc)
}

/// Child half: supplementary groups, then gid, then uid, as raw syscalls.
///
/// glibc's setgroups/setresuid/setresgid broadcast the change to every thread of the process
/// (nptl "setxid" signals). In a CLONE_VM child that still shares the daemon's memory, glibc
/// believes the daemon's threads are its own and would change *their* credentials: never call
/// the wrappers after the clone.
///
/// # Safety
/// Async-signal-safe: three raw syscalls on caller-provided data.
pub unsafe fn set_ids(uid: u32, gid: u32, groups: &[libc::gid_t]) -> Result<(), c_int> {
    // SAFETY: setgroups(n, ptr) with a valid slice (ptr may dangle when n == 0, which the kernel
    // never reads).
    check(unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) })?;
    // SAFETY: integer arguments only.
    check(unsafe { libc::syscall(libc::SYS_setresgid, gid, gid, gid) })?;
    // SAFETY: integer arguments only.
    check(unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, uid) })
}

/// # Safety
/// Async-signal-safe: one prctl.
pub unsafe fn no_new_privs() -> Result<(), c_int> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } as c_long)
}

/// `oom_score_adj` of every sandbox process (its init and every command): the OOM killer picks
/// sandboxes long before the daemon, which runs at a strongly negative value of its own.
pub const SANDBOX_OOM_SCORE_ADJ: &[u8] = b"500";

/// Child half, while it still holds CAP_SYS_RESOURCE and sees the host's /proc: set the
/// process's `oom_score_adj`. Written with CAP_SYS_RESOURCE, the value also becomes its
/// `oom_score_adj_min`, inherited by every descendant, so sandbox code (which holds no
/// CAP_SYS_RESOURCE) can raise its score but never lower it below this one. The child is a
/// CLONE_VFORK child: the kernel changes its own value only, not the daemon's it shares memory
/// with.
///
/// # Safety
/// Async-signal-safe: raw open/write/close.
pub unsafe fn set_sandbox_oom_score_adj() -> Result<(), c_int> {
    // SAFETY: a NUL-terminated literal path; flags only.
    let fd = unsafe {
        libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        )
    };
    check(fd as c_long)?;
    let v = SANDBOX_OOM_SCORE_ADJ;
    // SAFETY: `v` is a valid buffer of `v.len()` bytes; `fd` is ours.
    let rc = unsafe { libc::write(fd, v.as_ptr() as *const libc::c_void, v.len()) } as c_long;
    let res = check(rc);
    // SAFETY: closing the fd opened above.
    unsafe { libc::close(fd) };
    res
}

// ---------------------------------------------------------------------------------------------
// seccomp

/// clone(2) flags that make new namespaces; CLONE_NEWTIME is not a valid clone() flag (it
/// aliases the exit-signal byte) and only exists for clone3/unshare, both refused outright.
const CLONE_NEW_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
];

/// When a syscall of `syscall_policy` is refused, and with which errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    /// Always, with EPERM.
    Always,
    /// With EPERM, only when its first argument, a pid in the caller's pid namespace, is this
    /// one (the low 32 bits: the kernel reads a `pid_t`). Pid 1 is the sandbox's init: nothing
    /// in the sandbox may queue it a signal with a siginfo of its own making, change its
    /// rlimits or its scheduling policy.
    Pid(u32),
    /// With EINVAL, only when its third argument is one of these (the low 32 bits: the kernel
    /// reads an `int`). EINVAL is what a kernel without the value answers, which programs
    /// already handle; EPERM would read as a permission problem the caller might retry around.
    Arg2In(&'static [u32]),
    /// With ENOTTY (what a filesystem answers to an ioctl it does not know), only when its
    /// second argument, an ioctl command (the low 32 bits: the kernel reads an `unsigned
    /// int`), is of this ioctl type (its bits 8-15) and not one of `allow`.
    IoctlType { ty: u8, allow: &'static [u32] },
    /// With EPERM, unless its first argument is exactly this value (all 64 bits).
    Arg0Not(u64),
}

/// The btrfs ioctls' type. Making a subvolume needs no privilege, and a subvolume made inside
/// a sandbox's own (its writable layer on the btrfs scratch) has a quota group of its own, with
/// no limit: its writes escaped the sandbox's `disk_mb` (up to the whole scratch, its own "disk
/// full" then reading as the host's) and the daemon could not delete the sandbox's subvolume
/// (ENOTEMPTY). Snapshots, received-subvolume flags, subvolume flags (read-only) and the
/// subvolume info calls are the same kind: a sandbox has no use for any of them.
const BTRFS_IOCTL_TYPE: u8 = 0x94;
/// The generic VFS ioctls that share the btrfs type, allowed: reflinks (`cp --reflink`) and
/// dedupe, whose extents the sandbox's quota group counts.
const FICLONE: u32 = 0x4004_9409;
const FICLONERANGE: u32 = 0x4020_940d;
const FIDEDUPERANGE: u32 = 0xc018_9436;

/// madvise advice that moves the caller's own pages towards swap whatever the cgroup's
/// swappiness: MADV_COLD (deactivate) and MADV_PAGEOUT (reclaim now). On cgroup v1 a sandbox's
/// memory+swap limit is one page above its memory limit, and that page is the evidence that an
/// OOM was its own (docs/trajectory.md, "Whose OOM"): pages of its own pushed to swap fill it,
/// memory+swap then refuses first, no fail count rises, and the sandbox's own OOM reads as the
/// host's (infra, masked). Nothing a program needs: both are hints, refused as an older kernel
/// refuses them.
const MADV_TO_SWAP: &[u32] = &[libc::MADV_COLD as u32, libc::MADV_PAGEOUT as u32];

/// One refused syscall. Numbers the `libc` crate lacks are spelled out (they are the same on
/// x86_64 and aarch64: every syscall from 424 on has one number on every arch).
#[derive(Clone, Copy, Debug)]
struct Deny {
    name: &'static str,
    nr: c_long,
    when: When,
}

const fn deny(name: &'static str, nr: c_long) -> Deny {
    Deny {
        name,
        nr,
        when: When::Always,
    }
}

const SYS_STATMOUNT: c_long = 457;
const SYS_LISTMOUNT: c_long = 458;
const SYS_OPEN_TREE_ATTR: c_long = 467;
const SYS_MEMFD_SECRET: c_long = 447;

/// The syscall policy, as data (docs/architecture.md has the list and the reasons): every
/// syscall not here, and not `clone`/`clone3`/`socket` (see `build_filter`), is allowed.
fn syscall_policy() -> Vec<Deny> {
    let mut v = vec![
        // mounts and the root switch
        deny("mount", libc::SYS_mount),
        deny("umount2", libc::SYS_umount2),
        deny("pivot_root", libc::SYS_pivot_root),
        deny("chroot", libc::SYS_chroot),
        deny("move_mount", libc::SYS_move_mount),
        deny("open_tree", libc::SYS_open_tree),
        deny("open_tree_attr", SYS_OPEN_TREE_ATTR),
        deny("fsopen", libc::SYS_fsopen),
        deny("fsconfig", libc::SYS_fsconfig),
        deny("fsmount", libc::SYS_fsmount),
        deny("fspick", libc::SYS_fspick),
        deny("mount_setattr", libc::SYS_mount_setattr),
        // the host's mount table (mount ids of every namespace)
        deny("statmount", SYS_STATMOUNT),
        deny("listmount", SYS_LISTMOUNT),
        // namespaces
        deny("unshare", libc::SYS_unshare),
        deny("setns", libc::SYS_setns),
        // the kernel itself
        deny("kexec_load", libc::SYS_kexec_load),
        deny("kexec_file_load", libc::SYS_kexec_file_load),
        deny("init_module", libc::SYS_init_module),
        deny("finit_module", libc::SYS_finit_module),
        deny("delete_module", libc::SYS_delete_module),
        deny("bpf", libc::SYS_bpf),
        deny("keyctl", libc::SYS_keyctl),
        deny("add_key", libc::SYS_add_key),
        deny("request_key", libc::SYS_request_key),
        deny("perf_event_open", libc::SYS_perf_event_open),
        // fanotify marks (no capability needed with FAN_REPORT_FID) on the inodes sandboxes
        // share (the daemon's /dev, lxcfs's /proc files) report other sandboxes' opens and
        // reads; nothing a program needs (inotify, which file watchers use, is allowed)
        deny("fanotify_mark", libc::SYS_fanotify_mark),
        deny("userfaultfd", libc::SYS_userfaultfd),
        // secret memory is taken out of the kernel's direct map, whose huge pages it splits
        // for good: one command's 160 MiB turned 3 GiB of the host's direct map into 4 KiB
        // pages (a 1 GiB page among them), a TLB cost every tenant's kernel work then pays
        deny("memfd_secret", SYS_MEMFD_SECRET),
        deny("open_by_handle_at", libc::SYS_open_by_handle_at),
        deny("name_to_handle_at", libc::SYS_name_to_handle_at),
        deny("swapon", libc::SYS_swapon),
        deny("swapoff", libc::SYS_swapoff),
        deny("reboot", libc::SYS_reboot),
        deny("settimeofday", libc::SYS_settimeofday),
        deny("clock_settime", libc::SYS_clock_settime),
        deny("clock_adjtime", libc::SYS_clock_adjtime),
        deny("adjtimex", libc::SYS_adjtimex),
        deny("syslog", libc::SYS_syslog),
        deny("acct", libc::SYS_acct),
        deny("quotactl", libc::SYS_quotactl),
        deny("quotactl_fd", libc::SYS_quotactl_fd),
        deny("vhangup", libc::SYS_vhangup),
        deny("io_uring_setup", libc::SYS_io_uring_setup),
        deny("io_uring_enter", libc::SYS_io_uring_enter),
        deny("io_uring_register", libc::SYS_io_uring_register),
        // other processes' memory, fds and kernel objects
        deny("ptrace", libc::SYS_ptrace),
        deny("process_vm_readv", libc::SYS_process_vm_readv),
        deny("process_vm_writev", libc::SYS_process_vm_writev),
        deny("process_madvise", libc::SYS_process_madvise),
        deny("pidfd_getfd", libc::SYS_pidfd_getfd),
        deny("kcmp", libc::SYS_kcmp),
        // btrfs' own calls (BTRFS_IOCTL_TYPE)
        Deny {
            name: "ioctl",
            nr: libc::SYS_ioctl,
            when: When::IoctlType {
                ty: BTRFS_IOCTL_TYPE,
                allow: &[FICLONE, FICLONERANGE, FIDEDUPERANGE],
            },
        },
        // its own pages to swap (MADV_TO_SWAP): the v1 OOM evidence
        Deny {
            name: "madvise",
            nr: libc::SYS_madvise,
            when: When::Arg2In(MADV_TO_SWAP),
        },
        // the sandbox's init
        Deny {
            name: "rt_sigqueueinfo",
            nr: libc::SYS_rt_sigqueueinfo,
            when: When::Pid(1),
        },
        Deny {
            name: "rt_tgsigqueueinfo",
            nr: libc::SYS_rt_tgsigqueueinfo,
            when: When::Pid(1),
        },
        Deny {
            name: "prlimit64",
            nr: libc::SYS_prlimit64,
            when: When::Pid(1),
        },
        // SCHED_IDLE would starve the init's exec service whenever the sandbox is busy
        Deny {
            name: "sched_setscheduler",
            nr: libc::SYS_sched_setscheduler,
            when: When::Pid(1),
        },
        Deny {
            name: "sched_setattr",
            nr: libc::SYS_sched_setattr,
            when: When::Pid(1),
        },
        Deny {
            name: "sched_setparam",
            nr: libc::SYS_sched_setparam,
            when: When::Pid(1),
        },
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        deny("iopl", libc::SYS_iopl),
        deny("ioperm", libc::SYS_ioperm),
        deny("lookup_dcookie", libc::SYS_lookup_dcookie),
        deny("nfsservctl", libc::SYS_nfsservctl),
        deny("uselib", libc::SYS_uselib),
        // per-process segment descriptors: only 16-bit and Wine code needs them, and the
        // kernel's LDT code has had use-after-free bugs (CVE-2017-17053)
        deny("modify_ldt", libc::SYS_modify_ldt),
    ]);
    #[cfg(target_arch = "aarch64")]
    v.extend([
        deny("lookup_dcookie", libc::SYS_lookup_dcookie),
        deny("nfsservctl", libc::SYS_nfsservctl),
    ]);
    v
}

/// What the process tier (run_code requests, process sessions) may not do beyond
/// `syscall_policy`, whose rule for the same syscall it replaces: its processes see the host's
/// own OS directories (bind mounts, not a copy), so an inotify watch on them would report every
/// open of those files anywhere on the host: host processes' and other tenants' requests alike
/// (fanotify marks are refused everywhere: `syscall_policy`). And
/// `unshare` with exactly CLONE_NEWCGROUP: a request's child (a command's), after joining its
/// cgroups and before dropping its capabilities, takes a cgroup namespace of its own under the
/// zygote's filter (`zygote::lockdown`). Once they are dropped the kernel refuses it
/// (CAP_SYS_ADMIN), and every other flag, CLONE_NEWUSER with it included, stays refused here.
fn host_view_policy() -> Vec<Deny> {
    vec![
        deny("inotify_add_watch", libc::SYS_inotify_add_watch),
        Deny {
            name: "unshare",
            nr: libc::SYS_unshare,
            when: When::Arg0Not(libc::CLONE_NEWCGROUP as u64),
        },
    ]
}

/// What `socket(family, type, protocol)` may make, by family (network modes other than
/// "disabled", which allows AF_UNIX only); a family not here is allowed.
#[derive(Clone, Copy, Debug)]
enum FamilyRule {
    /// EAFNOSUPPORT, as if the kernel did not have it.
    Refuse,
    /// Only these protocols (args[2]); any other: EPROTONOSUPPORT.
    Only(&'static [u32]),
}

const NETLINK_ROUTE: u32 = 0;
const NETLINK_SOCK_DIAG: u32 = 4;

const SOCKET_POLICY: &[(c_int, FamilyRule)] = &[
    // Not confined by network namespaces: on a VM it reaches the hypervisor's services.
    (libc::AF_VSOCK, FamilyRule::Refuse),
    // The kernel's crypto API: a large attack surface no normal program needs.
    (libc::AF_ALG, FamilyRule::Refuse),
    // ROUTE (ip, getifaddrs, getaddrinfo's AI_ADDRCONFIG) and SOCK_DIAG (ss) only: the others
    // (generic netlink families, audit, uevents, netfilter, xfrm...) reach host-wide kernel
    // subsystems a sandbox has no use for.
    (
        libc::AF_NETLINK,
        FamilyRule::Only(&[NETLINK_ROUTE, NETLINK_SOCK_DIAG]),
    ),
];

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 62 | 0x8000_0000 | 0x4000_0000;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 183 | 0x8000_0000 | 0x4000_0000;
/// x86_64 runs x32-ABI syscalls with bit 30 set in the number, under the x86_64 audit arch; a
/// filter that only compares numbers must refuse them or `mount | 0x40000000` walks past it.
#[cfg(target_arch = "x86_64")]
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
#[cfg(not(target_arch = "x86_64"))]
const X32_SYSCALL_BIT: u32 = u32::MAX;

const BPF_LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const BPF_JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const BPF_JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
const BPF_JSET_K: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
const BPF_RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
const BPF_AND_K: u16 = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;

/// Offsets in `struct seccomp_data`.
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
/// Low 32 bits of args[0] (little-endian; every CLONE_NEW* bit lives there).
#[cfg(target_endian = "little")]
const OFF_ARG0_LO: u32 = 16;
#[cfg(target_endian = "big")]
const OFF_ARG0_LO: u32 = 20;

/// Low 32 bits of args[1] (ioctl's command).
#[cfg(target_endian = "little")]
const OFF_ARG1_LO: u32 = 24;
#[cfg(target_endian = "big")]
const OFF_ARG1_LO: u32 = 28;
/// High 32 bits of args[0].
#[cfg(target_endian = "little")]
const OFF_ARG0_HI: u32 = 20;
#[cfg(target_endian = "big")]
const OFF_ARG0_HI: u32 = 16;

/// Low 32 bits of args[2] (socket's protocol).
#[cfg(target_endian = "little")]
const OFF_ARG2_LO: u32 = 32;
#[cfg(target_endian = "big")]
const OFF_ARG2_LO: u32 = 36;

/// Where a jump goes, resolved after layout.
#[derive(Clone, Copy, Debug)]
enum Tgt {
    Next,
    At(usize),
    Allow,
    Eperm,
    Enosys,
    Kill,
    Eafnosupport,
    Eprotonosupport,
    CloneCheck,
    SocketCheck,
    /// The check "args[0] == pid" (`When::Pid`).
    PidCheck(u32),
    /// The check "args[2] in values" (`When::Arg2In`) of the policy's syscall with this number.
    Arg2Check(u32),
    /// The check of `When::IoctlType` of the policy's syscall with this number.
    IoctlCheck(u32),
    /// The check "args[0] is the value" (`When::Arg0Not`) of the policy's syscall with this
    /// number.
    Arg0Check(u32),
    Einval,
    Enotty,
}

struct Ins {
    code: u16,
    jt: Tgt,
    jf: Tgt,
    k: u32,
}

fn ins(code: u16, k: u32, jt: Tgt, jf: Tgt) -> Ins {
    Ins { code, jt, jf, k }
}

/// Balanced comparison tree over the sorted syscall numbers of the policy, each with where a
/// match goes: ~log2(n) comparisons per syscall instead of a linear chain. Besides the
/// per-call cost, this is what makes installing the filter cheap: the kernel emulates the
/// filter for every syscall number at attach time (the seccomp action cache), so the cost of
/// attaching grows with the path length.
fn emit_tree(out: &mut Vec<Ins>, nrs: &[(u32, Tgt)]) {
    if nrs.len() <= 3 {
        for (i, &(nr, hit)) in nrs.iter().enumerate() {
            let miss = if i + 1 == nrs.len() {
                Tgt::Allow
            } else {
                Tgt::Next
            };
            out.push(ins(BPF_JEQ_K, nr, hit, miss));
        }
        return;
    }
    let mid = nrs.len() / 2;
    let node = out.len();
    out.push(ins(BPF_JGE_K, nrs[mid].0, Tgt::Next, Tgt::Next));
    emit_tree(out, &nrs[..mid]);
    out[node].jt = Tgt::At(out.len());
    emit_tree(out, &nrs[mid..]);
}

/// The filter (see docs/architecture.md): foreign arch -> kill; x32 ABI numbers and clone3 ->
/// ENOSYS (libcs then fall back to clone, whose flags a filter can read); clone with any
/// CLONE_NEW* flag -> EPERM; socket() by `SOCKET_POLICY`; `syscall_policy` -> EPERM (EINVAL for
/// `When::Arg2In`); everything else allowed. `unix_only` (network "disabled"): socket() and socketpair() with
/// any family but AF_UNIX -> EAFNOSUPPORT (the family is args[0]: a filter can read it).
fn build_filter(unix_only: bool, host_view: bool) -> Result<Vec<libc::sock_filter>, HardenError> {
    let mut policy = syscall_policy();
    if host_view {
        let more = host_view_policy();
        policy.retain(|d| more.iter().all(|m| m.nr != d.nr));
        policy.extend(more);
    }
    policy.sort_unstable_by_key(|d| d.nr);
    if let Some(w) = policy.windows(2).find(|w| w[0].nr == w[1].nr) {
        let (a, b) = (w[0].name, w[1].name);
        return Err(HardenError::Seccomp(format!(
            "{a} and {b}: one syscall number twice in the policy"
        )));
    }
    let nrs: Vec<(u32, Tgt)> = policy
        .iter()
        .map(|d| {
            let hit = match d.when {
                When::Always => Tgt::Eperm,
                When::Pid(pid) => Tgt::PidCheck(pid),
                When::Arg2In(_) => Tgt::Arg2Check(d.nr as u32),
                When::IoctlType { .. } => Tgt::IoctlCheck(d.nr as u32),
                When::Arg0Not(_) => Tgt::Arg0Check(d.nr as u32),
            };
            (d.nr as u32, hit)
        })
        .collect();
    let new_mask = CLONE_NEW_FLAGS.iter().fold(0u64, |m, f| m | f) as u32;

    let mut p = vec![
        ins(BPF_LD_W_ABS, OFF_ARCH, Tgt::Next, Tgt::Next),
        ins(BPF_JEQ_K, AUDIT_ARCH, Tgt::Next, Tgt::Kill),
        ins(BPF_LD_W_ABS, OFF_NR, Tgt::Next, Tgt::Next),
    ];
    if X32_SYSCALL_BIT != u32::MAX {
        p.push(ins(BPF_JGE_K, X32_SYSCALL_BIT, Tgt::Enosys, Tgt::Next));
    }
    p.push(ins(
        BPF_JEQ_K,
        libc::SYS_clone3 as u32,
        Tgt::Enosys,
        Tgt::Next,
    ));
    p.push(ins(
        BPF_JEQ_K,
        libc::SYS_clone as u32,
        Tgt::CloneCheck,
        Tgt::Next,
    ));
    p.push(ins(
        BPF_JEQ_K,
        libc::SYS_socket as u32,
        Tgt::SocketCheck,
        Tgt::Next,
    ));
    if unix_only {
        p.push(ins(
            BPF_JEQ_K,
            libc::SYS_socketpair as u32,
            Tgt::SocketCheck,
            Tgt::Next,
        ));
    }
    emit_tree(&mut p, &nrs);
    let clone_check = p.len();
    p.push(ins(BPF_LD_W_ABS, OFF_ARG0_LO, Tgt::Next, Tgt::Next));
    p.push(ins(BPF_JSET_K, new_mask, Tgt::Eperm, Tgt::Allow));
    let socket_check = p.len();
    p.push(ins(BPF_LD_W_ABS, OFF_ARG0_LO, Tgt::Next, Tgt::Next));
    if unix_only {
        // Only AF_UNIX: no IP, netlink, packet, vsock... socket of any kind can be made.
        p.push(ins(
            BPF_JEQ_K,
            libc::AF_UNIX as u32,
            Tgt::Allow,
            Tgt::Eafnosupport,
        ));
    } else {
        // One comparison per family of the policy; a family's own protocol checks follow
        // the chain (forward jumps only).
        let chain = p.len();
        for (i, &(fam, _)) in SOCKET_POLICY.iter().enumerate() {
            let miss = if i + 1 == SOCKET_POLICY.len() {
                Tgt::Allow
            } else {
                Tgt::Next
            };
            p.push(ins(BPF_JEQ_K, fam as u32, Tgt::Next, miss));
        }
        for (i, &(_, rule)) in SOCKET_POLICY.iter().enumerate() {
            match rule {
                FamilyRule::Refuse => p[chain + i].jt = Tgt::Eafnosupport,
                FamilyRule::Only(protos) => {
                    p[chain + i].jt = Tgt::At(p.len());
                    p.push(ins(BPF_LD_W_ABS, OFF_ARG2_LO, Tgt::Next, Tgt::Next));
                    for (j, &proto) in protos.iter().enumerate() {
                        let miss = if j + 1 == protos.len() {
                            Tgt::Eprotonosupport
                        } else {
                            Tgt::Next
                        };
                        p.push(ins(BPF_JEQ_K, proto, Tgt::Allow, miss));
                    }
                }
            }
        }
    }
    // One "args[0] == pid" check per distinct pid of the policy.
    let mut pid_checks: Vec<(u32, usize)> = Vec::new();
    for &(_, hit) in &nrs {
        if let Tgt::PidCheck(pid) = hit {
            if pid_checks.iter().all(|&(q, _)| q != pid) {
                pid_checks.push((pid, p.len()));
                p.push(ins(BPF_LD_W_ABS, OFF_ARG0_LO, Tgt::Next, Tgt::Next));
                p.push(ins(BPF_JEQ_K, pid, Tgt::Eperm, Tgt::Allow));
            }
        }
    }
    // One "args[2] in values" check per syscall of the policy refused by its third argument.
    let mut arg2_checks: Vec<(u32, usize)> = Vec::new();
    for d in &policy {
        if let When::Arg2In(values) = d.when {
            if values.is_empty() {
                return Err(HardenError::Seccomp(format!("{}: no value", d.name)));
            }
            arg2_checks.push((d.nr as u32, p.len()));
            p.push(ins(BPF_LD_W_ABS, OFF_ARG2_LO, Tgt::Next, Tgt::Next));
            for (j, &v) in values.iter().enumerate() {
                let miss = if j + 1 == values.len() {
                    Tgt::Allow
                } else {
                    Tgt::Next
                };
                p.push(ins(BPF_JEQ_K, v, Tgt::Einval, miss));
            }
        }
    }
    // One "args[1] of this ioctl type and not allowed" check per syscall refused so.
    let mut ioctl_checks: Vec<(u32, usize)> = Vec::new();
    for d in &policy {
        if let When::IoctlType { ty, allow } = d.when {
            ioctl_checks.push((d.nr as u32, p.len()));
            p.push(ins(BPF_LD_W_ABS, OFF_ARG1_LO, Tgt::Next, Tgt::Next));
            for &cmd in allow {
                p.push(ins(BPF_JEQ_K, cmd, Tgt::Allow, Tgt::Next));
            }
            p.push(ins(BPF_AND_K, 0xff00, Tgt::Next, Tgt::Next));
            p.push(ins(BPF_JEQ_K, u32::from(ty) << 8, Tgt::Enotty, Tgt::Allow));
        }
    }
    // One "args[0] is the value" check per syscall of the policy allowed only with it.
    let mut arg0_checks: Vec<(u32, usize)> = Vec::new();
    for d in &policy {
        if let When::Arg0Not(v) = d.when {
            arg0_checks.push((d.nr as u32, p.len()));
            p.push(ins(BPF_LD_W_ABS, OFF_ARG0_LO, Tgt::Next, Tgt::Next));
            p.push(ins(BPF_JEQ_K, v as u32, Tgt::Next, Tgt::Eperm));
            p.push(ins(BPF_LD_W_ABS, OFF_ARG0_HI, Tgt::Next, Tgt::Next));
            p.push(ins(BPF_JEQ_K, (v >> 32) as u32, Tgt::Allow, Tgt::Eperm));
        }
    }
    let (allow, eperm, enosys, kill) = (p.len(), p.len() + 1, p.len() + 2, p.len() + 3);
    let (eafnosupport, eprotonosupport, einval) = (p.len() + 4, p.len() + 5, p.len() + 6);
    let enotty = p.len() + 7;
    let errno_ret = |e: i32| libc::SECCOMP_RET_ERRNO | (e as u32 & libc::SECCOMP_RET_DATA);
    for k in [
        libc::SECCOMP_RET_ALLOW,
        errno_ret(libc::EPERM),
        errno_ret(libc::ENOSYS),
        libc::SECCOMP_RET_KILL_PROCESS,
        errno_ret(libc::EAFNOSUPPORT),
        errno_ret(libc::EPROTONOSUPPORT),
        errno_ret(libc::EINVAL),
        errno_ret(libc::ENOTTY),
    ] {
        p.push(ins(BPF_RET_K, k, Tgt::Next, Tgt::Next));
    }

    let resolve = |i: usize, t: Tgt| -> Result<u8, HardenError> {
        let dest = match t {
            Tgt::Next => i + 1,
            Tgt::At(d) => d,
            Tgt::Allow => allow,
            Tgt::Eperm => eperm,
            Tgt::Enosys => enosys,
            Tgt::Kill => kill,
            Tgt::CloneCheck => clone_check,
            Tgt::SocketCheck => socket_check,
            Tgt::Eafnosupport => eafnosupport,
            Tgt::Eprotonosupport => eprotonosupport,
            Tgt::Einval => einval,
            Tgt::Enotty => enotty,
            Tgt::IoctlCheck(nr) => ioctl_checks
                .iter()
                .find(|&&(q, _)| q == nr)
                .map(|&(_, at)| at)
                .ok_or_else(|| HardenError::Seccomp(format!("no ioctl check for {nr}")))?,
            Tgt::Arg2Check(nr) => arg2_checks
                .iter()
                .find(|&&(q, _)| q == nr)
                .map(|&(_, at)| at)
                .ok_or_else(|| HardenError::Seccomp(format!("no check for syscall {nr}")))?,
            Tgt::Arg0Check(nr) => arg0_checks
                .iter()
                .find(|&&(q, _)| q == nr)
                .map(|&(_, at)| at)
                .ok_or_else(|| HardenError::Seccomp(format!("no check for syscall {nr}")))?,
            Tgt::PidCheck(pid) => pid_checks
                .iter()
                .find(|&&(q, _)| q == pid)
                .map(|&(_, at)| at)
                .ok_or_else(|| HardenError::Seccomp(format!("no check for pid {pid}")))?,
        };
        let off = dest
            .checked_sub(i + 1)
            .ok_or_else(|| HardenError::Seccomp(format!("backward jump at {i}")))?;
        u8::try_from(off).map_err(|_| HardenError::Seccomp(format!("jump too far at {i}")))
    };
    let mut prog = Vec::with_capacity(p.len());
    for (i, x) in p.iter().enumerate() {
        let (jt, jf) = if x.code & 0x07 == libc::BPF_JMP as u16 {
            (resolve(i, x.jt)?, resolve(i, x.jf)?)
        } else {
            (0, 0)
        };
        prog.push(libc::sock_filter {
            code: x.code,
            jt,
            jf,
            k: x.k,
        });
    }
    if prog.len() > libc::BPF_MAXINSNS as usize {
        return Err(HardenError::Seccomp(format!(
            "filter too long: {} insns",
            prog.len()
        )));
    }
    Ok(prog)
}

type Prog = OnceLock<Result<Vec<libc::sock_filter>, String>>;

/// A filter of `build_filter`, built once per daemon in `cell`.
fn built(
    cell: &'static Prog,
    unix_only: bool,
    host_view: bool,
) -> Result<&'static [libc::sock_filter], HardenError> {
    match cell.get_or_init(|| build_filter(unix_only, host_view).map_err(|e| e.to_string())) {
        Ok(p) => Ok(p.as_slice()),
        Err(e) => Err(HardenError::Seccomp(e.clone())),
    }
}

/// The sandbox filter (one for each value of `unix_only`).
pub fn seccomp_program(unix_only: bool) -> Result<&'static [libc::sock_filter], HardenError> {
    static PROG: Prog = OnceLock::new();
    static UNIX_ONLY: Prog = OnceLock::new();
    built(if unix_only { &UNIX_ONLY } else { &PROG }, unix_only, false)
}

/// The process tier's filter: AF_UNIX sockets only, and `host_view_policy` refused too.
pub fn host_view_program() -> Result<&'static [libc::sock_filter], HardenError> {
    static PROG: Prog = OnceLock::new();
    built(&PROG, true, true)
}

// ---------------------------------------------------------------------------------------------
// Landlock scoping (network "disabled")

/// `LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET` (uapi linux/landlock.h, Landlock ABI 6).
const LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1;
/// `LANDLOCK_CREATE_RULESET_VERSION`.
const LANDLOCK_CREATE_RULESET_VERSION: c_long = 1;

/// `struct landlock_ruleset_attr` as of ABI 6.
#[repr(C)]
struct LandlockRulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

/// Parent half: the kernel's Landlock ABI version, or -errno (EOPNOTSUPP: built in but not
/// enabled at boot; ENOSYS: not built).
pub fn landlock_abi() -> i64 {
    // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) only returns a number.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<LandlockRulesetAttr>(),
            0 as c_long,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if rc < 0 {
        -(errno() as i64)
    } else {
        rc as i64
    }
}

/// Child half: put the calling thread in a new Landlock domain that may not connect to an
/// abstract unix socket made outside it. Sandboxes with network "disabled" share one network
/// namespace, which is what scopes abstract socket names: without this, one sandbox could
/// connect to another's `@name`. No filesystem or network access is handled, so nothing else
/// changes. no_new_privs must already be set.
///
/// # Safety
/// Async-signal-safe: three raw syscalls on a struct on our stack.
pub unsafe fn landlock_scope_unix() -> Result<(), c_int> {
    let attr = LandlockRulesetAttr {
        handled_access_fs: 0,
        handled_access_net: 0,
        scoped: LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET,
    };
    // SAFETY: landlock_create_ruleset(&attr, sizeof attr, 0): `attr` outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const LandlockRulesetAttr,
            std::mem::size_of::<LandlockRulesetAttr>() as c_long,
            0 as c_long,
        )
    };
    check(fd)?;
    // SAFETY: landlock_restrict_self(fd, 0) on the ruleset fd just made.
    let rc = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, fd, 0 as c_long) };
    let err = errno();
    // SAFETY: closing the ruleset fd we own.
    unsafe { libc::close(fd as c_int) };
    if rc < 0 {
        return Err(err);
    }
    Ok(())
}

/// Child half: install the filter (no_new_privs must already be set).
///
/// # Safety
/// Async-signal-safe: one raw seccomp syscall; `prog` must stay alive for the call.
pub unsafe fn apply_seccomp(prog: &[libc::sock_filter]) -> Result<(), c_int> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut _,
    };
    // SAFETY: seccomp(SET_MODE_FILTER, 0, &fprog); the kernel copies the program before
    // returning, `fprog` and `prog` outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER as c_long,
            0 as c_long,
            &fprog as *const libc::sock_fprog,
        )
    };
    check(rc)
}

// ---------------------------------------------------------------------------------------------
// helpers for child code

/// The calling thread's errno (a TLS read: async-signal-safe).
#[inline]
pub fn errno() -> c_int {
    // SAFETY: __errno_location always returns a valid pointer to this thread's errno.
    unsafe { *libc::__errno_location() }
}

/// `Err(errno)` when a libc-style return value is negative.
#[inline]
pub fn check(rc: c_long) -> Result<(), c_int> {
    if rc < 0 {
        Err(errno())
    } else {
        Ok(())
    }
}

/// Child half: give every classic signal its default disposition and return the previous
/// handlers to the kernel's defaults. Handlers are reset by execve anyway, but SIG_IGN survives
/// it (the daemon ignores SIGPIPE, for one), and until the exec a handler of the daemon must
/// never run on the child's stack: callers keep every signal blocked until just before exec.
///
/// # Safety
/// Async-signal-safe: raw rt_sigaction calls.
pub unsafe fn reset_signal_dispositions() {
    // Kernel struct sigaction on x86_64 and aarch64: handler, flags, restorer, mask.
    let act: [u64; 4] = [0; 4]; // SIG_DFL, no flags, no mask
    for sig in 1..32 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: rt_sigaction(sig, &act, NULL, 8) with a valid kernel sigaction on our stack.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig as c_long,
                act.as_ptr(),
                std::ptr::null_mut::<u64>(),
                8 as c_long,
            );
        }
    }
}

/// Child half: unblock every signal (the mask is inherited across execve).
///
/// # Safety
/// Async-signal-safe: one raw rt_sigprocmask.
pub unsafe fn unblock_all_signals() {
    let empty: u64 = 0;
    // SAFETY: rt_sigprocmask(SIG_SETMASK, &empty, NULL, 8).
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK as c_long,
            &empty as *const u64,
            std::ptr::null_mut::<u64>(),
            8 as c_long,
        );
    }
}

/// Parent side: block every signal on the calling thread around a clone, so no handler of the
/// daemon can run in the child before it execs. Restored by dropping the guard.
pub struct SignalBlock {
    old: libc::sigset_t,
}

impl SignalBlock {
    pub fn new() -> Self {
        // SAFETY: sigset_t is plain data; sigfillset/pthread_sigmask get valid pointers.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            SignalBlock { old }
        }
    }
}

impl Drop for SignalBlock {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `new`.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BPF interpreter for the instructions the filter uses.
    fn run(prog: &[libc::sock_filter], nr: u32, arch: u32, arg0: u64) -> u32 {
        run_args(prog, nr, arch, &[arg0])
    }

    fn run_args(prog: &[libc::sock_filter], nr: u32, arch: u32, args: &[u64]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
        }
        let (mut pc, mut a) = (0usize, 0u32);
        loop {
            let i = prog[pc];
            pc += 1;
            match i.code {
                BPF_LD_W_ABS => {
                    let o = i.k as usize;
                    a = u32::from_ne_bytes(data[o..o + 4].try_into().unwrap());
                }
                BPF_JEQ_K => pc += if a == i.k { i.jt } else { i.jf } as usize,
                BPF_JGE_K => pc += if a >= i.k { i.jt } else { i.jf } as usize,
                BPF_JSET_K => pc += if a & i.k != 0 { i.jt } else { i.jf } as usize,
                BPF_AND_K => a &= i.k,
                BPF_RET_K => return i.k,
                c => panic!("unexpected opcode {c:#x}"),
            }
        }
    }

    #[test]
    fn unix_only_policy() {
        let p = seccomp_program(true).unwrap();
        let eaf = libc::SECCOMP_RET_ERRNO | libc::EAFNOSUPPORT as u32;
        for nr in [libc::SYS_socket as u32, libc::SYS_socketpair as u32] {
            assert_eq!(
                run(p, nr, AUDIT_ARCH, libc::AF_UNIX as u64),
                libc::SECCOMP_RET_ALLOW
            );
            for fam in [
                libc::AF_INET,
                libc::AF_INET6,
                libc::AF_NETLINK,
                libc::AF_PACKET,
                libc::AF_VSOCK,
                0,
                255,
            ] {
                assert_eq!(run(p, nr, AUDIT_ARCH, fam as u64), eaf, "{nr} family {fam}");
            }
        }
        let full = seccomp_program(false).unwrap();
        let inet = libc::AF_INET as u64;
        assert_eq!(
            run(full, libc::SYS_socket as u32, AUDIT_ARCH, inet),
            libc::SECCOMP_RET_ALLOW
        );
        let sock = libc::SYS_socket as u32;
        for fam in [libc::AF_VSOCK, libc::AF_ALG] {
            assert_eq!(run(full, sock, AUDIT_ARCH, fam as u64), eaf, "family {fam}");
        }
        let eproto = libc::SECCOMP_RET_ERRNO | libc::EPROTONOSUPPORT as u32;
        let nl = libc::AF_NETLINK as u64;
        let raw = libc::SOCK_RAW as u64;
        for proto in 0..32u64 {
            let want = if proto == 0 || proto == 4 {
                libc::SECCOMP_RET_ALLOW
            } else {
                eproto
            };
            let got = run_args(full, sock, AUDIT_ARCH, &[nl, raw, proto]);
            assert_eq!(got, want, "netlink protocol {proto}");
        }
        for fam in [libc::AF_INET6, libc::AF_UNIX, libc::AF_PACKET, 0, 255] {
            let got = run_args(full, sock, AUDIT_ARCH, &[fam as u64, raw, 9]);
            assert_eq!(got, libc::SECCOMP_RET_ALLOW, "family {fam}");
        }
        let mount = libc::SYS_mount as u32;
        assert_eq!(
            run(p, mount, AUDIT_ARCH, 0),
            libc::SECCOMP_RET_ERRNO | libc::EPERM as u32
        );
    }

    #[test]
    fn filter_policy() {
        let p = seccomp_program(false).unwrap();
        assert!(p.len() < 200, "{} insns", p.len());
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        let einval = libc::SECCOMP_RET_ERRNO | libc::EINVAL as u32;
        let policy = syscall_policy();
        let madv = |a: c_int| a as u32 as u64;
        let arg2s = [
            0u64,
            1,
            madv(libc::MADV_DONTNEED),
            madv(libc::MADV_FREE),
            madv(libc::MADV_COLD),
            madv(libc::MADV_PAGEOUT),
            0xffff_ffff_0000_0000 | madv(libc::MADV_PAGEOUT),
            0x0000_0001_0000_0000 | madv(libc::MADV_COLD),
        ];
        for nr in 0..1000u32 {
            let rule = policy.iter().find(|d| d.nr as u32 == nr);
            for arg0 in [0u64, 1, 2, 0xffff_ffff_0000_0001] {
                for arg2 in arg2s {
                    let r = run_args(p, nr, AUDIT_ARCH, &[arg0, 0, arg2]);
                    let want = match rule.map(|d| d.when) {
                        Some(When::Always) => eperm,
                        // the kernel reads a pid_t: the high half does not matter
                        Some(When::Pid(pid)) if arg0 as u32 == pid => eperm,
                        // and an int here
                        Some(When::Arg2In(v)) if v.contains(&(arg2 as u32)) => einval,
                        Some(When::IoctlType { .. }) => r, // by its command: below
                        _ if nr == libc::SYS_clone3 as u32 => enosys,
                        _ if nr == libc::SYS_clone as u32 || nr == libc::SYS_socket as u32 => r,
                        _ => libc::SECCOMP_RET_ALLOW,
                    };
                    assert_eq!(r, want, "syscall {nr} arg0 {arg0:#x} arg2 {arg2:#x}");
                }
            }
        }
        // madvise: the advice that pushes the caller's pages to swap is refused as unknown;
        // every other advice passes (the kernel judges it).
        let madvise = libc::SYS_madvise as u32;
        for advice in 0..128u64 {
            let want = if advice == 20 || advice == 21 {
                einval
            } else {
                libc::SECCOMP_RET_ALLOW
            };
            for unix_only in [false, true] {
                let prog = seccomp_program(unix_only).unwrap();
                let got = run_args(prog, madvise, AUDIT_ARCH, &[0x1000, 0x1000, advice]);
                assert_eq!(got, want, "madvise advice {advice} unix_only {unix_only}");
            }
        }
        // ioctl: btrfs' own commands (the subvolume and snapshot makers among them) are
        // refused as a filesystem refuses a command it does not know; the generic reflink and
        // dedupe commands of the same type, and every other type, pass. The kernel reads an
        // unsigned int: the high half does not matter.
        let enotty = libc::SECCOMP_RET_ERRNO | libc::ENOTTY as u32;
        let ioctl = libc::SYS_ioctl as u32;
        let btrfs_subvol_create: u64 = 0x5000_940e;
        let btrfs_snap_create_v2: u64 = 0x5000_9417;
        let btrfs_subvol_setflags: u64 = 0x4008_941a;
        for unix_only in [false, true] {
            let prog = seccomp_program(unix_only).unwrap();
            for (cmd, want) in [
                (btrfs_subvol_create, enotty),
                (btrfs_snap_create_v2, enotty),
                (btrfs_subvol_setflags, enotty),
                (0xffff_ffff_0000_0000 | btrfs_subvol_create, enotty),
                (0x9400, enotty),
                (0xffff_94ff, enotty),
                (u64::from(FICLONE), libc::SECCOMP_RET_ALLOW),
                (u64::from(FICLONERANGE), libc::SECCOMP_RET_ALLOW),
                (u64::from(FIDEDUPERANGE), libc::SECCOMP_RET_ALLOW),
                (libc::TIOCGWINSZ, libc::SECCOMP_RET_ALLOW),
                (libc::FIONREAD, libc::SECCOMP_RET_ALLOW),
                (0x8008_6601, libc::SECCOMP_RET_ALLOW), // FS_IOC_GETFLAGS
                (0x9300, libc::SECCOMP_RET_ALLOW),
                (0x9500, libc::SECCOMP_RET_ALLOW),
            ] {
                let got = run_args(prog, ioctl, AUDIT_ARCH, &[3, cmd, 0]);
                assert_eq!(got, want, "ioctl {cmd:#x} unix_only {unix_only}");
            }
        }
        // Named in the policy, by the numbers the kernel gives them.
        for (name, nr) in [
            ("process_vm_readv", libc::SYS_process_vm_readv),
            ("process_vm_writev", libc::SYS_process_vm_writev),
            ("pidfd_getfd", libc::SYS_pidfd_getfd),
            ("kcmp", libc::SYS_kcmp),
            ("statmount", 457),
            ("listmount", 458),
            ("open_tree_attr", 467),
        ] {
            assert_eq!(run(p, nr as u32, AUDIT_ARCH, 0), eperm, "{name}");
        }
        for nr in [
            libc::SYS_rt_sigqueueinfo,
            libc::SYS_rt_tgsigqueueinfo,
            libc::SYS_prlimit64,
            libc::SYS_sched_setscheduler,
            libc::SYS_sched_setattr,
            libc::SYS_sched_setparam,
        ] {
            assert_eq!(run(p, nr as u32, AUDIT_ARCH, 1), eperm, "{nr} to pid 1");
            assert_eq!(
                run(p, nr as u32, AUDIT_ARCH, 7),
                libc::SECCOMP_RET_ALLOW,
                "{nr} to another pid"
            );
        }
        let clone = libc::SYS_clone as u32;
        let fork_flags = (libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD) as u64;
        assert_eq!(
            run(p, clone, AUDIT_ARCH, fork_flags),
            libc::SECCOMP_RET_ALLOW
        );
        let threads = (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64;
        assert_eq!(run(p, clone, AUDIT_ARCH, threads), libc::SECCOMP_RET_ALLOW);
        for f in CLONE_NEW_FLAGS {
            assert_eq!(run(p, clone, AUDIT_ARCH, f | 17), eperm, "flag {f:#x}");
        }
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            run(p, libc::SYS_mount as u32 | X32_SYSCALL_BIT, AUDIT_ARCH, 0),
            enosys
        );
        assert_eq!(run(p, 1, 0x4000_0003, 0), libc::SECCOMP_RET_KILL_PROCESS);
    }

    #[test]
    fn host_view_policy_refuses_watches_and_nothing_else_more() {
        // Against the unix-only filter it extends: the same answer for every syscall and
        // argument but inotify watches, which it refuses (fanotify marks: both refuse them),
        // and unshare with exactly CLONE_NEWCGROUP, which it allows.
        let view = host_view_program().unwrap();
        let unix_only = seccomp_program(true).unwrap();
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let watches = [libc::SYS_inotify_add_watch as u32];
        let fanotify_mark = libc::SYS_fanotify_mark as u32;
        assert_eq!(run(unix_only, fanotify_mark, AUDIT_ARCH, 3), eperm);
        assert_eq!(run(view, fanotify_mark, AUDIT_ARCH, 3), eperm);
        let cgroupns = libc::CLONE_NEWCGROUP as u64;
        let unshare = libc::SYS_unshare as u32;
        for nr in 0..1000u32 {
            for arg0 in [
                0u64,
                1,
                libc::AF_UNIX as u64,
                libc::AF_INET as u64,
                cgroupns,
                cgroupns | libc::CLONE_NEWUSER as u64,
                cgroupns | libc::CLONE_NEWNS as u64,
                cgroupns | 1 << 32,
                libc::CLONE_NEWUSER as u64,
            ] {
                for arg2 in [0u64, 20, 21] {
                    let got = run_args(view, nr, AUDIT_ARCH, &[arg0, 0, arg2]);
                    let want = if watches.contains(&nr) {
                        eperm
                    } else if nr == unshare && arg0 == cgroupns {
                        libc::SECCOMP_RET_ALLOW
                    } else {
                        run_args(unix_only, nr, AUDIT_ARCH, &[arg0, 0, arg2])
                    };
                    assert_eq!(got, want, "syscall {nr} arg0 {arg0} arg2 {arg2}");
                }
            }
        }
        for nr in watches {
            assert_eq!(run(unix_only, nr, AUDIT_ARCH, 3), libc::SECCOMP_RET_ALLOW);
        }
    }

    #[test]
    fn rlimit_names() {
        assert_eq!(
            rlimit("nofile", 10, 20).unwrap().resource,
            libc::RLIMIT_NOFILE as c_int
        );
        assert_eq!(rlimit("RLIMIT_NPROC", -1, -1).unwrap().hard, RLIM_INFINITY);
        assert!(rlimit("bogus", 1, 1).is_err());
        assert!(rlimit("nofile", 20, 10).is_err());
    }
}
