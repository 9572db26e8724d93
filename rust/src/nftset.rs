//! Adding and removing set elements straight over nf_tables netlink. libnftables fetches the whole set
//! into its cache before a delete (to find interval boundaries), which costs O(elements): a
//! quarter of a second per sandbox with 10,000 of them. The kernel's own cost does not grow
//! like that. NFT_MSG_DESTROYSETELEM (Linux >= 6.3) ignores elements already gone (expired
//! DNS pins), so one batch removes a sandbox's elements whatever expired meanwhile.

use std::cell::RefCell;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use libc::c_void;

#[derive(Debug, thiserror::Error)]
pub enum NftSetError {
    #[error("invalid argument: {0}")]
    Invalid(String),
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

    fn attr(&mut self, ty: u16, data: &[u8]) {
        self.b
            .extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
        self.b.extend_from_slice(&ty.to_ne_bytes());
        self.b.extend_from_slice(data);
        self.b.resize(align4(self.b.len()), 0);
    }

    fn begin(&mut self, ty: u16) {
        self.nests.push(self.b.len());
        self.b.extend_from_slice(&0u16.to_ne_bytes());
        self.b.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    }

    fn end(&mut self) {
        let at = self.nests.pop().expect("end without begin");
        let len = (self.b.len() - at) as u16;
        self.b[at..at + 2].copy_from_slice(&len.to_ne_bytes());
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

/// Remove the given elements of `table` (family inet) in one batch (one transaction); an
/// element already gone is not an error.
pub fn destroy_elements(table: &str, sets: &[SetElems]) -> Result<(), NftSetError> {
    swap_elements(table, sets, &[])
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
    let items = gone
        .iter()
        .filter(|s| !s.elems.is_empty())
        .map(Change::Gone)
        .chain(
            added
                .iter()
                .filter(|(_, e)| !e.is_empty())
                .map(|(set, elems)| Change::Added(set, elems)),
        );
    elem_batch(items, |buf, seq, item| match item {
        Change::Gone(s) => write_destroy(buf, seq, &table, s),
        Change::Added(set, elems) => write_add(buf, seq, &table, set, elems),
    })
}

/// One element-list message of a batch.
enum Change<'a> {
    Gone(&'a SetElems),
    Added(&'a str, &'a [NewElem]),
}

fn write_destroy(buf: &mut Buf, seq: u32, table: &[u8], s: &SetElems) -> Result<(), NftSetError> {
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DESTROYSETELEM;
    let flags = libc::NLM_F_REQUEST as u16 | libc::NLM_F_ACK as u16;
    let at = elem_list(buf, ty, flags, seq, table, &s.set)?;
    for (key, end) in &s.elems {
        buf.begin(NFTA_LIST_ELEM);
        elem_keys(buf, key, end.as_deref());
        buf.end();
    }
    buf.end();
    buf.close_msg(at);
    Ok(())
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
    buf: &mut Buf,
    seq: u32,
    table: &[u8],
    set: &str,
    elems: &[NewElem],
) -> Result<(), NftSetError> {
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM;
    let flags = libc::NLM_F_REQUEST as u16 | libc::NLM_F_ACK as u16 | libc::NLM_F_CREATE as u16;
    let at = elem_list(buf, ty, flags, seq, table, set)?;
    for e in elems {
        buf.begin(NFTA_LIST_ELEM);
        elem_keys(buf, &e.key, e.end.as_deref());
        if let Some(ms) = e.timeout_ms {
            buf.attr(NFTA_SET_ELEM_TIMEOUT, &ms.to_be_bytes());
        }
        if let Some(chain) = &e.jump {
            buf.begin(NFTA_SET_ELEM_DATA);
            buf.begin(NFTA_DATA_VERDICT);
            buf.attr(NFTA_VERDICT_CODE, &NFT_JUMP.to_be_bytes());
            buf.attr(NFTA_VERDICT_CHAIN, &cstr(chain)?);
            buf.end();
            buf.end();
        }
        buf.end();
    }
    buf.end();
    buf.close_msg(at);
    Ok(())
}

/// One nf_tables batch (one transaction): `write` adds one element-list message per item
/// (its sequence number given); sent, and every message's ack read. Nothing is sent for no
/// items.
fn elem_batch<T>(
    items: impl Iterator<Item = T>,
    mut write: impl FnMut(&mut Buf, u32, T) -> Result<(), NftSetError>,
) -> Result<(), NftSetError> {
    let mut buf = Buf {
        b: Vec::new(),
        nests: Vec::new(),
    };
    let req = libc::NLM_F_REQUEST as u16;
    let at = buf.msg(NFNL_MSG_BATCH_BEGIN, req, 1, 0, NFNL_SUBSYS_NFTABLES);
    buf.close_msg(at);
    let mut seq = 2u32;
    let mut acks = Vec::new();
    for item in items {
        write(&mut buf, seq, item)?;
        acks.push(seq);
        seq += 1;
    }
    if acks.is_empty() {
        return Ok(());
    }
    let at = buf.msg(NFNL_MSG_BATCH_END, req, seq, 0, NFNL_SUBSYS_NFTABLES);
    buf.close_msg(at);
    send_batch(&buf.b, &acks)
}

/// The head of an element-list message for `set` of `table`, its elements' nest opened: the
/// caller adds the elements, ends the nest and closes the message (at the offset returned).
fn elem_list(
    buf: &mut Buf,
    ty: u16,
    flags: u16,
    seq: u32,
    table: &[u8],
    set: &str,
) -> Result<usize, NftSetError> {
    let at = buf.msg(ty, flags, seq, NFPROTO_INET, 0);
    buf.attr(NFTA_SET_ELEM_LIST_TABLE, table);
    buf.attr(NFTA_SET_ELEM_LIST_SET, &cstr(set)?);
    buf.begin(NFTA_SET_ELEM_LIST_ELEMENTS);
    Ok(at)
}

/// An element's key, and its end key in an interval set.
fn elem_keys(buf: &mut Buf, key: &[u8], end: Option<&[u8]>) {
    buf.begin(NFTA_SET_ELEM_KEY);
    buf.attr(NFTA_DATA_VALUE, key);
    buf.end();
    if let Some(end) = end {
        buf.begin(NFTA_SET_ELEM_KEY_END);
        buf.attr(NFTA_DATA_VALUE, end);
        buf.end();
    }
}

/// The counter (packets, bytes) of one element of a set with a `counter` statement, straight
/// over netlink (libnftables would read every set and chain of the table first); None if
/// the element is not there.
pub fn get_counter(table: &str, set: &str, key: &[u8]) -> Result<Option<(u64, u64)>, NftSetError> {
    let mut buf = Buf {
        b: Vec::new(),
        nests: Vec::new(),
    };
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM;
    let flags = libc::NLM_F_REQUEST as u16 | libc::NLM_F_ACK as u16;
    let at = buf.msg(ty, flags, 1, NFPROTO_INET, 0);
    buf.attr(NFTA_SET_ELEM_LIST_TABLE, &cstr(table)?);
    buf.attr(NFTA_SET_ELEM_LIST_SET, &cstr(set)?);
    buf.begin(NFTA_SET_ELEM_LIST_ELEMENTS);
    buf.begin(NFTA_LIST_ELEM);
    buf.begin(NFTA_SET_ELEM_KEY);
    buf.attr(NFTA_DATA_VALUE, key);
    buf.end();
    buf.end();
    buf.end();
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
    let mut buf = Buf {
        b: Vec::new(),
        nests: Vec::new(),
    };
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM;
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    let at = buf.msg(ty, flags, 1, NFPROTO_INET, 0);
    buf.attr(NFTA_SET_ELEM_LIST_TABLE, &cstr(table)?);
    buf.attr(NFTA_SET_ELEM_LIST_SET, &cstr(set)?);
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

fn send_batch(data: &[u8], acks: &[u32]) -> Result<(), NftSetError> {
    exchange(data, acks, |_, _| {})
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
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Send `data` and read answers until each sequence number in `acks` is acknowledged;
/// `seen(message type, payload)` gets every other message. On this thread's kept socket.
fn exchange(data: &[u8], acks: &[u32], seen: impl FnMut(u16, &[u8])) -> Result<(), NftSetError> {
    let fd = match SOCKET.with(|c| c.borrow_mut().take()) {
        Some(fd) => fd,
        None => new_socket()?,
    };
    // A kernel's error answer to the one request of an exchange (a get of an element not
    // there: ENOENT, every get of a sandbox never denied) ends it cleanly too.
    let (res, clean) = match exchange_on(&fd, data, acks, seen) {
        Ok(()) => (Ok(()), true),
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
