//! The event queue: a binary heap of timed events, earliest first, ties broken by the order
//! in which they were scheduled, so a run is a pure function of its inputs. (The simulation
//! queues every arrival first, so an arrival wins a tie against anything queued during the
//! run: see the crate docs.)

use std::cmp::Ordering;
use std::collections::BinaryHeap;

struct Item<E> {
    at_us: u64,
    seq: u64,
    ev: E,
}

impl<E> PartialEq for Item<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at_us, self.seq) == (other.at_us, other.seq)
    }
}
impl<E> Eq for Item<E> {}
impl<E> PartialOrd for Item<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Item<E> {
    // Reversed: the heap is a max-heap and the earliest (then first scheduled) must come out.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at_us, other.seq).cmp(&(self.at_us, self.seq))
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
        self.heap.push(Item {
            at_us,
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
}
