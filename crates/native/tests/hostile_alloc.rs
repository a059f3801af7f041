//! A hostile GGUF file cannot make the parser allocate more than a small multiple of its own
//! size: counts that claim billions of items size allocations by the bytes actually left.
//! A file of its own (one test) because it counts every allocation of the process.

use std::alloc::System;

use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tandem_native::GgufFile;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Room for the claimed items to start filling: zeros after each hostile header, so that a
/// parser bounding capacity by a fixed cap (instead of by the remaining bytes) would show.
const PADDING: usize = 1 << 20;

/// At most this many bytes allocated per byte of file: the largest ratio of an item's
/// in-memory size to its smallest encoding (a key-value pair: 13 bytes in the file, a
/// `(String, Value)` and its index entry in memory), with room to spare.
const MAX_BYTES_PER_FILE_BYTE: usize = 16;

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(n_tensors.to_le_bytes());
    b.extend(n_kv.to_le_bytes());
    b
}

/// One key-value pair "k" whose array claims `count` items of type `item`.
fn array_claim(item: u32, count: u64) -> Vec<u8> {
    let mut b = header(0, 1);
    b.extend(1u64.to_le_bytes());
    b.push(b'k');
    b.extend(9u32.to_le_bytes());
    b.extend(item.to_le_bytes());
    b.extend(count.to_le_bytes());
    b
}

#[test]
fn hostile_counts_allocate_in_proportion_to_the_file() {
    let mut long_string = header(0, 1);
    long_string.extend(1u64.to_le_bytes());
    long_string.push(b'k');
    long_string.extend(8u32.to_le_bytes());
    long_string.extend((1u64 << 40).to_le_bytes());
    let cases = [
        ("metadata count", header(0, u64::MAX)),
        ("tensor count", header(u64::MAX, 0)),
        ("string length", long_string),
        ("u8 array", array_claim(0, 1 << 40)),
        ("u64 array", array_claim(10, 1 << 40)),
        ("string array", array_claim(8, 1 << 40)),
        ("array of arrays", array_claim(9, 1 << 40)),
    ];
    for (what, mut bytes) in cases {
        bytes.resize(bytes.len() + PADDING, 0);
        let len = bytes.len();
        let region = Region::new(GLOBAL);
        let result = GgufFile::parse(bytes);
        let allocated = region.change().bytes_allocated;
        assert!(result.is_err(), "{what}: a hostile file parsed");
        assert!(
            allocated <= MAX_BYTES_PER_FILE_BYTE * len,
            "{what}: parsing a {len}-byte file allocated {allocated} bytes"
        );
    }
}
