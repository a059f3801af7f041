//! Conditional disaggregation (docs/ARCHITECTURE.md §6) as a pure function: given both pools, a request
//! and a mode, which decode worker, and whether (and where) to prefill remotely.
//!
//! The decode worker D is chosen first by the `kv` cost over the decode pool:
//! - under `always`, with no overlap credit at all: the prompt is prefilled elsewhere and
//!   pushed into D, so D's cache is never used for it and only D's load matters;
//! - under every other mode with the normal credit, since a local prefill on D uses D's cache
//!   and that is exactly what makes local prefill cheap.
//!
//! Then:
//! - `isl-bounding` (Dynamo's rule): local when the effective prompt on D (prompt tokens not
//!   cached on D, in any tier) is below `isl_max_local_tokens`; otherwise remote. With the
//!   opt-in `isl_max_local_fraction` f, local also needs the effective prompt below f × the
//!   prompt, i.e. D must already hold more than 1 − f of it: decode workers then only extend
//!   prompts they mostly cache (a conversation's next turn) and every fresh prompt, however
//!   short, is prefilled remotely;
//! - `prefill-load`: remote unless the best prefill worker's pending prefill tokens exceed
//!   `prefill_busy_tokens` (then waiting for it costs more than prefilling on D);
//! - `isl-or-load`: local if either rule says local;
//! - `always` / `never`: always remote / always local.
//!
//! The prefill worker is chosen by `kv` over the prefill pool, where prefix overlap dominates,
//! plus the cost of moving the KV to D: the prompt blocks D does not hold, times the per-block
//! cost of the distance between the two ([`TransferCosts`]: same process, host, rack, other —
//! from the workers' registered placements), in block-equivalents of prefill compute. So a
//! prefill worker next to D wins a tie, and a far one must hold that much more of the prompt.
//! With [`DisaggConfig::isl_compare_local`], a remote prefill the rule chose is also checked
//! against doing it on D: if the prefill worker's total (queue + compute + transfer, in
//! blocks, over its speed) exceeds D's (queue + compute, over D's speed), D prefills it.
//! An empty prefill pool means local prefill whatever the mode.
//!
//! Default per-block transfer costs, for an 8B model in fp16 (128 KiB per token, 2 MiB per
//! 16-token block) whose prefill computes a block in ~0.33 ms (the mocker's 8,192-token chunk
//! in 169 ms): same process 0 (no copy over a network), same host 0.06 (NVLink / PCIe at
//! ~100 GB/s: 0.02 ms), same rack 0.25 (a 200 Gb/s NIC: 0.08 ms), other 0.5 (half that
//! across racks).

use std::fmt;
use std::str::FromStr;

use tandem_protocol::{Distance, WorkerId};

use crate::error::{ConfigError, RouteError};
use crate::kv::{KvConfig, kv_decide};
use crate::pool::{PoolConfig, prepare_candidates};
use crate::rng::Rng;
use crate::view::{Decision, RouteRequest, WorkerView};

/// When to prefill on a separate worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DisaggMode {
    #[default]
    IslBounding,
    PrefillLoad,
    IslOrLoad,
    Always,
    Never,
}

impl DisaggMode {
    pub const ALL: [DisaggMode; 5] = [
        DisaggMode::IslBounding,
        DisaggMode::PrefillLoad,
        DisaggMode::IslOrLoad,
        DisaggMode::Always,
        DisaggMode::Never,
    ];

    pub const VALID_NAMES: &'static str = "isl-bounding, prefill-load, isl-or-load, always, never";

    pub const fn name(self) -> &'static str {
        match self {
            DisaggMode::IslBounding => "isl-bounding",
            DisaggMode::PrefillLoad => "prefill-load",
            DisaggMode::IslOrLoad => "isl-or-load",
            DisaggMode::Always => "always",
            DisaggMode::Never => "never",
        }
    }
}

impl fmt::Display for DisaggMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DisaggMode {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DisaggMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| ConfigError::UnknownDisaggMode {
                got: s.to_owned(),
                valid: DisaggMode::VALID_NAMES,
            })
    }
}

