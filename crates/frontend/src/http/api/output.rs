//! [`Output`]: backend chunks → the text a client sees, with `max_tokens` enforced, stop
//! strings applied and UTF-8 kept whole.

use std::sync::Arc;

use crate::http::backend::{FinishReason, TokenChunk};
use crate::http::logprobs::Rendered;
use crate::http::stop::StopMatcher;
use crate::http::tokenizer::{Detokenizer, Tokenizer};

/// What one chunk turned into.
#[derive(Debug, PartialEq)]
pub(crate) struct Step {
    /// Text to send now (maybe empty).
    pub text: String,
    /// The logprobs of the chunk's tokens that count (those within `max_tokens`), when the
    /// request asked for them; they may run ahead of `text` (a character split over tokens,
    /// a possible stop string, waits).
    pub logprobs: Vec<Rendered>,
    /// Set when the output is over; feed nothing after it.
    pub finish: Option<FinishReason>,
    /// The stop string that ended the output, if one did.
    pub stop_sequence: Option<String>,
}

#[derive(Debug)]
pub(crate) struct Output {
    tokenizer: Arc<Tokenizer>,
    detok: Detokenizer,
    stop: StopMatcher,
    max_tokens: u32,
    completion_tokens: u32,
}

impl Output {
    pub(crate) fn new(tokenizer: Arc<Tokenizer>, stop: Vec<String>, max_tokens: u32) -> Self {
        Output {
            detok: Detokenizer::new(tokenizer.clone()),
            tokenizer,
            stop: StopMatcher::new(stop),
            max_tokens,
            completion_tokens: 0,
        }
    }

    /// Tokens accepted so far (up to and including the one that completed a stop string).
    pub(crate) fn completion_tokens(&self) -> u32 {
        self.completion_tokens
    }

    pub(crate) fn feed(&mut self, chunk: &TokenChunk) -> Step {
        if let Some(text) = &chunk.text {
            return self.feed_text(text, chunk);
        }
        let room = self.max_tokens.saturating_sub(self.completion_tokens) as usize;
        let take = chunk.tokens.len().min(room);
        // take <= room <= u32::MAX.
        self.completion_tokens += take as u32;
        let mut finish = chunk.finish;
        // The edge enforces max_tokens even if a backend sends more.
        if chunk.tokens.len() > room
            || (finish.is_none() && self.completion_tokens >= self.max_tokens)
        {
            finish = Some(FinishReason::Length);
        }
        let taken = &chunk.tokens[..take];
        let logprobs = taken
            .iter()
            .zip(&chunk.logprobs)
            .map(|(&t, l)| Rendered::of(&self.tokenizer, t, l))
            .collect();
        let mut text = self.detok.push(taken);
        if finish.is_some() {
            text.push_str(&self.detok.finish());
        }
        let released = self.stop.push(&text);
        if released.stopped {
            return Step {
                text: released.text,
                logprobs,
                finish: Some(FinishReason::Stop),
                stop_sequence: released.matched,
            };
        }
        let mut text = released.text;
        if finish.is_some() {
            text.push_str(&self.stop.flush());
        }
        Step {
            text,
            logprobs,
            finish,
            stop_sequence: None,
        }
    }

    /// An engine's own text: no detokenizing, the engine's token count, stop strings as
    /// for any text (the engine enforced `max_tokens` itself).
    fn feed_text(&mut self, text: &str, chunk: &TokenChunk) -> Step {
        self.completion_tokens = self.completion_tokens.saturating_add(chunk.text_tokens);
        let released = self.stop.push(text);
        if released.stopped {
            return Step {
                text: released.text,
                logprobs: Vec::new(),
                finish: Some(FinishReason::Stop),
                stop_sequence: released.matched,
            };
        }
        let mut text = released.text;
        if chunk.finish.is_some() {
            text.push_str(&self.stop.flush());
        }
        Step {
            text,
            logprobs: Vec::new(),
            finish: chunk.finish,
            stop_sequence: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tests::cl100k;

    fn chunk(tokens: Vec<u32>, finish: Option<FinishReason>) -> TokenChunk {
        TokenChunk {
            tokens,
            finish,
            cached_tokens: 0,
            text: None,
            text_tokens: 0,
            logprobs: Vec::new(),
            embedding: Vec::new(),
        }
    }

    #[test]
    fn max_tokens_is_enforced_on_an_overlong_backend() {
        let tok = cl100k();
        let ids = tok.encode("one two three four").unwrap();
        let mut out = Output::new(tok.clone(), vec![], 2);
        let step = out.feed(&chunk(ids.clone(), None));
        assert_eq!(step.finish, Some(FinishReason::Length));
        assert_eq!(step.text, tok.decode(&ids[..2]));
        assert_eq!(out.completion_tokens(), 2);
    }

    #[test]
    fn backend_finish_flushes_and_stop_wins() {
        let tok = cl100k();
        let mut out = Output::new(tok.clone(), vec!["three".into()], 100);
        let a = out.feed(&chunk(tok.encode("one two").unwrap(), None));
        let b = out.feed(&chunk(tok.encode(" three four").unwrap(), None));
        assert_eq!(format!("{}{}", a.text, b.text), "one two ");
        assert_eq!(b.finish, Some(FinishReason::Stop));

        let mut out = Output::new(tok.clone(), vec![], 100);
        let s = out.feed(&chunk(
            tok.encode("done").unwrap(),
            Some(FinishReason::Stop),
        ));
        assert_eq!(s.text, "done");
        assert_eq!(s.finish, Some(FinishReason::Stop));
    }

    #[test]
    fn logprobs_come_for_the_tokens_that_count() {
        let tok = cl100k();
        let ids = tok.encode("one two three").unwrap();
        let mut c = chunk(ids.clone(), None);
        c.logprobs = (0..ids.len())
            .map(|i| crate::http::TokenLogprob {
                logprob: -(i as f32),
                top: vec![],
            })
            .collect();
        let mut out = Output::new(tok.clone(), vec![], 2);
        let step = out.feed(&c);
        let shown: Vec<(&str, f32)> = step
            .logprobs
            .iter()
            .map(|r| (r.chosen.token.as_str(), r.chosen.logprob))
            .collect();
        assert_eq!(shown, [("one", 0.0), (" two", -1.0)], "cut at max_tokens");
        let plain = Output::new(tok.clone(), vec![], 9).feed(&chunk(ids, None));
        assert!(plain.logprobs.is_empty());
    }
}
