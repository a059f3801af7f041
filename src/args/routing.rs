//! How the frontend (and `tandem sim`'s routers) route: every knob of the routing core as a
//! flag with an environment variable ([`RoutingArgs`]), turned into one [`RoutingConfig`].
//! Optional thresholds are off unless set. `tandem up --processes` hands the same flags to
//! its frontend process ([`RoutingArgs::to_args`]).

use anyhow::Context;
use clap::{ArgAction, Args};
use tandem_router::{
    AdapterConfig, ApproxConfig, CacheAwareConfig, CapacityConfig, DisaggConfig, DisaggMode,
    KvConfig, PolicyConfig, PolicyKind, PoolConfig, PrefixHashConfig, RoutingConfig, SessionConfig,
    TrackerConfig, TransferCosts,
};

fn kv() -> KvConfig {
    KvConfig::default()
}
fn cache_aware() -> CacheAwareConfig {
    CacheAwareConfig::default()
}
fn prefix_hash() -> PrefixHashConfig {
    PrefixHashConfig::default()
}
fn disagg() -> DisaggConfig {
    DisaggConfig::default()
}
fn adapters() -> AdapterConfig {
    AdapterConfig::default()
}

/// Routing flags (docs/ARCHITECTURE.md §5, §6; README "Routing").
#[derive(Args, Debug, Clone)]
pub struct RoutingArgs {
    /// Policy over the decode pool: round-robin, random, least-loaded, power-of-two, kv,
    /// cache-aware, prefix-hash.
    #[arg(long, env = "TANDEM_POLICY", default_value = "kv")]
    pub policy: String,
    /// kv: credit per cached device block (c).
    #[arg(long, env = "TANDEM_OVERLAP_CREDIT", default_value_t = kv().overlap_credit)]
    pub overlap_credit: f64,
    /// kv: credit per block cached in host memory (onboarding is cheaper than recomputing).
    #[arg(long, env = "TANDEM_HOST_WEIGHT", default_value_t = kv().host_weight)]
    pub host_weight: f64,
    /// kv: credit per block cached on disk.
    #[arg(long, env = "TANDEM_DISK_WEIGHT", default_value_t = kv().disk_weight)]
    pub disk_weight: f64,
    /// kv: weight of the prefill term (s). 2 by default, where Dynamo's configuration
    /// (`KvConfig::dynamo()`) has 1: on both bundled traces it lifts capacity under the SLO
    /// (conversation ×0.85 → ×0.95, the oracle's; crates/router/EXPERIMENTS.md).
    #[arg(long, env = "TANDEM_PREFILL_LOAD_SCALE", default_value_t = kv().prefill_load_scale)]
    pub prefill_load_scale: f64,
    /// kv: how fast a backlogged worker's device credit decays (d; 0: never).
    #[arg(long, env = "TANDEM_KV_DECAY", default_value_t = kv().decay)]
    pub kv_decay: f64,
    /// kv: softmax temperature (0: minimum cost).
    #[arg(long, env = "TANDEM_TEMPERATURE", default_value_t = kv().temperature)]
    pub temperature: f64,
    /// kv: cost per active request (a).
    #[arg(long, env = "TANDEM_ACTIVE_REQUEST_WEIGHT", default_value_t = kv().active_request_weight)]
    pub active_request_weight: f64,
    /// kv: weight of the decode term for interactive requests (standard: 1).
    #[arg(long, env = "TANDEM_INTERACTIVE_DECODE_WEIGHT", default_value_t = kv().interactive_decode_weight)]
    pub interactive_decode_weight: f64,
    /// kv: weight of the decode term for batch requests.
    #[arg(long, env = "TANDEM_BATCH_DECODE_WEIGHT", default_value_t = kv().batch_decode_weight)]
    pub batch_decode_weight: f64,
    /// A worker above this KV usage fraction is busy: left out while another is not (off
    /// unless set).
    #[arg(long, env = "TANDEM_BUSY_KV_USAGE")]
    pub busy_kv_usage: Option<f64>,
    /// A worker with more pending prefill tokens is busy (off unless set).
    #[arg(long, env = "TANDEM_BUSY_PREFILL_TOKENS")]
    pub busy_prefill_tokens: Option<u64>,
    /// Seconds a new worker's load counts as at least the pool's median.
    #[arg(long, env = "TANDEM_WARMUP_S", default_value_t = 30.0)]
    pub warmup_s: f64,
    /// cache-aware: balance by load when max − min active requests exceeds this…
    #[arg(long, env = "TANDEM_CACHE_AWARE_BALANCE_ABS", default_value_t = cache_aware().balance_abs_threshold)]
    pub cache_aware_balance_abs: u64,
    /// …and max exceeds this multiple of min.
    #[arg(long, env = "TANDEM_CACHE_AWARE_BALANCE_REL", default_value_t = cache_aware().balance_rel_threshold)]
    pub cache_aware_balance_rel: f64,
    /// cache-aware: least match rate (matched / prompt blocks) that earns prefix affinity.
    #[arg(long, env = "TANDEM_CACHE_AWARE_THRESHOLD", default_value_t = cache_aware().cache_threshold)]
    pub cache_aware_threshold: f64,
    /// prefix-hash: prompt tokens hashed into the ring key (k).
    #[arg(long, env = "TANDEM_PREFIX_HASH_TOKENS", default_value_t = prefix_hash().prefix_tokens)]
    pub prefix_hash_tokens: usize,
    /// prefix-hash: ring points per worker.
    #[arg(long, env = "TANDEM_PREFIX_HASH_VIRTUAL_NODES", default_value_t = prefix_hash().virtual_nodes)]
    pub prefix_hash_virtual_nodes: u32,
    /// prefix-hash: escape to least loaded when the owner's load exceeds this multiple of the
    /// mean.
    #[arg(long, env = "TANDEM_PREFIX_HASH_LOAD_FACTOR", default_value_t = prefix_hash().load_factor)]
    pub prefix_hash_load_factor: f64,
    /// Conditional disaggregation when a prefill pool exists: isl-bounding, prefill-load,
    /// isl-or-load, always, never.
    #[arg(long, env = "TANDEM_DISAGG", default_value = "isl-bounding")]
    pub disagg: String,
    /// isl-bounding: prefill on the decode worker when fewer prompt tokens than this are not
    /// cached there (Dynamo's rule).
    #[arg(long, env = "TANDEM_ISL_MAX_LOCAL_TOKENS", default_value_t = disagg().isl_max_local_tokens)]
    pub isl_max_local_tokens: u64,
    /// isl-bounding, opt-in second condition: the uncached part must also be below this
    /// fraction of the prompt (in [0, 1]), i.e. the decode worker must already hold most of
    /// it; every fresh prompt, however short, then prefills remotely.
    #[arg(long, env = "TANDEM_ISL_MAX_LOCAL_FRACTION")]
    pub isl_max_local_fraction: Option<f64>,
    /// Check a remote prefill against a local one: when the best prefill worker's total
    /// (queue + compute + KV transfer) exceeds the decode worker's (queue + compute), the
    /// decode worker prefills it.
    #[arg(long, env = "TANDEM_ISL_COMPARE_LOCAL", default_value_t = false, action = ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub isl_compare_local: bool,
    /// KV transfer cost per block (in blocks of prefill compute) between workers on one host
    /// (added to a prefill worker's cost for the blocks its decode worker lacks).
    #[arg(long, env = "TANDEM_TRANSFER_COST_HOST", default_value_t = TransferCosts::default().same_host)]
    pub transfer_cost_host: f64,
    /// … between workers with the same `--topology-rack` label.
    #[arg(long, env = "TANDEM_TRANSFER_COST_RACK", default_value_t = TransferCosts::default().same_rack)]
    pub transfer_cost_rack: f64,
    /// … between any other two workers (or unknown placements).
    #[arg(long, env = "TANDEM_TRANSFER_COST_OTHER", default_value_t = TransferCosts::default().other)]
    pub transfer_cost_other: f64,
    /// prefill-load: prefill locally when the best prefill worker has more pending tokens.
    #[arg(long, env = "TANDEM_PREFILL_BUSY_TOKENS", default_value_t = disagg().prefill_busy_tokens)]
    pub prefill_busy_tokens: u64,
    /// Fold workers' load reports into the router's own load counts (for replicas that do
    /// not sync; reports lag by their interval). In `tandem sim`, the snapshot mode's reports.
    #[arg(long, env = "TANDEM_MERGE_LOAD_REPORTS", default_value_t = false, action = ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub merge_load_reports: bool,
    /// Seconds a routed request counts in the router's load view when no finish is seen (a
    /// lost message, a crashed peer replica).
    #[arg(long, env = "TANDEM_TRACKER_TTL_S", default_value_t = 600.0)]
    pub tracker_ttl_s: f64,
    /// Route on the workers' KV events (`--kv-events false`: on the router's own decisions
    /// with a TTL, approximate KV, for every worker; for engines that publish no events).
    #[arg(long = "kv-events", env = "TANDEM_KV_EVENTS", default_value_t = true, action = ArgAction::Set)]
    pub route_on_kv_events: bool,
    /// Pin a request's session (`x-session-id`, `tandem.session_id`, or `--session-field`) to
    /// the decode worker of its last request while that worker is healthy and not busy.
    #[arg(long, env = "TANDEM_SESSION_AFFINITY", default_value_t = true, action = ArgAction::Set)]
    pub session_affinity: bool,
    /// Seconds an idle session stays pinned.
    #[arg(long, env = "TANDEM_SESSION_TTL_S", default_value_t = 600.0)]
    pub session_ttl_s: f64,
    /// Sessions remembered at most (least recently used forgotten first).
    #[arg(long, env = "TANDEM_SESSION_MAX", default_value_t = SessionConfig::default().max_sessions)]
    pub session_max: usize,
    /// Weigh workers by their measured speed (tokens per busy second from their load
    /// reports, over the pool's median): a worker twice as fast takes about twice the work.
    #[arg(long, env = "TANDEM_CAPACITY_WEIGHTS", default_value_t = false, action = ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub capacity_weights: bool,
    /// Weight of the newest speed sample in the moving average, in (0, 1].
    #[arg(long, env = "TANDEM_CAPACITY_ALPHA", default_value_t = CapacityConfig::default().alpha)]
    pub capacity_alpha: f64,
    /// Busy time one speed sample spans at least, milliseconds.
    #[arg(long, env = "TANDEM_CAPACITY_MIN_BUSY_MS", default_value_t = CapacityConfig::default().min_busy_ms)]
    pub capacity_min_busy_ms: u64,
    /// Workers without KV events (approximate KV): seconds a prompt routed to one counts as
    /// cached there.
    #[arg(long, env = "TANDEM_KV_APPROX_TTL_S", default_value_t = 120.0)]
    pub kv_approx_ttl_s: f64,
    /// Most (worker, block) entries the approximate index keeps.
    #[arg(long, env = "TANDEM_KV_APPROX_MAX_ENTRIES", default_value_t = 1 << 20)]
    pub kv_approx_max_entries: usize,
    /// LoRA-aware routing: blocks added to a worker's cost when it must load the request's
    /// adapter (not in flight there, not sent there within --adapter-ttl-s, not in its last
    /// load report).
    #[arg(long, env = "TANDEM_ADAPTER_LOAD_COST", default_value_t = adapters().load_cost)]
    pub adapter_load_cost: f64,
    /// LoRA-aware routing: blocks added on top when every adapter slot of the worker is
    /// taken by the adapters of requests in flight (the request would wait for one).
    #[arg(long, env = "TANDEM_ADAPTER_FULL_COST", default_value_t = adapters().full_cost)]
    pub adapter_full_cost: f64,
    /// LoRA-aware routing: seconds an adapter the router sent to a worker counts as resident
    /// there before the worker's load report says so.
    #[arg(long, env = "TANDEM_ADAPTER_TTL_S", default_value_t = adapters().ttl_ms as f64 / 1000.0)]
    pub adapter_ttl_s: f64,
}

