//! tandem-native against gguf-py, the GGUF authors' own Python package (from llama.cpp's
//! repository), as the independent implementation: gguf-py's `GGUFWriter` writes a file with
//! metadata of every value type and tensors of every type tandem loads, and `gguf.quants`
//! dequantizes them; tandem must read the same metadata and dequantize to the same bits.
//!
//! Q8_0, Q4_0 and Q4_1 tensors are quantized by gguf-py from random data; gguf-py cannot
//! quantize K-quants, so Q4_K, Q5_K and Q6_K tensors are random blocks with sane f16 scales.
//! Every type matches bit for bit (src/quant/dequant.rs says why that holds by construction:
//! every product is exact, so no order of evaluation can differ). The one known difference
//! between numpy and ggml, f16 signalling NaNs (numpy's conversion keeps them signalling,
//! ggml's quiets them, as tandem does), is kept out of the data; the unit tests check ggml's
//! behaviour there.

mod common;

use tandem_native::{GgmlType, GgufFile};

#[test]
fn gguf_py_file_reads_and_dequantizes_bitwise() {
    let dir = common::scratch_dir("gguf_interop");
    let manifest = common::run_script(&["synthetic".as_ref(), dir.as_path()], &dir);

    let file = GgufFile::read(dir.join(manifest["file"].as_str().unwrap())).unwrap();
    assert_eq!(
        u64::from(file.version()),
        manifest["version"].as_u64().unwrap()
    );
    assert_eq!(
        file.alignment() as u64,
        manifest["alignment"].as_u64().unwrap()
    );
    assert_eq!(file.data_offset() % file.alignment(), 0);
    assert_eq!(file.architecture().unwrap(), "llama");
    common::assert_metadata(&file, &manifest);
    // A few through the typed getters too.
    assert_eq!(file.get_u32("test.u16").unwrap(), 65535);
    assert_eq!(file.get_u64("test.u64").unwrap(), u64::MAX);
    assert!(file.get_u32("test.i8").is_err());
    assert_eq!(
        file.get_str("test.string").unwrap(),
        "héllo wörld — 你好 🦀 \n\t\"quoted\""
    );
    assert_eq!(file.get_str("test.string.empty").unwrap(), "");
    assert_eq!(
        file.get_str_array("test.array.string").unwrap(),
        ["a", "", "ü€", "<|im_start|>", "Ġ t"]
    );
    assert_eq!(
        file.get_u8_array("test.array.bytes").unwrap(),
        [0, 127, 255]
    );

    let tensors = manifest["tensors"].as_array().unwrap();
    assert_eq!(file.tensors().len(), tensors.len());
    let mut types_seen = Vec::new();
    for want in tensors {
        let name = want["name"].as_str().unwrap();
        let t = file
            .tensor(name)
            .unwrap_or_else(|| panic!("tensor {name} missing"));
        assert_eq!(t.ty().name(), want["type"].as_str().unwrap(), "{name}");
        assert_eq!(
            u64::from(t.ty().id()),
            want["type_id"].as_u64().unwrap(),
            "{name}"
        );
        let dims: Vec<usize> = want["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(t.dims(), dims, "{name}");
        assert_eq!(t.info().offset % file.alignment(), 0, "{name}");
        let expected = common::read_f32(&dir.join(want["expected"].as_str().unwrap()));
        common::assert_bitwise(name, &t.dequantize().unwrap(), &expected);
        // Row by row gives the same values.
        let mut row = vec![0f32; t.info().row_len()];
        for r in 0..t.info().n_rows() {
            t.dequantize_row(r, &mut row).unwrap();
            let at = r * row.len();
            common::assert_bitwise(name, &row, &expected[at..at + row.len()]);
        }
        types_seen.push(t.ty());
    }
    for ty in GgmlType::SUPPORTED {
        assert!(types_seen.contains(&ty), "no {ty} tensor in the file");
    }

    check_type_table(&manifest["types"]);
}

/// `GgmlType`'s ids, names and geometry against gguf-py's copy of ggml's table
/// (`GGMLQuantizationType`, `GGML_QUANT_SIZES`). A type gguf-py knows and tandem does not
/// is fine (tandem refuses it as an unknown id); one tandem knows must be gguf-py's too.
fn check_type_table(types: &serde_json::Value) {
    let types = types.as_array().unwrap();
    for t in types {
        let id = t["id"].as_u64().unwrap() as u32;
        let Some(ty) = GgmlType::from_id(id) else {
            continue;
        };
        let want = (
            t["name"].as_str().unwrap(),
            t["block_size"].as_u64().unwrap() as usize,
            t["type_size"].as_u64().unwrap() as usize,
        );
        assert_eq!(
            (ty.name(), ty.block_size(), ty.type_size()),
            want,
            "id {id}"
        );
    }
    for ty in GgmlType::ALL {
        assert!(
            types
                .iter()
                .any(|t| t["id"].as_u64() == Some(u64::from(ty.id()))),
            "{ty} ({}) is not in gguf-py's table",
            ty.id()
        );
    }
}
