//! [`Priority`]: the bands of the frontend's queue.

/// A request's priority band. Bands are strict: a request of a lower band is dispatched only
/// while no higher band has one waiting, except for the starvation guard
/// ([`super::FlowConfig::starvation_ms`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    /// Someone is waiting for the answer (chat, agents in the loop).
    Interactive,
    /// The default.
    #[default]
    Standard,
    /// Throughput work that may wait, and is shed first under overload.
    Batch,
}

impl Priority {
    /// Every band, highest first (the index is the band's number).
    pub const ALL: [Priority; 3] = [Priority::Interactive, Priority::Standard, Priority::Batch];

    /// 0 for the highest band.
    pub fn band(self) -> usize {
        self as usize
    }

    /// The name used in requests, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Standard => "standard",
            Priority::Batch => "batch",
        }
    }

    /// A band by name, with the synonyms other systems use: `interactive` / `high` /
    /// `critical`, `standard` / `default` / `normal`, `batch` / `low` / `sheddable` (the
    /// Gateway API Inference Extension's criticalities are `Critical`, `Standard`,
    /// `Sheddable`). Case-insensitive.
    pub fn parse(name: &str) -> Option<Priority> {
        match name.to_ascii_lowercase().as_str() {
            "interactive" | "high" | "critical" => Some(Priority::Interactive),
            "standard" | "default" | "normal" => Some(Priority::Standard),
            "batch" | "low" | "sheddable" => Some(Priority::Batch),
            _ => None,
        }
    }

    /// A band from an integer priority as vLLM's `priority` field means it (lower is served
    /// first, 0 the default): below 0 interactive, 0 standard, above 0 batch.
    pub fn from_int(p: i64) -> Priority {
        match p {
            i64::MIN..=-1 => Priority::Interactive,
            0 => Priority::Standard,
            _ => Priority::Batch,
        }
    }

    /// OpenAI's `service_tier`: `priority` is interactive, `flex` batch, others (`auto`,
    /// `default`, `scale`) standard.
    pub fn from_service_tier(tier: &str) -> Priority {
        match tier {
            "priority" => Priority::Interactive,
            "flex" => Priority::Batch,
            _ => Priority::Standard,
        }
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
