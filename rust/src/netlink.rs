//! A networked sandbox's link, set up over rtnetlink with the GIL released: a veth pair whose
//! host end holds the gateway address and a /32 route to the sandbox, and whose other end,
//! moved into the sandbox's network namespace as `eth0`, holds the sandbox's /32 address and a
//! default route via the gateway; the same for IPv6 when the daemon has an IPv6 range: a /128
//! address and route for the sandbox, and as its gateway a link-local address of the host end
//! (its own per link: see `veth_setup`). The calling thread enters the namespace for its half
//! and returns (as `netns_new` does). No process is started.

use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use libc::c_void;

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("{step}: {source}")]
    Os {
        step: &'static str,
        source: std::io::Error,
    },
}

impl NetlinkError {
    pub fn errno(&self) -> i32 {
        match self {
            NetlinkError::Invalid(_) => libc::EINVAL,
            NetlinkError::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

fn os(step: &'static str) -> impl FnOnce(std::io::Error) -> NetlinkError {
    move |source| NetlinkError::Os { step, source }
}

const NLMSG_HDRLEN: usize = 16;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_FLAGS: u16 = 8;
/// No prefix route for the address (its link's routes are ours).
const IFA_F_NOPREFIXROUTE: u32 = 0x200;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const NLA_F_NESTED: u16 = 1 << 15;
const IFINFOMSG_LEN: usize = 16;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// One request: header, fixed part, attributes (nested ones through `begin`/`end`).
struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Msg {
    fn new(ty: u16, flags: u16, fixed: &[u8]) -> Msg {
        let mut buf = vec![0u8; NLMSG_HDRLEN];
        buf[4..6].copy_from_slice(&ty.to_ne_bytes());
        let f = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16 | flags;
        buf[6..8].copy_from_slice(&f.to_ne_bytes());
        buf.extend_from_slice(fixed);
        buf.resize(align4(buf.len()), 0);
        Msg {
            buf,
            nests: Vec::new(),
        }
    }

    fn attr(&mut self, ty: u16, data: &[u8]) -> &mut Msg {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    fn begin(&mut self, ty: u16) -> &mut Msg {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    /// A nested attribute that starts with a fixed struct (VETH_INFO_PEER: an ifinfomsg).
    fn begin_with(&mut self, ty: u16, fixed: &[u8]) -> &mut Msg {
        self.begin(ty);
        self.buf.extend_from_slice(fixed);
        self
    }

    fn end(&mut self) -> &mut Msg {
        let at = self.nests.pop().expect("end without begin");
        let len = (self.buf.len() - at) as u16;
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    fn done(&mut self, seq: u32) -> &[u8] {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        &self.buf
    }
}

fn ifinfomsg(index: i32, flags: u32, change: u32) -> [u8; IFINFOMSG_LEN] {
    let mut m = [0u8; IFINFOMSG_LEN];
    m[0] = libc::AF_UNSPEC as u8;
    m[4..8].copy_from_slice(&index.to_ne_bytes());
    m[8..12].copy_from_slice(&flags.to_ne_bytes());
    m[12..16].copy_from_slice(&change.to_ne_bytes());
    m
}

/// IFA_F_NODAD: an IPv6 address usable at once (no duplicate detection on a link of two).
const IFA_F_NODAD: u8 = 0x02;

fn family(a: &IpAddr) -> (u8, u8, Vec<u8>) {
    match a {
        IpAddr::V4(v) => (libc::AF_INET as u8, 32, v.octets().to_vec()),
        IpAddr::V6(v) => (libc::AF_INET6 as u8, 128, v.octets().to_vec()),
    }
}

fn ifaddrmsg(index: i32, fam: u8, prefix: u8) -> [u8; 8] {
    let mut m = [0u8; 8];
    m[0] = fam;
    m[1] = prefix;
    if fam == libc::AF_INET6 as u8 {
        m[2] = IFA_F_NODAD;
    }
    m[3] = libc::RT_SCOPE_UNIVERSE;
    m[4..8].copy_from_slice(&(index as u32).to_ne_bytes());
    m
}

fn rtmsg(fam: u8, dst_len: u8, scope: u8) -> [u8; 12] {
    let mut m = [0u8; 12];
    m[0] = fam;
    m[1] = dst_len;
    m[4] = libc::RT_TABLE_MAIN;
    m[5] = libc::RTPROT_STATIC;
    m[6] = scope;
    m[7] = libc::RTN_UNICAST;
    m
}

/// A NETLINK_ROUTE socket in the calling thread's network namespace.
struct Rtnl {
    fd: OwnedFd,
    seq: u32,
}

impl Rtnl {
    fn open() -> Result<Rtnl, NetlinkError> {
        // SAFETY: socket(2) with constant arguments; checked below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(os("netlink socket")(std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Rtnl { fd, seq: 0 })
    }

    /// Send one request and wait for its acknowledgement.
    fn call(&mut self, step: &'static str, msg: &mut Msg) -> Result<(), NetlinkError> {
        self.seq += 1;
        let seq = self.seq;
        let data = msg.done(seq);
        // SAFETY: send of a buffer we own, its length.
        let n = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                data.as_ptr() as *const c_void,
                data.len(),
                0,
            )
        };
        if n < 0 {
            return Err(os(step)(std::io::Error::last_os_error()));
        }
        let mut buf = [0u8; 8192];
        loop {
            // SAFETY: recv into a stack buffer of the given length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr() as *mut c_void,
                    buf.len(),
                    0,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(os(step)(e));
            }
            let n = n as usize;
            let mut off = 0;
            while off + NLMSG_HDRLEN <= n {
                let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
                let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().unwrap());
                let rseq = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().unwrap());
                if len < NLMSG_HDRLEN || off + len > n {
                    return Err(os(step)(std::io::Error::from_raw_os_error(libc::EBADMSG)));
                }
                if ty == libc::NLMSG_ERROR as u16 && rseq == seq {
                    let code = i32::from_ne_bytes(
                        buf[off + NLMSG_HDRLEN..off + NLMSG_HDRLEN + 4]
                            .try_into()
                            .unwrap(),
                    );
                    if code == 0 {
                        return Ok(());
                    }
                    return Err(os(step)(std::io::Error::from_raw_os_error(-code)));
                }
                off += align4(len);
            }
        }
    }

    fn addr(&mut self, index: i32, addr: IpAddr) -> Result<(), NetlinkError> {
        let (fam, prefix, a) = family(&addr);
        let flags = (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
        self.call(
            "add address",
            Msg::new(libc::RTM_NEWADDR, flags, &ifaddrmsg(index, fam, prefix))
                .attr(IFA_LOCAL, &a)
                .attr(IFA_ADDRESS, &a),
        )
    }

    /// Link-local `addr` (/64, no prefix route, no duplicate detection) on link `index`.
    fn addr_link_local(&mut self, index: i32, addr: Ipv6Addr) -> Result<(), NetlinkError> {
        let flags = (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
        let mut hdr = ifaddrmsg(index, libc::AF_INET6 as u8, 64);
        hdr[3] = libc::RT_SCOPE_LINK;
        let ifa_flags = u32::from(IFA_F_NODAD) | IFA_F_NOPREFIXROUTE;
        self.call(
            "add address",
            Msg::new(libc::RTM_NEWADDR, flags, &hdr)
                .attr(IFA_LOCAL, &addr.octets())
                .attr(IFA_ADDRESS, &addr.octets())
                .attr(IFA_FLAGS, &ifa_flags.to_ne_bytes()),
        )
    }
    fn up(&mut self, index: i32) -> Result<(), NetlinkError> {
        let up = libc::IFF_UP as u32;
        self.call(
            "link up",
            &mut Msg::new(libc::RTM_NEWLINK, 0, &ifinfomsg(index, up, up)),
        )
    }

    /// A route to `dst` (a host route, on the link) or, with `dst` None, the default route
    /// via `gateway`; `v6` picks the family when neither gives it.
    fn route(
        &mut self,
        dst: Option<IpAddr>,
        gateway: Option<IpAddr>,
        v6: bool,
        index: i32,
    ) -> Result<(), NetlinkError> {
        let flags = (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
        let fam = if v6 { libc::AF_INET6 } else { libc::AF_INET } as u8;
        let (dst_len, scope) = match &dst {
            Some(d) => (family(d).1, libc::RT_SCOPE_LINK),
            None => (0, libc::RT_SCOPE_UNIVERSE),
        };
        // IPv6 routes have no scope of their own (the kernel wants universe).
        let scope = if v6 { libc::RT_SCOPE_UNIVERSE } else { scope };
        let mut m = Msg::new(libc::RTM_NEWROUTE, flags, &rtmsg(fam, dst_len, scope));
        if let Some(d) = &dst {
            m.attr(RTA_DST, &family(d).2);
        }
        if let Some(g) = &gateway {
            m.attr(RTA_GATEWAY, &family(g).2);
        }
        m.attr(RTA_OIF, &(index as u32).to_ne_bytes());
        self.call("add route", &mut m)
    }
}

fn if_index(name: &str) -> Result<i32, NetlinkError> {
    let c = CString::new(name).map_err(|_| NetlinkError::Invalid(name.into()))?;
    // SAFETY: a valid C string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(os("if_nametoindex")(std::io::Error::last_os_error()));
    }
    Ok(i as i32)
}

fn check_name(name: &str) -> Result<(), NetlinkError> {
    if name.is_empty()
        || name.len() > 15
        || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Err(NetlinkError::Invalid(format!("interface name {name:?}")));
    }
    Ok(())
}

/// The veth pair `host` (in the caller's namespace) / `eth0` (moved into `netns`), addressed,
/// up and routed as described at the top; `v6`: (gateway, address) for IPv6, or None (IPv6
/// off on both ends). On an error the host end is left for the caller to delete (it may
/// exist).
///
/// The IPv6 gateway is a link-local address given to the host end (fe80::/10, one per link),
/// and the host end makes no link-local address of its own. Routes that many links share are
/// what costs: the kernel walks a shared route's list of links at every addition, so a
/// gateway address on every host end, or the fe80::/64 route of each one's own link-local
/// address, made each new link cost in proportion to the links already there (10 ms per link
/// at 3,000 links, measured; 0.3 ms without IPv6).
pub fn veth_setup(
    netns: RawFd,
    host: &str,
    gateway: Ipv4Addr,
    addr: Ipv4Addr,
    v6: Option<(Ipv6Addr, Ipv6Addr)>,
) -> Result<(), NetlinkError> {
    check_name(host)?;
    if let Some((gw6, _)) = v6 {
        if gw6.segments()[0] & 0xffc0 != 0xfe80 {
            return Err(NetlinkError::Invalid(format!(
                "IPv6 gateway {gw6}: a link-local address"
            )));
        }
    }
    let mut nl = Rtnl::open()?;
    let excl = (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
    let mut m = Msg::new(libc::RTM_NEWLINK, excl, &ifinfomsg(0, 0, 0));
    m.attr(IFLA_IFNAME, format!("{host}\0").as_bytes())
        .begin(IFLA_LINKINFO)
        .attr(IFLA_INFO_KIND, b"veth")
        .begin(IFLA_INFO_DATA)
        .begin_with(VETH_INFO_PEER, &ifinfomsg(0, 0, 0))
        .attr(IFLA_IFNAME, b"eth0\0")
        .attr(IFLA_NET_NS_FD, &(netns as u32).to_ne_bytes())
        .end()
        .end()
        .end();
    nl.call("add veth", &mut m)?;
    let hidx = if_index(host)?;
    let (gw, a) = (IpAddr::V4(gateway), IpAddr::V4(addr));
    // No duplicate detection (a link of two; its wait would hold the link-local address
    // back), no router advertisements or solicitations: the addresses and routes are ours.
    ipv6_conf(host, v6.is_some(), false)?;
    nl.addr(hidx, gw)?;
    if let Some((gw6, _)) = v6 {
        nl.addr_link_local(hidx, gw6)?;
    }
    nl.up(hidx)?;
    nl.route(Some(a), None, false, hidx)?;
    if let Some((_, a6)) = v6 {
        nl.route(Some(IpAddr::V6(a6)), None, true, hidx)?;
    }
    in_netns(netns, || {
        let mut g = Rtnl::open()?;
        let gidx = if_index("eth0")?;
        ipv6_conf("eth0", v6.is_some(), true)?;
        g.addr(gidx, a)?;
        if let Some((_, a6)) = v6 {
            g.addr(gidx, IpAddr::V6(a6))?;
        }
        g.up(gidx)?;
        g.route(Some(gw), None, false, gidx)?;
        g.route(None, Some(gw), false, gidx)?;
        if let Some((gw6, _)) = v6 {
            // A link-local gateway is on the link: no route to it is needed.
            g.route(None, Some(IpAddr::V6(gw6)), true, gidx)?;
        }
        Ok(())
    })
}

/// IPv6 on interface `name` of the calling thread's namespace: off, or on without duplicate
/// detection, router advertisements and solicitations (before the link is up), and with a
/// link-local address of its own only if `link_local`. The path to
/// the interface's directory is walked once and each key opened relative to it: the walk's
/// first step (`net` under /proc/sys) is a dentry per network namespace that ever looked,
/// all under one parent, so it costs more the more namespaces (sandboxes) the host has.
fn ipv6_conf(name: &str, on: bool, link_local: bool) -> Result<(), NetlinkError> {
    let dir = match std::fs::File::open(format!("/proc/sys/net/ipv6/conf/{name}")) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()), // no IPv6 here
        Err(e) => return Err(os("sysctl")(e)),
    };
    let mut keys: Vec<(&str, &str)> = Vec::with_capacity(9);
    if on {
        if !link_local {
            keys.push(("addr_gen_mode", "1")); // IN6_ADDR_GEN_MODE_NONE: no link-local
        }
        keys.extend([
            ("accept_dad", "0"),
            ("dad_transmits", "0"),
            ("accept_ra", "0"),
            ("autoconf", "0"),
            ("router_solicitations", "0"),
            // The multicast listener reports a new address sends, repeated within 10 ms
            // rather than 1 s: a link is quiet (its counters settled) almost at once, which
            // reusing a sandbox's namespace needs (NetworkManager.recycle).
            ("mldv1_unsolicited_report_interval", "10"),
            ("mldv2_unsolicited_report_interval", "10"),
            ("disable_ipv6", "0"),
        ]);
    } else {
        keys.push(("disable_ipv6", "1"));
    }
    for (key, value) in &keys {
        write_at(&dir, key, value)?;
    }
    Ok(())
}

/// Write `value` to the sysctl file `key` of the directory `dir` (absent: nothing to do).
fn write_at(dir: &std::fs::File, key: &str, value: &str) -> Result<(), NetlinkError> {
    use rustix::fs::{Mode, OFlags};
    use std::io::Write;
    let fd = match rustix::fs::openat(dir, key, OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(os("sysctl")(e.into())),
    };
    std::fs::File::from(fd)
        .write_all(value.as_bytes())
        .map_err(os("sysctl"))
}

/// Run `f` with the calling thread in the network namespace `netns`, then return to its own
/// (abort if it cannot: the thread would serve the daemon from the wrong namespace).
fn in_netns<T>(
    netns: RawFd,
    f: impl FnOnce() -> Result<T, NetlinkError>,
) -> Result<T, NetlinkError> {
    // SAFETY: open with a valid C string; checked below.
    let orig = unsafe {
        libc::open(
            c"/proc/thread-self/ns/net".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if orig < 0 {
        return Err(os("open own netns")(std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh fd we own.
    let orig = unsafe { OwnedFd::from_raw_fd(orig) };
    // SAFETY: setns of the calling thread only, to a namespace fd the caller owns.
    if unsafe { libc::setns(netns, libc::CLONE_NEWNET) } < 0 {
        return Err(os("setns")(std::io::Error::last_os_error()));
    }
    let out = f();
    for _ in 0..3 {
        // SAFETY: setns of the calling thread back to its own namespace.
        if unsafe { libc::setns(orig.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
            return out;
        }
    }
    let msg = b"corral._core: cannot return to the daemon's network namespace; aborting\n";
    // SAFETY: write to stderr from a static buffer, then abort.
    unsafe {
        libc::write(2, msg.as_ptr() as *const c_void, msg.len());
        libc::abort();
    }
}
