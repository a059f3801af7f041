//! The crate's error type and its classification.

use std::fmt;
use std::path::PathBuf;

pub use tandem_protocol::ErrorClass;

use crate::quant::GgmlType;

/// Everything that can go wrong in tandem-native. A file that is not a GGUF tandem can load is
/// named precisely (where in the file, which key, which tensor) so that the message alone says
/// what to fix; the byte offsets are absolute positions in the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: it starts with \"{}\", expected \"GGUF\"", found.escape_ascii())]
    BadMagic { found: [u8; 4] },
    /// A GGUF version other than 2 and 3 (version 1 had 32-bit counts; later ones are unknown).
    #[error("GGUF version {version} is not supported (tandem reads versions 2 and 3)")]
    UnsupportedVersion { version: u32 },
    /// The version field reads as a byte-swapped small number: a big-endian file.
    #[error(
        "big-endian GGUF (version field {raw:#010x}) is not supported; tandem reads \
         little-endian files only"
    )]
    BigEndian { raw: u32 },
    /// The file ends (or a length overflows) before a field it declares.
    #[error("truncated GGUF: {what} at byte {offset} needs {needed} bytes, {available} left")]
    Truncated {
        what: &'static str,
        offset: usize,
        needed: u64,
        available: usize,
    },
    /// A key, string value or tensor name that is not UTF-8, as the format requires.
    #[error("invalid GGUF: {what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str, offset: usize },
    /// A metadata value type id outside the 13 the format defines.
    #[error("invalid GGUF: unknown metadata value type {id} at byte {offset}")]
    UnknownValueType { id: u32, offset: usize },
    /// Arrays of arrays nested deeper than the reader follows (a hostile file could otherwise
    /// exhaust the stack).
    #[error("invalid GGUF: arrays nested deeper than {limit} levels at byte {offset}")]
    NestingTooDeep { limit: usize, offset: usize },
    /// A metadata key of length zero.
    #[error("invalid GGUF: empty metadata key at byte {offset}")]
    EmptyKey { offset: usize },
    #[error("invalid GGUF: metadata key {key:?} appears twice")]
    DuplicateKey { key: String },
    #[error("invalid GGUF: tensor {name:?} appears twice")]
    DuplicateTensor { name: String },
    /// `general.alignment` is zero or not a power of two.
    #[error("invalid GGUF: general.alignment is {value}, not a power of two")]
    BadAlignment { value: u64 },
    #[error("invalid GGUF: tensor {tensor:?} has {n_dims} dimensions, at most {max} are allowed")]
    TooManyDims {
        tensor: String,
        n_dims: u32,
        max: usize,
    },
    /// A shape whose element or byte count does not fit in memory (or a dimension that is
    /// negative as ggml's signed 64-bit reads it).
    #[error("invalid GGUF: tensor {tensor:?} has shape {dims:?}, which is too large")]
    ShapeOverflow { tensor: String, dims: Vec<u64> },
    /// A tensor of a type tandem does not load (or an id ggml does not define).
    #[error(
        "tensor {tensor:?} has type {ty}, which tandem does not load; supported: {}",
        SupportedList
    )]
    UnsupportedTensorType { tensor: String, ty: GgmlTypeId },
    /// A row length that is not a whole number of the type's blocks.
    #[error(
        "invalid GGUF: tensor {tensor:?} of type {ty} has rows of {row_len} elements, not a \
         multiple of the block size {block}"
    )]
    RaggedRow {
        tensor: String,
        ty: GgmlType,
        row_len: usize,
        block: usize,
    },
    #[error(
        "invalid GGUF: tensor {tensor:?} starts at data offset {offset}, not a multiple of the \
         alignment {alignment}"
    )]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: usize,
    },
    #[error(
        "invalid GGUF: tensor {tensor:?} ({n_bytes} bytes at data offset {offset}) ends past the \
         data section ({data_len} bytes)"
    )]
    TensorOutOfBounds {
        tensor: String,
        offset: u64,
        n_bytes: usize,
        data_len: usize,
    },
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    /// `general.architecture` names a model the forward pass does not compute.
    #[error("architecture {name:?} is not one tandem computes (llama, qwen2)")]
    UnknownArchitecture { name: String },
    /// A tensor the architecture needs is not in the file.
    #[error("the model has no tensor {name:?}")]
    MissingTensor { name: String },
    /// A tensor of another shape than the model's hyperparameters imply.
    #[error("tensor {tensor:?} has shape {dims:?}, the model's hyperparameters need {expected:?}")]
    TensorShape {
        tensor: String,
        dims: Vec<usize>,
        expected: Vec<usize>,
    },
    /// Hyperparameters or a tokenizer that do not hang together.
    #[error("invalid model: {reason}")]
    InvalidModel { reason: String },
    /// A metadata value of another type than the caller asked for (or an integer that does not
    /// fit it).
    #[error("metadata key {key:?} holds {found}, expected {expected}")]
    KeyType {
        key: String,
        expected: &'static str,
        found: String,
    },
    /// A dequantization asked for a number of elements that is not a whole number of blocks.
    #[error("{ty} holds whole blocks of {block} elements, not {n}")]
    NotBlockMultiple {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    /// A row of `n` elements whose byte size does not fit in `usize`.
    #[error("a {ty} row of {n} elements is too large")]
    RowTooLarge { ty: GgmlType, n: usize },
    /// The source bytes of a dequantization do not match the elements asked for.
    #[error("{n} {ty} elements take {expected} bytes, got {got}")]
    RowBytes {
        ty: GgmlType,
        n: usize,
        expected: usize,
        got: usize,
    },
    /// A dequantization of a type tandem does not compute.
    #[error("tandem does not dequantize {ty}")]
    UnsupportedType { ty: GgmlType },
    #[error("row {row} is out of range: tensor {tensor:?} has {n_rows} rows")]
    RowOutOfRange {
        tensor: String,
        row: usize,
        n_rows: usize,
    },
}

