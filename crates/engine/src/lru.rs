//! An intrusive doubly-linked LRU list over dense `u32` slot indices: O(1) push to the
//! most-recent end, pop from the least-recent end, and unlink from anywhere.

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
pub(crate) struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32, // least recently used
    tail: u32, // most recently used
    len: usize,
}

impl LruList {
    pub(crate) fn new(slots: usize) -> Self {
        LruList {
            prev: vec![NIL; slots],
            next: vec![NIL; slots],
            linked: vec![false; slots],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, slot: u32) -> bool {
        self.linked[slot as usize]
    }

    /// Appends at the most-recent end. The slot must not be linked.
    pub(crate) fn push_back(&mut self, slot: u32) {
        debug_assert!(!self.linked[slot as usize], "slot {slot} already linked");
        let s = slot as usize;
        self.prev[s] = self.tail;
        self.next[s] = NIL;
        if self.tail == NIL {
            self.head = slot;
        } else {
            self.next[self.tail as usize] = slot;
        }
        self.tail = slot;
        self.linked[s] = true;
        self.len += 1;
    }

    /// Unlinks a slot; false when it was not linked.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let s = slot as usize;
        if !self.linked[s] {
            return false;
        }
        let (p, n) = (self.prev[s], self.next[s]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[s] = NIL;
        self.next[s] = NIL;
        self.linked[s] = false;
        self.len -= 1;
        true
    }

    /// Removes and returns the least recently used slot.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let h = self.head;
        if h == NIL {
            return None;
        }
        self.remove(h);
        Some(h)
    }

    /// Slots from least to most recently used.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let out = cur;
            cur = self.next[cur as usize];
            Some(out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_unlink() {
        let mut l = LruList::new(5);
        for s in [3, 1, 4, 0] {
            l.push_back(s);
        }
        assert!(l.remove(1));
        assert!(!l.remove(1));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![3, 4, 0]);
        assert_eq!(l.pop_front(), Some(3));
        l.push_back(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![4, 0, 3]);
        assert_eq!(l.len(), 3);
        assert!(l.contains(0) && !l.contains(2));
    }
}
