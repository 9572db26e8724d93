//! What a network namespace shows of its past, for reusing one whose sandbox did nothing in it.
//!
//! A sandbox has no CAP_NET_ADMIN: it cannot change its namespace's links, addresses, routes or
//! sysctls. What it can leave behind is traffic (lo's counters, the MIB counters) and sockets
//! (TIME_WAIT, in-flight fds). `fingerprint` reads those, from inside the namespace, in a form
//! that is the same for every fresh namespace: counter files verbatim, socket counts (sockstat,
//! without its host-wide fields), small socket tables as entry counts (their lines carry
//! per-socket inodes). The caller reuses a namespace only if its
//! fingerprint equals a fresh one's; one with any trace is closed.

use std::ffi::CStr;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use libc::c_void;

#[derive(Debug, thiserror::Error)]
pub enum NetprobeError {
    #[error("{step}: {source}")]
    Os {
        step: &'static str,
        source: io::Error,
    },
}

impl NetprobeError {
    pub fn errno(&self) -> i32 {
        match self {
            NetprobeError::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

/// Counter files: compared verbatim.
const COUNTERS: &[&CStr] = &[
    c"/proc/thread-self/net/dev",
    c"/proc/thread-self/net/snmp",
    c"/proc/thread-self/net/snmp6",
    c"/proc/thread-self/net/netstat",
    c"/proc/thread-self/net/sockstat6",
];
/// Socket counts by protocol (TCP in use and in TIME_WAIT, UDP, RAW, fragments): this one
/// also holds host-wide fields, left out (`GLOBAL`). The per-protocol tables (/proc/net/tcp
/// ...) are not read: each read walks the host's whole hash table (~10 ms for TCP here).
const SOCKSTAT: &CStr = c"/proc/thread-self/net/sockstat";
const GLOBAL: &[&str] = &["orphan", "alloc", "mem"];
/// Tables without a count elsewhere, small and per namespace: compared by their lines.
const TABLES: &[&CStr] = &[
    c"/proc/thread-self/net/unix",
    c"/proc/thread-self/net/packet",
    c"/proc/thread-self/net/netlink",
    c"/proc/thread-self/net/icmp",
    c"/proc/thread-self/net/icmp6",
    c"/proc/thread-self/net/igmp",
    c"/proc/thread-self/net/igmp6",
    // IPv6 flow labels: a label shared "any" lingers (up to its linger time) after its
    // socket and its sandbox are gone, readable by and joinable from the next.
    c"/proc/thread-self/net/ip6_flowlabel",
];

/// PIDFD_GET_NET_NAMESPACE: _IO(PIDFS_IOCTL_MAGIC 0xFF, 4) (Linux >= 6.11).
const PIDFD_GET_NET_NAMESPACE: libc::c_ulong = (0xFF << 8) | 4;

fn os(step: &'static str) -> NetprobeError {
    NetprobeError::Os {
        step,
        source: io::Error::last_os_error(),
    }
}

fn open(path: &CStr, step: &'static str) -> Result<OwnedFd, NetprobeError> {
    // SAFETY: open with a valid C string; the result is checked.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(os(step));
    }
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The network namespace of a live process, from its pidfd; ESRCH once it has exited (so a
/// namespace is never taken from a process that a pid reuse made someone else).
pub fn netns_of(pidfd: RawFd) -> Result<OwnedFd, NetprobeError> {
    // SAFETY: the ioctl takes no argument and returns a new fd or -1.
    let fd = unsafe { libc::ioctl(pidfd, PIDFD_GET_NET_NAMESPACE as _, 0) };
    if fd < 0 {
        return Err(os("pidfd_get_net_namespace"));
    }
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn read_all(path: &CStr) -> Vec<u8> {
    let Ok(fd) = open(path, "open") else {
        return b"-".to_vec(); // absent on this kernel: the same for every namespace
    };
    let mut f = std::fs::File::from(fd);
    let mut out = Vec::new();
    if f.read_to_end(&mut out).is_err() {
        return b"?".to_vec();
    }
    out
}

/// sockstat without its host-wide fields: "TCP: inuse 0 orphan 3 tw 0" -> "TCP: inuse 0 tw 0".
fn own_sockstat(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for line in String::from_utf8_lossy(text).lines() {
        let mut words = line.split_whitespace();
        if let Some(proto) = words.next() {
            out.extend_from_slice(proto.as_bytes());
        }
        let rest: Vec<&str> = words.collect();
        for pair in rest.chunks(2) {
            if !GLOBAL.contains(&pair[0]) {
                for w in pair {
                    out.push(b' ');
                    out.extend_from_slice(w.as_bytes());
                }
            }
        }
        out.push(b'\n');
    }
    out
}

fn snapshot() -> Vec<u8> {
    let mut out = Vec::new();
    for p in COUNTERS {
        out.extend_from_slice(&read_all(p));
        out.push(0);
    }
    out.extend_from_slice(&own_sockstat(&read_all(SOCKSTAT)));
    out.push(0);
    for p in TABLES {
        let lines = read_all(p).iter().filter(|&&b| b == b'\n').count();
        out.extend_from_slice(format!("{lines}\n").as_bytes());
    }
    out
}

/// The fingerprint of the namespace `netns`, read from inside it by the calling thread
/// (which returns to its own namespace before this returns).
pub fn fingerprint(netns: RawFd) -> Result<Vec<u8>, NetprobeError> {
    let orig = open(c"/proc/thread-self/ns/net", "open_own_netns")?;
    // SAFETY: setns of the calling thread only.
    if unsafe { libc::setns(netns, libc::CLONE_NEWNET) } < 0 {
        return Err(os("setns"));
    }
    let out = snapshot();
    for _ in 0..3 {
        // SAFETY: setns of the calling thread back to its own namespace.
        if unsafe { libc::setns(orig.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
            return Ok(out);
        }
    }
    let msg = b"corral._core: cannot return to the daemon's network namespace; aborting\n";
    // SAFETY: write to stderr from a static buffer, then abort: a daemon thread left in a
    // sandbox's namespace must not go on.
    unsafe {
        libc::write(2, msg.as_ptr() as *const c_void, msg.len());
        libc::abort();
    }
}
