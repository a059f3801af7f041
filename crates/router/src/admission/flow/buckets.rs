//! [`TokenBucket`]: a rate limit refilled continuously, in integer micro-units so that it is
//! exact and platform-independent.

/// Micro-units per unit: a bucket of `n` per minute refills `n` units in 60,000 ms, i.e.
/// `n * SCALE / 60_000` micro-units per millisecond, kept exact by refilling in whole ms.
const SCALE: u128 = 1_000_000;

/// A bucket of `capacity` units refilled at `capacity` per minute; starts full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    capacity: u64,
    /// Micro-units in the bucket at `at_ms`.
    level: u128,
    at_ms: u64,
}

impl TokenBucket {
    /// A full bucket of `per_minute` (at least 1) units.
    pub fn per_minute(per_minute: u64, now_ms: u64) -> Self {
        let capacity = per_minute.max(1);
        TokenBucket {
            capacity,
            level: u128::from(capacity) * SCALE,
            at_ms: now_ms,
        }
    }

    fn full(&self) -> u128 {
        u128::from(self.capacity) * SCALE
    }

    fn refill(&mut self, now_ms: u64) {
        if now_ms > self.at_ms {
            let added =
                u128::from(now_ms - self.at_ms) * u128::from(self.capacity) * SCALE / 60_000;
            self.level = (self.level + added).min(self.full());
            self.at_ms = now_ms;
        }
    }

    /// Milliseconds until `units` (capped at the capacity) are in the bucket; 0 when they are.
    pub fn wait_ms(&mut self, units: u64, now_ms: u64) -> u64 {
        self.refill(now_ms);
        let want = u128::from(units.min(self.capacity)) * SCALE;
        if self.level >= want {
            return 0;
        }
        let missing = want - self.level;
        let per_ms = u128::from(self.capacity) * SCALE;
        // ceil(missing * 60_000 / per_ms)
        let ms = (missing * 60_000).div_ceil(per_ms);
        u64::try_from(ms).unwrap_or(u64::MAX).max(1)
    }

    /// Takes `units` (capped at the capacity); the level may not go below zero.
    pub fn take(&mut self, units: u64, now_ms: u64) {
        self.refill(now_ms);
        let want = u128::from(units.min(self.capacity)) * SCALE;
        self.level = self.level.saturating_sub(want);
    }

    /// Gives `units` back (up to the capacity).
    pub fn give_back(&mut self, units: u64, now_ms: u64) {
        self.refill(now_ms);
        self.level = (self.level + u128::from(units) * SCALE).min(self.full());
    }

    pub fn is_full(&self, now_ms: u64) -> bool {
        let mut b = *self;
        b.refill(now_ms);
        b.level >= b.full()
    }

    /// Units in the bucket now (rounded down).
    pub fn available(&self, now_ms: u64) -> u64 {
        let mut b = *self;
        b.refill(now_ms);
        u64::try_from(b.level / SCALE).unwrap_or(u64::MAX)
    }
}
