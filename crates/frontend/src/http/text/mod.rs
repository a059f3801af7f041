//! Text to tokens: chat templates with Hugging Face's semantics (`chat_template.rs`,
//! `strftime.rs`), the conversation every chat API becomes (`conversation.rs`), prompts
//! (`prompt.rs`, tokenized in remembered pieces: `pieces.rs`) and the tokenizers
//! (`tokenizer.rs`).

pub(crate) mod chat_template;
pub(crate) mod conversation;
pub(crate) mod pieces;
pub(crate) mod prompt;
pub(crate) mod strftime;
pub mod tokenizer;
