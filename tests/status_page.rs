//! The frontend's status page (`GET /`, crates/frontend/src/http/observe/status.rs) in a real
//! browser: headless Chromium driven over the WebDriver protocol (chromedriver, plain JSON
//! over HTTP). A whole cluster runs as `tandem up` (one process: the frontend, one prefill
//! and two decode workers on mocker engines). The page must show the registered workers,
//! then, after chat completions, the routing decisions with each candidate's cost terms, a
//! remote prefill, and the requests' latency; a screenshot is saved under the target
//! directory and its path printed.
//!
//! Needs Debian's `chromium` and `chromium-driver` (scripts/test.sh installs them); without
//! them the test fails saying so.

use tandem_test_support as common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use common::chat::chat;
use common::cluster::{Proc, wait_for};
use common::http;
use common::words;

const MISSING: &str = "the status page test needs headless Chromium and chromedriver: \
                       `apt-get install -y chromium chromium-driver` (scripts/test.sh does)";

/// The executable `name` resolves to on PATH, asked of the shell (no environment reads here).
fn on_path(name: &str) -> PathBuf {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .unwrap_or_else(|e| panic!("running sh: {e}"));
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success() && !path.is_empty(),
        "{name} not found. {MISSING}"
    );
    PathBuf::from(path)
}

/// A chromedriver process and one browser session on it; the session is closed (and the
/// browser with it) before chromedriver is killed.
struct Browser {
    addr: SocketAddr,
    session: String,
    _driver: Proc,
}

impl Browser {
    fn start(dir: &Path) -> Browser {
        let chromium = on_path("chromium");
        let chromedriver = on_path("chromedriver");
        let port = tandem_runtime::external::free_port().unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let driver = Proc::spawn_bin(
            chromedriver.to_str().unwrap(),
            "chromedriver",
            "chromedriver",
            &[format!("--port={port}")],
            &dir.join("chromedriver.log"),
        );
        wait_for("chromedriver to listen", Duration::from_secs(20), || {
            http::get(addr, "/status")
                .ok()
                .filter(|r| r.status == 200)
                .map(|_| ())
        });
        let profile = dir.join("chromium-profile");
        std::fs::create_dir_all(&profile).unwrap();
        // Without the background-networking flags, Chromium on a closed network hangs
        // trying to reach Google's services.
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1400,1800",
        ]
        .iter()
        .map(|a| a.to_string())
        .chain([format!("--user-data-dir={}", profile.display())])
        .collect::<Vec<_>>();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium, "args": args},
        }}});
        let created = call(addr, "POST", "/session", Some(&caps));
        let session = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id in {created}"))
            .to_string();
        Browser {
            addr,
            session,
            _driver: driver,
        }
    }

    fn cmd(&self, method: &str, what: &str, body: Option<&Value>) -> Value {
        let path = format!("/session/{}/{what}", self.session);
        call(self.addr, method, &path, body)
    }

    fn goto(&self, url: &str) {
        self.cmd("POST", "url", Some(&json!({ "url": url })));
    }

    fn eval(&self, script: &str) -> Value {
        self.cmd(
            "POST",
            "execute/sync",
            Some(&json!({"script": script, "args": []})),
        )
    }

    fn screenshot(&self) -> Vec<u8> {
        let b64 = self.cmd("GET", "screenshot", None);
        base64_decode(b64.as_str().expect("a base64 string"))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let path = format!("/session/{}", self.session);
        let _ = http::request(self.addr, "DELETE", &path, None, &[]);
    }
}

/// One WebDriver command; its `value`, or a panic naming the error.
fn call(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Value {
    let bytes = body.map(|b| b.to_string().into_bytes());
    let r = http::request(addr, method, path, bytes.as_deref(), &[])
        .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"));
    assert_eq!(r.status, 200, "WebDriver {method} {path}: {}", r.text());
    let v: Value = r.json();
    v["value"].clone()
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let clean: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let mut out = Vec::with_capacity(clean.len() / 4 * 3);
    for quad in clean.chunks(4) {
        let data: Vec<u8> = quad.iter().copied().filter(|&c| c != b'=').collect();
        let mut n = 0u32;
        for (i, &c) in data.iter().enumerate() {
            n |= val(c) << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..data.len().max(1)]);
    }
    out
}

