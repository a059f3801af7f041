//! The Responses API's conversation store: what `previous_response_id` refers to.
//!
//! Each stored response keeps its own turn (the input items it was sent, as conversation
//! messages, and its output as one assistant message) and a link to the turn it continued;
//! the conversation is the chain of turns. The store is an LRU bounded by count and bytes
//! ([`ResponsesStoreConfig`]). Turns evicted from the store but still continued by stored
//! ones stay in memory through the links, so an entry is charged for its whole chain: the
//! byte bound is an upper bound on what the store keeps alive.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::http::conversation::{Content, Message};

/// Bounds of the Responses store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponsesStoreConfig {
    /// Most responses kept (least recently used go first). 0 disables storing. Default
    /// 10 000.
    pub max_responses: usize,
    /// Most bytes of conversation kept, each response charged for its whole chain. Default
    /// 256 MiB.
    pub max_bytes: usize,
}

impl Default for ResponsesStoreConfig {
    fn default() -> Self {
        ResponsesStoreConfig {
            max_responses: 10_000,
            max_bytes: 256 * 1024 * 1024,
        }
    }
}

/// One stored response: its turn and the turn it continued.
#[derive(Debug)]
pub(crate) struct StoredTurn {
    messages: Vec<Message>,
    parent: Option<Arc<StoredTurn>>,
    /// Bytes of this turn and all its ancestors.
    chain_bytes: usize,
}

impl StoredTurn {
    pub(crate) fn new(messages: Vec<Message>, parent: Option<Arc<StoredTurn>>) -> Self {
        let own: usize = messages.iter().map(message_bytes).sum();
        let chain_bytes = own + parent.as_ref().map_or(0, |p| p.chain_bytes);
        StoredTurn {
            messages,
            parent,
            chain_bytes,
        }
    }

    /// The whole conversation up to and including this turn.
    pub(crate) fn conversation(&self) -> Vec<Message> {
        let mut turns = vec![&self.messages];
        let mut at = self.parent.as_deref();
        while let Some(turn) = at {
            turns.push(&turn.messages);
            at = turn.parent.as_deref();
        }
        turns.into_iter().rev().flatten().cloned().collect()
    }
}

impl Drop for StoredTurn {
    /// Unlinks the chain iteratively: a recursive drop of a long conversation could exhaust
    /// the stack.
    fn drop(&mut self) {
        let mut next = self.parent.take();
        while let Some(turn) = next {
            match Arc::try_unwrap(turn) {
                Ok(mut turn) => next = turn.parent.take(),
                Err(_) => break,
            }
        }
    }
}

/// An estimate of the memory a message holds.
fn message_bytes(m: &Message) -> usize {
    let content = match &m.content {
        Content::Text(t) => t.len(),
        Content::Parts(parts) => parts.iter().map(|p| p.len() + 24).sum(),
    };
    let calls: usize = m
        .tool_calls
        .iter()
        .flatten()
        .map(|c| c.id.len() + c.name.len() + c.arguments.to_compact().len() + 64)
        .sum();
    let extra =
        m.name.as_ref().map_or(0, String::len) + m.tool_call_id.as_ref().map_or(0, String::len);
    96 + content + calls + extra
}

/// The store (shared by the handlers).
#[derive(Debug)]
pub(crate) struct ResponseStore {
    config: ResponsesStoreConfig,
    inner: Mutex<Lru>,
}

#[derive(Debug, Default)]
struct Lru {
    entries: HashMap<String, (Arc<StoredTurn>, u64)>,
    /// Use tick → id, oldest first.
    order: BTreeMap<u64, String>,
    tick: u64,
    bytes: usize,
}

impl ResponseStore {
    pub(crate) fn new(config: ResponsesStoreConfig) -> Self {
        ResponseStore {
            config,
            inner: Mutex::new(Lru::default()),
        }
    }

    /// The stored response `id` (now the most recently used).
    pub(crate) fn get(&self, id: &str) -> Option<Arc<StoredTurn>> {
        let mut lru = self.inner.lock();
        let Lru {
            entries,
            order,
            tick,
            ..
        } = &mut *lru;
        let (turn, used) = entries.get_mut(id)?;
        order.remove(used);
        *tick += 1;
        *used = *tick;
        order.insert(*tick, id.to_string());
        Some(turn.clone())
    }

    /// Stores `turn` as `id`, evicting the least recently used beyond the bounds. A turn
    /// whose chain alone is over the byte bound is not stored.
    pub(crate) fn put(&self, id: String, turn: StoredTurn) {
        let cost = turn.chain_bytes;
        if self.config.max_responses == 0 || cost > self.config.max_bytes {
            return;
        }
        let mut lru = self.inner.lock();
        lru.tick += 1;
        let tick = lru.tick;
        if let Some((_, old)) = lru.entries.insert(id.clone(), (Arc::new(turn), tick)) {
            lru.order.remove(&old);
        }
        lru.order.insert(tick, id);
        lru.bytes += cost;
        while lru.entries.len() > self.config.max_responses || lru.bytes > self.config.max_bytes {
            let Some((_, oldest)) = lru.order.pop_first() else {
                break;
            };
            if let Some((turn, _)) = lru.entries.remove(&oldest) {
                lru.bytes -= turn.chain_bytes;
            }
        }
    }

    /// Responses stored now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(text: &str, parent: Option<Arc<StoredTurn>>) -> StoredTurn {
        StoredTurn::new(vec![Message::text("user", text)], parent)
    }

    #[test]
    fn chains_evicts_by_count_and_bytes() {
        let store = ResponseStore::new(ResponsesStoreConfig {
            max_responses: 2,
            max_bytes: 10_000,
        });
        store.put("a".into(), turn("one", None));
        let a = store.get("a").unwrap();
        store.put("b".into(), turn("two", Some(a)));
        let b = store.get("b").unwrap();
        let texts: Vec<String> = b
            .conversation()
            .iter()
            .map(|m| m.content.joined())
            .collect();
        assert_eq!(texts, ["one", "two"]);
        // "a" was used before "b": it goes first.
        store.put("c".into(), turn("three", None));
        assert!(store.get("a").is_none());
        assert!(store.get("b").is_some() && store.get("c").is_some());
        assert_eq!(store.len(), 2);
        // A turn over the byte bound is not kept; big ones push the others out.
        let small = ResponseStore::new(ResponsesStoreConfig {
            max_responses: 10,
            max_bytes: 300,
        });
        small.put("huge".into(), turn(&"x".repeat(1000), None));
        assert!(small.get("huge").is_none());
        small.put("1".into(), turn(&"x".repeat(100), None));
        small.put("2".into(), turn(&"x".repeat(100), None));
        assert!(small.get("1").is_none() && small.get("2").is_some());
    }

    #[test]
    fn a_long_chain_drops_without_recursion() {
        let mut parent = None;
        for i in 0..200_000 {
            parent = Some(Arc::new(turn(&i.to_string(), parent)));
        }
        drop(parent);
    }
}
