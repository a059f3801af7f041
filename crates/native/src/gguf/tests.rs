//! The reader against files built byte by byte here: a well-formed one parses to exactly what
//! was written; truncated, hostile and random ones are errors, never panics.

use proptest::prelude::*;

use super::*;

/// Writes GGUF files field by field, so that tests can also write wrong ones.
struct Builder {
    version: u32,
    alignment: usize,
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

fn string(s: &[u8]) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend(s);
    out
}

impl Builder {
    fn new() -> Self {
        Builder {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            kv: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            n_tensors: 0,
            data: Vec::new(),
        }
    }

    /// A key-value pair whose value (type id and payload) is given raw.
    fn kv(mut self, key: &str, type_id: u32, payload: &[u8]) -> Self {
        self.kv.extend(string(key.as_bytes()));
        self.kv.extend(type_id.to_le_bytes());
        self.kv.extend(payload);
        self.n_kv += 1;
        self
    }

    fn alignment(self, alignment: u32) -> Self {
        let mut b = self.kv("general.alignment", 4, &alignment.to_le_bytes());
        b.alignment = alignment as usize;
        b
    }

    /// A tensor info, given raw, without data.
    fn info(mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> Self {
        self.infos.extend(string(name.as_bytes()));
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(type_id.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }

    /// A tensor with its data, placed at the next aligned offset of the data section.
    fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: &[u8]) -> Self {
        let offset = self.data.len().next_multiple_of(self.alignment);
        self.data.resize(offset, 0);
        self.data.extend(data);
        self.info(name, dims, ty.id(), offset as u64)
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        if self.n_tensors > 0 {
            out.resize(out.len().next_multiple_of(self.alignment), 0);
            out.extend(&self.data);
        }
        out
    }
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// An array payload: item type, count, items.
fn array(item_type: u32, count: u64, items: &[u8]) -> Vec<u8> {
    let mut out = item_type.to_le_bytes().to_vec();
    out.extend(count.to_le_bytes());
    out.extend(items);
    out
}

/// A Q8_0 block with scale 1.0 and quants 0..32.
fn q8_block() -> Vec<u8> {
    let mut b = vec![0x00, 0x3C];
    b.extend(0..32u8);
    b
}

/// A file with one value of every type, arrays (of strings, nested), and three tensors.
fn sample() -> Builder {
    let strings: Vec<u8> = [string("a".as_bytes()), string("ü€".as_bytes()), string(b"")].concat();
    let inner_a = array(5, 2, &[7i32.to_le_bytes(), (-7i32).to_le_bytes()].concat());
    let inner_b = array(8, 1, &string(b"x"));
    let nested = array(9, 2, &[inner_a, inner_b].concat());
    Builder::new()
        .kv("general.architecture", 8, &string(b"llama"))
        .kv("t.u8", 0, &[200])
        .kv("t.i8", 1, &(-5i8).to_le_bytes())
        .kv("t.u16", 2, &60000u16.to_le_bytes())
        .kv("t.i16", 3, &(-30000i16).to_le_bytes())
        .kv("t.u32", 4, &4_000_000_000u32.to_le_bytes())
        .kv("t.i32", 5, &(-2i32).to_le_bytes())
        .kv("t.f32", 6, &1.5f32.to_le_bytes())
        .kv("t.bool", 7, &[1])
        .kv("t.str", 8, &string("héllo 🦀".as_bytes()))
        .kv("t.u64", 10, &(u64::MAX - 1).to_le_bytes())
        .kv("t.i64", 11, &i64::MIN.to_le_bytes())
        .kv("t.f64", 12, &(-0.25f64).to_le_bytes())
        .kv("t.strs", 9, &array(8, 3, &strings))
        .kv("t.f32s", 9, &array(6, 2, &f32_bytes(&[0.5, -1.0])))
        .kv("t.u8s", 9, &array(0, 3, &[1, 2, 3]))
        .kv("t.nested", 9, &nested)
        .tensor(
            "norm",
            &[4],
            GgmlType::F32,
            &f32_bytes(&[1.0, 2.0, -3.0, 0.5]),
        )
        .tensor(
            "emb",
            &[32, 2],
            GgmlType::Q8_0,
            &[q8_block(), q8_block()].concat(),
        )
        .tensor("h", &[2, 1, 1, 1], GgmlType::F16, &[0x00, 0x3C, 0x00, 0xC0])
}

#[test]
fn sample_parses_to_what_was_written() {
    let f = GgufFile::parse(sample().build()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.metadata_entries().len(), 17);
    assert_eq!(f.metadata("t.u8"), Some(&Value::U8(200)));
    assert_eq!(f.metadata("t.i8"), Some(&Value::I8(-5)));
    assert_eq!(f.metadata("t.u16"), Some(&Value::U16(60000)));
    assert_eq!(f.metadata("t.i16"), Some(&Value::I16(-30000)));
    assert_eq!(f.metadata("t.u32"), Some(&Value::U32(4_000_000_000)));
    assert_eq!(f.metadata("t.i32"), Some(&Value::I32(-2)));
    assert_eq!(f.metadata("t.f32"), Some(&Value::F32(1.5)));
    assert_eq!(f.metadata("t.bool"), Some(&Value::Bool(true)));
    assert_eq!(f.get_str("t.str").unwrap(), "héllo 🦀");
    assert_eq!(f.metadata("t.u64"), Some(&Value::U64(u64::MAX - 1)));
    assert_eq!(f.metadata("t.i64"), Some(&Value::I64(i64::MIN)));
    assert_eq!(f.metadata("t.f64"), Some(&Value::F64(-0.25)));
    assert_eq!(f.get_str_array("t.strs").unwrap(), ["a", "ü€", ""]);
    assert_eq!(f.get_f32_array("t.f32s").unwrap(), [0.5, -1.0]);
    assert_eq!(f.get_u8_array("t.u8s").unwrap(), [1, 2, 3]);
    assert_eq!(
        f.metadata("t.nested"),
        Some(&Value::Array(Array::Array(vec![
            Array::I32(vec![7, -7]),
            Array::String(vec!["x".into()]),
        ])))
    );
    let order: Vec<&str> = f.metadata_entries().map(|(k, _)| k).take(3).collect();
    assert_eq!(order, ["general.architecture", "t.u8", "t.i8"]);

    assert_eq!(f.tensors().len(), 3);
    let norm = f.tensor("norm").unwrap();
    assert_eq!((norm.ty(), norm.dims()), (GgmlType::F32, &[4][..]));
    assert_eq!(norm.dequantize().unwrap(), [1.0, 2.0, -3.0, 0.5]);
    let emb = f.tensor("emb").unwrap();
    assert_eq!(emb.info().n_bytes, 68);
    assert_eq!(emb.info().offset, 32);
    assert_eq!((emb.info().n_rows(), emb.info().row_len()), (2, 32));
    assert_eq!(emb.data(), [q8_block(), q8_block()].concat());
    let mut row = [0f32; 32];
    emb.dequantize_row(1, &mut row).unwrap();
    assert_eq!(row[31], 31.0);
    assert!(matches!(
        emb.dequantize_row(2, &mut row),
        Err(Error::RowOutOfRange {
            row: 2,
            n_rows: 2,
            ..
        })
    ));
    assert_eq!(f.tensor("h").unwrap().dequantize().unwrap(), [1.0, -2.0]);
    assert!(f.tensor("missing").is_none());
    let names: Vec<&str> = f.tensors().map(|t| t.name()).collect();
    assert_eq!(names, ["norm", "emb", "h"]);
}

#[test]
fn version_2_and_custom_alignment() {
    let mut b = Builder::new()
        .alignment(64)
        .tensor("a", &[3], GgmlType::F32, &f32_bytes(&[1.0, 2.0, 3.0]))
        .tensor("b", &[1], GgmlType::F32, &f32_bytes(&[4.0]));
    b.version = 2;
    let f = GgufFile::parse(b.build()).unwrap();
    assert_eq!((f.version(), f.alignment()), (2, 64));
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor("b").unwrap().info().offset, 64);
    assert_eq!(f.tensor("b").unwrap().dequantize().unwrap(), [4.0]);
}

#[test]
fn a_file_without_tensors_may_end_before_the_data_section() {
    let bytes = Builder::new()
        .kv("general.architecture", 8, &string(b"x"))
        .build();
    assert_ne!(bytes.len() % 32, 0);
    let f = GgufFile::parse(bytes).unwrap();
    assert_eq!(f.tensors().len(), 0);
}

#[test]
fn every_truncation_is_an_error() {
    let full = sample().build();
    for n in 0..full.len() {
        let r = GgufFile::parse(full[..n].to_vec());
        assert!(
            r.is_err(),
            "parsed a file truncated to {n} of {} bytes",
            full.len()
        );
    }
}

#[test]
fn header_errors() {
    let good = sample().build();
    let with = |at: usize, bytes: &[u8]| {
        let mut b = good.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        GgufFile::parse(b).unwrap_err()
    };
    assert!(matches!(with(0, b"GGML"), Error::BadMagic { found } if &found == b"GGML"));
    for v in [0u32, 1, 4] {
        assert!(
            matches!(with(4, &v.to_le_bytes()), Error::UnsupportedVersion { version } if version == v)
        );
    }
    assert!(matches!(
        with(4, &3u32.to_be_bytes()),
        Error::BigEndian { .. }
    ));
}

#[test]
fn hostile_counts_and_lengths_are_errors() {
    // Counts that claim more than the file could hold: refused without a matching
    // allocation (tests/hostile_alloc.rs measures that), by running into the end of the file.
    let mut huge_counts = Builder::new();
    huge_counts.n_tensors = u64::MAX;
    assert!(matches!(
        GgufFile::parse(huge_counts.build()),
        Err(Error::Truncated { .. })
    ));
    let mut huge_kv = Builder::new();
    huge_kv.n_kv = u64::MAX;
    assert!(matches!(
        GgufFile::parse(huge_kv.build()),
        Err(Error::Truncated { .. })
    ));

    let cases: Vec<(&str, Builder)> = vec![
        (
            "string length",
            Builder::new().kv("k", 8, &u64::MAX.to_le_bytes()),
        ),
        ("key length", {
            let mut b = Builder::new();
            b.kv.extend((u64::MAX / 2).to_le_bytes());
            b.n_kv = 1;
            b
        }),
        (
            "u8 array",
            Builder::new().kv("k", 9, &array(0, u64::MAX, &[])),
        ),
        (
            "u64 array (count * 8 overflows)",
            Builder::new().kv("k", 9, &array(10, 1 << 61, &[])),
        ),
        (
            "string array",
            Builder::new().kv("k", 9, &array(8, 1 << 40, &string(b"x"))),
        ),
        (
            "nested array",
            Builder::new().kv("k", 9, &array(9, 1 << 40, &array(0, 0, &[]))),
        ),
        ("tensor name length", {
            let mut b = Builder::new();
            b.infos.extend((u64::MAX / 2).to_le_bytes());
            b.n_tensors = 1;
            b
        }),
    ];
    for (what, b) in cases {
        let r = GgufFile::parse(b.build());
        assert!(matches!(r, Err(Error::Truncated { .. })), "{what}: {r:?}");
    }
}

#[test]
fn arrays_nest_to_the_limit_and_no_further() {
    // `levels` arrays, each holding the next; the innermost holds one u8.
    let nest = |levels: usize| {
        let mut payload = Vec::new();
        for _ in 1..levels {
            payload.extend(array(9, 1, &[]));
        }
        payload.extend(array(0, 1, &[42]));
        Builder::new().kv("k", 9, &payload).build()
    };
    let f = GgufFile::parse(nest(MAX_NESTING)).unwrap();
    let mut a = f.metadata("k").unwrap().as_array().unwrap();
    for _ in 1..MAX_NESTING {
        match a {
            Array::Array(inner) => a = &inner[0],
            other => panic!("expected a nested array, got {other:?}"),
        }
    }
    assert_eq!(a, &Array::U8(vec![42]));
    assert!(matches!(
        GgufFile::parse(nest(MAX_NESTING + 1)),
        Err(Error::NestingTooDeep { .. })
    ));
    // Deep enough to overflow the stack if the reader followed it.
    assert!(GgufFile::parse(nest(100_000)).is_err());
}

#[test]
fn metadata_errors() {
    let parse = |b: Builder| GgufFile::parse(b.build()).unwrap_err();
    assert!(matches!(
        parse(Builder::new().kv("k", 13, &[])),
        Error::UnknownValueType { id: 13, .. }
    ));
    assert!(matches!(
        parse(Builder::new().kv("k", 9, &array(99, 0, &[]))),
        Error::UnknownValueType { id: 99, .. }
    ));
    assert!(matches!(
        parse(Builder::new().kv("", 0, &[1])),
        Error::EmptyKey { .. }
    ));
    assert!(matches!(
        parse(Builder::new().kv("k", 0, &[1]).kv("k", 0, &[2])),
        Error::DuplicateKey { key } if key == "k"
    ));
    assert!(matches!(
        parse(Builder::new().kv("k", 8, &string(&[0xff, 0xfe]))),
        Error::InvalidUtf8 {
            what: "string value",
            ..
        }
    ));
    for bad in [0u32, 48] {
        assert!(matches!(
            parse(Builder::new().kv("general.alignment", 4, &bad.to_le_bytes())),
            Error::BadAlignment { value } if value == u64::from(bad)
        ));
    }
    assert!(matches!(
        parse(Builder::new().kv("general.alignment", 8, &string(b"32"))),
        Error::KeyType { .. }
    ));
}

#[test]
fn tensor_errors() {
    let parse = |b: Builder| GgufFile::parse(b.build()).unwrap_err();
    let one = f32_bytes(&[1.0]);
    let dup = Builder::new()
        .tensor("t", &[1], GgmlType::F32, &one)
        .tensor("t", &[1], GgmlType::F32, &one);
    assert!(matches!(parse(dup), Error::DuplicateTensor { name } if name == "t"));
    assert!(matches!(
        parse(Builder::new().info("t", &[1, 1, 1, 1, 1], 0, 0)),
        Error::TooManyDims { n_dims: 5, .. }
    ));
    let too_large: [&[u64]; 5] = [
        &[u64::MAX],
        &[1 << 63],
        &[1 << 32, 1 << 32],
        &[1 << 40, 1 << 40, 0],
        // No elements, but more rows than usize counts.
        &[0, 1 << 62, 1 << 62],
    ];
    for dims in too_large {
        assert!(
            matches!(
                parse(Builder::new().info("t", dims, 0, 0)),
                Error::ShapeOverflow { .. }
            ),
            "{dims:?}"
        );
    }
    // Elements fit but bytes do not: 2^62 f32 elements.
    assert!(matches!(
        parse(Builder::new().info("t", &[1 << 31, 1 << 31], 0, 0)),
        Error::ShapeOverflow { .. }
    ));
    let empty = GgufFile::parse(Builder::new().info("e", &[0, 3], 0, 0).build()).unwrap();
    let e = empty.tensor("e").unwrap();
    assert_eq!(
        (
            e.info().n_bytes,
            e.info().n_rows(),
            e.dequantize().unwrap().len()
        ),
        (0, 3, 0)
    );

    let e = parse(Builder::new().info("blk.0.ffn_up.weight", &[256], 16, 0));
    assert!(matches!(
        &e,
        Error::UnsupportedTensorType {
            ty: GgmlTypeId(16),
            ..
        }
    ));
    assert!(e.to_string().starts_with(
        "tensor \"blk.0.ffn_up.weight\" has type IQ2_XXS (16), which tandem does not load"
    ));
    assert!(matches!(
        parse(Builder::new().info("t", &[32], 99, 0)),
        Error::UnsupportedTensorType {
            ty: GgmlTypeId(99),
            ..
        }
    ));
    assert!(matches!(
        parse(Builder::new().info("t", &[48, 2], GgmlType::Q4_K.id(), 0)),
        Error::RaggedRow {
            row_len: 48,
            block: 256,
            ..
        }
    ));
    assert!(matches!(
        parse(
            Builder::new()
                .tensor("a", &[1], GgmlType::F32, &one)
                .info("t", &[1], 0, 4)
        ),
        Error::MisalignedTensor {
            offset: 4,
            alignment: 32,
            ..
        }
    ));
    assert!(matches!(
        parse(
            Builder::new()
                .tensor("a", &[1], GgmlType::F32, &one)
                .info("t", &[2], 0, 0)
        ),
        Error::TensorOutOfBounds {
            n_bytes: 8,
            data_len: 4,
            ..
        }
    ));
    assert!(matches!(
        parse(
            Builder::new()
                .tensor("a", &[1], GgmlType::F32, &one)
                .info("t", &[1], 0, 1 << 62)
        ),
        Error::TensorOutOfBounds { .. }
    ));
}

#[test]
fn typed_getters() {
    let f = GgufFile::parse(
        Builder::new()
            .kv("u8", 0, &[7])
            .kv("i32", 5, &9i32.to_le_bytes())
            .kv("neg", 5, &(-1i32).to_le_bytes())
            .kv("big", 10, &(1u64 << 40).to_le_bytes())
            .kv("s", 8, &string(b"v"))
            .kv("f", 6, &2.5f32.to_le_bytes())
            .kv("b", 7, &[0])
            .kv(
                "ints",
                9,
                &array(5, 2, &[1i32.to_le_bytes(), 2i32.to_le_bytes()].concat()),
            )
            .build(),
    )
    .unwrap();
    assert_eq!(f.get_u32("u8").unwrap(), 7);
    assert_eq!(f.get_u32("i32").unwrap(), 9);
    assert_eq!(f.get_u64("big").unwrap(), 1 << 40);
    assert!(matches!(f.get_u32("neg"), Err(Error::KeyType { .. })));
    let e = f.get_u32("big").unwrap_err();
    assert_eq!(
        e.to_string(),
        "metadata key \"big\" holds u64, expected an integer that fits u32"
    );
    assert!(matches!(f.get_u32("s"), Err(Error::KeyType { .. })));
    assert_eq!(f.get_str("s").unwrap(), "v");
    assert_eq!(f.get_f32("f").unwrap(), 2.5);
    assert!(!f.get_bool("b").unwrap());
    assert_eq!(f.get_i32_array("ints").unwrap(), [1, 2]);
    let e = f.get_f32_array("ints").unwrap_err();
    assert_eq!(
        e.to_string(),
        "metadata key \"ints\" holds array of i32, expected array of f32"
    );
    assert!(matches!(f.get_str("nope"), Err(Error::MissingKey { key }) if key == "nope"));
    assert_eq!(f.get_opt::<u32>("nope").unwrap(), None);
    assert_eq!(f.get_opt::<u32>("u8").unwrap(), Some(7));
    assert!(f.get_opt::<&str>("u8").is_err());
    assert!(matches!(f.architecture(), Err(Error::MissingKey { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random bytes, most of them behind a valid header so that the parser gets past it.
    #[test]
    fn random_bytes_never_panic(header in any::<bool>(), tail in proptest::collection::vec(any::<u8>(), 0..400)) {
        let mut bytes = if header { b"GGUF\x03\0\0\0".to_vec() } else { Vec::new() };
        bytes.extend(tail);
        let _ = GgufFile::parse(bytes);
    }

    /// The sample file with a few bytes overwritten, then maybe truncated: whatever parses
    /// must also dequantize without a panic.
    #[test]
    fn mutated_files_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = sample().build();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            let n = cut.index(bytes.len());
            bytes.truncate(n);
        }
        if let Ok(f) = GgufFile::parse(bytes) {
            for t in f.tensors() {
                t.dequantize().unwrap();
            }
        }
    }
}