/// What the page shows, read from its DOM.
const PROBE: &str = r#"
const q = (s) => Array.from(document.querySelectorAll(s));
const text = (s) => { const e = document.querySelector(s); return e ? e.textContent : null; };
return {
  title: document.title,
  polls: Number(document.body.dataset.polls || 0),
  health: text('#health'),
  model: text('#model'),
  error: text('#poll-error'),
  sum_workers: text('#sum-workers'),
  sum_decisions: text('#sum-decisions'),
  sum_remote: text('#sum-remote'),
  sum_moved: text('#sum-moved'),
  sum_held: text('#sum-held'),
  hit_rate: text('#hit-rate'),
  engine_hit_rate: text('#hit-rate-engines'),
  ttft_count: text('#ttft-count'),
  ttft_p50: text('#ttft-p50'),
  itl_count: text('#itl-count'),
  ttft_shapes: q('#ttft-spark polyline, #ttft-spark circle').length,
  cache_health: text('#cache-health tbody'),
  workers: q('#workers tbody tr[data-worker-id]').map((r) => ({
    id: Number(r.dataset.workerId), pool: r.dataset.pool,
    state: r.cells[3].textContent, kv: r.cells[4].textContent,
    prompt_rate: r.cells[9].textContent, gen_rate: r.cells[10].textContent,
    last_seen: r.cells[13].textContent,
  })),
  decisions: q('#decisions tbody tr.decision').map((r) => ({
    decode: r.cells[4].textContent, prefill: r.cells[5].textContent,
    rule: r.cells[6].textContent, why: r.cells[7].textContent,
    open: !document.querySelector('tr.terms-row[data-request="' + r.dataset.request + '"]').hidden,
    candidates: q('#decisions tbody tr.terms-row[data-request="' + r.dataset.request +
                  '"] table.terms tbody tr').map((c) => ({
      worker: Number(c.dataset.worker), cost: c.dataset.cost,
      chosen: c.classList.contains('chosen'), cells: c.cells.length,
    })),
  })),
};
"#;