/// Cost of moving one KV block between two workers, in blocks of prefill compute, by their
/// distance ([`tandem_protocol::Distance`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransferCosts {
    pub same_process: f64,
    pub same_host: f64,
    pub same_rack: f64,
    pub other: f64,
}

impl Default for TransferCosts {
    fn default() -> Self {
        TransferCosts {
            same_process: 0.0,
            same_host: 0.06,
            same_rack: 0.25,
            other: 0.5,
        }
    }
}

impl TransferCosts {
    pub fn per_block(&self, d: tandem_protocol::Distance) -> f64 {
        use tandem_protocol::Distance::*;
        match d {
            SameProcess => self.same_process,
            SameHost => self.same_host,
            SameRack => self.same_rack,
            Other => self.other,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("transfer cost (same process)", self.same_process),
            ("transfer cost (same host)", self.same_host),
            ("transfer cost (same rack)", self.same_rack),
            ("transfer cost (other)", self.other),
        ] {
            crate::error::non_negative(name, v)?;
        }
        Ok(())
    }
}

/// Knobs of the disaggregation rule and of the two pools' selection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisaggConfig {
    pub mode: DisaggMode,
    /// `isl-bounding`: local only below this many uncached prompt tokens…
    pub isl_max_local_tokens: u64,
    /// …and, when set, below this fraction of the prompt (in [0, 1]; see the module docs).
    pub isl_max_local_fraction: Option<f64>,
    /// `prefill-load`: local when the best prefill worker has more pending prefill tokens.
    pub prefill_busy_tokens: u64,
    /// `kv` knobs for the decode pool (credit removed under `always`).
    pub decode_kv: KvConfig,
    /// `kv` knobs for the prefill pool ([`KvConfig::prefill_pool`] by default).
    pub prefill_kv: KvConfig,
    pub decode_pool: PoolConfig,
    pub prefill_pool: PoolConfig,
    /// Per-block KV transfer cost by distance, added to each prefill worker's cost.
    pub transfer: TransferCosts,
    /// Check a remote prefill against a local one (see the module docs). Off by default.
    pub isl_compare_local: bool,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig {
            mode: DisaggMode::IslBounding,
            isl_max_local_tokens: 2048,
            isl_max_local_fraction: None,
            // About one long prompt queued: beyond it, a remote prefill waits longer than a
            // local one takes on a decode worker.
            prefill_busy_tokens: 8192,
            decode_kv: KvConfig::default(),
            prefill_kv: KvConfig::prefill_pool(),
            decode_pool: PoolConfig::default(),
            prefill_pool: PoolConfig::default(),
            transfer: TransferCosts::default(),
            isl_compare_local: false,
        }
    }
}

impl DisaggConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(f) = self.isl_max_local_fraction
            && !(f.is_finite() && (0.0..=1.0).contains(&f))
        {
            return Err(ConfigError::OutOfRange {
                name: "isl max local fraction",
                requirement: "a fraction of the prompt in [0, 1]",
                value: f,
            });
        }
        self.transfer.validate()?;
        self.decode_kv.validate()?;
        self.prefill_kv.validate()?;
        self.decode_pool.validate()?;
        self.prefill_pool.validate()
    }

    /// Whether `isl-bounding` says local for this effective prompt.
    pub fn isl_says_local(&self, effective_tokens: u64, prompt_tokens: u64) -> bool {
        effective_tokens < self.isl_max_local_tokens
            && self
                .isl_max_local_fraction
                .is_none_or(|f| (effective_tokens as f64) < f * prompt_tokens as f64)
    }

    /// Whether `prefill-load` says local for this backlog on the best prefill worker.
    pub fn load_says_local(&self, backlog_tokens: u64) -> bool {
        backlog_tokens > self.prefill_busy_tokens
    }
}

