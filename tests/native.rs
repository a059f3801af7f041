//! `tandem up --model PATH.gguf`: the whole cluster serving a real model (SmolLM2-135M, which
//! scripts/test.sh fetches into target/models) with the native engine — real text from the
//! first request, the same tokens whether the prompt is prefilled on the decode worker or on
//! a prefill worker with its KV moved over, frontend and engines tokenizing alike.

use tandem_test_support as common;

use std::path::Path;
use std::time::Duration;

use common::http;
use common::native::{Up, model_path, up};
use serde_json::{Value, json};

fn chat(up: &Up, body: &Value) -> (Value, http::Response) {
    let r = http::post_json(up.addr, "/v1/chat/completions", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    (serde_json::from_str(&r.text()).unwrap(), r)
}

fn greedy(content: &str, max_tokens: u32) -> Value {
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0
    })
}

fn text(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

fn mismatches(up: &Up) -> f64 {
    let m = http::get(up.admin, "/metrics").unwrap().text();
    common::metrics::Metrics::parse(&m)
        .0
        .get("tandem_frontend_prompt_token_mismatch_total")
        .copied()
        .unwrap_or(0.0)
}

#[test]
fn tandem_up_serves_real_text_and_disaggregation_changes_no_token() {
    let _serial = common::chat::serial();
    // Aggregated: every prompt prefilled on the decode worker.
    let agg = up(
        "native-agg",
        &model_path().display().to_string(),
        &["--disagg", "never"],
    );
    let (models, _) = {
        let r = http::get(agg.addr, "/v1/models").unwrap();
        (serde_json::from_str::<Value>(&r.text()).unwrap(), r)
    };
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(models["data"][0]["max_model_len"], 8192);
    let (colors, _) = chat(&agg, &greedy("Name three colors.", 40));
    let answer = text(&colors).to_lowercase();
    for c in ["red", "blue", "green"] {
        assert!(answer.contains(c), "{c} in {answer:?}");
    }
    assert_eq!(colors["choices"][0]["finish_reason"], "stop", "{colors}");
    // Seeded sampling at temperature 0.8, and a prompt of several blocks.
    let seeded = json!({
        "messages": [{"role": "user", "content": "Write two sentences about the sea."}],
        "max_tokens": 30, "temperature": 0.8, "seed": 11
    });
    let (agg_seeded, _) = chat(&agg, &seeded);
    let (again, r) = chat(&agg, &seeded);
    assert_eq!(
        text(&again),
        text(&agg_seeded),
        "a seed gives the same draws"
    );
    assert!(
        r.header("x-tandem-cached-tokens").is_some_and(|c| c != "0"),
        "the repeated prompt hits the prefix cache"
    );
    assert_eq!(mismatches(&agg), 0.0, "frontend and engine tokenize alike");
    drop(agg);

    // Disaggregated, each role its own process on real etcd and NATS: every prompt prefilled
    // on the prefill worker, its KV moved to the decode worker's process: the same tokens.
    // The model by name, from a cache that holds it, with the package index unreachable: the
    // processes find it there and fetch nothing.
    let cache = common::temp_dir("native-cache");
    std::fs::create_dir_all(cache.join("models")).unwrap();
    std::os::unix::fs::symlink(
        model_path(),
        cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
    .unwrap();
    let cache_flag = format!("--cache-dir={}", cache.display());
    let disagg = up(
        "native-disagg",
        "smollm2-135m-instruct",
        &[
            "--processes",
            "--disagg",
            "always",
            &cache_flag,
            "--model-index=http://127.0.0.1:9/simple/",
        ],
    );
    let models: Value =
        serde_json::from_str(&http::get(disagg.addr, "/v1/models").unwrap().text()).unwrap();
    assert_eq!(models["data"][0]["id"], "smollm2-135m-instruct");
    let (d_colors, r) = chat(&disagg, &greedy("Name three colors.", 40));
    assert!(
        r.header("x-tandem-prefill-worker").is_some(),
        "prefilled remotely"
    );
    assert_eq!(text(&d_colors), text(&colors));
    let (d_seeded, _) = chat(&disagg, &seeded);
    assert_eq!(text(&d_seeded), text(&agg_seeded));
    assert_eq!(mismatches(&disagg), 0.0);
}

/// The official `openai` client (tests/native_openai.py, the `sdk` venv) against a
/// disaggregated `tandem up --model`: a streamed chat with usage and logprobs (the first token's
/// drawn on the prefill worker), top_k and min_p, completions logprobs, a repeated long
/// prompt reported cached, and `/v1/embeddings` (prefilled on the decode worker).
#[test]
fn the_openai_client_gets_usage_logprobs_and_cached_tokens_from_the_real_model() {
    let _serial = common::chat::serial();
    let up = up(
        "native-openai",
        &model_path().display().to_string(),
        &["--disagg", "always"],
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/native_openai.py");
    let out = common::run_ok(
        std::process::Command::new(common::python("sdk"))
            .arg(&script)
            .arg(format!("http://{}", up.addr)),
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("openai client: {v}");
    let answer = v["text"].as_str().unwrap().to_lowercase();
    assert!(answer.contains("red"), "{answer:?}");
    let logprobs = v["logprobs"].as_array().unwrap();
    assert!(
        logprobs.iter().any(|l| l.as_f64().unwrap() < 0.0),
        "a real model is not certain of every token: {logprobs:?}"
    );
    let prompt = v["long_prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 500, "{prompt}");
    let cached: Vec<u64> = v["cached"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap())
        .collect();
    assert!(cached[0] < prompt / 2, "the first time is cold: {cached:?}");
    // Every full block but the last token's is served from the cache.
    assert!(cached[1] + 16 >= prompt - 1, "{cached:?} of {prompt}");
    // The model's hidden size (SmolLM2-135M: 576).
    assert_eq!(v["embedding_dim"], 576);
    assert_eq!(mismatches(&up), 0.0);
}

/// `--device cuda` in a build without the `cuda` feature, and a device that is not one, are
/// refused at start with the reason, before anything is served.
#[cfg(not(feature = "cuda"))]
#[test]
fn a_gpu_device_is_refused_at_start_by_a_build_without_gpu_support() {
    let model = model_path();
    let model = model.to_str().unwrap();
    for (device, says) in [
        (
            "cuda",
            "--device cuda:0: this tandem was built without GPU support",
        ),
        ("gpu", "expected cpu, cuda or cuda:N"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["up", "--port", "0", "--model", model, "--device", device])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--device {device} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{says:?} not in:\n{err}");
    }
}

/// A worker's disk tier survives a restart: a prompt computed by one `tandem up`, spilled to
/// disk as its decode worker stops, is a prefix hit for the next run on the same directory,
/// announced to its router (the decision shows the blocks on disk), and gives the same answer.
#[test]
fn the_disk_tier_survives_a_restart_and_the_router_sees_it() {
    // Alone: a first run that cannot stop in time (the other tests' models computing beside
    // it) is killed, and spills nothing.
    let _serial = common::chat::serial();
    let dir = common::temp_dir("kv-disk-restart");
    let disk = dir.join("kv");
    let disk = disk.to_str().unwrap();
    let model = model_path();
    let flags = [
        "--kv-disk-dir",
        disk,
        "--kv-disk-mb",
        "64",
        "--kv-memory-mb",
        "32",
    ];
    let prompt: Vec<u32> = (0..600u32).map(|i| 200 + (i * 7919) % 40_000).collect();
    let body = json!({
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1,
    })
    .to_string();
    let ask = |up: &Up| {
        let r = http::post_json(up.addr, "/v1/completions", &body).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json::<Value>()
    };
    let first = {
        let up = up("kv-disk-first", model.to_str().unwrap(), &flags);
        let v = ask(&up);
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
            "{v}"
        );
        v
    }; // stopped: its decode worker spills its cache to disk as it goes
    let up = up("kv-disk-second", model.to_str().unwrap(), &flags);
    // The restarted worker announces its disk tier after it joins: wait until the router
    // has it (600 tokens: 37 full blocks) before asking.
    common::cluster::wait_for(
        "the disk tier in the router's index",
        Duration::from_secs(60),
        || {
            let m = http::get(up.admin, "/metrics")
                .ok()
                .filter(|r| r.status == 200)?;
            (common::metrics::Metrics::parse(&m.text()).index_entries() >= 37).then_some(())
        },
    );
    let again = ask(&up);
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached tokens in {again}"));
    assert!(
        cached >= 576,
        "cached {cached} of 600 after the restart: {again}"
    );
    assert_eq!(
        again["choices"], first["choices"],
        "the same answer from disk KV"
    );
    let status: Value = http::get(up.admin, "/status.json").unwrap().json();
    let chosen = &status["backend"]["decisions"][0]["decode"]["candidates"][0];
    assert!(
        chosen["overlap_disk"].as_u64().is_some_and(|n| n >= 36),
        "the router knew the prefix is on the worker's disk: {}",
        status["backend"]["decisions"][0]
    );
    drop(up);
}