fn count(v: &Value, key: &str) -> u64 {
    v[key]
        .as_str()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn the_status_page_shows_the_cluster_and_follows_traffic() {
    let dir = common::temp_dir("status-page");
    let args: Vec<String> = [
        "up",
        "--engine",
        "mocker",
        "--port",
        "0",
        "--admin-listen",
        "127.0.0.1:0",
        "--prefill",
        "1",
        "--decode",
        "2",
        "--speedup-ratio",
        "10",
    ]
    .map(String::from)
    .to_vec();
    let mut up = Proc::spawn("tandem-up", "up", &args, &dir.join("up.log"));
    // The addresses it bound (port 0: nothing can take them first); the status page and its
    // data are on the admin listener.
    let (addr, admin) = wait_for("tandem up's addresses", Duration::from_secs(60), || {
        assert!(up.is_running(), "tandem up exited:\n{}", up.log());
        common::native::bound_addresses(&up.log())
    });
    // Every worker registered and reporting load.
    let ids: Vec<u64> = wait_for("3 workers reporting", Duration::from_secs(60), || {
        assert!(up.is_running(), "tandem up exited:\n{}", up.log());
        let s: Value = http::get(admin, "/status.json").ok()?.json();
        let workers = s["backend"]["workers"].as_array()?;
        let ok = workers.len() == 3 && workers.iter().all(|w| w["state"] == "ok");
        ok.then(|| workers.iter().filter_map(|w| w["id"].as_u64()).collect())
    });

    let browser = Browser::start(&dir);
    browser.goto(&format!("http://{admin}/"));
    let before = wait_for(
        "the page to show 3 workers",
        Duration::from_secs(20),
        || {
            let v = browser.eval(PROBE);
            (v["workers"].as_array().map(Vec::len) == Some(3)).then_some(v)
        },
    );
    assert_eq!(before["title"], "tandem status");
    assert_eq!(before["health"], "ready");
    assert_eq!(before["model"], "mocker");
    assert_eq!(before["error"], "");
    assert_eq!(before["sum_workers"], "3");
    let mut shown: Vec<u64> = before["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_u64().unwrap())
        .collect();
    shown.sort_unstable();
    let mut want = ids.clone();
    want.sort_unstable();
    assert_eq!(shown, want, "the page's workers are the registry's");
    for w in before["workers"].as_array().unwrap() {
        assert_eq!(w["state"], "ok", "{w}");
        assert!(w["kv"].as_str().unwrap().ends_with('%'), "{w}");
        assert!(w["last_seen"].as_str().unwrap().ends_with("ago"), "{w}");
    }
    let pools: Vec<&str> = before["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["pool"].as_str().unwrap())
        .collect();
    assert_eq!(pools.iter().filter(|p| **p == "prefill").count(), 1);
    assert_eq!(before["decisions"].as_array().map(Vec::len), Some(0));
    assert_eq!(count(&before, "ttft_count"), 0);

    // Short prompts sharing a prefix (prefilled on the decode workers), then a long fresh
    // one (prefilled on the prefill worker).
    let system = words(7, 200);
    for i in 0..4 {
        let body = chat(&system, &format!("question {i}?"), 4);
        let r = http::post_json(addr, "/v1/chat/completions", &body.to_string()).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let long = chat(&words(40, 3000), "Hello?", 4);
    let r = http::post_json(addr, "/v1/chat/completions", &long.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let prefill_worker = r
        .header("x-tandem-prefill-worker")
        .expect("the long prompt was prefilled remotely")
        .to_string();
    let long_prompt = r.json::<Value>()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();

    // Each worker's token rates, once two of its load reports a second apart are in.
    let rated = |v: &Value| {
        v["workers"].as_array().is_some_and(|ws| {
            ws.iter().all(|w| {
                ["prompt_rate", "gen_rate"]
                    .iter()
                    .all(|k| w[*k].as_str().is_some_and(|s| s.parse::<f64>().is_ok()))
            })
        })
    };
    let after = wait_for(
        "the page to show the traffic",
        Duration::from_secs(20),
        || {
            let v = browser.eval(PROBE);
            let ready = v["decisions"].as_array().map(Vec::len) == Some(5)
                && count(&v, "ttft_count") >= 5
                && rated(&v);
            ready.then_some(v)
        },
    );
    assert_eq!(count(&after, "sum_decisions"), 5, "{after}");
    assert_eq!(count(&after, "sum_remote"), 1, "{after}");
    // The long prompt was fresh everywhere: all of its KV came over, none was held.
    assert_eq!(count(&after, "sum_moved"), long_prompt, "{after}");
    assert_eq!(after["sum_held"], "0", "{after}");
    assert!(count(&after, "itl_count") > 0, "{after}");
    assert!(
        after["ttft_p50"].as_str().unwrap().ends_with('s'),
        "{after}"
    );
    assert!(
        after["ttft_shapes"].as_u64().unwrap() > 0,
        "no TTFT sparkline: {after}"
    );
    assert!(
        after["hit_rate"].as_str().unwrap().ends_with('%'),
        "{after}"
    );
    // The engines' own count: the shared prefix was served from their caches.
    let engines = after["engine_hit_rate"].as_str().unwrap();
    assert!(
        engines.ends_with('%') && engines != "0.0 %",
        "engine hit rate {engines:?}: {after}"
    );
    let decisions = after["decisions"].as_array().unwrap();
    // Newest first: the long prompt's decision names its prefill worker and why.
    assert_eq!(decisions[0]["prefill"], prefill_worker.as_str(), "{after}");
    assert!(
        decisions[0]["why"].as_str().unwrap().starts_with("remote"),
        "{after}"
    );
    // The newest decision's candidates are open, the others folded.
    assert_eq!(decisions[0]["open"], true, "{after}");
    assert_eq!(decisions[1]["open"], false, "{after}");
    for d in decisions {
        let cands = d["candidates"].as_array().unwrap();
        // Both decode workers scored, the chosen one marked, every cost term shown.
        assert!(cands.len() >= 2, "{d}");
        let chosen: Vec<&Value> = cands.iter().filter(|c| c["chosen"] == true).collect();
        assert!(!chosen.is_empty(), "{d}");
        assert_eq!(
            chosen[0]["worker"].to_string(),
            d["decode"].as_str().unwrap(),
            "{d}"
        );
        for c in cands {
            assert_eq!(c["cells"], 12, "{c}");
            assert!(c["cost"].as_str().is_some_and(|s| !s.is_empty()), "{c}");
        }
        assert!(!d["rule"].as_str().unwrap().is_empty(), "{d}");
    }
    // Every worker publishes events and served what the index predicted: no cause found.
    assert!(
        after["cache_health"]
            .as_str()
            .unwrap()
            .starts_with("no cause found"),
        "{after}"
    );
    // The router's index saw the shared prefix: some prompt tokens were cached.
    let s: Value = http::get(admin, "/status.json").unwrap().json();
    assert!(
        s["backend"]["totals"]["cached_tokens"].as_u64().unwrap() > 0,
        "{}",
        s["backend"]["totals"]
    );

    let png = browser.screenshot();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status_page.png");
    std::fs::write(&shot, &png).unwrap();
    println!("status page screenshot: {}", shot.display());

    drop(browser);
    up.signal("INT");
    let status = up.wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "tandem up did not stop cleanly:\n{}",
        up.log()
    );
}
