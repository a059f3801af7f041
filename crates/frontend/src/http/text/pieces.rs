//! Tokenizing a rendered prompt in pieces, each remembered: a conversation's next turn, or
//! another request on the same system prompt, tokenizes only the text it has not seen.
//!
//! A prompt is cut only where tokenizing the two sides apart gives exactly the tokens of the
//! whole ([`Cuts`]), so the ids are those of one call on the whole text. Each piece's ids are
//! kept in a [`PieceCache`] by the piece's text. Cuts are found from the start of the text
//! (each piece at least [`MIN_PIECE`] bytes), so a prompt that extends an earlier one cuts
//! its shared part the same way and finds every piece of it.

use std::sync::Arc;

// foldhash, randomly seeded: a piece is hundreds of bytes, and SipHash spent about a fifth
// of a cached prompt's tokenizing instructions hashing them (BENCHMARKS.md).
use hashbrown::HashMap;

use parking_lot::Mutex;

/// Pieces are at least this long (but for the last): fewer, larger cache entries.
pub(crate) const MIN_PIECE: usize = 256;

/// Where a rendered prompt may be cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cuts {
    /// Never: the tokenizer's pieces are not known to be independent.
    None,
    /// After a newline, before a character that is neither whitespace nor `/` (tiktoken's
    /// `cl100k_base` and `o200k_base`). Their pre-tokenizer regex splits the text into
    /// pieces that BPE merges within, and no piece runs past such a spot: `\s*[\r\n]+`
    /// takes a whitespace run that ends in newlines whole, whatever follows, and the only
    /// pieces that hold a newline after other characters end with `[\r\n]*` (`o200k`:
    /// `[\r\n/]*`). A special-token string holds no newline, so the cut never splits one.
    AfterNewline,
    /// Before a special token the template wrote (a Hugging Face tokenizer whose special
    /// tokens strip no whitespace, match in any word and are not normalized): the library
    /// splits its input at added tokens first and tokenizes what lies between them apart.
    BeforeSpecial,
}

impl Cuts {
    /// Byte offsets where `text` is cut: at least [`MIN_PIECE`] apart, each where
    /// `is_special_at` (for [`Cuts::BeforeSpecial`]) or the newline rule allows.
    pub(crate) fn offsets(self, text: &str, is_special_at: impl Fn(&str) -> bool) -> Vec<usize> {
        let mut cuts = Vec::new();
        if self == Cuts::None || text.len() < 2 * MIN_PIECE {
            return cuts;
        }
        let bytes = text.as_bytes();
        let mut at = MIN_PIECE;
        while at < text.len() {
            let ok = match self {
                Cuts::AfterNewline => {
                    // The first spot at or past `at` that follows a newline (a character
                    // boundary, '\n' being ASCII), found by memchr rather than byte by byte.
                    let Some(newline) = memchr::memchr(b'\n', &bytes[at - 1..]) else {
                        break;
                    };
                    at += newline;
                    at < text.len()
                        && !matches!(bytes[at], b'/' | b' ' | b'\t' | b'\n' | b'\r')
                        && !text[at..].starts_with(char::is_whitespace)
                }
                Cuts::BeforeSpecial => text.is_char_boundary(at) && is_special_at(&text[at..]),
                Cuts::None => false,
            };
            if ok {
                cuts.push(at);
                at += MIN_PIECE;
            } else {
                at += 1;
            }
        }
        cuts
    }
}

/// Ids of pieces by their text, within a bound on memory: two generations, the older
/// dropped whole when the newer fills half the bound (an entry used from the older moves to
/// the newer).
#[derive(Debug)]
pub(crate) struct PieceCache {
    inner: Mutex<Generations>,
    budget: usize,
}

#[derive(Debug, Default)]
struct Generations {
    current: HashMap<Box<str>, Arc<[u32]>>,
    current_bytes: usize,
    previous: HashMap<Box<str>, Arc<[u32]>>,
    hits: u64,
    misses: u64,
}

