//! `POST /v1/embeddings`, OpenAI's Embeddings API (<https://platform.openai.com/docs/api-reference/embeddings>):
//! each input's embedding from the pool's model — the final hidden state of the input's last
//! token, normalized to length 1, the last-token pooling vLLM applies to decoder models —
//! computed by a one-token request per input through the same admission (API key, drain,
//! body limit, validation, tokenizer, tenant and cache salt), routing and flow control as
//! generation. An input whose prompt the workers hold already is mostly served from their
//! prefix cache: only its last token is computed again.
//!
//! `input` is a string, a list of strings, a list of token ids or a list of lists of them
//! (at most [`MAX_INPUTS`]); `encoding_format` `float` (the default) or `base64` (the
//! little-endian f32 bytes, what OpenAI's clients ask for by default); `dimensions` only as
//! the model's own size (no model here is trained to be shortened; vLLM refuses the same).

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tracing::Instrument as _;

use crate::http::backend::{Endpoint, ValidRequest};
use crate::http::body;
use crate::http::error::ServeError;
use crate::http::generate;
use crate::http::ids::unix_now;
use crate::http::metrics::RequestRecord;
use crate::http::models::resolve_model;
use crate::http::openai::Prompt;
use crate::http::state::HttpState;
use crate::http::trace;
use crate::http::validate::{self, Common, PromptInput};

/// Most inputs one request may carry (OpenAI's limit).
pub(crate) const MAX_INPUTS: usize = 2048;

/// Inputs of one request computed at once: the rest wait their turn, so that one large
/// request does not take the whole pool's queue.
const CONCURRENT_INPUTS: usize = 8;

/// The request body.
#[derive(Debug, Deserialize)]
pub(crate) struct EmbeddingsRequest {
    pub model: Option<String>,
    pub input: Option<Prompt>,
    pub encoding_format: Option<String>,
    pub dimensions: Option<i64>,
    // (`user`, the end user as OpenAI takes it, is accepted and not used: like any other
    // field this body does not name.)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Encoding {
    Float,
    Base64,
}

#[derive(Serialize)]
struct EmbeddingsResponse<'a> {
    object: &'static str,
    data: Vec<EmbeddingObject>,
    model: &'a str,
    usage: EmbeddingsUsage,
}

