//! [`FaultyEventPlane`]: fault injection for tests and drills — an event plane that drops,
//! duplicates and reorders the messages published on chosen subjects, with a seeded
//! generator so that a run reproduces. Consumers must survive exactly this (the plane's
//! contract is at most once, no order across reconnections: docs/CONVENTIONS.md §7).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use tandem_protocol::Rng;

use super::{EventPlane, Subscription};
use crate::error::RuntimeError;

/// How often each fault happens, per published message.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EventFaults {
    pub drop: f64,
    pub duplicate: f64,
    /// Held back and published after the next message on the subject (or after
    /// [`REORDER_FLUSH`] when none comes).
    pub reorder: f64,
    pub seed: u64,
}

/// A held-back message goes out at the latest after this long.
pub const REORDER_FLUSH: Duration = Duration::from_millis(200);

impl std::str::FromStr for EventFaults {
    type Err = String;

    /// `drop=0.05,duplicate=0.05,reorder=0.05,seed=7` (any subset).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut f = EventFaults::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected name=value"))?;
            if k == "seed" {
                f.seed = v.parse().map_err(|e| format!("seed: {e}"))?;
                continue;
            }
            let p: f64 = v.parse().map_err(|e| format!("{k}: {e}"))?;
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("{k}: a probability in [0, 1], got {p}"));
            }
            match k {
                "drop" => f.drop = p,
                "duplicate" => f.duplicate = p,
                "reorder" => f.reorder = p,
                other => {
                    return Err(format!(
                        "unknown fault {other:?} (drop, duplicate, reorder, seed)"
                    ));
                }
            }
        }
        Ok(f)
    }
}

/// Counts of what the plane did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub published: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub reordered: u64,
}

struct State {
    rng: Rng,
    held: Option<(String, Bytes, u64)>,
    generation: u64,
    counts: FaultCounts,
}

/// Wraps a plane; messages on subjects ending with one of `suffixes` suffer [`EventFaults`].
pub struct FaultyEventPlane {
    inner: Arc<dyn EventPlane>,
    faults: EventFaults,
    suffixes: Vec<String>,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for FaultyEventPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyEventPlane")
            .field("faults", &self.faults)
            .field("suffixes", &self.suffixes)
            .finish_non_exhaustive()
    }
}

impl FaultyEventPlane {
    pub fn new(inner: Arc<dyn EventPlane>, faults: EventFaults, suffixes: &[&str]) -> Self {
        FaultyEventPlane {
            inner,
            faults,
            suffixes: suffixes.iter().map(|s| s.to_string()).collect(),
            state: Arc::new(Mutex::new(State {
                rng: Rng::seed_from_u64(faults.seed),
                held: None,
                generation: 0,
                counts: FaultCounts::default(),
            })),
        }
    }

    pub fn counts(&self) -> FaultCounts {
        self.state.lock().counts
    }

    fn draw(rng: &mut Rng) -> f64 {
        (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[async_trait]
impl EventPlane for FaultyEventPlane {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), RuntimeError> {
        if !self.suffixes.iter().any(|s| subject.ends_with(s.as_str())) {
            return self.inner.publish(subject, payload).await;
        }
        enum Act {
            Drop,
            Send(Vec<Bytes>),
            Hold(u64),
        }
        let (act, released) = {
            let mut st = self.state.lock();
            st.counts.published += 1;
            let f = self.faults;
            let released = st.held.take().map(|(subj, b, _)| (subj, b));
            let act = if Self::draw(&mut st.rng) < f.drop {
                st.counts.dropped += 1;
                Act::Drop
            } else if released.is_none() && Self::draw(&mut st.rng) < f.reorder {
                st.counts.reordered += 1;
                st.generation += 1;
                let g = st.generation;
                st.held = Some((subject.to_string(), payload.clone(), g));
                Act::Hold(g)
            } else if Self::draw(&mut st.rng) < f.duplicate {
                st.counts.duplicated += 1;
                Act::Send(vec![payload.clone(), payload.clone()])
            } else {
                Act::Send(vec![payload.clone()])
            };
            (act, released)
        };
        match act {
            Act::Drop => {}
            Act::Send(msgs) => {
                for m in msgs {
                    self.inner.publish(subject, m).await?;
                }
            }
            Act::Hold(g) => {
                // Out after the next message, or after the flush time.
                let (state, inner) = (self.state.clone(), self.inner.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(REORDER_FLUSH).await;
                    let held = {
                        let mut st = state.lock();
                        match &st.held {
                            Some((_, _, hg)) if *hg == g => st.held.take(),
                            _ => None,
                        }
                    };
                    if let Some((subj, b, _)) = held {
                        let _ = inner.publish(&subj, b).await;
                    }
                });
            }
        }
        // The held one goes after the message that overtook it.
        if let Some((subj, b)) = released {
            self.inner.publish(&subj, b).await?;
        }
        Ok(())
    }

    async fn subscribe(&self, subject: &str) -> Result<Subscription, RuntimeError> {
        self.inner.subscribe(subject).await
    }
}
