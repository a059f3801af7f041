//! Test support (`#[cfg(test)]` here, the `test-support` feature for other test targets): a
//! [`Backend`] made of a closure, and the token chunks fake backends stream. Tests of the HTTP
//! edge differ in what they answer (a fixed text, a reply chosen from the prompt, a scripted
//! failure), not in how an answer becomes a [`Generation`]: that part lives here once.

use futures::StreamExt;

use crate::http::{
    Backend, FinishReason, Generation, RouteInfo, ServeError, TokenChunk, ValidRequest,
};

/// A stream's items, in order.
pub type Chunks = Vec<Result<TokenChunk, ServeError>>;

/// `tokens` in chunks of `per` tokens (at least 1), the last with `finish`; nothing cached.
pub fn token_chunks(tokens: &[u32], per: usize, finish: FinishReason) -> Chunks {
    let pieces: Vec<&[u32]> = tokens.chunks(per.max(1)).collect();
    let n = pieces.len();
    pieces
        .into_iter()
        .enumerate()
        .map(|(i, tokens)| {
            Ok(TokenChunk {
                tokens: tokens.to_vec(),
                finish: (i + 1 == n).then_some(finish),
                cached_tokens: 0,
                text: None,
                text_tokens: 0,
                logprobs: Vec::new(),
                embedding: Vec::new(),
            })
        })
        .collect()
}

/// The route a fake reports: decode worker 1, prefilled there.
pub const ROUTE: RouteInfo = RouteInfo {
    decode_worker: 1,
    prefill_worker: None,
};

/// A [`Backend`] whose answer to each request is `reply(&request)`: `Err` fails `generate`,
/// `Ok(chunks)` streams them and ends. Always ready.
pub struct FnBackend<F> {
    reply: F,
}

impl<F> FnBackend<F>
where
    F: Fn(&ValidRequest) -> Result<Chunks, ServeError> + Send + Sync + 'static,
{
    pub fn new(reply: F) -> Self {
        FnBackend { reply }
    }
}

impl<F> std::fmt::Debug for FnBackend<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnBackend").finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl<F> Backend for FnBackend<F>
where
    F: Fn(&ValidRequest) -> Result<Chunks, ServeError> + Send + Sync + 'static,
{
    async fn generate(&self, req: ValidRequest) -> Result<Generation, ServeError> {
        let chunks = (self.reply)(&req)?;
        Ok(Generation {
            route: ROUTE,
            chunks: futures::stream::iter(chunks).boxed(),
        })
    }

    fn ready(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_the_tokens_and_only_the_last_finishes() {
        let c = token_chunks(&[1, 2, 3, 4, 5], 2, FinishReason::Length);
        let c: Vec<TokenChunk> = c.into_iter().map(Result::unwrap).collect();
        let tokens: Vec<&[u32]> = c.iter().map(|c| c.tokens.as_slice()).collect();
        assert_eq!(tokens, [&[1, 2][..], &[3, 4], &[5]]);
        let finish: Vec<_> = c.iter().map(|c| c.finish).collect();
        assert_eq!(finish, [None, None, Some(FinishReason::Length)]);
        assert!(token_chunks(&[], 4, FinishReason::Stop).is_empty());
        assert_eq!(token_chunks(&[7, 8], 0, FinishReason::Stop).len(), 2);
    }
}