/// Why the request prefills where it does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DisaggReason {
    /// No prefill workers: local.
    NoPrefillPool,
    /// Mode `never`: local.
    Never,
    /// Mode `always`: remote.
    Always,
    /// `isl-bounding` (or `isl-or-load`) said local.
    ShortEffectivePrompt { effective_tokens: u64 },
    /// `isl-bounding` said remote.
    LongEffectivePrompt { effective_tokens: u64 },
    /// `prefill-load` (or `isl-or-load`) said local.
    PrefillBusy { backlog_tokens: u64 },
    /// `prefill-load` said remote.
    PrefillAvailable { backlog_tokens: u64 },
    /// `isl-or-load`: both rules said remote.
    LongPromptPrefillAvailable {
        effective_tokens: u64,
        backlog_tokens: u64,
    },
    /// The rule said remote, but the best prefill worker's total (queue + compute +
    /// transfer, blocks over its speed) was above the decode worker's local one
    /// ([`DisaggConfig::isl_compare_local`]).
    LocalSooner { remote_cost: f64, local_cost: f64 },
    /// A remote prefill was chosen, but the caller prefills locally after all (the simulator's
    /// decode worker had no room to reserve the KV's blocks).
    Fallback,
    /// The request asked to be prefilled where it decodes ([`RouteRequest::local_prefill`]).
    LocalOnly,
}

/// Where a request goes.
#[derive(Clone, Debug, PartialEq)]
pub struct DisaggDecision {
    pub decode: Decision,
    /// The prefill worker's decision when prefill is remote.
    pub prefill: Option<Decision>,
    pub why: DisaggReason,
}

impl DisaggDecision {
    pub fn decode_worker(&self) -> WorkerId {
        self.decode.worker
    }

    pub fn prefill_worker(&self) -> Option<WorkerId> {
        self.prefill.as_ref().map(|d| d.worker)
    }

    pub fn is_remote(&self) -> bool {
        self.prefill.is_some()
    }

    /// Drops the remote prefill: the decode worker prefills itself ([`DisaggReason::Fallback`]).
    pub fn prefill_locally(&mut self) {
        if self.prefill.take().is_some() {
            self.why = DisaggReason::Fallback;
        }
    }
}

/// Prompt tokens not cached on a worker with `overlap_blocks` leading blocks in any tier.
pub fn effective_prompt_tokens(req: &RouteRequest, overlap_blocks: u32) -> u64 {
    let cached = u64::from(overlap_blocks) * u64::from(req.block_size.get());
    req.prompt_tokens.saturating_sub(cached)
}

/// `kv` over one pool after its warm-up and busy rules; the pick's prepared view comes along
/// (its load as the rule saw it).
fn pick(
    kv: &KvConfig,
    pool: &PoolConfig,
    req: &RouteRequest,
    views: &[WorkerView],
    rng: &mut Rng,
) -> Result<(Decision, WorkerView), RouteError> {
    crate::policy::check_candidates(views)?;
    let c = prepare_candidates(pool, views);
    let mut d = kv_decide(kv, req, &c.views, rng)?;
    d.excluded_busy = c.excluded_busy;
    let view = c
        .views
        .iter()
        .find(|v| v.id == d.worker)
        .copied()
        .ok_or(RouteError::NoWorkers)?;
    Ok((d, view))
}

/// The prefill pool's pick for decode worker `d` (holding `d_blocks` leading prompt blocks):
/// each candidate's cost adds the transfer of the blocks `d` lacks over their distance.
fn pick_prefill(
    cfg: &DisaggConfig,
    req: &RouteRequest,
    prefill: &[WorkerView],
    (d, d_blocks): (WorkerId, u32),
    distance: &dyn Fn(WorkerId, WorkerId) -> Distance,
    rng: &mut Rng,
) -> Result<(Decision, WorkerView), RouteError> {
    let moved = req.full_prompt_blocks().saturating_sub(u64::from(d_blocks)) as f64;
    let views: Vec<WorkerView> = prefill
        .iter()
        .map(|v| WorkerView {
            extra_cost: moved * cfg.transfer.per_block(distance(v.id, d)),
            ..*v
        })
        .collect();
    pick(&cfg.prefill_kv, &cfg.prefill_pool, req, &views, rng)
}

