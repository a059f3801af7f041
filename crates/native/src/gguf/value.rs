//! GGUF metadata values: the 13 value types, arrays of any of them (arrays of arrays too), and
//! their decoding.

use std::fmt;

use super::cursor::Cursor;
use crate::Error;

/// How deep arrays of arrays may nest. No model uses more than one level (ggml's own reader
/// refuses nested arrays altogether); the limit keeps a hostile file from recursing the
/// reader off its stack.
pub const MAX_NESTING: usize = 8;

/// A metadata value type, with the GGUF spec's numeric ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        [
            U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64,
        ]
        .get(usize::try_from(id).ok()?)
        .copied()
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// A short lowercase name (`u32`, `string`, `array`), as in messages.
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: all items of one type, kept as a typed vector (a vocabulary's 50k strings
/// or scores are one `Vec`, not 50k `Value`s).
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// Arrays of arrays; each inner array has its own item type.
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value, widened.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer value that fits a `u32` (converters differ in which integer type they
    /// write for counts and ids).
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }

    /// Any integer value that fits a `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// What the value is, for messages: `u32`, `string`, `array of i32`.
    pub fn describe(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.item_type()),
            v => v.value_type().name().to_owned(),
        }
    }
}

impl Array {
    pub fn item_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A type a metadata value can be read as ([`super::GgufFile::get`]).
pub trait FromValue<'a>: Sized {
    /// What the caller asked for, for [`Error::KeyType`].
    const EXPECTED: &'static str;
    fn from_value(value: &'a Value) -> Option<Self>;
}

macro_rules! from_value {
    ($t:ty, $expected:literal, |$v:ident| $body:expr) => {
        impl<'a> FromValue<'a> for $t {
            const EXPECTED: &'static str = $expected;
            fn from_value($v: &'a Value) -> Option<Self> {
                $body
            }
        }
    };
}

from_value!(u32, "an integer that fits u32", |v| v.as_u32());
from_value!(u64, "an integer that fits u64", |v| v.as_u64());
from_value!(f32, "f32", |v| v.as_f32());
from_value!(bool, "bool", |v| v.as_bool());
from_value!(&'a str, "string", |v| v.as_str());
from_value!(&'a Array, "array", |v| v.as_array());
from_value!(&'a [String], "array of string", |v| match v {
    Value::Array(Array::String(items)) => Some(items.as_slice()),
    _ => None,
});
from_value!(&'a [i32], "array of i32", |v| match v {
    Value::Array(Array::I32(items)) => Some(items.as_slice()),
    _ => None,
});
from_value!(&'a [f32], "array of f32", |v| match v {
    Value::Array(Array::F32(items)) => Some(items.as_slice()),
    _ => None,
});
from_value!(&'a [u8], "array of u8", |v| match v {
    Value::Array(Array::U8(items)) => Some(items.as_slice()),
    _ => None,
});

/// Reads a value type id; `offset` is where it was for the error.
pub(super) fn read_type(c: &mut Cursor<'_>, what: &'static str) -> Result<ValueType, Error> {
    let offset = c.pos();
    let id = c.u32(what)?;
    ValueType::from_id(id).ok_or(Error::UnknownValueType { id, offset })
}

/// Reads one value of type `ty`.
pub(super) fn read_value(c: &mut Cursor<'_>, ty: ValueType) -> Result<Value, Error> {
    Ok(match ty {
        ValueType::U8 => Value::U8(u8::from_le_bytes(c.array("u8 value")?)),
        ValueType::I8 => Value::I8(i8::from_le_bytes(c.array("i8 value")?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array("u16 value")?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array("i16 value")?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(c.array("u32 value")?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array("i32 value")?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array("f32 value")?)),
        // ggml reads any nonzero byte as true; so does tandem.
        ValueType::Bool => Value::Bool(c.array::<1>("bool value")?[0] != 0),
        ValueType::String => Value::String(c.string("string value")?),
        ValueType::Array => Value::Array(read_array(c, 1)?),
        ValueType::U64 => Value::U64(u64::from_le_bytes(c.array("u64 value")?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array("i64 value")?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array("f64 value")?)),
    })
}

/// Reads an array (item type, u64 count, items) at nesting level `depth` (1 for a value's own
/// array).
fn read_array(c: &mut Cursor<'_>, depth: usize) -> Result<Array, Error> {
    let start = c.pos();
    let item = read_type(c, "array item type")?;
    let count = c.u64("array length")?;
    Ok(match item {
        ValueType::U8 => Array::U8(c.fixed_items(count, "u8 array", u8::from_le_bytes)?),
        ValueType::I8 => Array::I8(c.fixed_items(count, "i8 array", i8::from_le_bytes)?),
        ValueType::U16 => Array::U16(c.fixed_items(count, "u16 array", u16::from_le_bytes)?),
        ValueType::I16 => Array::I16(c.fixed_items(count, "i16 array", i16::from_le_bytes)?),
        ValueType::U32 => Array::U32(c.fixed_items(count, "u32 array", u32::from_le_bytes)?),
        ValueType::I32 => Array::I32(c.fixed_items(count, "i32 array", i32::from_le_bytes)?),
        ValueType::F32 => Array::F32(c.fixed_items(count, "f32 array", f32::from_le_bytes)?),
        ValueType::Bool => Array::Bool(c.fixed_items(count, "bool array", |[b]: [u8; 1]| b != 0)?),
        ValueType::U64 => Array::U64(c.fixed_items(count, "u64 array", u64::from_le_bytes)?),
        ValueType::I64 => Array::I64(c.fixed_items(count, "i64 array", i64::from_le_bytes)?),
        ValueType::F64 => Array::F64(c.fixed_items(count, "f64 array", f64::from_le_bytes)?),
        ValueType::String => {
            // Each string takes at least its 8-byte length.
            let mut items = Vec::with_capacity(c.capacity_for(count, 8));
            for _ in 0..count {
                items.push(c.string("string in array")?);
            }
            Array::String(items)
        }
        ValueType::Array => {
            if depth >= MAX_NESTING {
                return Err(Error::NestingTooDeep {
                    limit: MAX_NESTING,
                    offset: start,
                });
            }
            // Each inner array takes at least its 4-byte type and 8-byte count.
            let mut items = Vec::with_capacity(c.capacity_for(count, 12));
            for _ in 0..count {
                items.push(read_array(c, depth + 1)?);
            }
            Array::Array(items)
        }
    })
}
