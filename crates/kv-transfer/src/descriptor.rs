//! What a receiver publishes about an exposed region, and the vocabulary around it.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::error::TransferError;

/// Which transport moves the blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// UCP one-sided puts over whatever UCX selects (RDMA, shared memory, TCP).
    Ucx,
    /// Framed block writes over a TCP connection, copied into the region by the receiver.
    Tcp,
    /// In-process copies (both sides in the same process).
    Local,
}

impl TransportKind {
    pub const ALL: [TransportKind; 3] =
        [TransportKind::Ucx, TransportKind::Tcp, TransportKind::Local];

    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Ucx => "ucx",
            TransportKind::Tcp => "tcp",
            TransportKind::Local => "local",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TransportKind {
    type Err = TransferError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ucx" => Ok(TransportKind::Ucx),
            "tcp" => Ok(TransportKind::Tcp),
            "local" => Ok(TransportKind::Local),
            other => Err(TransferError::InvalidArgument(format!(
                "unknown transport `{other}` (expected ucx, tcp or local)"
            ))),
        }
    }
}

/// Where a region's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    Host,
    Cuda,
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda => "cuda",
        })
    }
}

/// Everything a sender needs to write into a receiver's exposed region. Small (well under a
/// kilobyte for UCX, tens of bytes otherwise) so that it fits a worker's discovery record;
/// [`RegionDescriptor::to_compact`] gives the one-line form for a record field.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionDescriptor {
    pub transport: TransportKind,
    /// Transport address: `host:port` (tcp), the hex-encoded UCP worker address (ucx), or
    /// `local:<pid>` (local).
    pub address: String,
    /// Region key within that address: the region's id in the listener's table (tcp) or in the
    /// process registry (local); the remote virtual address of block 0 (ucx).
    pub region: u64,
    /// Packed UCP remote key (ucx); empty otherwise.
    pub rkey: Vec<u8>,
    pub bytes_per_block: u64,
    pub num_blocks: u32,
    pub memory: MemoryKind,
}

/// Prefix of the compact form; the digit is the encoding's version.
const COMPACT_PREFIX: &str = "kvt1:";

impl RegionDescriptor {
    /// One line, URL-safe: `kvt1:` + base64url(bincode(self)).
    pub fn to_compact(&self) -> String {
        let bytes = bincode::serde::encode_to_vec(self, bincode::config::standard())
            .expect("a descriptor always encodes");
        let mut out = String::from(COMPACT_PREFIX);
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode_string(bytes, &mut out);
        out
    }

    /// Parses [`RegionDescriptor::to_compact`]'s output.
    pub fn from_compact(s: &str) -> Result<Self, TransferError> {
        let body = s.trim().strip_prefix(COMPACT_PREFIX).ok_or_else(|| {
            TransferError::BadDescriptor(format!("missing `{COMPACT_PREFIX}` prefix"))
        })?;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|e| TransferError::BadDescriptor(format!("base64: {e}")))?;
        let (d, used): (RegionDescriptor, usize) =
            bincode::serde::decode_from_slice(&bytes, bincode::config::standard())
                .map_err(|e| TransferError::BadDescriptor(format!("decode: {e}")))?;
        if used != bytes.len() {
            return Err(TransferError::BadDescriptor("trailing bytes".into()));
        }
        d.validate()?;
        Ok(d)
    }

    /// Total bytes of the region.
    pub fn len_bytes(&self) -> u64 {
        self.bytes_per_block * u64::from(self.num_blocks)
    }

    /// Structural checks every transport relies on.
    /// [`validate`](Self::validate), and that the descriptor is for `kind` (what a
    /// transport's `connect` checks first).
    pub fn validate_for(&self, kind: TransportKind) -> Result<(), TransferError> {
        self.validate()?;
        if self.transport != kind {
            return Err(TransferError::BadDescriptor(format!(
                "a {} descriptor given to the {kind} transport",
                self.transport
            )));
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), TransferError> {
        if self.bytes_per_block == 0 || self.num_blocks == 0 {
            return Err(TransferError::BadDescriptor("empty region".into()));
        }
        if self
            .bytes_per_block
            .checked_mul(u64::from(self.num_blocks))
            .is_none()
        {
            return Err(TransferError::BadDescriptor("region size overflows".into()));
        }
        if self.address.is_empty() {
            return Err(TransferError::BadDescriptor("empty address".into()));
        }
        Ok(())
    }

    /// Checks a write of `len` bytes into block `block`: whole blocks only, in range.
    pub fn check_put(&self, block: u32, len: usize) -> Result<(), TransferError> {
        if block >= self.num_blocks {
            return Err(TransferError::OutOfRange {
                block,
                num_blocks: self.num_blocks,
            });
        }
        if len as u64 != self.bytes_per_block {
            return Err(TransferError::BlockSize {
                expected: self.bytes_per_block,
                got: len as u64,
            });
        }
        Ok(())
    }

    /// Checks that bytes `range` of remote block `block` lie inside the region's block.
    pub fn check_put_part(&self, block: u32, range: &Range<usize>) -> Result<(), TransferError> {
        self.check_put(block, self.bytes_per_block as usize)?;
        if range.start > range.end || range.end as u64 > self.bytes_per_block {
            return Err(TransferError::BadPart {
                start: range.start as u64,
                end: range.end as u64,
                bytes_per_block: self.bytes_per_block,
            });
        }
        Ok(())
    }
}

