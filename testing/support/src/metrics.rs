//! A `/metrics` scrape as `name{labels}` → value, with the gauges the cluster tests read.

use std::collections::HashMap;

/// `/metrics` as `name{labels}` → value.
#[derive(Debug, Clone)]
pub struct Metrics(pub HashMap<String, f64>);

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let map = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect();
        Metrics(map)
    }

    /// The value of `key` (`name` or `name{label="v"}`); panics when absent.
    pub fn get(&self, key: &str) -> f64 {
        *self
            .0
            .get(key)
            .unwrap_or_else(|| panic!("metric {key} missing from /metrics"))
    }

    pub fn decode_workers(&self) -> u64 {
        self.get("tandem_workers{role=\"decode\"}") as u64
    }

    pub fn prefill_workers(&self) -> u64 {
        self.get("tandem_workers{role=\"prefill\"}") as u64
    }

    pub fn index_workers(&self) -> u64 {
        self.get("tandem_index_workers") as u64
    }

    pub fn index_entries(&self) -> u64 {
        self.get("tandem_index_entries") as u64
    }

    /// The worker and index gauges, sorted, for failure messages.
    pub fn cluster_view(&self) -> Vec<(&str, f64)> {
        let mut v: Vec<_> = self
            .0
            .iter()
            .filter(|(k, _)| k.starts_with("tandem_workers") || k.starts_with("tandem_index"))
            .map(|(k, v)| (k.as_str(), *v))
            .collect();
        v.sort_by(|a, b| a.0.cmp(b.0));
        v
    }

    pub fn feed(&self, kind: &str) -> u64 {
        self.get(&format!("tandem_index_feed{{kind=\"{kind}\"}}")) as u64
    }
}
