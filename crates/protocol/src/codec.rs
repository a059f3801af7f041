//! The versioned envelope around every message on the event plane.
//!
//! Layout: 4 magic bytes `TDM1`, a u16 LE format version, a u16 LE message kind, then the
//! bincode (standard config) body. A reader rejects a newer version or a different kind with a
//! typed error instead of misreading it, and a truncated or corrupt body is an error too.

use serde::{Serialize, de::DeserializeOwned};

use crate::events::{KvDump, KvEvent};
use crate::worker::{LoadReport, WorkerRecord};

const MAGIC: [u8; 4] = *b"TDM1";
const HEADER_LEN: usize = 8;
/// Wire format version written by this build; readers accept it and older ones they know.
pub const FORMAT_VERSION: u16 = 1;
/// Largest body a reader accepts (64 MiB): a corrupt length never allocates without bound.
const MAX_BODY: usize = 64 << 20;

/// Message kinds, so a subscriber never decodes a load report as events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum MessageKind {
    KvEvents = 1,
    KvDump = 2,
    LoadReport = 3,
    WorkerRecord = 4,
    /// Router replica sync (the router crate's `SyncMessage`).
    RouterSync = 5,
    /// A router replica's presence (the router crate's `SyncHello`).
    RouterHello = 6,
}

/// Why bytes could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    #[error("not a tandem message (bad magic)")]
    BadMagic,
    #[error("message truncated: {0} bytes")]
    Truncated(usize),
    #[error("message format version {found} is newer than supported version {supported}")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("expected a {expected:?} message, got kind {found}")]
    WrongKind { expected: MessageKind, found: u16 },
    #[error("message body too large: {0} bytes")]
    TooLarge(usize),
    #[error("corrupt message body: {0}")]
    Corrupt(String),
    #[error("cannot encode message: {0}")]
    Encode(String),
}

/// A type that travels in an envelope under one kind.
pub trait Envelope: Serialize + DeserializeOwned {
    const KIND: MessageKind;

