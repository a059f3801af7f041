//! The suite (its description: tests/native_kv.rs).

use tandem_test_support as common;

use std::sync::OnceLock;
use std::time::Duration;

use common::chat::{chunks, content, final_usage, open_stream, read_events, streamed};
use common::cluster::{Cluster, Metrics, Options, prefill_id, wait_for};
use common::http::{self, StreamEnd};
use common::native::{Up, model_path, up};
use common::words;
use serde_json::{Value, json};

/// Tokens every request generates.
const MAX_TOKENS: u32 = 12;

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 200 + (i * 7919 + seed * 31) % 40_000)
        .collect()
}

/// A completion of `prompt`; `temperature` 0: greedy, else seeded.
fn completion(prompt: Vec<u32>, temperature: f32) -> (&'static str, Value) {
    (
        "/v1/completions",
        json!({
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 7,
            "logprobs": 2,
        }),
    )
}

fn chat(system: &str, user: &str, temperature: f32) -> (&'static str, Value) {
    (
        "/v1/chat/completions",
        json!({
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 11,
            "logprobs": true, "top_logprobs": 2,
        }),
    )
}

/// The requests, in the order they are sent (later ones extend earlier ones' prompts).
fn requests() -> Vec<(&'static str, Value)> {
    let long = ids(900, 3);
    let extended: Vec<u32> = long.iter().copied().chain(ids(400, 4)).collect();
    let system = "You are a careful assistant. Answer in one short sentence, plainly.";
    vec![
        completion(ids(10, 1), 0.0),
        completion(ids(60, 2), 0.0),
        completion(ids(250, 5), 0.8),
        completion(long.clone(), 0.0),
        // The 900-token prompt again (a prefix hit), then extended by 400 tokens.
        completion(long, 0.8),
        completion(extended, 0.0),
        completion(ids(3000, 6), 0.0),
        chat(system, "Name three colors.", 0.0),
        chat(system, "Write two sentences about the sea.", 0.8),
        // The same system prompt: its blocks are cached.
        chat(system, "What is the capital of France?", 0.0),
        completion(ids(10, 10), 0.8),
        completion(ids(30, 7), 0.8),
        completion(ids(120, 8), 0.0),
        completion(ids(480, 9), 0.8),
        // A prefix of the 3,000-token prompt (held whole but its last partial block), and
        // that prompt extended by 50 tokens.
        completion(ids(3000, 6)[..1200].to_vec(), 0.8),
        completion(ids(3000, 6).into_iter().chain(ids(50, 11)).collect(), 0.0),
        chat(system, "Name three colors.", 0.8),
        chat(system, "Say hello in French.", 0.0),
        chat(system, "Count from one to five.", 0.8),
        chat("You are terse.", "What is two plus two?", 0.0),
    ]
}

/// What must not change between runs: each request's choices (text, finish reason,
/// logprobs) and token counts.
fn answers(up: &Up, remote: bool) -> Vec<Value> {
    answers_of(up, &requests(), Some(remote))
}

/// [`answers`] of some requests; `remote`: whether each must say it was prefilled remotely
/// (`None`: either).
fn answers_of(up: &Up, requests: &[(&'static str, Value)], remote: Option<bool>) -> Vec<Value> {
    requests
        .iter()
        .enumerate()
        .map(|(i, (path, body))| {
            let r = http::post_json(up.addr, path, &body.to_string()).unwrap();
            assert_eq!(r.status, 200, "request {i}: {}", r.text());
            if let Some(remote) = remote {
                assert_eq!(
                    r.header("x-tandem-prefill-worker").is_some(),
                    remote,
                    "request {i} prefilled where it should not be"
                );
            }
            answer(&r)
        })
        .collect()
}

/// What must not change of one response: its choices and token counts.
fn answer(r: &http::Response) -> Value {
    let v: Value = serde_json::from_str(&r.text()).unwrap();
    json!({
        "choices": v["choices"],
        "completion_tokens": v["usage"]["completion_tokens"],
        "prompt_tokens": v["usage"]["prompt_tokens"],
    })
}

/// Both workers on both cores: the requests go one at a time, so one worker computes at once.
fn cluster(tag: &str, extra: &[&str]) -> Up {
    let mut flags = vec!["--threads", "2"];
    flags.extend_from_slice(extra);
    up(tag, &model_path().display().to_string(), &flags)
}

/// The aggregated run every other is held against: each prompt prefilled on the decode
/// worker.
fn reference() -> &'static [Value] {
    static REFERENCE: OnceLock<Vec<Value>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let agg = cluster("kv-agg", &["--disagg", "never"]);
        let a = answers(&agg, false);
        // The answers are the model's: text, and logprobs that are not all certain.
        assert!(
            a[7]["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_lowercase()
                .contains("color"),
            "{}",
            a[7]
        );
        assert!(a[0]["choices"][0]["logprobs"]["token_logprobs"][0].as_f64() < Some(0.0));
        a
    })
}

