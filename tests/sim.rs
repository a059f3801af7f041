//! `tandem sim` over the built binary: flags, the markdown table, the JSON record, plots.

use tandem_test_support as common;

use std::process::Command;

use common::{run_ok, temp_dir, trace};

fn tandem(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("sim")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn sim_writes_table_json_and_plots() {
    let dir = temp_dir("sim");
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
        stdout.contains("| TTFT |")
            && stdout.contains("prefix hit rate")
            && stdout.contains("max−min requests per worker"),
        "{stdout}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["completed"], 60);
    // Latencies as the bench report writes them: one summary per latency.
    for (latency, figure) in [("ttft_ms", "p90"), ("itl_ms", "p99"), ("e2e_ms", "max")] {
        assert!(v[latency][figure].is_number(), "{latency}.{figure}");
    }
    // One TTFT and one E2E per request; one ITL per gap between tokens.
    assert_eq!(v["ttft_ms"]["count"], 60);
    assert_eq!(v["e2e_ms"]["count"], 60);
    assert!(v["itl_ms"]["count"].as_u64().unwrap() > 60);
    for key in [
        "goodput_rps",
        "prefix_hit_rate",
        "inflight_imbalance_max_minus_min_mean",
        "inflight_imbalance_max_minus_min_max",
        "inflight_imbalance_max_over_mean_mean",
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
        (&["--arrival-jitter-ms=-1"][..], "--arrival-jitter-ms"),
        (&["--arrival-jitter-ms", "NaN"][..], "--arrival-jitter-ms"),
        (&["--arrival-jitter-ms", "inf"][..], "--arrival-jitter-ms"),
        (
            &["--isl-max-local-fraction", "70"][..],
            "--isl-max-local-fraction",
        ),
        (&["--isl-max-local-tokens=-1"][..], "--isl-max-local-tokens"),
        (
            &["--cascade-escalation-rate", "2"][..],
            "--cascade-escalation-rate must be in [0, 1]",
        ),
        (
            &["--cascade-escalation-rate=0.1", "--cascade-large-workers=0"][..],
            "--cascade-large-workers must be at least 1",
        ),
        (
            &["--prefill-busy-tokens", "lots"][..],
            "--prefill-busy-tokens",
        ),
    ] {
        let out = tandem(args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[test]
fn disagg_threshold_flags_reach_the_rule() {
    let dir = temp_dir("sim-disagg");
    let split = |extra: &[&str], env: &[(&str, &str)]| {
        let json = dir.join("out.json");
        run_ok(
            Command::new(env!("CARGO_BIN_EXE_tandem"))
                .args(["sim", "--workload", "shared-prefix", "--requests", "40"])
                .args(["--rate", "20", "--workers", "2", "--prefill-workers", "1"])
                .args(["--isl", "64", "--prefix-len", "256", "--prefix-groups", "2"])
                .args(["--osl", "4", "--json", json.to_str().unwrap()])
                .args(extra)
                .envs(env.iter().copied()),
        );
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        (
            v["remote_prefills"].as_u64().unwrap(),
            v["local_prefills"].as_u64().unwrap(),
        )
    };
    // Defaults (Dynamo's rule): every prompt here is under 2048 uncached tokens, so local.
    assert_eq!(split(&[], &[]), (0, 40));
    // With the opt-in fraction, prompts with a cached prefix on their decode worker prefill
    // locally, fresh ones remotely.
    let (remote, local) = split(&["--isl-max-local-fraction", "0.7"], &[]);
    assert!(remote > 0 && local > 0, "{remote} / {local}");
    let env = split(&[], &[("TANDEM_ISL_MAX_LOCAL_FRACTION", "0.7")]);
    assert_eq!(env, (remote, local));
    // No effective prompt is below 0 tokens, or below 0 × the prompt: all remote.
    assert_eq!(split(&["--isl-max-local-tokens", "0"], &[]), (40, 0));
    assert_eq!(split(&["--isl-max-local-fraction", "0"], &[]), (40, 0));
    assert_eq!(split(&[], &[("TANDEM_ISL_MAX_LOCAL_TOKENS", "0")]), (40, 0));
    // prefill-load: no prefill backlog reaches 8192 tokens here; any backlog exceeds 0.
    assert_eq!(split(&["--disagg", "prefill-load"], &[]), (40, 0));
    let (remote, local) = split(
        &["--disagg", "prefill-load", "--prefill-busy-tokens", "0"],
        &[],
    );
    assert!(remote > 0 && local > 0, "{remote} / {local}");
}

#[test]
fn arrival_jitter_zero_is_byte_identical_to_no_flag_and_positive_is_repeatable() {
    let dir = temp_dir("sim-jitter");
    let trace = trace("conversation_trace.jsonl");
    let json = |name: &str, extra: &[&str], env: &[(&str, &str)]| {
        let path = dir.join(name);
        run_ok(
            Command::new(env!("CARGO_BIN_EXE_tandem"))
                .args(["sim", "--trace", trace.to_str().unwrap(), "--limit", "60"])
                .args(["--workers", "3", "--routers", "2", "--seed", "4"])
                .args(["--json", path.to_str().unwrap()])
                .args(extra)
                .envs(env.iter().copied()),
        );
        std::fs::read(&path).unwrap()
    };
    let plain = json("plain.json", &[], &[]);
    assert_eq!(plain, json("zero.json", &["--arrival-jitter-ms", "0"], &[]));
    assert_eq!(
        plain,
        json(
            "zero-env.json",
            &[],
            &[("TANDEM_WORKLOAD_ARRIVAL_JITTER_MS", "0")]
        )
    );
    let a = json("a.json", &["--arrival-jitter-ms", "250"], &[]);
    let b = json(
        "b.json",
        &[],
        &[("TANDEM_WORKLOAD_ARRIVAL_JITTER_MS", "250")],
    );
    assert_eq!(a, b);
    assert_ne!(a, plain);
    let v: serde_json::Value = serde_json::from_slice(&a).unwrap();
    assert_eq!(
        v["completed"].as_u64().unwrap() + v["rejected"].as_u64().unwrap(),
        60
    );
}

/// `tandem size`: the fewest workers meeting the SLO, aggregated (by bisection) and split;
/// the smallest answer is consistent with the runs it lists, and a load no cluster up to the
/// limit can carry is said to be so.
#[test]
fn plan_finds_the_smallest_clusters_that_meet_the_slo() {
    let dir = temp_dir("plan");
    let json = dir.join("plan.json");
    let plan = |workers: &str, rate: &str, extra: &[&str]| {
        let mut args = vec![
            "size",
            "--workers",
            workers,
            "--rate",
            rate,
            "--requests",
            "300",
            "--isl",
            "2048",
            "--osl",
            "64",
            "--seed",
            "1",
        ];
        args.extend_from_slice(extra);
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(&args)
            .output()
            .unwrap()
    };
    let out = plan("8", "12", &["--json", json.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let agg = v["aggregated"]["decode_workers"]
        .as_u64()
        .expect("an aggregated answer");
    let runs = v["runs"].as_array().unwrap();
    let meets = |p: u64, d: u64| {
        runs.iter()
            .find(|r| r["prefill_workers"] == p && r["decode_workers"] == d)
            .map(|r| r["meets_slo"].as_bool().unwrap())
    };
    assert_eq!(meets(0, agg), Some(true));
    if agg > 1 {
        assert_eq!(
            meets(0, agg - 1),
            Some(false),
            "one fewer must miss: {runs:?}"
        );
    }
    let split = &v["disaggregated"];
    let total =
        split["prefill_workers"].as_u64().unwrap() + split["decode_workers"].as_u64().unwrap();
    assert!(total <= agg.max(2), "no bigger than the aggregated answer");
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("aggregated: {agg} workers")));

    // Ten times the load on at most two workers: nothing fits.
    let out = plan("2", "120", &["--topologies", "aggregated"]);
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("none up to 2 workers meets the SLO"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Runs `tandem sim` on the bundled conversation trace and returns its JSON report.
fn trace_report(dir: &std::path::Path, name: &str, args: &[&str]) -> serde_json::Value {
    let json = dir.join(name);
    run_ok(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .arg("sim")
            .arg("--trace")
            .arg(trace("conversation_trace.jsonl"))
            .args(args)
            .arg("--json")
            .arg(&json),
    );
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

/// On a real trace, prefix affinity beats round-robin on cache hits, and the KV index's
/// prediction at routing time matches the engines' real hits (what `tandem replay` showed).
#[test]
fn prefix_affinity_beats_round_robin_and_the_index_predicts_the_hits() {
    let dir = temp_dir("sim-trace");
    let args = ["--workers", "8", "--limit", "300", "--host-blocks", "4096"];
    let run = |policy: &str| {
        let mut a = args.to_vec();
        a.extend(["--policy", policy]);
        trace_report(&dir, &format!("{policy}.json"), &a)
    };
    let (rr, affinity, kv) = (run("round-robin"), run("cache-aware"), run("kv"));
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    for r in [&rr, &affinity, &kv] {
        assert_eq!(r["completed"], 300);
        assert!(f(r, "kv_events_applied") > 0.0);
        // Without preemption, prediction and real hits differ only by evictions between
        // routing and admission.
        assert_eq!(r["preemptions"], 0);
        let gap = (f(r, "predicted_cached_tokens") - f(r, "cached_tokens")).abs();
        assert!(
            gap / f(r, "prompt_tokens") < 0.01,
            "index prediction off by {gap} tokens: {r}"
        );
    }
    let hits = |r: &serde_json::Value| f(r, "prefix_hit_rate");
    assert!(hits(&affinity) > 1.3 * hits(&rr), "{affinity} vs {rr}");
    assert!(hits(&kv) > hits(&rr), "{kv} vs {rr}");
}

#[test]
fn sim_refuses_bad_trace_input_with_a_clear_error() {
    for (args, expect) in [
        (
            &["--block-size", "0"][..],
            "--block-size must be at least 1",
        ),
        (&["--trace", "/nonexistent.jsonl"][..], "cannot read trace"),
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
        cmd.arg("sim").args(args);
        if args[0] != "--trace" {
            cmd.arg("--trace").arg(trace("synthetic_trace.jsonl"));
        }
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

/// `--experiment` reads the `[experiment]` of a groups file (the rest of the file is the
/// frontend's): the JSON record then holds each arm's figures; a file without one, or with a
/// bad one, is refused with its name. `--cascade-escalation-rate` runs a cascade: both pools
/// in the record.
#[test]
fn sim_splits_an_experiment_from_a_groups_file_and_runs_a_cascade() {
    let dir = temp_dir("sim-experiment");
    let groups = dir.join("groups.toml");
    std::fs::write(
        &groups,
        "[[model]]\nname = \"m\"\n[[model.group]]\nname = \"pool\"\npool = true\n\n\
         [experiment]\nname = \"credit\"\nb_share = 0.5\n[experiment.b]\noverlap_credit = 0.0\n",
    )
    .unwrap();
    let json = dir.join("out.json");
    let (groups_arg, json_arg) = (groups.to_str().unwrap(), json.to_str().unwrap());
    let out = tandem(&[
        "--workload",
        "multi-turn",
        "--requests",
        "40",
        "--rate",
        "20",
        "--workers",
        "2",
        "--isl",
        "64",
        "--osl",
        "4",
        "--experiment",
        groups_arg,
        "--json",
        json_arg,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("experiment credit arm a"), "{stdout}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let arms = report["experiment"]["arms"].as_array().unwrap();
    let count = |i: usize| arms[i]["requests"].as_u64().unwrap();
    assert_eq!(count(0) + count(1), 40);
    // A cascade from the command line: the JSON holds both pools.
    let out = tandem(&[
        "--requests",
        "40",
        "--rate",
        "20",
        "--isl",
        "64",
        "--isl-spread",
        "0.5",
        "--osl",
        "4",
        "--cascade-escalation-rate",
        "0.25",
        "--json",
        json_arg,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["escalated"], 10);
    assert_eq!(report["large"]["completed"], 10);
    assert_eq!(report["small"]["completed"], 40);
    for (text, expect) in [
        ("[[model]]\nname = \"m\"\n", "has no [experiment]"),
        (
            "[experiment]\nname = \"x\"\nb_share = 0.5\nwhat = 1\n",
            "[experiment]",
        ),
        ("[experiment]\nname = \"x\"\nb_share = 3\n", "b_share"),
    ] {
        std::fs::write(&groups, text).unwrap();
        let out = tandem(&["--requests", "4", "--experiment", groups_arg]);
        assert!(!out.status.success(), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{text}: {err}");
    }
}
