//! The TCP transport's wire format and the state its listener and writers share: frame
//! layout, limits, the exposed-region table entry, the idle-connection pool key.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::region::Region;

pub(super) const MAGIC: &[u8; 4] = b"TKV1";
pub(super) const HELLO_LEN: usize = 4 + 8 + 8 + 4;
/// Op byte + `u64` argument.
pub(super) const FRAME_HEADER: usize = 9;
pub(super) const OP_PUT: u8 = 1;
/// Most blocks one `PUT` frame may carry (the receiver's bound).
pub(super) const MAX_FRAME_BLOCKS: usize = 1024;
pub(super) const OP_FLUSH: u8 = 2;
/// Parts of blocks: `(block, offset, length)` as three `u32` per part, then the bytes.
pub(super) const OP_PUT_PART: u8 = 3;
pub(super) const REPLY_ACK: u8 = 1;
pub(super) const REPLY_ERR: u8 = 2;
/// A batch of queued `put_region` blocks is written once it holds this many blocks...
pub(super) const BATCH_BLOCKS: usize = 32;
/// ... or this many bytes.
pub(super) const BATCH_BYTES: usize = 2 << 20;
/// Connections a listener serves at once; more are closed on accept.
pub(super) const MAX_CONNECTIONS: usize = 1024;
/// Longest error message either side accepts.
pub(super) const MAX_MESSAGE: u32 = 4096;

pub(super) type PoolKey = (String, u64);

pub(super) struct Exposed {
    pub(super) region: Arc<Region>,
    pub(super) withdrawn: Arc<AtomicBool>,
}

pub(super) fn message_frame(tag: u8, text: &str) -> Vec<u8> {
    let text = &text.as_bytes()[..text.len().min(MAX_MESSAGE as usize)];
    let mut out = Vec::with_capacity(5 + text.len());
    out.push(tag);
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text);
    out
}