fn assert_same(name: &str, got: &[Value]) {
    assert_same_as(name, got, reference());
}

fn assert_same_as(name: &str, got: &[Value], want: &[Value]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "{name}: request {i} differs from the aggregated run");
    }
}

fn disaggregated_over(name: &str, extra: &[&str]) {
    let _serial = common::chat::serial();
    reference();
    let mut flags = vec!["--disagg", "always"];
    flags.extend_from_slice(extra);
    let up = cluster(&format!("kv-{name}"), &flags);
    let got = answers(&up, true);
    assert_same(name, &got);
    // Every prompt's KV came over: none fell back to a local prefill.
    let m = http::get(up.admin, "/metrics").unwrap().text();
    let m = common::metrics::Metrics::parse(&m);
    let get = |series: String| m.0.get(&series).copied().unwrap_or(0.0);
    let outcome = |o: &str| get(format!("tandem_prefills_total{{outcome=\"{o}\"}}"));
    assert_eq!(
        (outcome("remote"), outcome("fallback")),
        (requests().len() as f64, 0.0),
        "{name}: every prefill remote"
    );
    // Paged: what the decode worker held (the 900-token prompt's 56 full blocks, twice; the
    // 3,000-token prompt's blocks under its cut and its extension; the shared system prompt)
    // was not sent, the rest was.
    let tokens = |kind: &str| {
        get(format!(
            "tandem_remote_prefill_tokens_total{{kind=\"{kind}\"}}"
        ))
    };
    let prompts: f64 = got
        .iter()
        .map(|a| a["prompt_tokens"].as_f64().unwrap())
        .sum();
    assert_eq!(tokens("moved") + tokens("held"), prompts, "{name}");
    assert!(
        tokens("held") > 2.0 * 896.0 + 1_100.0 + 2_900.0,
        "{name}: held {}",
        tokens("held")
    );
}

#[test]
fn disaggregated_over_local_copies_gives_the_aggregated_tokens() {
    disaggregated_over("local", &[]);
}

#[test]
fn disaggregated_over_tcp_gives_the_aggregated_tokens() {
    disaggregated_over("tcp", &["--kv-transport", "tcp"]);
}

#[test]
fn disaggregated_over_ucx_gives_the_aggregated_tokens() {
    disaggregated_over("ucx", &["--kv-transport", "ucx"]);
}

#[test]
fn disaggregated_inline_on_the_grpc_stream_gives_the_aggregated_tokens() {
    disaggregated_over("inline", &["--kv-transport", "inline"]);
}

#[test]
fn disaggregated_across_processes_gives_the_aggregated_tokens() {
    disaggregated_over("processes", &["--processes"]);
}

/// Every transfer has one byte flipped after its digest was taken: the decode worker catches
/// it, prefills the prompt itself, and answers exactly what the aggregated run answered.
#[test]
fn a_corrupted_transfer_is_caught_and_the_local_prefill_gives_the_same_tokens() {
    let _serial = common::chat::serial();
    let picked = [0, 2, 3, 7, 8];
    let want: Vec<Value> = picked.iter().map(|&i| reference()[i].clone()).collect();
    let all = requests();
    let asked: Vec<_> = picked.iter().map(|&i| all[i].clone()).collect();
    let up = cluster(
        "kv-corrupt",
        &["--disagg", "always", "--inject-kv-corruption"],
    );
    assert_same_as("corrupted", &answers_of(&up, &asked, None), &want);
    let m = http::get(up.admin, "/metrics").unwrap().text();
    let m = common::metrics::Metrics::parse(&m);
    assert_eq!(
        m.0.get("tandem_prefills_total{outcome=\"fallback\"}")
            .copied(),
        Some(picked.len() as f64),
        "every corrupted transfer fell back to a local prefill"
    );
}