/// A remote prefill's total and a local one's, in blocks over each worker's speed:
/// (remote, local).
fn remote_and_local(p: &Decision, d: &Decision) -> (f64, f64) {
    let total = |dec: &Decision| {
        dec.chosen_terms()
            .map_or(0.0, |t| t.prefill_blocks / t.speed + t.transfer)
    };
    (total(p), total(d))
}

/// Picks the decode worker, and the prefill worker when prefill is remote. `cfg` should have
/// passed [`DisaggConfig::validate`]. `distance` says how far apart two workers are (their
/// registered placements), for the KV transfer's cost.
pub fn decide(
    cfg: &DisaggConfig,
    req: &RouteRequest,
    decode: &[WorkerView],
    prefill: &[WorkerView],
    distance: &dyn Fn(WorkerId, WorkerId) -> Distance,
    rng: &mut Rng,
) -> Result<DisaggDecision, RouteError> {
    req.overrides.validate()?;
    let local = |decode: Decision, why| DisaggDecision {
        decode,
        prefill: None,
        why,
    };
    if cfg.mode == DisaggMode::Always && !prefill.is_empty() && !req.local_prefill {
        // D's cache plays no part: credit 0 for every tier, whatever the request asks.
        let mut load_only = *req;
        load_only.overrides.overlap_credit = None;
        let kv = cfg.decode_kv.without_credit();
        let (d, d_view) = pick(&kv, &cfg.decode_pool, &load_only, decode, rng)?;
        let target = (d.worker, d_view.overlap.total());
        let (p, _) = pick_prefill(cfg, req, prefill, target, distance, rng)?;
        return Ok(DisaggDecision {
            decode: d,
            prefill: Some(p),
            why: DisaggReason::Always,
        });
    }
    let (d, d_view) = pick(&cfg.decode_kv, &cfg.decode_pool, req, decode, rng)?;
    if prefill.is_empty() {
        return Ok(local(d, DisaggReason::NoPrefillPool));
    }
    if req.local_prefill {
        return Ok(local(d, DisaggReason::LocalOnly));
    }
    let target = (d.worker, d_view.overlap.total());
    let effective = effective_prompt_tokens(req, d_view.overlap.total());
    let isl_local = cfg.isl_says_local(effective, req.prompt_tokens);
    // A remote prefill the rule chose, unless doing it on D finishes sooner (when asked).
    let remote = |d: Decision, p: Decision, why: DisaggReason| {
        let (remote_cost, local_cost) = remote_and_local(&p, &d);
        if cfg.isl_compare_local && remote_cost > local_cost {
            return local(
                d,
                DisaggReason::LocalSooner {
                    remote_cost,
                    local_cost,
                },
            );
        }
        DisaggDecision {
            decode: d,
            prefill: Some(p),
            why,
        }
    };
    match cfg.mode {
        DisaggMode::Never => return Ok(local(d, DisaggReason::Never)),
        DisaggMode::IslBounding | DisaggMode::IslOrLoad if isl_local => {
            let why = DisaggReason::ShortEffectivePrompt {
                effective_tokens: effective,
            };
            return Ok(local(d, why));
        }
        DisaggMode::IslBounding => {
            let (p, _) = pick_prefill(cfg, req, prefill, target, distance, rng)?;
            let why = DisaggReason::LongEffectivePrompt {
                effective_tokens: effective,
            };
            return Ok(remote(d, p, why));
        }
        _ => {}
    }
    // prefill-load, or isl-or-load whose length rule said remote.
    let (p, p_view) = pick_prefill(cfg, req, prefill, target, distance, rng)?;
    let backlog = p_view.load.active_prefill_tokens;
    if cfg.load_says_local(backlog) {
        return Ok(local(
            d,
            DisaggReason::PrefillBusy {
                backlog_tokens: backlog,
            },
        ));
    }
    let why = if cfg.mode == DisaggMode::IslOrLoad {
        DisaggReason::LongPromptPrefillAvailable {
            effective_tokens: effective,
            backlog_tokens: backlog,
        }
    } else {
        DisaggReason::PrefillAvailable {
            backlog_tokens: backlog,
        }
    };
    Ok(remote(d, p, why))
}
