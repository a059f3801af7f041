//! A/B routing, sans-IO: an experiment splits the pool's requests between two routing
//! configurations (each a set of the `kv` policy's knobs) by session, never request by
//! request — a conversation split across two arms would lose its cached prefix on every
//! switch and both arms would measure the damage, not the configurations. A request without
//! a session is placed by the start of its prompt (its first [`ExperimentConfig::prefix_tokens`]
//! tokens), so requests that share a prefix share an arm too.
//!
//! The split is a hash of the experiment's name and the session (or the prefix): the same
//! session lands in the same arm on every frontend replica and after a restart, and two
//! experiments split independently.

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::KvOverrides;

/// One arm's routing configuration: the `kv` policy's knobs it sets (a knob it leaves out
/// keeps the frontend's own).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ArmConfig {
    pub overlap_credit: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    pub temperature: Option<f64>,
}

impl ArmConfig {
    /// The knobs as the router's per-request overrides.
    pub fn overrides(&self) -> KvOverrides {
        KvOverrides {
            overlap_credit: self.overlap_credit,
            prefill_load_scale: self.prefill_load_scale,
            temperature: self.temperature,
        }
    }
}

/// `[experiment]` in the groups file.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExperimentConfig {
    /// Its name (the metrics' `experiment` label; it also seeds the split).
    pub name: String,
    /// The share of sessions (and of prompt prefixes) in arm `b`, in [0, 1].
    pub b_share: f64,
    #[serde(default)]
    pub a: ArmConfig,
    #[serde(default)]
    pub b: ArmConfig,
    /// Tokens of a prompt's start that place a request without a session.
    #[serde(default = "default_prefix_tokens")]
    pub prefix_tokens: usize,
    /// A request whose time to first token is within this counts toward its arm's goodput.
    #[serde(default)]
    pub ttft_slo_ms: Option<f64>,
}

fn default_prefix_tokens() -> usize {
    64
}

/// An experiment's arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arm {
    A,
    B,
}

impl Arm {
    pub fn as_str(self) -> &'static str {
        match self {
            Arm::A => "a",
            Arm::B => "b",
        }
    }
}

impl ExperimentConfig {
    /// Why the experiment cannot run, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("name is empty".into());
        }
        if !(0.0..=1.0).contains(&self.b_share) {
            return Err(format!("b_share must be in [0, 1], got {}", self.b_share));
        }
        for (arm, c) in [("a", &self.a), ("b", &self.b)] {
            c.overrides()
                .validate()
                .map_err(|e| format!("arm {arm}: {e}"))?;
        }
        if self.prefix_tokens == 0 {
            return Err("prefix_tokens must be > 0".into());
        }
        if let Some(s) = self.ttft_slo_ms
            && !(s.is_finite() && s > 0.0)
        {
            return Err(format!("ttft_slo_ms must be a number > 0, got {s}"));
        }
        Ok(())
    }

    /// The arm of a request of `session` (else of `prompt`'s start).
    pub fn arm_of(&self, session: Option<&str>, prompt: &[u32]) -> Arm {
        let seed = xxh3_64_with_seed(self.name.as_bytes(), 0x6162);
        let h = match session {
            Some(s) => xxh3_64_with_seed(s.as_bytes(), seed),
            None => {
                let start = &prompt[..prompt.len().min(self.prefix_tokens)];
                let bytes: Vec<u8> = start.iter().flat_map(|t| t.to_le_bytes()).collect();
                // Apart from any session id's hash: another seed.
                xxh3_64_with_seed(&bytes, seed ^ 0x7072_6566_6978)
            }
        };
        // The top 53 bits as a fraction in [0, 1).
        let at = (h >> 11) as f64 / (1u64 << 53) as f64;
        if at < self.b_share { Arm::B } else { Arm::A }
    }

    /// The arm's configuration.
    pub fn arm(&self, arm: Arm) -> &ArmConfig {
        match arm {
            Arm::A => &self.a,
            Arm::B => &self.b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn experiment(share: f64) -> ExperimentConfig {
        ExperimentConfig {
            name: "temperature".into(),
            b_share: share,
            a: ArmConfig::default(),
            b: ArmConfig {
                temperature: Some(0.5),
                ..ArmConfig::default()
            },
            prefix_tokens: 4,
            ttft_slo_ms: None,
        }
    }

    #[test]
    fn a_session_keeps_its_arm_and_sessions_split_by_the_share() {
        let e = experiment(0.3);
        let mut b = 0;
        for i in 0..10_000 {
            let s = format!("session-{i}");
            let arm = e.arm_of(Some(&s), &[1, 2, 3]);
            // Whatever the prompt: the session decides.
            assert_eq!(e.arm_of(Some(&s), &[9, 9, 9, 9, 9]), arm);
            b += usize::from(arm == Arm::B);
        }
        assert!((2_800..3_200).contains(&b), "{b} of 10,000 in b");
        assert!((0..100).all(|i| experiment(0.0).arm_of(Some(&i.to_string()), &[]) == Arm::A));
        assert!((0..100).all(|i| experiment(1.0).arm_of(Some(&i.to_string()), &[]) == Arm::B));
    }

    #[test]
    fn without_a_session_the_prompts_start_places_it() {
        let e = experiment(0.5);
        // Prompts that share their first 4 tokens share an arm.
        let arms: Vec<Arm> = (0..200u32)
            .map(|i| {
                let first = e.arm_of(None, &[i, i + 1, i + 2, i + 3, 7]);
                assert_eq!(e.arm_of(None, &[i, i + 1, i + 2, i + 3, 8, 8, 8]), first);
                first
            })
            .collect();
        let b = arms.iter().filter(|&&a| a == Arm::B).count();
        assert!((60..140).contains(&b), "{b} of 200 in b");
    }

    #[test]
    fn experiments_of_other_names_split_independently() {
        let e = experiment(0.5);
        let mut f = experiment(0.5);
        f.name = "overlap".into();
        let same = (0..2_000)
            .filter(|i| {
                let s = i.to_string();
                e.arm_of(Some(&s), &[]) == f.arm_of(Some(&s), &[])
            })
            .count();
        assert!((850..1_150).contains(&same), "{same} of 2,000 agree");
    }

    #[test]
    fn bad_experiments_are_refused_with_why() {
        assert!(experiment(1.5).check().is_err());
        let mut e = experiment(0.5);
        e.b.temperature = Some(-1.0);
        assert!(e.check().unwrap_err().contains("arm b"));
        let mut e = experiment(0.5);
        e.prefix_tokens = 0;
        assert!(e.check().is_err());
        assert!(experiment(0.5).check().is_ok());
    }
}
