//! The GGUF reader (versions 2 and 3, little-endian).
//!
//! Layout of a file (the GGUF spec, ggml/docs/gguf.md; ggml's reader is ggml/src/gguf.cpp):
//! the magic `GGUF`, a u32 version, a u64 tensor count, a u64 metadata count; the metadata
//! (key string, u32 value type, value); the tensor infos (name string, u32 dimension count,
//! u64 dimensions fastest first, u32 ggml type, u64 offset into the data section); padding to
//! `general.alignment` (32 by default); the data section. Strings are a u64 byte length then
//! UTF-8; arrays are a u32 item type, a u64 count, then the items.
//!
//! [`GgufFile::parse`] checks everything once — lengths against the bytes left, counts
//! against what the bytes could hold before anything is allocated, every tensor's type,
//! shape and extent — so that the accessors need not: a tensor it hands out is one tandem
//! can dequantize, and its bytes are in the file.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use crate::quant::GgmlType;
use crate::{Error, GgmlTypeId};
use cursor::Cursor;

mod cursor;
mod tensor;
mod value;

#[cfg(test)]
mod tests;

pub use tensor::{MAX_DIMS, Tensor, TensorInfo};
pub use value::{Array, FromValue, MAX_NESTING, Value, ValueType};

/// The alignment of the data section and of every tensor in it when the file does not set
/// `general.alignment`.
pub const DEFAULT_ALIGNMENT: usize = 32;

const MAGIC: [u8; 4] = *b"GGUF";

/// A GGUF file, read whole into memory and checked.
pub struct GgufFile {
    bytes: Vec<u8>,
    layout: Layout,
}

/// Everything [`parse_layout`] learns; the bytes join it in [`GgufFile::parse`].
struct Layout {
    version: u32,
    alignment: usize,
    /// Where the data section starts in the bytes (may equal their length).
    data_offset: usize,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl GgufFile {
    /// Reads the file at `path` into memory and parses it.
    pub fn read(path: impl AsRef<Path>) -> Result<GgufFile, Error> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_owned(),
            source,
        })?;
        GgufFile::parse(bytes)
    }

    /// Parses a whole GGUF file held in `bytes`.
    pub fn parse(bytes: Vec<u8>) -> Result<GgufFile, Error> {
        let layout = parse_layout(&bytes)?;
        Ok(GgufFile { bytes, layout })
    }

    pub fn version(&self) -> u32 {
        self.layout.version
    }

    /// The alignment of the data section and its tensors.
    pub fn alignment(&self) -> usize {
        self.layout.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_offset(&self) -> usize {
        self.layout.data_offset
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Every metadata entry, in file order.
    pub fn metadata_entries(&self) -> impl ExactSizeIterator<Item = (&str, &Value)> {
        self.layout.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn metadata(&self, key: &str) -> Option<&Value> {
        let &i = self.layout.key_index.get(key)?;
        self.layout.metadata.get(i).map(|(_, v)| v)
    }

    /// The value at `key` as a `T`: an error names the key when it is missing or holds
    /// another type.
    pub fn get<'a, T: FromValue<'a>>(&'a self, key: &str) -> Result<T, Error> {
        self.get_opt(key)?.ok_or_else(|| Error::MissingKey {
            key: key.to_owned(),
        })
    }

    /// As [`GgufFile::get`], with `None` for a missing key (an optional parameter).
    pub fn get_opt<'a, T: FromValue<'a>>(&'a self, key: &str) -> Result<Option<T>, Error> {
        let Some(value) = self.metadata(key) else {
            return Ok(None);
        };
        T::from_value(value)
            .map(Some)
            .ok_or_else(|| Error::KeyType {
                key: key.to_owned(),
                expected: T::EXPECTED,
                found: value.describe(),
            })
    }

    pub fn get_str(&self, key: &str) -> Result<&str, Error> {
        self.get(key)
    }

    /// Any integer type, if the value fits.
    pub fn get_u32(&self, key: &str) -> Result<u32, Error> {
        self.get(key)
    }

    /// Any integer type, if the value fits.
    pub fn get_u64(&self, key: &str) -> Result<u64, Error> {
        self.get(key)
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, Error> {
        self.get(key)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, Error> {
        self.get(key)
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String], Error> {
        self.get(key)
    }

    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], Error> {
        self.get(key)
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], Error> {
        self.get(key)
    }

    pub fn get_u8_array(&self, key: &str) -> Result<&[u8], Error> {
        self.get(key)
    }

    /// `general.architecture` (`llama`, `qwen2`, ...), which names the prefix of the model's
    /// other keys.
    pub fn architecture(&self) -> Result<&str, Error> {
        self.get_str("general.architecture")
    }

    /// Every tensor info, in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.layout.tensors
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = Tensor<'_>> {
        self.layout.tensors.iter().map(|info| self.view(info))
    }

    pub fn tensor(&self, name: &str) -> Option<Tensor<'_>> {
        let &i = self.layout.tensor_index.get(name)?;
        self.layout.tensors.get(i).map(|info| self.view(info))
    }

    fn view<'a>(&'a self, info: &'a TensorInfo) -> Tensor<'a> {
        // In bounds: `parse_layout` checked every tensor's extent against the data section,
        // and neither the bytes nor the infos change afterwards.
        let start = self.layout.data_offset + info.offset;
        Tensor {
            info,
            data: &self.bytes[start..start + info.n_bytes],
        }
    }
}

impl fmt::Debug for GgufFile {
    /// A summary: the bytes and the metadata can be hundreds of megabytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.layout.version)
            .field("bytes", &self.bytes.len())
            .field("metadata", &self.layout.metadata.len())
            .field("tensors", &self.layout.tensors.len())
            .field("alignment", &self.layout.alignment)
            .field("data_offset", &self.layout.data_offset)
            .finish()
    }
}

