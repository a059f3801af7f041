//! The `Generate` stream of a request taken whole (`GenerateRequest.whole`: the client does
//! not stream, and nothing needs the tokens as they come): the first chunk goes as it comes
//! (its first token ends the prefill, for the caller's time to first token and the router's
//! load), the rest are merged into one chunk sent at the finish. A non-streamed answer of N
//! tokens is then two messages instead of N, each of which cost a frame, a wake-up and a
//! step of the caller's pipeline (BENCHMARKS.md, 2026-12-07).
//!
//! Held tokens are sent before anything else the stream says — a drain's handover offer (the
//! caller continues the request from the tokens it has), an error, the stream's end — so the
//! caller never loses a token it was owed.

use futures::{StreamExt, stream};
use tandem_protocol::grpc::{FinishReason, GenerateChunk};
use tandem_worker::ChunkStream;
use tonic::Status;

struct State {
    chunks: ChunkStream<GenerateChunk>,
    first: bool,
    held: Option<GenerateChunk>,
    /// What to send after the held chunk.
    after: Option<Result<GenerateChunk, Status>>,
}

type Step = (Result<GenerateChunk, Status>, Option<State>);

impl State {
    /// Sends what is held, then `next`; or `next` when nothing is held.
    fn release(mut self, next: Result<GenerateChunk, Status>) -> Step {
        match self.held.take() {
            Some(h) => {
                self.after = Some(next);
                (Ok(h), Some(self))
            }
            None => (next, Some(self)),
        }
    }
}

/// `chunks` as a whole request wants them (see the module doc).
pub(crate) fn coalesced(chunks: ChunkStream<GenerateChunk>) -> ChunkStream<GenerateChunk> {
    let state = State {
        chunks,
        first: true,
        held: None,
        after: None,
    };
    Box::pin(stream::unfold(Some(state), |state| async move {
        let mut s = state?;
        if let Some(next) = s.after.take() {
            return Some((next, Some(s)));
        }
        loop {
            let Some(next) = s.chunks.next().await else {
                // The end: what is held, then nothing.
                return s.held.take().map(|c| (Ok(c), None));
            };
            match next {
                Ok(c) if s.first => {
                    s.first = false;
                    return Some((Ok(c), Some(s)));
                }
                // A handover offer (or another chunk without output): after the tokens.
                Ok(c) if c.tokens.is_empty() && c.text.is_none() => return Some(s.release(Ok(c))),
                Ok(c) => {
                    let done = c.finish != FinishReason::Unspecified as i32;
                    match &mut s.held {
                        Some(h) => merge(h, c),
                        None => s.held = Some(c),
                    }
                    if done {
                        let c = s.held.take();
                        return c.map(|c| (Ok(c), Some(s)));
                    }
                }
                Err(e) => return Some(s.release(Err(e))),
            }
        }
    }))
}

/// Appends `c`'s output to `into`; the counts (the same on every chunk) and the finish are
/// `c`'s.
fn merge(into: &mut GenerateChunk, c: GenerateChunk) {
    into.tokens.extend(c.tokens);
    into.logprobs.extend(c.logprobs);
    if let Some(t) = c.text {
        into.text.get_or_insert_with(String::new).push_str(&t);
    }
    into.completion_tokens += c.completion_tokens;
    into.cached_tokens = c.cached_tokens;
    into.prompt_tokens = c.prompt_tokens;
    into.finish = c.finish;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(t: u32, finish: FinishReason) -> Result<GenerateChunk, Status> {
        Ok(GenerateChunk {
            tokens: vec![t],
            cached_tokens: 16,
            prompt_tokens: 40,
            finish: finish as i32,
            logprobs: vec![Default::default()],
            ..Default::default()
        })
    }

    async fn run(items: Vec<Result<GenerateChunk, Status>>) -> Vec<Result<GenerateChunk, Status>> {
        coalesced(Box::pin(stream::iter(items))).collect().await
    }

    fn tokens(out: &[Result<GenerateChunk, Status>]) -> Vec<Result<Vec<u32>, String>> {
        out.iter()
            .map(|r| match r {
                Ok(c) if c.handover => Err("handover".into()),
                Ok(c) => Ok(c.tokens.clone()),
                Err(e) => Err(e.message().to_string()),
            })
            .collect()
    }

    #[tokio::test]
    async fn the_first_token_goes_alone_and_the_rest_in_one_chunk_at_the_finish() {
        use FinishReason::{Length, Unspecified};
        let out = run((1..=5)
            .map(|t| token(t, if t == 5 { Length } else { Unspecified }))
            .collect())
        .await;
        assert_eq!(tokens(&out), [Ok(vec![1]), Ok(vec![2, 3, 4, 5])]);
        let last = out[1].as_ref().unwrap();
        assert_eq!(last.finish, Length as i32);
        assert_eq!(last.logprobs.len(), 4, "one logprob entry per token");
        assert_eq!((last.cached_tokens, last.prompt_tokens), (16, 40));
        // One token: one chunk.
        assert_eq!(tokens(&run(vec![token(9, Length)]).await), [Ok(vec![9])]);
    }

    /// Held tokens go before a handover offer, an error or the stream's end.
    #[tokio::test]
    async fn held_tokens_go_before_anything_else() {
        use FinishReason::{Stop, Unspecified};
        let handover = Ok(GenerateChunk {
            handover: true,
            ..Default::default()
        });
        let out = run(vec![
            token(1, Unspecified),
            token(2, Unspecified),
            token(3, Unspecified),
            handover,
            token(4, Unspecified),
            token(5, Stop),
        ])
        .await;
        assert_eq!(
            tokens(&out),
            [
                Ok(vec![1]),
                Ok(vec![2, 3]),
                Err("handover".into()),
                Ok(vec![4, 5])
            ]
        );
        let out = run(vec![
            token(1, Unspecified),
            token(2, Unspecified),
            Err(Status::unavailable("gone")),
        ])
        .await;
        assert_eq!(tokens(&out), [Ok(vec![1]), Ok(vec![2]), Err("gone".into())]);
        let out = run(vec![
            token(1, Unspecified),
            token(2, Unspecified),
            token(3, Unspecified),
        ])
        .await;
        assert_eq!(tokens(&out), [Ok(vec![1]), Ok(vec![2, 3])]);
    }
}