/// Plain English for the dtype test's prompts (written for this test).
const PROSE: &str = "The river town woke slowly in the winter. Before dawn the bakers lit \
    their ovens, and the smell of bread drifted along the narrow streets toward the harbor. \
    Fishermen checked their nets by lantern light while the gulls waited on the wooden posts. \
    At the school on the hill, the teacher wrote the day's lesson on the board: the history of \
    the bridge that joined the two halves of the town. It had been built two hundred years \
    ago, after a flood carried away the old ferry, and every child could name the stonemason \
    who carved the lions at each end. In the market square the first stalls opened at seven. \
    Farmers from the valley sold apples, cheese and honey, and an old woman sold wool socks \
    she had knitted through the autumn. The mayor walked past on her way to the town hall, \
    greeting the traders by name and asking about their families. By noon the sun had melted \
    the frost on the roofs, and the river shone like polished metal under the bridge. In the \
    afternoon the children ran down to the water to throw stones and count the ripples, and \
    the old men on the benches argued, as they did every day, about whether the winter would \
    be long or short. When evening came the lamps were lit one by one, the bakers slept, and \
    the town grew quiet again, listening to the river.";

/// An f32-KV prefill worker serving an f16-KV decode worker (`--prefill-kv-dtype f32`): the
/// blocks come inline in f32 and the decode worker rounds them to f16 (nearest even) as they
/// arrive. Every prefill is remote (converted, not refused). Not bitwise the f32-only run
/// (the decode worker attends over f16): over 20 prose prompts, its greedy tokens agree with
/// that run's at least as often as an all-f16 pool's do, and on at least 85 % of them.
#[test]
fn an_f32_prefill_pool_serves_an_f16_decode_pool_through_a_conversion() {
    let _serial = common::chat::serial();
    // Prose the model continues with some confidence (on random token ids its greedy
    // choices are near ties, and one flipped early token changes all that follow).
    let words: Vec<&str> = PROSE.split_whitespace().collect();
    let asked: Vec<(&'static str, Value)> = (0..20)
        .map(|i| {
            let (from, len) = ((i * 7) % 40, 8 + i * 14);
            let text = words[from..(from + len).min(words.len())].join(" ");
            let body = json!({
                "prompt": text, "max_tokens": 16, "temperature": 0, "logprobs": 1,
                "ignore_eos": true,
            });
            ("/v1/completions", body)
        })
        .collect();
    let tokens = |answers: &[Value]| -> Vec<Vec<String>> {
        answers
            .iter()
            .map(|a| {
                a["choices"][0]["logprobs"]["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_str().unwrap().to_string())
                    .collect()
            })
            .collect()
    };
    let f32_only = {
        let up = cluster("kv-f32", &["--disagg", "always", "--kv-dtype", "f32"]);
        tokens(&answers_of(&up, &asked, Some(true)))
    };
    let up = cluster(
        "kv-f32-to-f16",
        &[
            "--disagg",
            "always",
            "--kv-dtype",
            "f16",
            "--prefill-kv-dtype",
            "f32",
        ],
    );
    let mixed = tokens(&answers_of(&up, &asked, Some(true)));
    let m = common::metrics::Metrics::parse(&http::get(up.admin, "/metrics").unwrap().text());
    assert_eq!(
        m.0.get("tandem_prefills_total{outcome=\"remote\"}")
            .copied(),
        Some(asked.len() as f64),
        "every prefill came over and was converted"
    );
    // The same pool all in f16: how far f16 storage alone moves the tokens.
    let f16_only = {
        let up = cluster("kv-f16", &["--disagg", "always"]);
        tokens(&answers_of(&up, &asked, Some(true)))
    };
    let agreement = |x: &[Vec<String>]| {
        let (mut same, mut total) = (0, 0);
        for (a, b) in x.iter().zip(&f32_only) {
            total += a.len();
            same += a.iter().zip(b).filter(|(p, q)| p == q).count();
        }
        (same, total)
    };
    let ((mixed_same, total), (f16_same, _)) = (agreement(&mixed), agreement(&f16_only));
    eprintln!(
        "greedy tokens as the f32-only run's: f32 prefill → f16 decode {mixed_same} of \
         {total}, f16 throughout {f16_same} of {total}"
    );
    // The conversion adds nothing to what f16 storage itself changes (the f32 prefill's
    // share is exact), and most tokens stand: measured 287 and 266 of 320 (one early flip
    // of a greedy choice changes every token after it).
    assert!(
        mixed_same >= f16_same,
        "{mixed_same} < {f16_same} of {total}"
    );
    assert!(
        mixed_same as f64 >= 0.85 * total as f64,
        "{mixed_same} of {total} tokens agree"
    );
}

/// A cluster of separate processes on real etcd and NATS (testing/support/src/cluster.rs), its
/// workers computing the model.
fn native_cluster(name: &str, opts: Options) -> Cluster {
    let model = model_path().display().to_string();
    let mut worker_args = vec![
        "--engine=native".into(),
        format!("--model={model}"),
        "--threads=1".into(),
    ];
    worker_args.extend(opts.worker_args.iter().cloned());
    Cluster::start(
        name,
        Options {
            worker_args,
            frontend_args: vec![
                "--model=SmolLM2-135M-Instruct.Q4_1".into(),
                format!("--tokenizer={model}"),
                "--context-length=8192".into(),
            ],
            ..opts
        },
    )
}

/// Two streams of 300 tokens (greedy, and seeded at temperature 0.8) on the decode worker
/// of `c` that holds their long shared prompt, 50 tokens into each.
struct TwoStreams {
    system: String,
    home: u64,
    prompt: u64,
    streams: Vec<http::EventStream>,
    events: [Vec<String>; 2],
}

const TEMPERATURES: [f32; 2] = [0.0, 0.8];

impl TwoStreams {
    fn open(c: &Cluster, seed: u64) -> TwoStreams {
        let system = format!("You tell stories. {}", words(seed, 600));
        let mut two = TwoStreams {
            system,
            home: 0,
            prompt: 0,
            streams: Vec::new(),
            events: [Vec::new(), Vec::new()],
        };
        // The shared prompt warms one worker's cache, so both streams are routed to it (the
        // router's cache credit for it outweighs one stream's load).
        let first = c.chat(&two.story(0.0));
        two.home = first.decode;
        two.prompt = u64::from(first.completion.usage.prompt_tokens);
        c.wait_metrics("the prompt in the index", Duration::from_secs(20), |m| {
            m.index_entries() >= two.prompt / 16
        });
        two.streams = TEMPERATURES
            .iter()
            .map(|&t| open_stream(c, &streamed(two.story(t))))
            .collect();
        for (s, events) in two.streams.iter_mut().zip(&mut two.events) {
            assert_eq!(
                s.header("x-tandem-decode-worker"),
                Some(two.home.to_string().as_str()),
                "both streams on the worker holding their prompt"
            );
            *events = read_events(s, 50);
        }
        two
    }

    fn story(&self, temperature: f32) -> Value {
        json!({
            "messages": [{"role": "system", "content": self.system},
                         {"role": "user", "content": "Tell me a story."}],
            "max_tokens": 300, "ignore_eos": true, "temperature": temperature, "seed": 5,
        })
    }

    /// Reads both streams to their end at once (so that each event's arrival is its own),
    /// printing the longest pause each saw after `since` under `what`.
    fn finish(&mut self, since: std::time::Instant, what: &str) {
        let readers: Vec<_> = std::mem::take(&mut self.streams)
            .into_iter()
            .map(|mut s| std::thread::spawn(move || s.collect_timed()))
            .collect();
        for (reader, events) in readers.into_iter().zip(&mut self.events) {
            let (rest, end) = reader.join().unwrap();
            assert!(matches!(end, StreamEnd::Done), "{end:?}");
            eprintln!(
                "{what}: the stream paused {:?}",
                longest_pause(since, &rest)
            );
            events.extend(rest.into_iter().map(|(_, e)| e));
        }
    }

    /// Each stream is complete and says what an uninterrupted run (on another worker) says.
    fn assert_uninterrupted(&self, c: &Cluster, what: &str) {
        for (events, temperature) in self.events.iter().zip(TEMPERATURES) {
            let got = chunks(events);
            assert_eq!(final_usage(&got).completion_tokens, 300);
            let uninterrupted = c.chat(&self.story(temperature));
            assert_ne!(uninterrupted.decode, self.home);
            assert_eq!(
                content(&got),
                uninterrupted.content(),
                "temperature {temperature}: the {what} stream differs from an uninterrupted run"
            );
        }
    }
}

/// kill -9 of the decode worker serving two streams (greedy, and seeded at temperature
/// 0.8) after 50 of their 300 tokens: both migrate to the other decode worker (prompt and
/// tokens so far, recomputed there) and complete exactly as an uninterrupted run does.
#[test]
fn a_killed_decode_workers_streams_migrate_and_equal_the_uninterrupted_ones() {
    let _serial = common::chat::serial();
    let mut c = native_cluster(
        "kv-migrate",
        Options {
            decode: 2,
            ..Options::default()
        },
    );
    let mut two = TwoStreams::open(&c, 3);
    c.worker(two.home).kill9();
    two.finish(std::time::Instant::now(), "migration by recompute");
    assert!(c.metrics().get("tandem_migrations_total") >= 2.0);
    two.assert_uninterrupted(&c, "migrated");
}

#[test]
fn a_prefill_worker_killed_mid_transfer_falls_back_to_the_same_tokens() {
    let _serial = common::chat::serial();
    let want = reference()[5].clone();
    let mut c = native_cluster(
        "kv-prefill-killed",
        Options {
            prefill: 1,
            decode: 1,
            disagg: "always",
            kv_transport: "tcp",
            worker_args: vec!["--metrics-addr=127.0.0.1:0".into()],
            ..Options::default()
        },
    );
    let prefill: std::net::SocketAddr = c
        .worker_metrics_addrs()
        .into_iter()
        .find(|(role, _)| role == "prefill")
        .expect("the prefill worker registered")
        .1
        .parse()
        .unwrap();
    let (path, body) = requests()[5].clone();
    let front = c.addr_of(0);
    let asked = std::thread::spawn(move || http::post_json(front, path, &body.to_string()));
    let early = wait_for(
        "the prefill worker to send its first chunk",
        Duration::from_secs(120),
        || {
            let m = Metrics::parse(&http::get(prefill, "/metrics").ok()?.text());
            (m.get("tandem_worker_kv_transfer_bytes_total{direction=\"sent\"}") > 0.0)
                .then(|| m.get("tandem_worker_kv_transfer_early_bytes_total"))
        },
    );
    // Its layers left one by one as the forward pass computed them (layer streaming).
    assert!(
        early > 0.0,
        "nothing was sent before the first chunk's step ended"
    );
    c.worker(prefill_id(0)).kill9();
    let r = asked.join().unwrap().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        answer(&r),
        want,
        "the fallback differs from the aggregated run"
    );
    let m = c.metrics();
    assert_eq!(m.get("tandem_prefills_total{outcome=\"fallback\"}"), 1.0);
    assert_eq!(m.get("tandem_prefills_total{outcome=\"remote\"}"), 0.0);
}

/// The longest wait for a token from `since` on: the pause a stream saw.
fn longest_pause(since: std::time::Instant, events: &[(std::time::Instant, String)]) -> Duration {
    let mut last = since;
    let mut longest = Duration::ZERO;
    for (at, _) in events {
        longest = longest.max(at.duration_since(last));
        last = *at;
    }
    longest
}

/// SIGTERM to the decode worker serving two streams (greedy, and seeded at temperature 0.8)
/// after 50 of their 300 tokens: it offers their KV, the frontend continues both on the
/// other decode worker with the draining one as the remote prefill (their blocks move over
/// UCX; only the last partial block is computed), and both complete exactly as an
/// uninterrupted run does. The pause each stream saw is printed (`--nocapture`).
#[test]
fn a_draining_decode_worker_hands_its_streams_over_and_they_equal_uninterrupted_ones() {
    let _serial = common::chat::serial();
    let mut c = native_cluster(
        "kv-handover",
        Options {
            decode: 2,
            drain_timeout_s: 60,
            ..Options::default()
        },
    );
    let mut two = TwoStreams::open(&c, 4);
    let before = c.metrics();
    c.worker(two.home).signal("TERM");
    two.finish(std::time::Instant::now(), "handover with KV");
    let m = c.metrics();
    assert_eq!(m.get("tandem_handovers_total{outcome=\"moved\"}"), 2.0);
    assert_eq!(m.get("tandem_migrations_total"), 0.0);
    // Both continuations' KV came from the draining worker: the prompt and at least the
    // 50 tokens each had, moved, not recomputed.
    let remote = |m: &Metrics| m.get("tandem_prefills_total{outcome=\"remote\"}");
    assert_eq!(remote(&m) - remote(&before), 2.0);
    let moved = |m: &Metrics| m.get("tandem_remote_prefill_tokens_total{kind=\"moved\"}");
    assert!(moved(&m) - moved(&before) >= 2.0 * (two.prompt + 50) as f64);
    assert_eq!(m.get("tandem_prefills_total{outcome=\"fallback\"}"), 0.0);
    two.assert_uninterrupted(&c, "handed-over");
    let status = c
        .worker(two.home)
        .wait_exit(Duration::from_secs(60))
        .expect("the drained worker exits");
    assert!(status.success(), "exit status {status}");
}