fn parse_layout(bytes: &[u8]) -> Result<Layout, Error> {
    let mut c = Cursor::new(bytes);
    let magic = c.array::<4>("magic")?;
    if magic != MAGIC {
        return Err(Error::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        // A big-endian file's small version reads with its bytes swapped.
        if matches!(version.swap_bytes(), 2 | 3) {
            return Err(Error::BigEndian { raw: version });
        }
        return Err(Error::UnsupportedVersion { version });
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;

    let (metadata, key_index) = parse_metadata(&mut c, n_kv)?;
    let alignment = match key_index.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(&i) => {
            let value = &metadata[i].1;
            let align = value.as_u32().ok_or_else(|| Error::KeyType {
                key: "general.alignment".into(),
                expected: "an integer that fits u32",
                found: value.describe(),
            })?;
            if !align.is_power_of_two() {
                return Err(Error::BadAlignment {
                    value: align.into(),
                });
            }
            // A u32 fits usize on every target tandem builds for; refuse rather than truncate.
            usize::try_from(align).map_err(|_| Error::BadAlignment {
                value: align.into(),
            })?
        }
    };

    let (tensors, tensor_index) = parse_tensor_infos(&mut c, n_tensors)?;

    // The data section starts at the next multiple of the alignment. A file without tensor
    // data may end before it (ggml's reader accepts that too).
    let data_offset = c
        .pos()
        .checked_next_multiple_of(alignment)
        .unwrap_or(usize::MAX);
    let data_len = bytes.len().saturating_sub(data_offset);
    let data_offset = data_offset.min(bytes.len());
    for t in &tensors {
        check_extent(t, alignment, data_len)?;
    }
    Ok(Layout {
        version,
        alignment,
        data_offset,
        metadata,
        key_index,
        tensors,
        tensor_index,
    })
}

type Metadata = (Vec<(String, Value)>, HashMap<String, usize>);

fn parse_metadata(c: &mut Cursor<'_>, n_kv: u64) -> Result<Metadata, Error> {
    // A key-value pair takes at least 13 bytes: key length, value type, a one-byte value.
    let cap = c.capacity_for(n_kv, 13);
    let mut entries = Vec::with_capacity(cap);
    let mut index = HashMap::with_capacity(cap);
    for _ in 0..n_kv {
        let at = c.pos();
        let key = c.string("metadata key")?;
        if key.is_empty() {
            return Err(Error::EmptyKey { offset: at });
        }
        if index.contains_key(&key) {
            return Err(Error::DuplicateKey { key });
        }
        let ty = value::read_type(c, "metadata value type")?;
        let value = value::read_value(c, ty)?;
        index.insert(key.clone(), entries.len());
        entries.push((key, value));
    }
    Ok((entries, index))
}

type Tensors = (Vec<TensorInfo>, HashMap<String, usize>);

fn parse_tensor_infos(c: &mut Cursor<'_>, n_tensors: u64) -> Result<Tensors, Error> {
    // A tensor info takes at least 24 bytes: name length, dimension count, type, offset.
    let cap = c.capacity_for(n_tensors, 24);
    let mut infos = Vec::with_capacity(cap);
    let mut index = HashMap::with_capacity(cap);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        if index.contains_key(&name) {
            return Err(Error::DuplicateTensor { name });
        }
        let n_dims = c.u32("tensor dimension count")?;
        if n_dims as usize > MAX_DIMS {
            return Err(Error::TooManyDims {
                tensor: name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut raw_dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            raw_dims.push(c.u64("tensor dimension")?);
        }
        let type_id = c.u32("tensor type")?;
        let offset = c.u64("tensor offset")?;
        let info = tensor_info(name, raw_dims, type_id, offset)?;
        index.insert(info.name.clone(), infos.len());
        infos.push(info);
    }
    Ok((infos, index))
}

/// Checks a tensor's type and shape and computes its size. The offset is checked later,
/// against the data section.
fn tensor_info(
    name: String,
    raw_dims: Vec<u64>,
    type_id: u32,
    offset: u64,
) -> Result<TensorInfo, Error> {
    let ty = match GgmlType::from_id(type_id) {
        Some(ty) if ty.is_supported() => ty,
        _ => {
            return Err(Error::UnsupportedTensorType {
                tensor: name,
                ty: GgmlTypeId(type_id),
            });
        }
    };
    // ggml reads dimensions as i64 and refuses negative ones; the element count must fit
    // too. Sizes past `usize` could never be in memory.
    let overflow = |name: String, raw_dims: Vec<u64>| Error::ShapeOverflow {
        tensor: name,
        dims: raw_dims,
    };
    let mut dims = Vec::with_capacity(raw_dims.len());
    let mut n_elements: usize = 1;
    for &d in &raw_dims {
        let d = i64::try_from(d)
            .ok()
            .and_then(|d| usize::try_from(d).ok())
            .filter(|&d| n_elements.checked_mul(d).is_some());
        match d {
            Some(d) => {
                n_elements *= d;
                dims.push(d);
            }
            None => return Err(overflow(name, raw_dims)),
        }
    }
    let row_len = dims.first().copied().unwrap_or(1);
    // Checked on its own: with a zero-length row the element count is 0 whatever the rest.
    let Some(n_rows) = dims
        .iter()
        .skip(1)
        .try_fold(1usize, |n, &d| n.checked_mul(d))
    else {
        return Err(overflow(name, raw_dims));
    };
    let block = ty.block_size();
    if !row_len.is_multiple_of(block) {
        return Err(Error::RaggedRow {
            tensor: name,
            ty,
            row_len,
            block,
        });
    }
    let n_bytes = match (row_len / block)
        .checked_mul(ty.type_size())
        .and_then(|row_bytes| row_bytes.checked_mul(n_rows))
    {
        Some(n) => n,
        None => return Err(overflow(name, raw_dims)),
    };
    // An offset past `usize` is out of bounds; keep it as read for the error.
    let offset_usize = usize::try_from(offset).unwrap_or(usize::MAX);
    Ok(TensorInfo {
        name,
        dims,
        ty,
        offset: offset_usize,
        n_bytes,
    })
}

fn check_extent(t: &TensorInfo, alignment: usize, data_len: usize) -> Result<(), Error> {
    if !t.offset.is_multiple_of(alignment) {
        return Err(Error::MisalignedTensor {
            tensor: t.name.clone(),
            offset: t.offset as u64,
            alignment,
        });
    }
    match t.offset.checked_add(t.n_bytes) {
        Some(end) if end <= data_len => Ok(()),
        _ => Err(Error::TensorOutOfBounds {
            tensor: t.name.clone(),
            offset: t.offset as u64,
            n_bytes: t.n_bytes,
            data_len,
        }),
    }
}