/// What an entry costs: its text, its ids, and the map's own share.
fn cost(text: &str, ids: &[u32]) -> usize {
    text.len() + 4 * ids.len() + 64
}

impl PieceCache {
    /// A cache that holds at most about `budget` bytes.
    pub(crate) fn new(budget: usize) -> Self {
        PieceCache {
            inner: Mutex::new(Generations::default()),
            budget,
        }
    }

    pub(crate) fn get(&self, text: &str) -> Option<Arc<[u32]>> {
        let mut g = self.inner.lock();
        if let Some(ids) = g.current.get(text) {
            let ids = ids.clone();
            g.hits += 1;
            return Some(ids);
        }
        match g.previous.remove_entry(text) {
            Some((key, ids)) => {
                g.hits += 1;
                g.insert(key, ids.clone(), self.budget);
                Some(ids)
            }
            None => {
                g.misses += 1;
                None
            }
        }
    }

    pub(crate) fn insert(&self, text: &str, ids: Arc<[u32]>) {
        if cost(text, &ids) > self.budget / 2 {
            return;
        }
        self.inner.lock().insert(text.into(), ids, self.budget);
    }

    /// Pieces found and not found so far.
    pub(crate) fn counts(&self) -> (u64, u64) {
        let g = self.inner.lock();
        (g.hits, g.misses)
    }

    /// Bytes held, by [`cost`]'s count.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        let g = self.inner.lock();
        g.current_bytes + g.previous.iter().map(|(k, v)| cost(k, v)).sum::<usize>()
    }
}

impl Generations {
    fn insert(&mut self, text: Box<str>, ids: Arc<[u32]>, budget: usize) {
        let c = cost(&text, &ids);
        if self.current_bytes + c > budget / 2 {
            self.previous = std::mem::take(&mut self.current);
            self.current_bytes = 0;
        }
        let key_len = text.len();
        self.current_bytes += c;
        if let Some(old) = self.current.insert(text, ids) {
            self.current_bytes -= key_len + 4 * old.len() + 64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_are_min_piece_apart_after_newlines() {
        let line = format!("{}\n", "word ".repeat(20));
        let text = line.repeat(20);
        let cuts = Cuts::AfterNewline.offsets(&text, |_| false);
        assert!(!cuts.is_empty());
        let mut last = 0;
        for &c in &cuts {
            assert!(c - last >= MIN_PIECE);
            assert_eq!(text.as_bytes()[c - 1], b'\n');
            last = c;
        }
        assert!(Cuts::None.offsets(&text, |_| true).is_empty());
        // Whitespace or `/` after the newline: no cut there.
        let spaced = format!("{}\n  x", "a".repeat(600));
        assert!(Cuts::AfterNewline.offsets(&spaced, |_| false).is_empty());
        let slashed = format!("{}\n/x", "a".repeat(600));
        assert!(Cuts::AfterNewline.offsets(&slashed, |_| false).is_empty());
        let special = format!("{}<s>{}", "a".repeat(300), "b".repeat(300));
        assert_eq!(
            Cuts::BeforeSpecial.offsets(&special, |t| t.starts_with("<s>")),
            vec![300]
        );
    }

    #[test]
    fn the_cache_stays_within_its_budget_and_keeps_what_is_used() {
        let cache = PieceCache::new(10_000);
        let ids: Arc<[u32]> = Arc::from(vec![1u32; 10]);
        cache.insert("kept", ids.clone());
        for i in 0..1_000 {
            cache.insert(&format!("piece {i}"), ids.clone());
            assert!(cache.get("kept").is_some(), "used entries survive");
            assert!(cache.bytes() <= 10_000);
        }
        assert!(cache.get("piece 0").is_none(), "old entries go");
        let (hits, misses) = cache.counts();
        assert_eq!((hits, misses), (1_000, 1));
        // Too big for the cache: not kept.
        cache.insert(&"x".repeat(6_000), ids);
        assert!(cache.get(&"x".repeat(6_000)).is_none());
    }
}
