//! `tandem sim` over the built binary: flags, the markdown table, the JSON record, plots.

use std::process::Command;

fn tandem(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("sim")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn sim_writes_table_json_and_plots() {
    let dir = std::env::temp_dir().join(format!("tandem-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let out = tandem(&[
        "--workload",
        "shared-prefix",
        "--requests",
        "60",
        "--rate",
        "20",
        "--workers",
        "3",
        "--isl",
        "128",
        "--prefix-len",
        "256",
        "--osl",
        "8",
        "--policy",
        "kv",
        "--seed",
        "3",
        "--json",
        json.to_str().unwrap(),
        "--plot-dir",
        dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("| TTFT |") && stdout.contains("prefix hit rate"),
        "{stdout}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["completed"], 60);
    for key in [
        "ttft_p90_ms",
        "itl_p99_ms",
        "e2e_max_ms",
        "goodput_rps",
        "prefix_hit_rate",
    ] {
        assert!(v[key].is_number(), "{key}");
    }
    assert!(
        std::fs::read_to_string(dir.join("ttft_cdf.svg"))
            .unwrap()
            .starts_with("<svg")
    );
}

#[test]
fn sim_refuses_bad_flags_with_a_clear_message() {
    for (args, expect) in [
        (&["--policy", "fastest"][..], "round-robin, random"),
        (&["--disagg", "sometimes"][..], "isl-bounding"),
        (&["--workers", "0"][..], "--workers must be at least 1"),
        (&["--sweep-rate", "1,x"][..], "--sweep-rate"),
        (&["--event-delay-ms=-1"][..], "--event-delay-ms"),
    ] {
        let out = tandem(args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}