impl Error {
    /// The class of this error: the one place that decides how callers react to it. A model
    /// file that cannot be used is a configuration error (the same file fails everywhere); a
    /// misuse of the dequantization API is a bug.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
                    ErrorClass::InvalidRequest
                }
                _ => ErrorClass::Internal,
            },
            Error::NotBlockMultiple { .. }
            | Error::RowTooLarge { .. }
            | Error::RowBytes { .. }
            | Error::UnsupportedType { .. }
            | Error::RowOutOfRange { .. } => ErrorClass::Internal,
            _ => ErrorClass::InvalidRequest,
        }
    }
}

/// A tensor's ggml type as the file states it: an id, named when ggml defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlTypeId(pub u32);

impl fmt::Display for GgmlTypeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match GgmlType::from_id(self.0) {
            Some(ty) => write!(f, "{ty} ({})", self.0),
            None => write!(f, "unknown id {}", self.0),
        }
    }
}

/// The supported types, comma-separated, for [`Error::UnsupportedTensorType`].
struct SupportedList;

impl fmt::Display for SupportedList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, ty) in GgmlType::SUPPORTED.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{ty}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_type_message_names_tensor_type_and_the_supported_list() {
        let e = Error::UnsupportedTensorType {
            tensor: "blk.0.ffn_up.weight".into(),
            ty: GgmlTypeId(16),
        };
        assert_eq!(
            e.to_string(),
            "tensor \"blk.0.ffn_up.weight\" has type IQ2_XXS (16), which tandem does not load; \
             supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"
        );
        let e = Error::UnsupportedTensorType {
            tensor: "x".into(),
            ty: GgmlTypeId(99),
        };
        assert!(e.to_string().contains("type unknown id 99,"), "{e}");
    }

    #[test]
    fn classes() {
        assert_eq!(
            Error::BadMagic { found: *b"GGML" }.class(),
            ErrorClass::InvalidRequest
        );
        let missing = Error::Io {
            path: "/nope".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(missing.class(), ErrorClass::InvalidRequest);
        assert_eq!(
            Error::UnsupportedType { ty: GgmlType::Q2_K }.class(),
            ErrorClass::Internal
        );
    }

    #[test]
    fn bad_magic_message_escapes_bytes() {
        let e = Error::BadMagic {
            found: [0x00, b'G', 0xff, b'F'],
        };
        assert_eq!(
            e.to_string(),
            "not a GGUF file: it starts with \"\\x00G\\xffF\", expected \"GGUF\""
        );
    }
}