impl fmt::Display for RegionDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_compact())
    }
}

impl FromStr for RegionDescriptor {
    type Err = TransferError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RegionDescriptor::from_compact(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RegionDescriptor {
        RegionDescriptor {
            transport: TransportKind::Ucx,
            address: "ab".repeat(200),
            region: 0x7f00_dead_0000,
            rkey: vec![7; 90],
            bytes_per_block: 65536,
            num_blocks: 1024,
            memory: MemoryKind::Host,
        }
    }

    #[test]
    fn compact_round_trip() {
        let d = sample();
        let s = d.to_compact();
        assert!(s.starts_with("kvt1:"));
        assert!(s.len() < 1024, "{} bytes", s.len());
        assert_eq!(s.parse::<RegionDescriptor>().unwrap(), d);
        // JSON works too (serde), for records that embed it structurally.
        let j = serde_json::to_string(&d).unwrap();
        assert!(j.contains("\"ucx\""));
        assert_eq!(serde_json::from_str::<RegionDescriptor>(&j).unwrap(), d);
    }

    #[test]
    fn compact_rejects_garbage() {
        for bad in ["", "kvt1:", "kvt1:!!!", "xyz:AAAA", "kvt1:AAAA"] {
            let e = RegionDescriptor::from_compact(bad).unwrap_err();
            assert!(matches!(e, TransferError::BadDescriptor(_)), "{bad}: {e}");
        }
    }

    #[test]
    fn kinds_parse() {
        for k in TransportKind::ALL {
            assert_eq!(k.as_str().parse::<TransportKind>().unwrap(), k);
        }
        assert_eq!(
            " UCX ".parse::<TransportKind>().unwrap(),
            TransportKind::Ucx
        );
        assert!("rdma".parse::<TransportKind>().is_err());
    }

    #[test]
    fn check_put_bounds() {
        let d = sample();
        assert!(d.check_put(1023, 65536).is_ok());
        assert!(matches!(
            d.check_put(1024, 65536),
            Err(TransferError::OutOfRange { block: 1024, .. })
        ));
        assert!(matches!(
            d.check_put(0, 10),
            Err(TransferError::BlockSize { .. })
        ));
        assert!(d.check_put_part(3, &(4096..8192)).is_ok());
        assert!(d.check_put_part(3, &(0..65536)).is_ok());
        assert!(matches!(
            d.check_put_part(3, &(65000..65537)),
            Err(TransferError::BadPart { .. })
        ));
        assert!(matches!(
            d.check_put_part(1024, &(0..16)),
            Err(TransferError::OutOfRange { .. })
        ));
    }
}
