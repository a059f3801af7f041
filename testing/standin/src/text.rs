//! The stand-in's text: it has no tokenizer, so token `t` reads ` t<t>` (a plain server's
//! text, for clients that take text only; logprobs' text offsets count it too).

/// The text of `tokens`.
pub(crate) fn token_text(tokens: &[u32]) -> String {
    tokens.iter().map(|t| format!(" t{t}")).collect()
}
