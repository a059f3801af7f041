//! The checksum a prefill worker sends with a transfer's completion and the decode worker
//! checks before using the blocks: xxh3-64 over the transferred blocks' bytes, in order.

use xxhash_rust::xxh3::Xxh3;

/// Running digest over transferred KV blocks.
#[derive(Clone)]
pub struct KvDigest {
    hasher: Xxh3,
    blocks: u32,
}

impl std::fmt::Debug for KvDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvDigest")
            .field("blocks", &self.blocks)
            .finish_non_exhaustive()
    }
}

impl Default for KvDigest {
    fn default() -> Self {
        KvDigest {
            hasher: Xxh3::new(),
            blocks: 0,
        }
    }
}

impl KvDigest {
    /// Counts a block without hashing it (a transfer whose receiver checks no digest).
    pub fn count(&mut self) {
        self.blocks += 1;
    }

    pub fn update(&mut self, block: &[u8]) {
        self.hasher.update(block);
        self.blocks += 1;
    }

    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    pub fn value(&self) -> u64 {
        self.hasher.digest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_content_matter() {
        let (mut a, mut b, mut c) = (
            KvDigest::default(),
            KvDigest::default(),
            KvDigest::default(),
        );
        a.update(b"one");
        a.update(b"two");
        b.update(b"two");
        b.update(b"one");
        c.update(b"one");
        c.update(b"twp");
        assert_ne!(a.value(), b.value());
        assert_ne!(a.value(), c.value());
        assert_eq!(a.blocks(), 2);
    }
}
