//! A little-endian reader over the file's bytes that checks every length against what is left
//! before it reads or allocates.

use crate::Error;

pub(super) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    /// The absolute offset of the next byte.
    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The next `n` bytes, or `Truncated` naming `what` if fewer are left.
    pub(super) fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], Error> {
        let truncated = || Error::Truncated {
            what,
            offset: self.pos,
            needed: n,
            available: self.remaining(),
        };
        let len = usize::try_from(n).map_err(|_| truncated())?;
        let (head, _) = self.buf[self.pos..]
            .split_at_checked(len)
            .ok_or_else(truncated)?;
        self.pos += len;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], Error> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    pub(super) fn u32(&mut self, what: &'static str) -> Result<u32, Error> {
        self.array(what).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, what: &'static str) -> Result<u64, Error> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string: a u64 byte length, then that many bytes of UTF-8.
    pub(super) fn string(&mut self, what: &'static str) -> Result<String, Error> {
        let len = self.u64(what)?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| Error::InvalidUtf8 {
                what,
                offset: start,
            })
    }

    /// `count` items of `N` bytes each, decoded by `decode`. The whole run is checked against
    /// the remaining bytes before anything is allocated.
    pub(super) fn fixed_items<const N: usize, T>(
        &mut self,
        count: u64,
        what: &'static str,
        decode: impl Fn([u8; N]) -> T,
    ) -> Result<Vec<T>, Error> {
        let n_bytes = count.checked_mul(N as u64).ok_or(Error::Truncated {
            what,
            offset: self.pos,
            needed: u64::MAX,
            available: self.remaining(),
        })?;
        let bytes = self.take(n_bytes, what)?;
        let (items, _) = bytes.as_chunks::<N>();
        Ok(items.iter().map(|item| decode(*item)).collect())
    }

    /// A capacity for `count` items that each take at least `min_bytes` of the file: never more
    /// than the remaining bytes could hold, so a hostile count cannot make a huge allocation
    /// (the items themselves then run into the end of the file).
    pub(super) fn capacity_for(&self, count: u64, min_bytes: usize) -> usize {
        let fits = self.remaining() / min_bytes.max(1);
        usize::try_from(count).map_or(fits, |count| count.min(fits))
    }
}
