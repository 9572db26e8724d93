//! Adding and removing set elements straight over nf_tables netlink. libnftables fetches the whole set
//! into its cache before a delete (to find interval boundaries), which costs O(elements): a
//! quarter of a second per sandbox with 10,000 of them. The kernel's own cost does not grow
//! like that. NFT_MSG_DESTROYSETELEM (Linux >= 6.3) ignores elements already gone (expired
//! DNS pins), so one batch removes a sandbox's elements whatever expired meanwhile.
//!
//! Sizes: a nested netlink attribute's length is 16 bits, so a set's element list goes out
//! as messages of at most `MSG_ELEMS` bytes of elements each (several messages for one set
//! in one batch). A removal goes out in sends below the socket's send buffer, each its own
//! transaction (DESTROYSETELEM is idempotent; the caller orders the sets so the first
//! transaction already cuts the sandbox off). An add, or a swap, stays one transaction
//! whatever its size: the socket's send buffer is raised to carry it (up to
//! `MAX_TRANSACTION`), as libnftables does for a large ruleset.

use std::cell::RefCell;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use libc::c_void;

#[derive(Debug, thiserror::Error)]
pub enum NftSetError {
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("a netlink attribute of {0} bytes (a nested attribute's length holds 65,535)")]
    TooLong(usize),
    #[error("a transaction of {0} bytes (at most {MAX_TRANSACTION})")]
    TooBig(usize),
    #[error("{step}: {source}")]
    Os {
        step: &'static str,
        source: std::io::Error,
    },
}

