//! The main job end to end: `tandem replay` over the built binary and a bundled trace.

mod common;

use std::path::Path;
use std::process::Command;

use common::{run_ok, temp_dir, trace};

/// Runs `tandem replay` with `args` and returns its JSON results.
fn replay(dir: &Path, name: &str, args: &[&str]) -> serde_json::Value {
    let json = dir.join(name);
    let out = run_ok(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .arg("replay")
            .args(args)
            .arg("--trace")
            .arg(trace("conversation_trace.jsonl"))
            .arg("--json")
            .arg(&json),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("| round-robin |") && stdout.contains("| kv-overlap |"),
        "{stdout}"
    );
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

#[test]
fn replay_routes_by_kv_overlap_better_than_round_robin() {
    let dir = temp_dir("replay");
    let results = replay(
        &dir,
        "out.json",
        &["--workers", "8", "--limit", "300", "--host-blocks", "4096"],
    );
    let by = |p: &str| {
        results
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["policy"] == p)
            .unwrap()
            .clone()
    };
    let (rr, kv) = (by("round-robin"), by("kv-overlap"));
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    for r in [&rr, &kv] {
        assert_eq!(r["requests"], 300);
        assert_eq!(
            r["events_duplicate"], 0,
            "a contiguous stream has no duplicates"
        );
        assert!(f(r, "events_applied") > 0.0);
        assert!(f(r, "ttft_p50_ms") > 0.0);
        // Without preemption the index's prediction at routing time and the engines' real
        // hits differ only by evictions between routing and admission.
        assert_eq!(r["preemptions"], 0);
        let gap = (f(r, "predicted_cached_tokens") - f(r, "cached_tokens")).abs();
        assert!(
            gap / f(r, "prompt_tokens") < 0.01,
            "index prediction off by {gap} tokens: {r}"
        );
    }
    assert!(
        f(&kv, "prefix_hit_rate") > 1.3 * f(&rr, "prefix_hit_rate"),
        "kv-overlap {kv} vs round-robin {rr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn replay_figures_do_not_depend_on_writing_kv_bytes() {
    let dir = temp_dir("replay-bytes");
    let args = [
        "--workers",
        "2",
        "--limit",
        "12",
        "--device-blocks",
        "4096",
        "--host-blocks",
        "256",
    ];
    let plain = replay(&dir, "plain.json", &args);
    let mut with_bytes = args.to_vec();
    with_bytes.push("--kv-bytes");
    assert_eq!(plain, replay(&dir, "bytes.json", &with_bytes));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn replay_rejects_bad_flags_with_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["replay", "--workers", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--workers must be at least 1"));
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["replay", "--block-size", "0"])
        .arg("--trace")
        .arg(trace("synthetic_trace.jsonl"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("block size must be at least 1"));
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["replay", "--trace", "/nonexistent.jsonl"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read trace"));
}
