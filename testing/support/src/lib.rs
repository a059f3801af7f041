//! What the integration tests of the `tandem` package share (tests/): processes and whole
//! clusters on real etcd and NATS, the native model's `tandem up`, a plain HTTP/1.1 client with
//! SSE, the OpenAI response shapes, Prometheus text, and the vLLM stand-in. A crate of its own,
//! so it is compiled once for every test binary, not once in each.
//!
//! The binaries under test are the ones cargo builds for the integration test that runs
//! ([`bin`]); the repository's files are found from this crate's place in it ([`repo`]).

pub mod chat;
pub mod cluster;
pub mod http;
pub mod metrics;
pub mod native;
pub mod openai;
pub mod proc;
pub mod standin;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository's root directory (this crate is `testing/support` in it).
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("testing/support lies two levels below the repository's root")
}

/// A binary of the `tandem` package (`tandem`, `tandem-standin`): cargo builds them for the
/// package's integration tests into the directory above the test binary's own `deps/`.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().expect("the test binary's directory");
    let dir = if dir.ends_with("deps") {
        dir.parent().unwrap_or(dir)
    } else {
        dir
    };
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} is missing: it is built for the tandem package's integration tests",
        path.display()
    );
    path
}

/// A fresh directory for one test's files, unique per process and tag, removed when dropped
/// (see [`TestDir`]).
pub fn temp_dir(tag: &str) -> TestDir {
    let dir = std::env::temp_dir().join(format!("tandem-{tag}-{}", std::process::id()));
    // A directory left by an earlier process with this id holds nothing of this run's.
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    TestDir(dir)
}

/// One test's directory (logs, configuration, caches). Dropped, it is removed, except where
/// the test is failing (then its path is printed, to read the logs) or `TANDEM_TEST_KEEP_LOGS`
/// is set (a test harness switch, not configuration of tandem): test runs leave nothing
/// behind in the temporary directory.
#[derive(Debug)]
pub struct TestDir(PathBuf);

impl std::ops::Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TestDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TestDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        #[allow(clippy::disallowed_methods)]
        let keep = std::env::var_os("TANDEM_TEST_KEEP_LOGS").is_some();
        if std::thread::panicking() {
            eprintln!("===== test files kept in {} =====", self.0.display());
        } else if !keep {
            std::fs::remove_dir_all(&self.0).ok();
        }
    }
}

/// A trace the repository ships (traces/).
pub fn trace(name: &str) -> PathBuf {
    repo().join("traces").join(name)
}

/// The interpreter of one Python tool's venv, `target/python/<tool>` (scripts/test.sh makes one
/// per tool: two tools' packages installed together can overwrite each other's files).
pub fn python(tool: &str) -> PathBuf {
    let venv = repo().join("target/python");
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