impl NftSetError {
    pub fn errno(&self) -> i32 {
        match self {
            NftSetError::Invalid(_) => libc::EINVAL,
            NftSetError::TooLong(_) | NftSetError::TooBig(_) => libc::EMSGSIZE,
            NftSetError::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

const NLMSG_HDRLEN: usize = 16;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_GETSETELEM: u16 = 13;
const NFTA_SET_ELEM_EXPR: u16 = 7;
const NFTA_SET_ELEM_EXPRESSIONS: u16 = 11;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_COUNTER_BYTES: u16 = 1;
const NFTA_COUNTER_PACKETS: u16 = 2;
const NFT_MSG_DESTROYSETELEM: u16 = 30;
const NFPROTO_INET: u8 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NFT_JUMP: i32 = -3;
const NLA_F_NESTED: u16 = 1 << 15;
/// Bytes of elements in one element-list message: below the 65,535 of its nest's length.
const MSG_ELEMS: usize = 60 * 1024;
/// The largest add or swap (one transaction) sent: the socket's send buffer is raised to it.
pub const MAX_TRANSACTION: usize = 32 << 20;
const NETLINK_CAP_ACK: libc::c_int = 10;
const SO_SNDBUFFORCE: libc::c_int = 32;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

struct Buf {
    b: Vec<u8>,
    nests: Vec<usize>,
}

impl Buf {
    fn msg(&mut self, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16) -> usize {
        let at = self.b.len();
        self.b.extend_from_slice(&[0u8; NLMSG_HDRLEN]);
        self.b[at + 4..at + 6].copy_from_slice(&ty.to_ne_bytes());
        self.b[at + 6..at + 8].copy_from_slice(&flags.to_ne_bytes());
        self.b[at + 8..at + 12].copy_from_slice(&seq.to_ne_bytes());
        // struct nfgenmsg: family, version, res_id (big endian)
        self.b.push(family);
        self.b.push(0);
        self.b.extend_from_slice(&res_id.to_be_bytes());
        at
    }

    fn close_msg(&mut self, at: usize) {
        let len = (self.b.len() - at) as u32;
        self.b[at..at + 4].copy_from_slice(&len.to_ne_bytes());
    }

    fn attr(&mut self, ty: u16, data: &[u8]) -> Result<(), NftSetError> {
        let len =
            u16::try_from(4 + data.len()).map_err(|_| NftSetError::TooLong(4 + data.len()))?;
        self.b.extend_from_slice(&len.to_ne_bytes());
        self.b.extend_from_slice(&ty.to_ne_bytes());
        self.b.extend_from_slice(data);
        self.b.resize(align4(self.b.len()), 0);
        Ok(())
    }

    fn begin(&mut self, ty: u16) {
        self.nests.push(self.b.len());
        self.b.extend_from_slice(&0u16.to_ne_bytes());
        self.b.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    }

    /// Close the innermost nest; an error if it outgrew the 16 bits of its length (the
    /// kernel would read a wrapped length, act on part of it and still acknowledge).
    fn end(&mut self) -> Result<(), NftSetError> {
        let at = self.nests.pop().expect("end without begin");
        let len = u16::try_from(self.b.len() - at)
            .map_err(|_| NftSetError::TooLong(self.b.len() - at))?;
        self.b[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        Ok(())
    }

    fn new() -> Buf {
        Buf {
            b: Vec::new(),
            nests: Vec::new(),
        }
    }
}

fn cstr(s: &str) -> Result<Vec<u8>, NftSetError> {
    if s.is_empty() || s.len() > 255 || s.contains('\0') {
        return Err(NftSetError::Invalid(format!("name {s:?}")));
    }
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    Ok(v)
}

/// One set's elements to remove: each a key (the concatenated register data, as the kernel
/// stores it) and, for interval sets, the key of the range's end.
pub struct SetElems {
    pub set: String,
    pub elems: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

/// Remove the given elements of `table` (family inet); an element already gone is not an
/// error. One transaction if it fits one send, else several, in the order given (the caller
/// puts first what cuts the sandbox off).
pub fn destroy_elements(table: &str, sets: &[SetElems]) -> Result<(), NftSetError> {
    let table = cstr(table)?;
    let mut msgs = Vec::new();
    for s in sets.iter().filter(|s| !s.elems.is_empty()) {
        write_destroy(&mut msgs, &table, s)?;
    }
    send_msgs(&msgs, true)
}

/// Remove the elements of `gone`, then add those of `added`, in one batch (one transaction).
/// An element in both is deleted and added again, which an interval set's lookup can miss
/// for an instant: callers pass only the difference (Firewall.swap).
pub fn swap_elements(
    table: &str,
    gone: &[SetElems],
    added: &[(String, Vec<NewElem>)],
) -> Result<(), NftSetError> {
    let table = cstr(table)?;
    let mut msgs = Vec::new();
    for s in gone.iter().filter(|s| !s.elems.is_empty()) {
        write_destroy(&mut msgs, &table, s)?;
    }
    for (set, elems) in added.iter().filter(|(_, e)| !e.is_empty()) {
        write_add(&mut msgs, &table, set, elems)?;
    }
    send_msgs(&msgs, false)
}

fn write_destroy(msgs: &mut Vec<Vec<u8>>, table: &[u8], s: &SetElems) -> Result<(), NftSetError> {
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DESTROYSETELEM;
    let flags = libc::NLM_F_REQUEST as u16;
    write_elems(
        msgs,
        ty,
        flags,
        table,
        &s.set,
        &s.elems,
        |buf, (key, end)| elem_keys(buf, key, end.as_deref()),
    )
}

/// One element to add: its key (and end key in an interval set), a timeout, and in a verdict
/// map the chain it jumps to.
pub struct NewElem {
    pub key: Vec<u8>,
    pub end: Option<Vec<u8>>,
    pub timeout_ms: Option<u64>,
    pub jump: Option<String>,
}

/// Add the given elements to sets of `table` (family inet) in one batch (one transaction):
/// what libnftables would send for `add element`, without reading the table's sets first.
/// An element already there stays as it is.
pub fn add_elements(table: &str, sets: &[(String, Vec<NewElem>)]) -> Result<(), NftSetError> {
    swap_elements(table, &[], sets)
}

fn write_add(
    msgs: &mut Vec<Vec<u8>>,
    table: &[u8],
    set: &str,
    elems: &[NewElem],
) -> Result<(), NftSetError> {
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM;
    let flags = libc::NLM_F_REQUEST as u16 | libc::NLM_F_CREATE as u16;
    write_elems(msgs, ty, flags, table, set, elems, |buf, e| {
        elem_keys(buf, &e.key, e.end.as_deref())?;
        if let Some(ms) = e.timeout_ms {
            buf.attr(NFTA_SET_ELEM_TIMEOUT, &ms.to_be_bytes())?;
        }
        if let Some(chain) = &e.jump {
            buf.begin(NFTA_SET_ELEM_DATA);
            buf.begin(NFTA_DATA_VERDICT);
            buf.attr(NFTA_VERDICT_CODE, &NFT_JUMP.to_be_bytes())?;
            buf.attr(NFTA_VERDICT_CHAIN, &cstr(chain)?)?;
            buf.end()?;
            buf.end()?;
        }
        Ok(())
    })
}

/// One set's elements as element-list messages (sequence number 0, set when sent), each
/// holding at most about `MSG_ELEMS` bytes of elements; `one` writes an element's attributes.
fn write_elems<T>(
    msgs: &mut Vec<Vec<u8>>,
    ty: u16,
    flags: u16,
    table: &[u8],
    set: &str,
    elems: &[T],
    mut one: impl FnMut(&mut Buf, &T) -> Result<(), NftSetError>,
) -> Result<(), NftSetError> {
    let mut rest = elems.iter().peekable();
    while rest.peek().is_some() {
        let mut buf = Buf::new();
        let at = buf.msg(ty, flags, 0, NFPROTO_INET, 0);
        buf.attr(NFTA_SET_ELEM_LIST_TABLE, table)?;
        buf.attr(NFTA_SET_ELEM_LIST_SET, &cstr(set)?)?;
        buf.begin(NFTA_SET_ELEM_LIST_ELEMENTS);
        let start = buf.b.len();
        while buf.b.len() - start < MSG_ELEMS {
            let Some(e) = rest.next() else { break };
            buf.begin(NFTA_LIST_ELEM);
            one(&mut buf, e)?;
            buf.end()?;
        }
        buf.end()?;
        buf.close_msg(at);
        msgs.push(buf.b);
    }
    Ok(())
}

/// Send element-list messages in nf_tables batches, each message given its sequence number
/// and the last of each batch an ack request (the kernel reports any message's error without
/// one, and acknowledges the last only once the batch is committed). `split`: in as many
/// batches (transactions) as the socket's send buffer needs; else one, the buffer raised to
/// carry it. Nothing is sent for no messages.
fn send_msgs(msgs: &[Vec<u8>], split: bool) -> Result<(), NftSetError> {
    if msgs.is_empty() {
        return Ok(());
    }
    with_socket(|fd| {
        // Room in one send: the kernel refuses a message over its send buffer less 32 bytes.
        let room = if split {
            sndbuf(fd)?.saturating_sub(64).max(MSG_ELEMS + 1024)
        } else {
            usize::MAX
        };
        let mut rest = msgs.iter().peekable();
        while rest.peek().is_some() {
            let mut buf = Buf::new();
            let req = libc::NLM_F_REQUEST as u16;
            let at = buf.msg(NFNL_MSG_BATCH_BEGIN, req, 1, 0, NFNL_SUBSYS_NFTABLES);
            buf.close_msg(at);
            let mut seq = 1u32;
            let mut last = 0;
            while let Some(m) = rest.peek() {
                if seq > 1 && buf.b.len() + m.len() + 2 * NLMSG_HDRLEN + 4 > room {
                    break;
                }
                seq += 1;
                last = buf.b.len();
                buf.b.extend_from_slice(m);
                buf.b[last + 8..last + 12].copy_from_slice(&seq.to_ne_bytes());
                rest.next();
            }
            let flags = u16::from_ne_bytes([buf.b[last + 6], buf.b[last + 7]]);
            let flags = flags | libc::NLM_F_ACK as u16;
            buf.b[last + 6..last + 8].copy_from_slice(&flags.to_ne_bytes());
            let at = buf.msg(NFNL_MSG_BATCH_END, req, seq + 1, 0, NFNL_SUBSYS_NFTABLES);
            buf.close_msg(at);
            if buf.b.len() > MAX_TRANSACTION {
                return Err((NftSetError::TooBig(buf.b.len()), true));
            }
            fit_sndbuf(fd, buf.b.len())?;
            exchange_on(fd, &buf.b, &[seq], |_, _| {})?;
        }
        Ok(())
    })
}

/// This socket's send buffer (what the kernel holds it to: twice what was asked).
fn sndbuf(fd: &OwnedFd) -> Result<usize, (NftSetError, bool)> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into an int we own, its size given.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &mut v as *mut libc::c_int as *mut c_void,
            &mut len,
        )
    };
    if r < 0 {
        return Err((os_err("getsockopt SO_SNDBUF"), false));
    }
    Ok(v.max(0) as usize)
}

/// Raise this socket's send buffer so one send of `len` bytes fits (the daemon is root:
/// SO_SNDBUFFORCE passes the system's wmem_max, as libnftables does for a large batch).
fn fit_sndbuf(fd: &OwnedFd, len: usize) -> Result<(), (NftSetError, bool)> {
    if len + 32 <= sndbuf(fd)? {
        return Ok(());
    }
    let want = libc::c_int::try_from(len / 2 + 4096).unwrap_or(libc::c_int::MAX);
    // SAFETY: setsockopt from an int we own, its size given.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_SNDBUFFORCE,
            &want as *const libc::c_int as *const c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err((os_err("setsockopt SO_SNDBUFFORCE"), true));
    }
    Ok(())
}

fn os_err(step: &'static str) -> NftSetError {
    NftSetError::Os {
        step,
        source: std::io::Error::last_os_error(),
    }
}

/// An element's key, and its end key in an interval set.
fn elem_keys(buf: &mut Buf, key: &[u8], end: Option<&[u8]>) -> Result<(), NftSetError> {
    buf.begin(NFTA_SET_ELEM_KEY);
    buf.attr(NFTA_DATA_VALUE, key)?;
    buf.end()?;
    if let Some(end) = end {
        buf.begin(NFTA_SET_ELEM_KEY_END);
        buf.attr(NFTA_DATA_VALUE, end)?;
        buf.end()?;
    }
    Ok(())
}

/// The counter (packets, bytes) of one element of a set with a `counter` statement, straight
/// over netlink (libnftables would read every set and chain of the table first); None if
/// the element is not there.
pub fn get_counter(table: &str, set: &str, key: &[u8]) -> Result<Option<(u64, u64)>, NftSetError> {
    let mut buf = Buf::new();
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM;
    let flags = libc::NLM_F_REQUEST as u16 | libc::NLM_F_ACK as u16;
    let at = buf.msg(ty, flags, 1, NFPROTO_INET, 0);
    buf.attr(NFTA_SET_ELEM_LIST_TABLE, &cstr(table)?)?;
    buf.attr(NFTA_SET_ELEM_LIST_SET, &cstr(set)?)?;
    buf.begin(NFTA_SET_ELEM_LIST_ELEMENTS);
    buf.begin(NFTA_LIST_ELEM);
    elem_keys(&mut buf, key, None)?;
    buf.end()?;
    buf.end()?;
    buf.close_msg(at);
    let mut found = None;
    let res = exchange(&buf.b, &[1], |ty, payload| {
        if ty & 0xff == NFT_MSG_NEWSETELEM && payload.len() >= 4 {
            found = found.or_else(|| counter_of(&payload[4..]));
        }
    });
    match res {
        Ok(()) => Ok(found.or(Some((0, 0)))),
        Err(NftSetError::Os { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The counters of every element of `set` whose key starts with `prefix`: (key, packets,
/// bytes), by one dump of the set (the kernel has no lookup by a key's prefix). An element
/// without a counter is left out; a set that is not there is an empty list.
pub fn dump_counters(
    table: &str,
    set: &str,
    prefix: &[u8],
) -> Result<Vec<(Vec<u8>, u64, u64)>, NftSetError> {
    let mut buf = Buf::new();
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM;
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    let at = buf.msg(ty, flags, 1, NFPROTO_INET, 0);
    buf.attr(NFTA_SET_ELEM_LIST_TABLE, &cstr(table)?)?;
    buf.attr(NFTA_SET_ELEM_LIST_SET, &cstr(set)?)?;
    buf.close_msg(at);
    let mut out = Vec::new();
    let res = exchange(&buf.b, &[1], |ty, payload| {
        if ty & 0xff != NFT_MSG_NEWSETELEM || payload.len() < 4 {
            return;
        }
        let Some(elems) = find(&payload[4..], NFTA_SET_ELEM_LIST_ELEMENTS) else {
            return;
        };
        for (t, elem) in attrs(elems) {
            if t != NFTA_LIST_ELEM {
                continue;
            }
            let key = find(elem, NFTA_SET_ELEM_KEY).and_then(|k| find(k, NFTA_DATA_VALUE));
            match (key, elem_counter(elem)) {
                (Some(key), Some((packets, bytes))) if key.starts_with(prefix) => {
                    out.push((key.to_vec(), packets, bytes))
                }
                _ => {}
            }
        }
    });
    match res {
        Ok(()) => Ok(out),
        Err(NftSetError::Os { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            Ok(Vec::new())
        }
        Err(e) => Err(e),
    }
}

/// Attributes of a netlink attribute stream: (type without flags, payload).
fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            break;
        }
        out.push((ty, &b[4..len]));
        b = &b[align4(len).min(b.len())..];
    }
    out
}

fn find(b: &[u8], ty: u16) -> Option<&[u8]> {
    attrs(b).into_iter().find(|(t, _)| *t == ty).map(|(_, p)| p)
}

/// (packets, bytes) of the counter expression in a set element message's attributes.
fn counter_of(msg_attrs: &[u8]) -> Option<(u64, u64)> {
    let elems = find(msg_attrs, NFTA_SET_ELEM_LIST_ELEMENTS)?;
    elem_counter(find(elems, NFTA_LIST_ELEM)?)
}

/// (packets, bytes) of the counter expression of one element (an NFTA_LIST_ELEM's payload).
fn elem_counter(elem: &[u8]) -> Option<(u64, u64)> {
    let mut exprs: Vec<&[u8]> = Vec::new();
    if let Some(e) = find(elem, NFTA_SET_ELEM_EXPR) {
        exprs.push(e);
    }
    if let Some(list) = find(elem, NFTA_SET_ELEM_EXPRESSIONS) {
        exprs.extend(attrs(list).into_iter().map(|(_, p)| p));
    }
    for e in exprs {
        if find(e, NFTA_EXPR_NAME) != Some(b"counter\0".as_slice()) {
            continue;
        }
        let data = find(e, NFTA_EXPR_DATA)?;
        let be64 = |t| {
            find(data, t)
                .and_then(|p| p.get(..8))
                .map(|p| u64::from_be_bytes(p.try_into().unwrap_or([0; 8])))
        };
        return Some((be64(NFTA_COUNTER_PACKETS)?, be64(NFTA_COUNTER_BYTES)?));
    }
    None
}

thread_local! {
    /// This thread's nf_tables socket, kept open from one call to the next: the kernel
    /// answers the close of a netfilter netlink socket (NETLINK_URELEASE) by taking the
    /// nf_tables commit mutex and waiting for the release of earlier transactions (an RCU
    /// grace period), 5-25 ms per close measured under sandbox churn. A socket is put back
    /// only after a clean exchange (every answer read), so the next one starts on an empty
    /// queue; after any error it is closed.
    static SOCKET: RefCell<Option<OwnedFd>> = const { RefCell::new(None) };
}

fn new_socket() -> Result<OwnedFd, NftSetError> {
    // SAFETY: socket(2) with constant arguments; checked below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_NETFILTER,
        )
    };
    if fd < 0 {
        return Err(NftSetError::Os {
            step: "netlink socket",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // An error answer without a copy of the request it refuses (up to a whole element list):
    // every answer fits the receive buffer the exchange reads into.
    // SAFETY: setsockopt from an int we own, its size given.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_NETLINK,
            NETLINK_CAP_ACK,
            &one as *const libc::c_int as *const c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(os_err("setsockopt NETLINK_CAP_ACK"));
    }
    Ok(fd)
}

/// Send `data` and read answers until each sequence number in `acks` is acknowledged;
/// `seen(message type, payload)` gets every other message. On this thread's kept socket.
fn exchange(data: &[u8], acks: &[u32], seen: impl FnMut(u16, &[u8])) -> Result<(), NftSetError> {
    with_socket(|fd| exchange_on(fd, data, acks, seen))
}

/// `f` on this thread's kept socket (a new one if there is none), put back for the next
/// call if `f` succeeds or its error says every answer was read.
fn with_socket<R>(
    f: impl FnOnce(&OwnedFd) -> Result<R, (NftSetError, bool)>,
) -> Result<R, NftSetError> {
    let fd = match SOCKET.with(|c| c.borrow_mut().take()) {
        Some(fd) => fd,
        None => new_socket()?,
    };
    // A kernel's error answer to the one request of an exchange (a get of an element not
    // there: ENOENT, every get of a sandbox never denied) ends it cleanly too.
    let (res, clean) = match f(&fd) {
        Ok(r) => (Ok(r), true),
        Err((e, clean)) => (Err(e), clean),
    };
    if clean {
        SOCKET.with(|c| *c.borrow_mut() = Some(fd));
    }
    res
}

/// The exchange on `fd`; an error says whether every answer was read (the socket reusable).
fn exchange_on(
    fd: &OwnedFd,
    data: &[u8],
    acks: &[u32],
    mut seen: impl FnMut(u16, &[u8]),
) -> Result<(), (NftSetError, bool)> {
    let os = |step: &'static str| {
        (
            NftSetError::Os {
                step,
                source: std::io::Error::last_os_error(),
            },
            false,
        )
    };
    // SAFETY: send of a buffer we own, its length.
    let n = unsafe {
        libc::send(
            fd.as_raw_fd(),
            data.as_ptr() as *const c_void,
            data.len(),
            0,
        )
    };
    if n < 0 {
        return Err(os("send"));
    }
    let mut pending: Vec<u32> = acks.to_vec();
    let mut buf = vec![0u8; 65536]; // a dump's messages are up to 32 KiB
    while !pending.is_empty() {
        // SAFETY: recv into a buffer we own, its length.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut c_void,
                buf.len(),
                0,
            )
        };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(os("recv"));
        }
        let n = n as usize;
        let mut off = 0;
        while off + NLMSG_HDRLEN <= n {
            let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
            let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().unwrap());
            let seq = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().unwrap());
            if len < NLMSG_HDRLEN || off + len > n {
                return Err((
                    NftSetError::Os {
                        step: "recv",
                        source: std::io::Error::from_raw_os_error(libc::EBADMSG),
                    },
                    false,
                ));
            }
            if ty == libc::NLMSG_ERROR as u16 {
                let code = i32::from_ne_bytes(
                    buf[off + NLMSG_HDRLEN..off + NLMSG_HDRLEN + 4]
                        .try_into()
                        .unwrap(),
                );
                pending.retain(|s| *s != seq);
                if code != 0 {
                    let last = pending.is_empty() && off + align4(len) >= n;
                    return Err((
                        NftSetError::Os {
                            step: "set elements",
                            source: std::io::Error::from_raw_os_error(-code),
                        },
                        last,
                    ));
                }
            } else if ty == libc::NLMSG_DONE as u16 {
                pending.retain(|s| *s != seq); // the end of a dump
            } else {
                seen(ty, &buf[off + NLMSG_HDRLEN..off + len]);
            }
            off += align4(len);
        }
    }
    Ok(())
}