    /// Encodes into a fresh buffer.
    fn encode(&self) -> Result<Vec<u8>, CodecError> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(Self::KIND as u16).to_le_bytes());
        bincode::serde::encode_into_std_write(self, &mut out, bincode::config::standard())
            .map_err(|e| CodecError::Encode(e.to_string()))?;
        Ok(out)
    }

    /// Decodes, rejecting other kinds, newer versions, trailing bytes and corrupt bodies.
    fn decode(bytes: &[u8]) -> Result<Self, CodecError> {
        if bytes.len() < HEADER_LEN {
            return Err(CodecError::Truncated(bytes.len()));
        }
        if bytes[..4] != MAGIC {
            return Err(CodecError::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version > FORMAT_VERSION {
            return Err(CodecError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let kind = u16::from_le_bytes([bytes[6], bytes[7]]);
        if kind != Self::KIND as u16 {
            return Err(CodecError::WrongKind {
                expected: Self::KIND,
                found: kind,
            });
        }
        let body = &bytes[HEADER_LEN..];
        if body.len() > MAX_BODY {
            return Err(CodecError::TooLarge(body.len()));
        }
        let (value, used) = decode_body(body).map_err(|e| CodecError::Corrupt(e.to_string()))?;
        if used != body.len() {
            return Err(CodecError::Corrupt(format!(
                "{} trailing bytes",
                body.len() - used
            )));
        }
        Ok(value)
    }
}

/// Most bytes bincode may claim per body byte. Claims are what a decoder is about to hold:
/// a primitive claims its in-memory size (16 bytes at most, a `u128`, from at least one
/// wire byte), a string or byte vector its length (its bytes are on the wire). So a valid
/// body never claims more than 16 times its length, while a lying length prefix claims
/// whatever it says.
const CLAIM_PER_BYTE: usize = 16;

/// Bincode-decodes a body with a claim limit of its size class (the smallest of 64 KiB,
/// 1 MiB, 16 MiB and [`MAX_BODY`] that is at least [`CLAIM_PER_BYTE`] times its length):
/// a length prefix can make the decoder reserve (`vec![0; len]` for a string) at most that,
/// not 64 MiB for a 20-byte message. Bincode's limit is a const generic, hence the classes.
fn decode_body<T: DeserializeOwned>(
    body: &[u8],
) -> Result<(T, usize), bincode::error::DecodeError> {
    fn with_limit<T: DeserializeOwned, const LIMIT: usize>(
        body: &[u8],
    ) -> Result<(T, usize), bincode::error::DecodeError> {
        let cfg = bincode::config::standard().with_limit::<LIMIT>();
        bincode::serde::decode_from_slice(body, cfg)
    }
    let most = body.len().saturating_mul(CLAIM_PER_BYTE);
    if most <= 64 << 10 {
        with_limit::<T, { 64 << 10 }>(body)
    } else if most <= 1 << 20 {
        with_limit::<T, { 1 << 20 }>(body)
    } else if most <= 16 << 20 {
        with_limit::<T, { 16 << 20 }>(body)
    } else {
        with_limit::<T, MAX_BODY>(body)
    }
}

/// A batch of events from one worker, in event-id order.
pub type KvEventBatch = Vec<KvEvent>;

impl Envelope for Vec<KvEvent> {
    const KIND: MessageKind = MessageKind::KvEvents;
}
impl Envelope for KvDump {
    const KIND: MessageKind = MessageKind::KvDump;
}
impl Envelope for LoadReport {
    const KIND: MessageKind = MessageKind::LoadReport;
}
impl Envelope for WorkerRecord {
    const KIND: MessageKind = MessageKind::WorkerRecord;
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::events::{KvEventKind, StoredBlock};
    use crate::hashing::BlockSize;
    use crate::ids::{LocalBlockHash, SequenceHash, StorageTier, WorkerId};
    use crate::worker::{TierCapacity, WorkerAddresses, WorkerRole};

    fn sample_events() -> Vec<KvEvent> {
        vec![
            KvEvent {
                worker_id: WorkerId(7),
                event_id: 1,
                tier: StorageTier::Device,
                kind: KvEventKind::Stored {
                    parent: None,
                    blocks: vec![StoredBlock {
                        sequence_hash: SequenceHash(11),
                        local_hash: LocalBlockHash(11),
                    }],
                },
            },
            KvEvent {
                worker_id: WorkerId(7),
                event_id: 2,
                tier: StorageTier::Host,
                kind: KvEventKind::Removed {
                    blocks: vec![SequenceHash(11)],
                },
            },
            KvEvent {
                worker_id: WorkerId(7),
                event_id: 3,
                tier: StorageTier::Disk,
                kind: KvEventKind::Cleared,
            },
        ]
    }

    #[test]
    fn events_round_trip() {
        let ev = sample_events();
        let bytes = ev.encode().unwrap();
        assert_eq!(Vec::<KvEvent>::decode(&bytes).unwrap(), ev);
    }

    #[test]
    fn record_round_trip() {
        let rec = WorkerRecord {
            id: WorkerId(3),
            role: WorkerRole::Decode,
            model: "mocker".into(),
            block_size: BlockSize::DEFAULT,
            kv_capacity: TierCapacity {
                device_blocks: 100,
                host_blocks: 50,
                disk_blocks: 0,
            },
            addresses: WorkerAddresses {
                grpc: "127.0.0.1:1".into(),
                kv_transfer: None,
                metrics: None,
                http: None,
            },
            kv_events: true,
            placement: Default::default(),
            takes_text: false,
        };
        assert_eq!(WorkerRecord::decode(&rec.encode().unwrap()).unwrap(), rec);
    }

    #[test]
    fn newer_version_is_a_typed_error() {
        let mut bytes = sample_events().encode().unwrap();
        bytes[4..6].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        assert_eq!(
            Vec::<KvEvent>::decode(&bytes),
            Err(CodecError::UnsupportedVersion {
                found: FORMAT_VERSION + 1,
                supported: FORMAT_VERSION
            })
        );
    }

    #[test]
    fn wrong_kind_magic_and_truncation_are_typed_errors() {
        let bytes = LoadReport::default().encode().unwrap();
        assert!(matches!(
            Vec::<KvEvent>::decode(&bytes),
            Err(CodecError::WrongKind { .. })
        ));
        assert_eq!(
            Vec::<KvEvent>::decode(b"nope-nope"),
            Err(CodecError::BadMagic)
        );
        assert_eq!(
            Vec::<KvEvent>::decode(b"TDM"),
            Err(CodecError::Truncated(3))
        );
        let good = sample_events().encode().unwrap();
        assert!(matches!(
            Vec::<KvEvent>::decode(&good[..good.len() - 1]),
            Err(CodecError::Corrupt(_))
        ));
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(matches!(
            Vec::<KvEvent>::decode(&trailing),
            Err(CodecError::Corrupt(_))
        ));
    }

    proptest! {
        // Arbitrary bytes never panic the decoder, and any flipped byte in the body either
        // fails to decode or decodes to something (never a crash, never an unbounded alloc).
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Vec::<KvEvent>::decode(&bytes);
            let mut framed = b"TDM1\x01\x00\x01\x00".to_vec();
            framed.extend_from_slice(&bytes);
            let _ = Vec::<KvEvent>::decode(&framed);
        }
    }
}
