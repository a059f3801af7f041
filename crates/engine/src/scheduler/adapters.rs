//! LoRA adapter slots: how many adapters a step may use, as vLLM's `max_loras`.
//!
//! vLLM's scheduler (`vllm/v1/core/sched/scheduler.py`) admits a waiting request on an
//! adapter only while the batch uses fewer than `max_loras` distinct adapters or already uses
//! that one; otherwise the request is skipped for the step and the scan goes on (it keeps its
//! place in the queue). Adapters stay loaded after their requests end and are evicted least
//! recently used when a new one needs the slot, so a worker that sees the same adapters again
//! does not reload them. Loading one costs the step that needs it time
//! ([`crate::mocker::MockerConfig::adapter_load_ms`]).

use std::sync::Arc;

/// The adapters one scheduler holds.
#[derive(Clone, Debug, Default)]
pub(super) struct AdapterSlots {
    /// Slots; 0: adapters are not limited (no load is ever modelled).
    max: usize,
    /// Loaded adapters with the step that last used them.
    loaded: Vec<(Arc<str>, u64)>,
    /// Loads since the scheduler started.
    pub(super) loads: u64,
}

/// What taking a slot did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Take {
    /// The adapter was loaded already (or adapters are not limited).
    Resident,
    /// It was loaded now (into a free slot, or in place of an idle one).
    Loaded,
    /// Every slot holds an adapter the running requests use: the request waits.
    NoSlot,
}

impl AdapterSlots {
    pub(super) fn new(max: usize) -> Self {
        AdapterSlots {
            max,
            ..AdapterSlots::default()
        }
    }

    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// Whether [`AdapterSlots::take`] would succeed now.
    pub(super) fn can_take(&self, name: &str, in_use: impl Fn(&str) -> bool) -> bool {
        self.max == 0
            || self.loaded.len() < self.max
            || self.loaded.iter().any(|(n, _)| &**n == name || !in_use(n))
    }

    /// Takes `name`'s slot for a request scheduled in `step`; `in_use` tells whether a
    /// running request uses an adapter (those are never evicted).
    pub(super) fn take(
        &mut self,
        name: &Arc<str>,
        step: u64,
        in_use: impl Fn(&str) -> bool,
    ) -> Take {
        if self.max == 0 {
            return Take::Resident;
        }
        if let Some(slot) = self.loaded.iter_mut().find(|(n, _)| n == name) {
            slot.1 = step;
            return Take::Resident;
        }
        if self.loaded.len() >= self.max {
            let victim = self
                .loaded
                .iter()
                .enumerate()
                .filter(|(_, (n, _))| !in_use(n))
                .min_by_key(|(_, (_, used))| *used)
                .map(|(i, _)| i);
            match victim {
                Some(i) => {
                    self.loaded.swap_remove(i);
                }
                None => return Take::NoSlot,
            }
        }
        self.loaded.push((Arc::clone(name), step));
        self.loads += 1;
        Take::Loaded
    }

    /// The loaded adapters' names, most recently used first.
    pub(super) fn resident(&self) -> Vec<String> {
        let mut v: Vec<_> = self.loaded.iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.into_iter().map(|(n, _)| n.to_string()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn unlimited_slots_never_load() {
        let mut s = AdapterSlots::new(0);
        assert_eq!(s.take(&name("a"), 1, |_| true), Take::Resident);
        assert_eq!(s.loads, 0);
        assert!(s.resident().is_empty());
    }

    #[test]
    fn loads_once_then_resident() {
        let mut s = AdapterSlots::new(2);
        assert_eq!(s.take(&name("a"), 1, |_| false), Take::Loaded);
        assert_eq!(s.take(&name("a"), 2, |_| false), Take::Resident);
        assert_eq!(s.take(&name("b"), 3, |_| false), Take::Loaded);
        assert_eq!(s.loads, 2);
        assert_eq!(s.resident(), vec!["b".to_string(), "a".to_string()]);
    }

    #[test]
    fn evicts_the_least_recently_used_idle_adapter() {
        let mut s = AdapterSlots::new(2);
        s.take(&name("a"), 1, |_| false);
        s.take(&name("b"), 2, |_| false);
        s.take(&name("a"), 3, |_| false);
        // b is older: it goes.
        assert_eq!(s.take(&name("c"), 4, |_| false), Take::Loaded);
        assert_eq!(s.resident(), vec!["c".to_string(), "a".to_string()]);
        // a is older than c but in use: c goes.
        assert_eq!(s.take(&name("d"), 5, |n| n == "a"), Take::Loaded);
        assert_eq!(s.resident(), vec!["d".to_string(), "a".to_string()]);
    }

    #[test]
    fn no_slot_while_every_adapter_is_in_use() {
        let mut s = AdapterSlots::new(1);
        s.take(&name("a"), 1, |_| false);
        assert_eq!(s.take(&name("b"), 2, |n| n == "a"), Take::NoSlot);
        assert_eq!(s.resident(), vec!["a".to_string()]);
        assert_eq!(s.loads, 1);
    }
}
