//! Mooncake trace records and their expansion into tokens.

use std::path::Path;

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens one trace hash id stands for.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Token ids are drawn below this bound (a Llama-sized vocabulary).
const VOCAB: u64 = 32_000;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Arrival, milliseconds from the start of the trace.
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    /// One id per 512-token block of the prompt; equal ids mean equal prefixes.
    pub hash_ids: Vec<u64>,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("trace line {line}: {message}")]
    Parse { line: usize, message: String },
}

/// Reads a JSONL trace file.
pub fn load_trace(path: impl AsRef<Path>) -> Result<Vec<TraceRecord>, TraceError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_trace(&text)
}

/// Parses JSONL trace text, checking that each record's ids cover its input length.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let rec: TraceRecord = serde_json::from_str(line).map_err(|e| TraceError::Parse {
            line: i + 1,
            message: e.to_string(),
        })?;
        let need = (rec.input_length as usize).div_ceil(TRACE_BLOCK_TOKENS);
        if rec.hash_ids.len() < need {
            return Err(TraceError::Parse {
                line: i + 1,
                message: format!(
                    "{} hash ids cannot cover {} input tokens ({need} needed)",
                    rec.hash_ids.len(),
                    rec.input_length
                ),
            });
        }
        out.push(rec);
    }
    Ok(out)
}

/// The prompt of a record as token ids: each hash id becomes 512 tokens that depend only on
/// the id and the position inside its block; the last block is cut to the input length.
pub fn expand_tokens(rec: &TraceRecord) -> Vec<u32> {
    let n = rec.input_length as usize;
    let mut out = Vec::with_capacity(n);
    'ids: for &id in &rec.hash_ids {
        for j in 0..TRACE_BLOCK_TOKENS as u64 {
            if out.len() == n {
                break 'ids;
            }
            out.push((xxh3_64_with_seed(&j.to_le_bytes(), id) % VOCAB) as u32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use tandem_protocol::hashing::compute_block_hashes;
    use tandem_protocol::{BlockSize, HashSeed};

    use super::*;

    const TWO: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 7, "input_length": 700, "output_length": 3, "hash_ids": [0, 2]}
"#;

    #[test]
    fn parses_and_expands() {
        let recs = parse_trace(TWO).unwrap();
        assert_eq!(recs.len(), 2);
        let a = expand_tokens(&recs[0]);
        let b = expand_tokens(&recs[1]);
        assert_eq!(a.len(), 1000);
        assert_eq!(b.len(), 700);
        assert_eq!(
            a[..512],
            b[..512],
            "shared id 0 means shared first 512 tokens"
        );
        assert_ne!(a[512..600], b[512..600]);
        // At 16-token blocks the shared id gives exactly 32 shared block hashes.
        let bs = BlockSize::DEFAULT;
        let ha = compute_block_hashes(&a, bs, HashSeed::UNSALTED);
        let hb = compute_block_hashes(&b, bs, HashSeed::UNSALTED);
        let shared = ha.iter().zip(&hb).take_while(|(x, y)| x == y).count();
        assert_eq!(shared, 32);
    }

    #[test]
    fn bad_lines_are_typed_errors_with_line_numbers() {
        let err = parse_trace("{\"timestamp\": 0}\n").unwrap_err();
        assert!(matches!(err, TraceError::Parse { line: 1, .. }), "{err}");
        let short =
            r#"{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}"#;
        assert!(matches!(
            parse_trace(short),
            Err(TraceError::Parse { line: 1, .. })
        ));
        assert!(matches!(
            load_trace("/nonexistent/trace.jsonl"),
            Err(TraceError::Io { .. })
        ));
    }

    #[test]
    fn bundled_traces_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
        for (file, n) in [
            ("synthetic_trace.jsonl", 3993),
            ("conversation_trace.jsonl", 12031),
        ] {
            let recs = load_trace(dir.join(file)).unwrap();
            assert_eq!(recs.len(), n, "{file}");
            assert!(
                recs.windows(2).all(|w| w[0].timestamp <= w[1].timestamp),
                "{file} sorted"
            );
        }
    }
}
