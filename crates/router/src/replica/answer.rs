//! A prompt's overlap as a decision reads it: [`Answer`], one source's answer, either the
//! per-worker list ([`OverlapScores`]) or the exact index's grouped answer ([`Extents`]), and
//! [`Overlaps`], the answer of each [`KvSource`].
//!
//! The grouped answer costs nothing per matching worker: where most of a large pool shares a
//! prefix (a system prompt), the list has an entry for every one of them and building it was
//! most of a decision at 1,000 workers (BENCHMARKS.md, the routing decision). A decision that
//! scores only holders and the least loaded (`candidates.rs`' shortcut) asks for the groups,
//! each group's members in load order, and a few workers' overlaps; one that scores every
//! member asks every member's overlap and reads the list.

use tandem_indexer::{Extents, OverlapScores, TierCounts};
use tandem_protocol::WorkerId;

use super::KvSource;

/// One source's answer (see the module docs).
#[derive(Clone, Copy)]
pub(super) enum Answer<'a> {
    /// Per worker, sorted by id.
    Listed(&'a OverlapScores),
    /// Grouped by overlap, best first.
    Grouped(&'a Extents<'a>),
}

impl<'a> Answer<'a> {
    /// `id`'s overlap; `None` when it holds nothing of the prompt.
    pub(super) fn get(self, id: WorkerId) -> Option<TierCounts> {
        match self {
            Answer::Listed(s) => s.get(id),
            Answer::Grouped(x) => x.get(id),
        }
    }

    /// Every holder with its overlap: by id when listed, group after group when grouped.
    pub(super) fn for_each(self, mut f: impl FnMut(WorkerId, TierCounts)) {
        match self {
            Answer::Listed(s) => s.iter().for_each(|&(id, overlap)| f(id, overlap)),
            Answer::Grouped(x) => {
                for g in x.iter() {
                    let overlap = g.counts();
                    g.workers().for_each(|id| f(id, overlap));
                }
            }
        }
    }
}

/// A prompt's overlap, by source: each candidate reads the one of its [`KvSource`].
#[derive(Clone, Copy)]
pub(super) struct Overlaps<'a> {
    pub(super) exact: Answer<'a>,
    pub(super) approx: &'a OverlapScores,
}

impl<'a> Overlaps<'a> {
    /// The answer a member of `source` reads.
    pub(super) fn of(&self, source: KvSource) -> Answer<'a> {
        match source {
            KvSource::Events => self.exact,
            KvSource::Approximate => Answer::Listed(self.approx),
        }
    }

    /// Both answers with their source.
    pub(super) fn by_source(&self) -> [(Answer<'a>, KvSource); 2] {
        [
            (self.exact, KvSource::Events),
            (Answer::Listed(self.approx), KvSource::Approximate),
        ]
    }
}
