//! The APIs the edge serves and their formats: the handlers (`generate.rs`), OpenAI's chat
//! completions and completions (`openai.rs`, `format.rs`, `format_chat.rs`, `output.rs`,
//! `logprobs.rs`), the Responses API (`responses.rs`, `responses_store.rs`), Anthropic's
//! Messages (`messages.rs`), `/v1/embeddings` (`embeddings.rs`), `/v1/models` (`models.rs`), tool calls (`tool_calls.rs`), stop
//! strings (`stop.rs`), Python-compatible JSON (`pyjson.rs`), request bodies and their
//! validation (`body.rs`, `validate.rs`, `hints.rs`), response ids (`ids.rs`).

pub(crate) mod body;
pub(crate) mod embeddings;
pub(crate) mod format;
pub(crate) mod format_chat;
pub(crate) mod generate;
pub(crate) mod groups;
pub(crate) mod hints;
pub(crate) mod ids;
pub(crate) mod logprobs;
pub(crate) mod messages;
pub(crate) mod models;
pub(crate) mod openai;
pub(crate) mod output;
pub(crate) mod pyjson;
pub(crate) mod responses;
pub(crate) mod responses_store;
pub(crate) mod semantic_cache;
pub(crate) mod stop;
pub(crate) mod tool_calls;
pub(crate) mod validate;
