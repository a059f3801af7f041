//! One streamed request to an OpenAI-compatible endpoint, timed: when each chunk with text
//! arrives, and the usage the endpoint reports at the end.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};

/// Which OpenAI API the prompts go to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions` with the prompt as text: exact prefixes.
    #[default]
    Completions,
    /// `/v1/chat/completions` with the prompt as one user message (the endpoint's chat
    /// template goes around it).
    Chat,
}

/// What one request is.
#[derive(Clone, Debug)]
pub(crate) struct Call {
    pub api: Api,
    pub model: String,
    pub prompt: String,
    pub max_tokens: u32,
    pub ignore_eos: bool,
    /// The conversation it belongs to (multi-turn workloads), sent as `x-session-id`: what a
    /// chat client sends, and what session affinity and an experiment's split go by.
    pub session: Option<String>,
}

impl Call {
    pub(crate) fn path(&self) -> &'static str {
        match self.api {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }

    pub(crate) fn body(&self) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        match self.api {
            Api::Completions => body["prompt"] = json!(self.prompt),
            Api::Chat => body["messages"] = json!([{"role": "user", "content": self.prompt}]),
        }
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        body
    }
}

/// How one request went. Times in ms from sending it. Its inter-token gaps are not kept
/// here: they go into the report's ITL histogram when the request ends.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Record {
    /// When it was sent, ms after the run started.
    pub sent_ms: f64,
    pub ok: bool,
    /// Why it failed (HTTP status and the endpoint's message, or the transport error).
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    /// The experiment arm tandem placed it in (`x-tandem-experiment: NAME/ARM`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arm: Option<String>,
}

impl Record {
    /// Mean time per output token after the first; None with fewer than two tokens.
    pub fn tpot_ms(&self) -> Option<f64> {
        let (ttft, e2e) = (self.ttft_ms?, self.e2e_ms?);
        (self.completion_tokens > 1).then(|| (e2e - ttft) / (self.completion_tokens - 1) as f64)
    }

    pub(crate) fn failed(sent_ms: f64, error: String) -> Record {
        Record {
            sent_ms,
            error: Some(error),
            ..Record::default()
        }
    }
}

/// A finished request: its record, and the gaps between its chunks with text after the first
/// (ms), until the report has taken them.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Timed {
    pub record: Record,
    pub itl_ms: Vec<f64>,
}

impl From<Record> for Timed {
    fn from(record: Record) -> Self {
        Timed {
            record,
            itl_ms: Vec::new(),
        }
    }
}

/// Sends `call` to `base` (e.g. `http://127.0.0.1:8000`) and reads its stream to the end.
pub(crate) async fn send(
    http: &reqwest::Client,
    base: &str,
    api_key: Option<&str>,
    call: &Call,
    sent_ms: f64,
    timeout: Duration,
) -> Timed {
    let start = Instant::now();
    let mut req = http
        .post(format!("{base}{}", call.path()))
        .json(&call.body())
        .timeout(timeout);
    if let Some(key) = api_key {
        req = req.bearer_auth(key);
    }
    if let Some(session) = &call.session {
        req = req.header("x-session-id", session);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => return Record::failed(sent_ms, format!("request: {}", error_chain(&e))).into(),
    };
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| text.chars().take(200).collect());
        return Record::failed(sent_ms, format!("HTTP {}: {message}", status.as_u16())).into();
    }
    let mut stream = SseReader::default();
    let mut record = Record {
        sent_ms,
        arm: resp
            .headers()
            .get("x-tandem-experiment")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        ..Record::default()
    };
    let mut itl_ms = Vec::new();
    let mut last_chunk: Option<Instant> = None;
    let mut body = resp.bytes_stream();
    let mut done = false;
    while !done {
        let bytes = match body.next().await {
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                return Record::failed(sent_ms, format!("stream: {}", error_chain(&e))).into();
            }
            None => break,
        };
        let now = Instant::now();
        for event in stream.push(&bytes) {
            match event {
                SseEvent::Done => done = true,
                SseEvent::Data(v) => {
                    if let Some(msg) = v["error"]["message"].as_str() {
                        return Record::failed(sent_ms, format!("stream error: {msg}")).into();
                    }
                    if chunk_has_text(&v) {
                        match last_chunk {
                            None => record.ttft_ms = Some(ms(now - start)),
                            Some(prev) => itl_ms.push(ms(now - prev)),
                        }
                        last_chunk = Some(now);
                    }
                    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                        record.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                        record.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                        record.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                            .as_u64()
                            .unwrap_or(0);
                    }
                }
            }
        }
    }
    record.e2e_ms = Some(ms(start.elapsed()));
    if record.ttft_ms.is_none() {
        return Record::failed(sent_ms, "the stream ended without any text".into()).into();
    }
    if record.completion_tokens == 0 {
        // No usage reported: count chunks with text.
        record.completion_tokens = itl_ms.len() as u64 + 1;
    }
    record.ok = true;
    Timed { record, itl_ms }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The error and its causes on one line (reqwest's top level says little: "error sending
/// request").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// A completions or chat chunk that carries generated text.
fn chunk_has_text(v: &Value) -> bool {
    v["choices"].as_array().is_some_and(|choices| {
        choices.iter().any(|c| {
            c["text"].as_str().is_some_and(|t| !t.is_empty())
                || c["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
        })
    })
}

#[derive(Debug, PartialEq)]
enum SseEvent {
    Data(Value),
    Done,
}

/// Server-sent events from arbitrary byte chunks: `data:` lines, one JSON value each, or
/// `[DONE]`; other fields and comments are skipped, as are data lines that are not JSON.
#[derive(Debug, Default)]
struct SseReader {
    pending: Vec<u8>,
}

impl SseReader {
    fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.pending.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(nl) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            let data = data.trim_start();
            if data == "[DONE]" {
                events.push(SseEvent::Done);
            } else if let Ok(v) = serde_json::from_str(data) {
                events.push(SseEvent::Data(v));
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_survive_any_chunking() {
        let text = "data: {\"choices\":[{\"text\":\"a\"}]}\r\n\r\n: keep-alive\n\n\
                    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n";
        for split in 1..text.len() {
            let mut r = SseReader::default();
            let mut events = r.push(&text.as_bytes()[..split]);
            events.extend(r.push(&text.as_bytes()[split..]));
            assert_eq!(events.len(), 3, "split at {split}");
            assert!(chunk_has_text(match &events[0] {
                SseEvent::Data(v) => v,
                SseEvent::Done => panic!("data first"),
            }));
            assert_eq!(events[2], SseEvent::Done);
        }
    }

    #[test]
    fn text_chunks_of_both_apis() {
        assert!(chunk_has_text(
            &json!({"choices":[{"delta":{"content":"x"}}]})
        ));
        assert!(!chunk_has_text(
            &json!({"choices":[{"delta":{"role":"assistant"}}]})
        ));
        assert!(!chunk_has_text(&json!({"choices":[{"text":""}]})));
        assert!(!chunk_has_text(&json!({"choices":[]})));
    }

    #[test]
    fn tpot_needs_two_tokens() {
        let mut r = Record {
            ttft_ms: Some(100.0),
            e2e_ms: Some(190.0),
            completion_tokens: 10,
            ..Record::default()
        };
        assert_eq!(r.tpot_ms(), Some(10.0));
        r.completion_tokens = 1;
        assert_eq!(r.tpot_ms(), None);
    }
}
