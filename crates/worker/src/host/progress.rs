//! A step's progress, told to the requests whose exported blocks it completes: a prefill
//! worker sends each layer's part of those blocks as soon as the layer is in the arena, so the
//! transfer overlaps the rest of the forward pass (docs/ARCHITECTURE.md §7).

use std::sync::Arc;

use tandem_engine::ExportedBlock;
use tokio::sync::mpsc;

use super::{HostOutput, State};

/// Slots a request's channel keeps free for what the step's end delivers (its blocks and its
/// token): progress never takes them, so it can never make a request overflow.
const KEEP_FREE: usize = 2;

/// The requests told of the in-flight step's progress, and how a layer count becomes bytes.
#[derive(Default)]
pub(super) struct Followers {
    /// Bytes of one layer in a block (blocks are layer-major: the first `n` layers of a block
    /// are its first `n · layer_bytes` bytes).
    layer_bytes: usize,
    /// The model's layers.
    pub(super) layers: u32,
    list: Vec<(mpsc::Sender<HostOutput>, Arc<[ExportedBlock]>)>,
}

impl Followers {
    /// Those of the step `st`'s engine has just planned: every request exported by reference
    /// whose blocks the step completes.
    pub(super) fn of(st: &State) -> Followers {
        let exports = st.engine.step_exports();
        if exports.is_empty() {
            return Followers::default();
        }
        let layers = st.engine.model().kv_shape().num_layers;
        let bytes = st.engine.pool().device_arena().bytes_per_block();
        let list = exports
            .into_iter()
            .filter_map(|(id, blocks)| {
                let out = st.outputs.get(&id)?;
                Some((out.tx.clone(), Arc::from(blocks)))
            })
            .collect();
        Followers {
            layer_bytes: bytes / layers.max(1) as usize,
            layers,
            list,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty() || self.layers == 0
    }

    /// The step has written `done` layers of K/V: tells every follower. Never waits and never
    /// fills a channel: a progress that does not fit is dropped (the next one, or the step's
    /// end, covers it).
    pub(super) fn tell(&self, done: u32) {
        let ready = done.min(self.layers) as usize * self.layer_bytes;
        for (tx, blocks) in &self.list {
            if tx.capacity() > KEEP_FREE {
                let _ = tx.try_send(HostOutput::Computed {
                    blocks: Arc::clone(blocks),
                    bytes: ready,
                });
            }
        }
    }
}