/// Seconds as whole milliseconds, refusing negative or non-finite values.
fn seconds_ms(flag: &str, s: f64) -> anyhow::Result<u64> {
    anyhow::ensure!(
        s.is_finite() && s >= 0.0,
        "{flag} must be a number of seconds >= 0, got {s}"
    );
    Ok((s * 1000.0).round() as u64)
}

impl RoutingArgs {
    /// The routing these flags describe: the frontend's and `tandem sim`'s alike.
    pub fn config(&self) -> anyhow::Result<RoutingConfig> {
        let kind: PolicyKind = self.policy.parse().context("--policy")?;
        if let Some(f) = self.isl_max_local_fraction {
            anyhow::ensure!(
                f.is_finite() && (0.0..=1.0).contains(&f),
                "--isl-max-local-fraction must be a fraction of the prompt in [0, 1], got {f}"
            );
        }
        let kv = KvConfig {
            overlap_credit: self.overlap_credit,
            host_weight: self.host_weight,
            disk_weight: self.disk_weight,
            prefill_load_scale: self.prefill_load_scale,
            decay: self.kv_decay,
            active_request_weight: self.active_request_weight,
            temperature: self.temperature,
            interactive_decode_weight: self.interactive_decode_weight,
            batch_decode_weight: self.batch_decode_weight,
        };
        let policy = PolicyConfig {
            kind,
            kv,
            cache_aware: CacheAwareConfig {
                balance_abs_threshold: self.cache_aware_balance_abs,
                balance_rel_threshold: self.cache_aware_balance_rel,
                cache_threshold: self.cache_aware_threshold,
            },
            prefix_hash: PrefixHashConfig {
                prefix_tokens: self.prefix_hash_tokens,
                virtual_nodes: self.prefix_hash_virtual_nodes,
                load_factor: self.prefix_hash_load_factor,
            },
        };
        let warmup_ms = seconds_ms("--warmup-s", self.warmup_s)?;
        let pool = PoolConfig {
            warmup_ms,
            busy_kv_usage: self.busy_kv_usage,
            busy_prefill_tokens: self.busy_prefill_tokens,
        };
        // The prefill pool shares the tier weights and decay; its own busy rule is the
        // disaggregation mode's (`prefill-load`).
        let prefill_kv = KvConfig {
            host_weight: self.host_weight,
            disk_weight: self.disk_weight,
            decay: self.kv_decay,
            ..KvConfig::prefill_pool()
        };
        let disagg = DisaggConfig {
            mode: self.disagg.parse::<DisaggMode>().context("--disagg")?,
            isl_max_local_tokens: self.isl_max_local_tokens,
            isl_max_local_fraction: self.isl_max_local_fraction,
            prefill_busy_tokens: self.prefill_busy_tokens,
            decode_kv: kv,
            prefill_kv,
            decode_pool: pool,
            prefill_pool: PoolConfig {
                warmup_ms,
                ..PoolConfig::default()
            },
            transfer: TransferCosts {
                same_process: 0.0,
                same_host: self.transfer_cost_host,
                same_rack: self.transfer_cost_rack,
                other: self.transfer_cost_other,
            },
            isl_compare_local: self.isl_compare_local,
        };
        let routing = RoutingConfig {
            policy,
            pool,
            disagg,
            merge_load_reports: self.merge_load_reports,
            approximate_kv: !self.route_on_kv_events,
            capacity: CapacityConfig {
                enabled: self.capacity_weights,
                alpha: self.capacity_alpha,
                min_busy_ms: self.capacity_min_busy_ms,
            },
            sessions: SessionConfig {
                enabled: self.session_affinity,
                ttl_ms: seconds_ms("--session-ttl-s", self.session_ttl_s)?,
                max_sessions: self.session_max,
            },
            tracker: TrackerConfig {
                ttl_ms: seconds_ms("--tracker-ttl-s", self.tracker_ttl_s)?,
                ..TrackerConfig::default()
            },
            approx: ApproxConfig {
                ttl_ms: seconds_ms("--kv-approx-ttl-s", self.kv_approx_ttl_s)?,
                max_entries: self.kv_approx_max_entries,
            },
            adapters: AdapterConfig {
                load_cost: self.adapter_load_cost,
                full_cost: self.adapter_full_cost,
                ttl_ms: seconds_ms("--adapter-ttl-s", self.adapter_ttl_s)?,
            },
            ..Default::default()
        };
        routing.validate().context("routing flags")?;
        Ok(routing)
    }

