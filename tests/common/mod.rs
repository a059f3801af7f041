//! Helpers shared by the tests that drive the built `tandem` binary.

#![allow(dead_code)] // each test crate uses its own subset

pub mod chat;
pub mod cluster;
pub mod http;
pub mod metrics;
pub mod native;
pub mod openai;
pub mod standin;

use std::path::PathBuf;
use std::process::{Command, Output};

/// A fresh directory for one test's files, unique per process.
pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A trace the repository ships (traces/).
pub fn trace(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("traces")
        .join(name)
}

/// The interpreter of one Python tool's venv, `target/python/<tool>` (scripts/test.sh makes one
/// per tool: two tools' packages installed together can overwrite each other's files).
pub fn python(tool: &str) -> PathBuf {
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/python");
    venv.join(tool).join("bin/python3")
}

/// Runs a command and asserts it succeeded, showing its stderr when it did not.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `n` words of English, one cl100k token each (with the leading space), chosen by `seed`:
/// prompts of about `n` tokens that other seeds do not share a prefix with.
pub fn words(seed: u64, n: usize) -> String {
    const WORDS: [&str; 48] = [
        "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are",
        "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by",
        "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there",
        "use", "an", "each", "which", "she", "do", "how", "their", "if",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(n * 5);
    for i in 0..n {
        // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}
