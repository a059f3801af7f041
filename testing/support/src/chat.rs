//! Chat requests and SSE chunk helpers for the cluster tests, and the lock that runs one
//! cluster at a time (on a two-core CI machine, clusters side by side would compete for the
//! CPU that lease keep-alives and real-time engine steps need).

use parking_lot::{Mutex, MutexGuard};

use serde_json::{Value, json};

use super::cluster::Cluster;
use super::http::{self, Event};
use super::openai::{ChatCompletionChunk, Usage};

/// One cluster at a time, across the tests of one test binary (see the module docs); cargo
/// runs test binaries one after another.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
}

/// A chat request: a long system prompt (the shared prefix) and a short question.
pub fn chat(system: &str, question: &str, max_tokens: u32) -> Value {
    json!({
        "model": "mocker",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "temperature": 0,
    })
}

/// The same request, streamed with usage.
pub fn streamed(mut body: Value) -> Value {
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body
}

/// Parses every event of a chat stream as a chunk.
pub fn chunks(events: &[String]) -> Vec<ChatCompletionChunk> {
    events
        .iter()
        .map(|e| {
            serde_json::from_str(e)
                .unwrap_or_else(|err| panic!("not a ChatCompletionChunk ({err}): {e}"))
        })
        .collect()
}

pub fn finish_reasons(chunks: &[ChatCompletionChunk]) -> Vec<&str> {
    chunks
        .iter()
        .flat_map(|c| &c.choices)
        .filter_map(|c| c.finish_reason.as_deref())
        .collect()
}

/// The usage of the final (choice-less) chunk of an `include_usage` stream.
pub fn final_usage(chunks: &[ChatCompletionChunk]) -> Usage {
    let last = chunks.last().expect("a chunk");
    assert!(last.choices.is_empty(), "the usage chunk has no choices");
    last.usage.expect("the last chunk carries the usage")
}

pub fn content(chunks: &[ChatCompletionChunk]) -> String {
    chunks
        .iter()
        .flat_map(|c| &c.choices)
        .filter_map(|c| c.delta.content.as_deref())
        .collect()
}

/// Opens a chat stream that must start (200).
pub fn open_stream(c: &Cluster, body: &Value) -> http::EventStream {
    let s = http::post_stream(c.addr, "/v1/chat/completions", &body.to_string()).unwrap();
    assert_eq!(s.status, 200);
    s
}

/// Reads `n` chunk events, which must arrive before the stream ends.
pub fn read_events(s: &mut http::EventStream, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| match s.next_event().unwrap() {
            Event::Data(d) => d,
            e => panic!("the stream ended early: {e:?}"),
        })
        .collect()
}

/// Full 16-token blocks of a prompt.
pub fn blocks(prompt_tokens: u32) -> u64 {
    u64::from(prompt_tokens / 16)
}
