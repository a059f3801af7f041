//! Text-level stop strings: [`StopMatcher`] cuts the output before the first stop string,
//! holding back just enough text that a stop string split across tokens is still caught.

/// Finds stop strings in streamed text. Text is released as soon as it cannot be the start
/// of a stop string.
#[derive(Debug)]
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    /// Text seen but not released: the longest tail that is a prefix of some stop string.
    held: String,
}

/// What one push released.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Released {
    pub text: String,
    /// A stop string matched; `text` ends just before it and nothing follows.
    pub stopped: bool,
    /// Which one (Anthropic's `stop_sequence` reports it).
    pub matched: Option<String>,
}

impl StopMatcher {
    /// `stops` must not contain empty strings (validation drops them).
    pub(crate) fn new(stops: Vec<String>) -> Self {
        debug_assert!(stops.iter().all(|s| !s.is_empty()));
        StopMatcher {
            stops,
            held: String::new(),
        }
    }

    /// Adds `text`; returns what can be shown now.
    pub(crate) fn push(&mut self, text: &str) -> Released {
        if self.stops.is_empty() {
            return Released {
                text: text.to_string(),
                stopped: false,
                matched: None,
            };
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first {
            let matched = Some(stop.clone());
            self.held.truncate(at);
            return Released {
                text: std::mem::take(&mut self.held),
                stopped: true,
                matched,
            };
        }
        let keep = self.partial_tail_len();
        let release_to = self.held.len() - keep;
        let rest = self.held.split_off(release_to);
        Released {
            text: std::mem::replace(&mut self.held, rest),
            stopped: false,
            matched: None,
        }
    }

    /// Releases the held-back text (the output ended without a match).
    pub(crate) fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest tail of `held` that is a proper prefix of a stop string.
    fn partial_tail_len(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let max_tail = longest.saturating_sub(1).min(self.held.len());
        (1..=max_tail)
            .rev()
            .filter(|&n| self.held.is_char_boundary(self.held.len() - n))
            .find(|&n| {
                let tail = &self.held[self.held.len() - n..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn cuts_before_stop_within_one_piece() {
        assert_eq!(run(&["END"], &["abcENDxyz"]), ("abc".into(), true));
    }

    #[test]
    fn catches_stop_split_across_pieces() {
        assert_eq!(run(&["END"], &["abcE", "N", "Dxyz"]), ("abc".into(), true));
    }

    #[test]
    fn releases_held_text_when_no_match() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        let r = m.push("abcEN");
        assert_eq!(r.text, "abc");
        let r = m.push("x");
        assert_eq!(r.text, "ENx");
        assert_eq!(m.flush(), "");
        assert_eq!(run(&["END"], &["abE"]), ("abE".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_safe() {
        assert_eq!(run(&["zz", "b"], &["aabzz"]), ("aa".into(), true));
        let mut m = StopMatcher::new(vec!["zz".into(), "b".into()]);
        assert_eq!(m.push("aabzz").matched.as_deref(), Some("b"));
        assert_eq!(
            run(&["世界"], &["你好", "世", "界!"]),
            ("你好".into(), true)
        );
        assert_eq!(run(&["é!"], &["ééé"]), ("ééé".into(), false));
    }
}
