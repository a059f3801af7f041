//! Request ids: a per-process counter (the `u64` the backend sees) and, for clients, a string
//! with a random per-process prefix so ids from different frontend processes do not collide.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::http::backend::Endpoint;

#[derive(Debug)]
pub(crate) struct RequestIds {
    prefix: String,
    next: AtomicU64,
}

impl RequestIds {
    pub(crate) fn new() -> Self {
        // RandomState is seeded from the OS per process; mixing in the time keeps prefixes
        // apart even where that seed is weak.
        let mut h = RandomState::new().build_hasher();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        RequestIds {
            prefix: format!("{:08x}", h.finish() as u32),
            next: AtomicU64::new(1),
        }
    }

    /// The next id and its client-facing form, e.g. `(42, "chatcmpl-1f2e3d4c-42")`; the
    /// Responses and Messages APIs' ids are `resp_<prefix><id>` / `msg_<prefix><id>`, as
    /// theirs look (a prefix, an underscore, letters and digits).
    pub(crate) fn next(&self, endpoint: Endpoint) -> (u64, String) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let text = match endpoint {
            Endpoint::Chat | Endpoint::Completion | Endpoint::Embeddings => {
                // Pieces pushed into one sized string: `format!` costs a request more.
                let prefix = endpoint.id_prefix();
                let mut digits = itoa::Buffer::new();
                let digits = digits.format(id);
                let mut text =
                    String::with_capacity(prefix.len() + self.prefix.len() + digits.len() + 2);
                for piece in [prefix, "-", &self.prefix, "-", digits] {
                    text.push_str(piece);
                }
                text
            }
            Endpoint::Responses | Endpoint::Messages => {
                format!("{}_{}{id:08}", endpoint.id_prefix(), self.prefix)
            }
        };
        (id, text)
    }
}

/// Unix time in seconds.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_prefixed() {
        let ids = RequestIds::new();
        let (a, sa) = ids.next(Endpoint::Chat);
        let (b, sb) = ids.next(Endpoint::Completion);
        assert_ne!(a, b);
        assert!(sa.starts_with("chatcmpl-"), "{sa}");
        assert!(sb.starts_with("cmpl-"), "{sb}");
        assert!(sb.ends_with(&format!("-{b}")));
        let (_, r) = ids.next(Endpoint::Responses);
        assert!(
            r.starts_with("resp_") && r[5..].chars().all(|c| c.is_ascii_alphanumeric()),
            "{r}"
        );
        assert!(ids.next(Endpoint::Messages).1.starts_with("msg_"));
    }
}
