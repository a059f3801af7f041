//! The event queue: a binary heap of timed events, earliest first; at one instant, events
//! pushed with [`EventQueue::push_first`] (replica-sync messages) before the others, and
//! otherwise in the order they were scheduled, so a run is a pure function of its inputs. (The
//! simulation queues every arrival first, so an arrival wins a tie against anything else
//! queued during the run except a `push_first` event: see the crate docs.)

use std::cmp::Ordering;
use std::collections::BinaryHeap;

struct Item<E> {
    at_us: u64,
    /// 0: `push_first`, 1: `push`.
    class: u8,
    seq: u64,
    ev: E,
}

impl<E> Item<E> {
    fn key(&self) -> (u64, u8, u64) {
        (self.at_us, self.class, self.seq)
    }
}

impl<E> PartialEq for Item<E> {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}
impl<E> Eq for Item<E> {}
impl<E> PartialOrd for Item<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Item<E> {
    // Reversed: the heap is a max-heap and the earliest (then first class, then first
    // scheduled) must come out.
    fn cmp(&self, other: &Self) -> Ordering {
        other.key().cmp(&self.key())
    }
}

/// Timed events in virtual microseconds.
pub(crate) struct EventQueue<E> {
    heap: BinaryHeap<Item<E>>,
    next_seq: u64,
}

impl<E> EventQueue<E> {
    pub fn new() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            next_seq: 0,
        }
    }

    pub fn push(&mut self, at_us: u64, ev: E) {
        self.push_class(at_us, 1, ev);
    }

    /// Handled before every [`EventQueue::push`] event of the same instant, even those queued
    /// earlier (among themselves, in scheduling order).
    pub fn push_first(&mut self, at_us: u64, ev: E) {
        self.push_class(at_us, 0, ev);
    }

    fn push_class(&mut self, at_us: u64, class: u8, ev: E) {
        self.heap.push(Item {
            at_us,
            class,
            seq: self.next_seq,
            ev,
        });
        self.next_seq += 1;
    }

    pub fn pop(&mut self) -> Option<(u64, E)> {
        self.heap.pop().map(|i| (i.at_us, i.ev))
    }
}

#[cfg(test)]
mod tests {
    use super::EventQueue;

    #[test]
    fn earliest_first_then_scheduling_order() {
        let mut q = EventQueue::new();
        q.push(5, 'a');
        q.push(3, 'b');
        q.push(5, 'c');
        q.push(3, 'd');
        let order: Vec<char> = std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect();
        assert_eq!(order, ['b', 'd', 'a', 'c']);
    }

    #[test]
    fn push_first_wins_ties_against_earlier_pushes() {
        let mut q = EventQueue::new();
        q.push(5, 'a');
        q.push(5, 'b');
        q.push(4, 'c');
        q.push_first(5, 'x');
        q.push_first(5, 'y');
        q.push_first(6, 'z');
        let order: Vec<char> = std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect();
        assert_eq!(order, ['c', 'x', 'y', 'a', 'b', 'z']);
    }
}
