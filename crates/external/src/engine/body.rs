//! The body of a generation call to a vLLM or OpenAI-style engine, written straight from the
//! request: a `serde_json::Value` built first cost a node per prompt token and a sorted map
//! per call, about 3 % of `tandem frontend --backend-url`'s CPU per request.
//!
//! Fields as vLLM's `CompletionRequest` names them (`vllm/entrypoints/openai/protocol.py`);
//! an unset option is left out, so that the engine applies its own default.

use serde::Serialize;
use serde_json::Value;

use super::EngineGenerate;

#[derive(Serialize)]
pub(super) struct CompletionBody<'a> {
    /// Written by [`CompletionBody::to_vec`], ahead of the fields serde writes.
    #[serde(skip)]
    prompt: &'a [u32],
    model: &'a str,
    max_tokens: u32,
    temperature: f32,
    ignore_eos: bool,
    return_token_ids: bool,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_token_ids: Option<[u32; 1]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_transfer_params: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<u32>,
    /// With logprobs: each token named by its id (`token_id:123`), not its text.
    #[serde(skip_serializing_if = "Option::is_none")]
    return_tokens_as_token_ids: Option<bool>,
}

/// Asks a streamed answer to end with its usage (OpenAI's `stream_options`).
#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

impl<'a> CompletionBody<'a> {
    /// `req`'s body for `model` (the adapter's name on a LoRA request).
    pub(super) fn new(model: &'a str, req: &'a EngineGenerate, stream: bool) -> Self {
        CompletionBody {
            prompt: &req.prompt,
            model: req.lora_adapter.as_deref().unwrap_or(model),
            max_tokens: req.max_tokens,
            temperature: req.temperature,
            ignore_eos: req.ignore_eos,
            return_token_ids: true,
            stream,
            stream_options: stream.then_some(StreamOptions {
                include_usage: true,
            }),
            top_p: req.top_p,
            top_k: req.top_k,
            min_p: req.min_p,
            seed: req.seed,
            stop_token_ids: req.stop_token.map(|t| [t]),
            cache_salt: req.cache_salt.as_deref(),
            kv_transfer_params: req.kv_transfer_params.as_ref(),
            logprobs: req.logprobs,
            return_tokens_as_token_ids: req.logprobs.map(|_| true),
        }
    }

    /// The body as JSON: `{"prompt":[ids],` written by a loop of its own, then the other
    /// fields as serde writes them, their object's `{` dropped. Through serde each id cost a
    /// sequence element's calls: with a prompt of a few hundred tokens, the prompt was most
    /// of the body's cost (about 5 % of `tandem frontend --backend-url`'s instructions a
    /// request).
    pub(super) fn to_vec(&self) -> serde_json::Result<Vec<u8>> {
        // Ten digits at most and a comma each. Each id is made in a scratch buffer, its
        // digits ending at a fixed place, and the 11 bytes ending there are copied whole:
        // a copy of fixed length (two moves, no copy call) whose excess the next id, or the
        // truncation, overwrites. The buffer has 11 bytes of room past the last id for it.
        let mut out = vec![0; 11 + self.prompt.len() * 11 + 11];
        out[..11].copy_from_slice(b"{\"prompt\":[");
        let mut at = 11;
        let mut scratch = [0; 22];
        for (i, &t) in self.prompt.iter().enumerate() {
            // The first id has no comma before it.
            let from = comma_and_digits(&mut scratch, t) + usize::from(i == 0);
            out[at..at + 11].copy_from_slice(&scratch[from..from + 11]);
            at += 11 - from;
        }
        out.truncate(at);
        out.reserve(320);
        out.extend_from_slice(b"],");
        let rest = out.len();
        // The other fields: `model` always among them, so never an empty object.
        serde_json::to_writer(&mut out, self)?;
        out.remove(rest);
        Ok(out)
    }
}

/// "00", "01", … "99": two digits a step.
const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
    2021222324252627282930313233343536373839\
    4041424344454647484950515253545556575859\
    6061626364656667686970717273747576777879\
    8081828384858687888990919293949596979899";

/// Writes `,` and `v` in decimal into `scratch`, ending before index 11; returns where the
/// comma is.
fn comma_and_digits(scratch: &mut [u8; 22], mut v: u32) -> usize {
    let mut start = 11;
    while v >= 100 {
        let pair = 2 * (v % 100) as usize;
        v /= 100;
        start -= 2;
        scratch[start..start + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if v >= 10 {
        let pair = 2 * v as usize;
        start -= 2;
        scratch[start..start + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        start -= 1;
        scratch[start] = b'0' + v as u8;
    }
    start -= 1;
    scratch[start] = b',';
    start
}
