//! What every API's response format shares: the [`Format`] a generation is presented
//! through (chat completions, completions, Responses, Messages), the [`End`] it is given,
//! and the JSON and SSE helpers. The formats and the request path (`generate.rs`) both
//! depend on this module; it depends on neither.

use crate::http::backend::FinishReason;
use crate::http::error::ServeError;
use crate::http::logprobs::Rendered;
use crate::http::openai::Usage;
use crate::http::tool_calls::Piece;

/// The end of a generation, as the formats need it.
#[derive(Clone, Debug)]
pub(crate) struct End {
    pub finish: FinishReason,
    /// The stop string that ended the output, if one did.
    pub stop_sequence: Option<String>,
    pub usage: Usage,
    /// At least one tool call was parsed out of the output.
    pub tool_calls: bool,
}

/// How one API presents a generation.
pub(crate) trait Format: Send + 'static {
    /// Streaming: the events that open the stream (may be empty).
    fn open(&mut self) -> String;
    /// Streaming: the events for what one backend chunk released, and the logprobs of its
    /// tokens (empty unless asked for; a format without logprobs ignores them); `end` is set
    /// on the last call, whose events end the stream.
    fn step(&mut self, pieces: Vec<Piece>, logprobs: &[Rendered], end: Option<&End>) -> String;
    /// Streaming: the events for a backend error after the head; they end the stream.
    fn stream_error(&mut self, e: &ServeError) -> String;
    /// The whole (non-streaming) response body.
    fn whole(&mut self, pieces: Vec<Piece>, logprobs: &[Rendered], end: &End) -> String;
}

pub(crate) fn to_json<T: serde::Serialize>(value: &T) -> String {
    // Room for a whole short answer, so that its buffer is not grown (and copied) twice on
    // the way, as from serde_json's own 128 bytes.
    let mut out = Vec::with_capacity(512);
    match serde_json::to_writer(&mut out, value) {
        // serde_json writes UTF-8 only.
        Ok(()) => String::from_utf8(out).unwrap_or_else(|e| {
            ServeError::internal(format!("a response serialized to bad UTF-8: {e}")).to_json()
        }),
        // Our response types hold only strings, numbers and options: this does not happen.
        Err(e) => ServeError::internal(format!("failed to serialize a response: {e}")).to_json(),
    }
}

/// An SSE event with data only: `data: {json}`.
pub(crate) fn sse_data(json: &str) -> String {
    format!("data: {json}\n\n")
}

/// A named SSE event: `event: {name}` and `data: {json}` (Responses, Anthropic).
pub(crate) fn sse_event(name: &str, json: &str) -> String {
    format!("event: {name}\ndata: {json}\n\n")
}