    /// The same flags as command-line arguments, for a child process (`tandem up
    /// --processes`): parsing them back gives the same [`RoutingArgs::config`].
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            format!("--policy={}", self.policy),
            format!("--overlap-credit={}", self.overlap_credit),
            format!("--host-weight={}", self.host_weight),
            format!("--disk-weight={}", self.disk_weight),
            format!("--prefill-load-scale={}", self.prefill_load_scale),
            format!("--kv-decay={}", self.kv_decay),
            format!("--temperature={}", self.temperature),
            format!("--active-request-weight={}", self.active_request_weight),
            format!(
                "--interactive-decode-weight={}",
                self.interactive_decode_weight
            ),
            format!("--batch-decode-weight={}", self.batch_decode_weight),
            format!("--warmup-s={}", self.warmup_s),
            format!("--cache-aware-balance-abs={}", self.cache_aware_balance_abs),
            format!("--cache-aware-balance-rel={}", self.cache_aware_balance_rel),
            format!("--cache-aware-threshold={}", self.cache_aware_threshold),
            format!("--prefix-hash-tokens={}", self.prefix_hash_tokens),
            format!(
                "--prefix-hash-virtual-nodes={}",
                self.prefix_hash_virtual_nodes
            ),
            format!("--prefix-hash-load-factor={}", self.prefix_hash_load_factor),
            format!("--disagg={}", self.disagg),
            format!("--isl-max-local-tokens={}", self.isl_max_local_tokens),
            format!("--prefill-busy-tokens={}", self.prefill_busy_tokens),
            format!("--isl-compare-local={}", self.isl_compare_local),
            format!("--transfer-cost-host={}", self.transfer_cost_host),
            format!("--transfer-cost-rack={}", self.transfer_cost_rack),
            format!("--transfer-cost-other={}", self.transfer_cost_other),
            format!("--merge-load-reports={}", self.merge_load_reports),
            format!("--kv-events={}", self.route_on_kv_events),
            format!("--session-affinity={}", self.session_affinity),
            format!("--capacity-weights={}", self.capacity_weights),
            format!("--capacity-alpha={}", self.capacity_alpha),
            format!("--capacity-min-busy-ms={}", self.capacity_min_busy_ms),
            format!("--session-ttl-s={}", self.session_ttl_s),
            format!("--session-max={}", self.session_max),
            format!("--tracker-ttl-s={}", self.tracker_ttl_s),
            format!("--kv-approx-ttl-s={}", self.kv_approx_ttl_s),
            format!("--kv-approx-max-entries={}", self.kv_approx_max_entries),
            format!("--adapter-load-cost={}", self.adapter_load_cost),
            format!("--adapter-full-cost={}", self.adapter_full_cost),
            format!("--adapter-ttl-s={}", self.adapter_ttl_s),
        ];
        if let Some(u) = self.busy_kv_usage {
            a.push(format!("--busy-kv-usage={u}"));
        }
        if let Some(t) = self.busy_prefill_tokens {
            a.push(format!("--busy-prefill-tokens={t}"));
        }
        if let Some(f) = self.isl_max_local_fraction {
            a.push(format!("--isl-max-local-fraction={f}"));
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::RoutingArgs;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        routing: RoutingArgs,
    }

    fn parse(args: &[&str]) -> anyhow::Result<RoutingArgs> {
        let argv = std::iter::once("t").chain(args.iter().copied());
        Ok(Cli::try_parse_from(argv)?.routing)
    }

    #[test]
    fn every_knob_reaches_the_config_and_survives_to_args() {
        let a = parse(&[
            "--policy=cache-aware",
            "--overlap-credit=0.5",
            "--host-weight=0.6",
            "--disk-weight=0.1",
            "--prefill-load-scale=2",
            "--kv-decay=1.5",
            "--temperature=0.3",
            "--active-request-weight=4",
            "--interactive-decode-weight=3",
            "--batch-decode-weight=0.25",
            "--busy-kv-usage=0.9",
            "--busy-prefill-tokens=5000",
            "--warmup-s=2.5",
            "--cache-aware-balance-abs=8",
            "--cache-aware-balance-rel=1.2",
            "--cache-aware-threshold=0.4",
            "--prefix-hash-tokens=64",
            "--prefix-hash-virtual-nodes=40",
            "--prefix-hash-load-factor=2",
            "--disagg=isl-or-load",
            "--isl-max-local-tokens=1024",
            "--isl-max-local-fraction=0.5",
            "--prefill-busy-tokens=100",
            "--isl-compare-local",
            "--transfer-cost-host=0.1",
            "--transfer-cost-rack=0.3",
            "--transfer-cost-other=0.9",
            "--merge-load-reports",
            "--kv-events=false",
            "--session-affinity=false",
            "--capacity-weights",
            "--capacity-alpha=0.5",
            "--capacity-min-busy-ms=80",
            "--session-ttl-s=9",
            "--session-max=12",
            "--tracker-ttl-s=60",
            "--kv-approx-ttl-s=5",
            "--kv-approx-max-entries=77",
            "--adapter-load-cost=12.5",
            "--adapter-full-cost=300",
            "--adapter-ttl-s=4.5",
        ])
        .unwrap();
        let c = a.config().unwrap();
        let kv = c.policy.kv;
        assert_eq!(
            (kv.overlap_credit, kv.host_weight, kv.disk_weight),
            (0.5, 0.6, 0.1)
        );
        assert_eq!(
            (kv.prefill_load_scale, kv.decay, kv.temperature),
            (2.0, 1.5, 0.3)
        );
        assert_eq!(kv.active_request_weight, 4.0);
        assert_eq!(
            (kv.interactive_decode_weight, kv.batch_decode_weight),
            (3.0, 0.25)
        );
        assert_eq!(c.pool.busy_kv_usage, Some(0.9));
        assert_eq!(c.pool.busy_prefill_tokens, Some(5000));
        assert_eq!(c.pool.warmup_ms, 2500);
        assert_eq!(c.disagg.decode_pool, c.pool);
        assert_eq!(c.disagg.prefill_pool.warmup_ms, 2500);
        assert_eq!(c.disagg.decode_kv, kv);
        assert_eq!(
            (c.disagg.prefill_kv.decay, c.disagg.prefill_kv.host_weight),
            (1.5, 0.6)
        );
        let ca = c.policy.cache_aware;
        assert_eq!(
            (
                ca.balance_abs_threshold,
                ca.balance_rel_threshold,
                ca.cache_threshold
            ),
            (8, 1.2, 0.4)
        );
        let ph = c.policy.prefix_hash;
        assert_eq!(
            (ph.prefix_tokens, ph.virtual_nodes, ph.load_factor),
            (64, 40, 2.0)
        );
        assert_eq!(c.disagg.isl_max_local_tokens, 1024);
        assert_eq!(c.disagg.isl_max_local_fraction, Some(0.5));
        assert_eq!(c.disagg.prefill_busy_tokens, 100);
        assert!(c.disagg.isl_compare_local);
        let t = c.disagg.transfer;
        assert_eq!((t.same_host, t.same_rack, t.other), (0.1, 0.3, 0.9));
        assert!(c.merge_load_reports);
        assert!(c.approximate_kv);
        assert!(!c.sessions.enabled);
        assert!(c.capacity.enabled);
        assert_eq!((c.capacity.alpha, c.capacity.min_busy_ms), (0.5, 80));
        assert_eq!((c.sessions.ttl_ms, c.sessions.max_sessions), (9000, 12));
        assert_eq!(c.tracker.ttl_ms, 60_000);
        assert_eq!((c.approx.ttl_ms, c.approx.max_entries), (5000, 77));
        assert_eq!(
            (
                c.adapters.load_cost,
                c.adapters.full_cost,
                c.adapters.ttl_ms
            ),
            (12.5, 300.0, 4500)
        );
        // A child process given `to_args` routes alike.
        let args = a.to_args();
        let back = parse(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back.config().unwrap(), c);
        let defaults = parse(&[]).unwrap();
        let back = defaults.to_args();
        let back = parse(&back.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back.config().unwrap(), defaults.config().unwrap());
    }

    #[test]
    fn bad_values_are_refused_with_the_flag_named() {
        for (args, expect) in [
            (
                &["--isl-max-local-fraction=1.5"][..],
                "--isl-max-local-fraction",
            ),
            (&["--kv-decay=-1"][..], "kv decay"),
            (&["--host-weight=NaN"][..], "kv host weight"),
            (&["--warmup-s=-2"][..], "--warmup-s"),
            (&["--prefix-hash-virtual-nodes=0"][..], "virtual nodes"),
            (&["--busy-kv-usage=-0.5"][..], "busy kv usage"),
            (&["--adapter-load-cost=-1"][..], "adapter load cost"),
            (&["--adapter-full-cost=inf"][..], "adapter full cost"),
            (&["--adapter-ttl-s=-3"][..], "--adapter-ttl-s"),
        ] {
            let e = parse(args).and_then(|a| a.config()).unwrap_err();
            assert!(format!("{e:#}").contains(expect), "{args:?}: {e:#}");
        }
    }
}