#[derive(Serialize)]
struct EmbeddingObject {
    object: &'static str,
    index: usize,
    embedding: Vector,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct EmbeddingsUsage {
    prompt_tokens: u64,
    total_tokens: u64,
}

/// One input's answer: its embedding and its prompt and cached tokens.
pub(crate) struct Embedded {
    pub(crate) vector: Vec<f32>,
    prompt_tokens: u32,
    cached_tokens: u32,
}

pub(crate) async fn embeddings(
    State(state): State<HttpState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let span = trace::request_span(Endpoint::Embeddings, &headers);
    let mut record =
        RequestRecord::start(state.metrics().clone(), Endpoint::Embeddings).traced(span.clone());
    let answered = serve(&state, &headers, body, &mut record)
        .instrument(span)
        .await;
    let response = match answered {
        Ok(response) => {
            record.completed();
            response
        }
        Err(e) => {
            tracing::debug!(error = %e, kind = ?e.kind(), "embeddings request failed");
            e.into_response()
        }
    };
    record.status(response.status().as_u16());
    response
}

async fn serve(
    state: &HttpState,
    headers: &HeaderMap,
    body: Body,
    record: &mut RequestRecord,
) -> Result<Response, ServeError> {
    let received = generate::receive(state, headers, body).await?;
    let req: EmbeddingsRequest = validate::parse_json(&received.bytes)?;
    let config = state.config();
    let model = resolve_model(req.model.as_deref(), config)?;
    let encoding = match req.encoding_format.as_deref() {
        None | Some("float") => Encoding::Float,
        Some("base64") => Encoding::Base64,
        Some(other) => {
            return Err(ServeError::invalid(format!(
                "encoding_format must be \"float\" or \"base64\", got {other:?}"
            ))
            .with_param("encoding_format"));
        }
    };
    let dimensions = match req.dimensions {
        None => None,
        Some(d) if d >= 1 => Some(usize::try_from(d).unwrap_or(usize::MAX)),
        Some(d) => {
            return Err(
                ServeError::invalid(format!("dimensions must be at least 1, got {d}"))
                    .with_param("dimensions"),
            );
        }
    };
    let inputs = inputs(req.input)?;
    // Each input admitted as a one-token request, before any is sent: a bad one refuses the
    // whole request at once.
    let mut requests = Vec::with_capacity(inputs.len());
    for prompt in inputs {
        let mut common = Common::new(None, Some((1, "max_tokens")));
        common.temperature = Some(0.0);
        let checked = validate::finish_common(
            common,
            model.clone(),
            Endpoint::Embeddings,
            prompt,
            "input",
            config,
        )?;
        let (checked, tokens) = generate::tokenize(state, checked).await?;
        let ids = state.ids().next(Endpoint::Embeddings);
        let mut valid = checked.into_valid(tokens, config, ids, (unix_now(), received.arrived))?;
        let tenant = received.tenant.clone();
        body::finish(&mut valid, headers, config, received.arrived, None, tenant)?;
        requests.push(valid);
    }
    let answers: Vec<Result<Embedded, ServeError>> = futures::stream::iter(requests)
        .map(|r| embed_one(state, r))
        .buffered(CONCURRENT_INPUTS)
        .collect()
        .await;
    let (mut prompt_tokens, mut cached_tokens) = (0u64, 0u64);
    let mut data = Vec::with_capacity(answers.len());
    for (index, answer) in answers.into_iter().enumerate() {
        let e = answer?;
        if let Some(d) = dimensions.filter(|&d| d != e.vector.len()) {
            return Err(ServeError::invalid(format!(
                "dimensions: this model's embeddings have {} dimensions and cannot be \
                 shortened to {d}",
                e.vector.len()
            ))
            .with_param("dimensions"));
        }
        prompt_tokens += u64::from(e.prompt_tokens);
        cached_tokens += u64::from(e.cached_tokens);
        let embedding = match encoding {
            Encoding::Float => Vector::Float(e.vector),
            Encoding::Base64 => Vector::Base64(base64_of(&e.vector)),
        };
        data.push(EmbeddingObject {
            object: "embedding",
            index,
            embedding,
        });
    }
    record.counted(prompt_tokens, cached_tokens);
    let response = EmbeddingsResponse {
        object: "list",
        data,
        model: &model.model,
        usage: EmbeddingsUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
    };
    let body = serde_json::to_vec(&response)
        .map_err(|e| ServeError::internal(format!("failed to write the response: {e}")))?;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok((headers, body).into_response())
}

/// The request's inputs, each a prompt; none may be empty.
fn inputs(input: Option<Prompt>) -> Result<Vec<PromptInput>, ServeError> {
    let invalid = |m: String| ServeError::invalid(m).with_param("input");
    let inputs: Vec<PromptInput> = match input {
        None => return Err(invalid("input is required".into())),
        // (`[]` reads as an empty list of token ids.)
        Some(Prompt::Tokens(t)) if t.is_empty() => {
            return Err(invalid("input must not be empty".into()));
        }
        Some(Prompt::Text(t)) => vec![PromptInput::Text(t)],
        Some(Prompt::Tokens(t)) => vec![PromptInput::Tokens(t)],
        Some(Prompt::Texts(v)) => v.into_iter().map(PromptInput::Text).collect(),
        Some(Prompt::TokenLists(v)) => v.into_iter().map(PromptInput::Tokens).collect(),
    };
    if inputs.is_empty() {
        return Err(invalid("input must not be an empty list".into()));
    }
    if inputs.len() > MAX_INPUTS {
        return Err(invalid(format!(
            "at most {MAX_INPUTS} inputs per request, got {}",
            inputs.len()
        )));
    }
    for (i, p) in inputs.iter().enumerate() {
        let empty = match p {
            PromptInput::Text(t) => t.is_empty(),
            PromptInput::Tokens(t) => t.is_empty(),
            PromptInput::Chat(_) => false,
        };
        if empty {
            return Err(invalid(format!("input {i} is empty")));
        }
    }
    Ok(inputs)
}

/// One input through the backend: its first (and only) chunk carries the embedding.
pub(crate) async fn embed_one(
    state: &HttpState,
    req: ValidRequest,
) -> Result<Embedded, ServeError> {
    let sent = u32::try_from(req.prompt_tokens.len()).unwrap_or(u32::MAX);
    let engine = req.engine.clone();
    let generation = state.backend().generate(req).await?;
    let mut chunks = generation.chunks;
    let first = match chunks.next().await {
        Some(Ok(chunk)) => chunk,
        Some(Err(e)) => return Err(e),
        None => {
            return Err(ServeError::internal(
                "the backend ended the request before any output",
            ));
        }
    };
    // (One token was asked for: dropping the stream ends whatever is left of it.)
    drop(chunks);
    if first.embedding.is_empty() {
        return Err(ServeError::invalid(
            "this model's engine returns no embeddings (a sidecar's engine serves its own \
             /v1/embeddings; the native engine on a GPU has none yet)",
        )
        .with_code("embeddings_unsupported"));
    }
    Ok(Embedded {
        vector: first.embedding,
        prompt_tokens: engine.prompt_tokens().unwrap_or(sent),
        cached_tokens: first.cached_tokens,
    })
}

/// An embedding as OpenAI's `base64` encoding has it: its f32 values' little-endian bytes.
fn base64_of(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_little_endian_f32_bytes() {
        let s = base64_of(&[1.0, -0.5]);
        let bytes = base64::engine::general_purpose::STANDARD.decode(s).unwrap();
        assert_eq!(bytes, [0, 0, 128, 63, 0, 0, 0, 191]);
    }

    #[test]
    fn inputs_are_checked_before_anything_is_sent() {
        let text = |s: &str| Some(Prompt::Text(s.into()));
        assert_eq!(inputs(text("hi")).unwrap().len(), 1);
        assert!(inputs(None).is_err());
        assert!(inputs(text("")).is_err());
        assert!(inputs(Some(Prompt::Texts(vec![]))).is_err());
        assert!(inputs(Some(Prompt::Tokens(vec![]))).is_err());
        assert!(inputs(Some(Prompt::TokenLists(vec![vec![1], vec![]]))).is_err());
        let many = Prompt::Texts(vec!["a".into(); MAX_INPUTS + 1]);
        let e = inputs(Some(many)).unwrap_err();
        assert!(e.to_string().contains("at most 2048"), "{e}");
    }
}
