//! The requests of a run: arrival times, output lengths and compact prompt descriptions, turned
//! into token ids only when a request arrives (100,000 prompts held as tokens would take GBs).
//!
//! Synthetic prompts are made of *streams*: token `i` of stream `s` is a fixed function of
//! `(s, i)`, so two prompts that start with the same stream share exactly that prefix. A
//! shared-prefix request is its group's stream then its own; a multi-turn request is the first
//! `n` tokens of its session's stream, `n` growing turn by turn.

use tandem_protocol::Rng;

use crate::arrivals::{Arrivals, draw};
use crate::config::{PromptShape, SyntheticConfig, WorkloadConfig};
use crate::error::WorkloadError;
use crate::trace::{TraceRecord, expand_tokens, load_trace};

/// Vocabulary of synthetic tokens (the mocker's default).
const VOCAB: u64 = 32_000;

/// One request before it arrives.
#[derive(Clone, Debug)]
pub struct RequestSpec {
    pub arrival_us: u64,
    pub max_tokens: u32,
    pub prompt: PromptSpec,
    /// The conversation it belongs to (multi-turn workloads), for session affinity.
    pub session: Option<u64>,
    /// Its LoRA adapter (index into the workload's [`crate::AdapterMix`], named by
    /// [`crate::AdapterMix::name`]); `None`: the base model.
    pub adapter: Option<u32>,
}

/// A prompt, to be expanded into tokens at arrival.
#[derive(Clone, Debug)]
pub enum PromptSpec {
    Trace(TraceRecord),
    /// Up to two streams back to back: `(stream id, tokens)`; a zero length is skipped.
    Streams([(u64, u32); 2]),
}

impl PromptSpec {
    #[allow(clippy::len_without_is_empty)] // a prompt is never empty
    pub fn len(&self) -> usize {
        match self {
            PromptSpec::Trace(r) => r.input_length as usize,
            PromptSpec::Streams(s) => s.iter().map(|&(_, n)| n as usize).sum(),
        }
    }

    pub fn tokens(&self) -> Vec<u32> {
        match self {
            PromptSpec::Trace(r) => expand_tokens(r),
            PromptSpec::Streams(streams) => {
                let mut out = Vec::with_capacity(self.len());
                for &(s, n) in streams {
                    out.extend((0..u64::from(n)).map(|i| stream_token(s, i)));
                }
                out
            }
        }
    }
}

/// SplitMix64's finalizer: a cheap, well-mixed function of one word.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn stream_token(stream: u64, i: u64) -> u32 {
    (mix(stream ^ mix(i)) % VOCAB) as u32
}

/// Stream ids of different kinds never collide: the kind sits in the top byte.
fn stream_id(seed: u64, kind: u8, n: u64) -> u64 {
    (mix(seed ^ (u64::from(kind) << 56) ^ n) & 0x00ff_ffff_ffff_ffff) | (u64::from(kind) << 56)
}

/// The requests of a workload, ordered by arrival (ties by generation order), the first
/// generated arrival at 0.
///
/// With `jitter_us > 0`, each arrival is then moved later by an offset uniform in
/// `[0, jitter_us)` µs, drawn in that order from the workload's random stream (the one synthetic
/// workloads draw from, continued after them; seeded from `seed` alone, so same seed, same
/// offsets), and the requests are sorted again, stably: ties still go by generation order. The
/// time origin stays the first *generated* arrival, so request `k` arrives in `[t_k, t_k + J)`.
/// With 0 nothing is drawn and the result is exactly the unjittered one.
///
/// `cfg` is validated first ([`WorkloadConfig::validate`]).
pub fn build(
    cfg: &WorkloadConfig,
    seed: u64,
    jitter_us: u64,
) -> Result<Vec<RequestSpec>, WorkloadError> {
    cfg.validate()?;
    let mut rng = Rng::seed_from_u64(seed ^ 0x574f_524b_4c4f_4144);
    let mut specs = match cfg {
        WorkloadConfig::Trace(t) => {
            let mut recs = load_trace(&t.path)?;
            if let Some(limit) = t.limit {
                recs.truncate(limit);
            }
            recs.into_iter()
                .map(|r| RequestSpec {
                    arrival_us: (r.timestamp as f64 * 1000.0 / t.arrival_speedup).round() as u64,
                    max_tokens: r.output_length.max(1),
                    prompt: PromptSpec::Trace(r),
                    // Mooncake records name no session and no adapter.
                    session: None,
                    adapter: None,
                })
                .collect()
        }
        WorkloadConfig::Synthetic(s) => synthetic(s, seed, &mut rng),
    };
    if specs.is_empty() {
        return Err(WorkloadError::Empty);
    }
    specs.sort_by_key(|s| s.arrival_us); // stable: ties keep generation order
    let first = specs[0].arrival_us;
    for s in &mut specs {
        s.arrival_us -= first;
    }
    if jitter_us > 0 {
        for s in &mut specs {
            s.arrival_us = s.arrival_us.saturating_add(below_u64(&mut rng, jitter_us));
        }
        specs.sort_by_key(|s| s.arrival_us); // stable again
    }
    Ok(specs)
}

/// Uniform in `0..n` (`n > 0`): the high word of a 64×64-bit product, so always below `n`
/// (bias under n / 2⁶⁴, nothing at µs scales).
fn below_u64(rng: &mut Rng, n: u64) -> u64 {
    ((u128::from(rng.next_u64()) * u128::from(n)) >> 64) as u64
}

/// Draws adapters from a [`crate::AdapterMix`]: cumulative Zipf weights, searched.
struct AdapterDraw {
    cumulative: Vec<f64>,
}

impl AdapterDraw {
    fn new(mix: crate::AdapterMix) -> Self {
        let mut total = 0.0;
        let cumulative = (0..mix.count)
            .map(|k| {
                total += 1.0 / f64::from(k + 1).powf(mix.skew);
                total
            })
            .collect();
        AdapterDraw { cumulative }
    }

    /// None without adapters (and then nothing is drawn, so workloads without adapters keep
    /// their random stream).
    fn draw(&self, rng: &mut Rng) -> Option<u32> {
        let total = *self.cumulative.last()?;
        let x = rng.unit_f64() * total;
        let k = self.cumulative.partition_point(|&c| c <= x);
        Some(k.min(self.cumulative.len() - 1) as u32)
    }
}

fn synthetic(cfg: &SyntheticConfig, seed: u64, rng: &mut Rng) -> Vec<RequestSpec> {
    let mut arrivals = Arrivals::new(cfg.arrival, cfg.rate);
    let adapters = AdapterDraw::new(cfg.adapters);
    let mut out = Vec::with_capacity(cfg.requests);
    match cfg.shape {
        PromptShape::Random | PromptShape::SharedPrefix { .. } => {
            for i in 0..cfg.requests as u64 {
                let at = arrivals.next(rng);
                let own = (stream_id(seed, 1, i), draw(cfg.isl, rng));
                let prefix = match cfg.shape {
                    PromptShape::SharedPrefix { groups, prefix_len } => {
                        let g = rng.below(groups as usize) as u64;
                        (stream_id(seed, 2, g), prefix_len)
                    }
                    _ => (0, 0),
                };
                out.push(RequestSpec {
                    arrival_us: at,
                    max_tokens: draw(cfg.osl, rng),
                    prompt: PromptSpec::Streams([prefix, own]),
                    session: None,
                    adapter: adapters.draw(rng),
                });
            }
        }
        PromptShape::MultiTurn {
            turns,
            think_time_us,
        } => {
            let mut session = 0u64;
            while out.len() < cfg.requests {
                let start = arrivals.next(rng);
                let stream = stream_id(seed, 3, session);
                let adapter = adapters.draw(rng);
                let mut history = 0u32;
                for k in 0..turns {
                    if out.len() == cfg.requests {
                        break;
                    }
                    let user = draw(cfg.isl, rng);
                    let answer = draw(cfg.osl, rng);
                    out.push(RequestSpec {
                        arrival_us: start + u64::from(k) * think_time_us,
                        max_tokens: answer,
                        prompt: PromptSpec::Streams([(stream, history + user), (0, 0)]),
                        session: Some(stream),
                        adapter,
                    });
                    history += user + answer;
                }
                session += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ArrivalProcess, LengthDist};

    fn cfg(shape: PromptShape, arrival: ArrivalProcess) -> WorkloadConfig {
        WorkloadConfig::Synthetic(SyntheticConfig {
            requests: 2000,
            rate: 100.0,
            arrival,
            isl: LengthDist {
                mean: 64,
                spread: 0.5,
            },
            osl: LengthDist::fixed(8),
            shape,
            adapters: crate::AdapterMix::default(),
        })
    }

    #[test]
    fn adapters_follow_zipf_and_sessions_keep_theirs() {
        let with = |shape, count| {
            let WorkloadConfig::Synthetic(mut c) = cfg(shape, ArrivalProcess::Poisson) else {
                unreachable!()
            };
            c.adapters = crate::AdapterMix { count, skew: 1.0 };
            build(&WorkloadConfig::Synthetic(c), 3, 0).unwrap()
        };
        let specs = with(PromptShape::Random, 4);
        let mut counts = [0usize; 4];
        for s in &specs {
            counts[s.adapter.unwrap() as usize] += 1;
        }
        // Weights 1, 1/2, 1/3, 1/4 of 2.083: 48 %, 24 %, 16 %, 12 % of 2,000.
        for (k, expect) in [(0, 960.0), (1, 480.0), (2, 320.0), (3, 240.0)] {
            let got = counts[k] as f64;
            assert!((got - expect).abs() < 0.15 * expect, "adapter {k}: {got}");
        }
        // No adapters: none drawn, and the workload is the one it always was.
        let none = with(PromptShape::Random, 0);
        assert!(none.iter().all(|s| s.adapter.is_none()));
        let plain = build(&cfg(PromptShape::Random, ArrivalProcess::Poisson), 3, 0).unwrap();
        let key = |v: &[RequestSpec]| {
            v.iter()
                .map(|s| (s.arrival_us, s.prompt.len()))
                .collect::<Vec<_>>()
        };
        assert_eq!(key(&none), key(&plain));
        // A session's turns share one adapter.
        let turns = with(
            PromptShape::MultiTurn {
                turns: 4,
                think_time_us: 1000,
            },
            8,
        );
        let mut by_session = std::collections::HashMap::new();
        for s in &turns {
            let a = by_session.entry(s.session.unwrap()).or_insert(s.adapter);
            assert_eq!(*a, s.adapter);
        }
    }

    fn trace(limit: usize) -> WorkloadConfig {
        WorkloadConfig::Trace(crate::config::TraceWorkload {
            path: std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../traces/conversation_trace.jsonl"),
            arrival_speedup: 1.0,
            limit: Some(limit),
        })
    }

    /// A trace request's unjittered arrival (speedup 1, first timestamp 0 in this trace).
    fn trace_time_us(s: &RequestSpec) -> u64 {
        match &s.prompt {
            PromptSpec::Trace(r) => r.timestamp * 1000,
            PromptSpec::Streams(_) => unreachable!(),
        }
    }

    #[test]
    fn arrival_jitter_spreads_trace_buckets_within_the_window() {
        let plain = build(&trace(50), 9, 0).unwrap();
        assert!(plain.iter().all(|s| s.arrival_us == trace_time_us(s)));
        let distinct: std::collections::BTreeSet<u64> =
            plain.iter().map(|s| s.arrival_us).collect();
        assert!(distinct.len() < 20, "the trace's first 50 share timestamps");

        let j = 1_000_000; // 1 s
        let jit = build(&trace(50), 9, j).unwrap();
        assert_eq!(jit.len(), 50);
        let times: std::collections::BTreeSet<u64> = jit.iter().map(|s| s.arrival_us).collect();
        assert_eq!(times.len(), 50, "no two requests share an arrival time");
        assert!(jit.windows(2).all(|w| w[0].arrival_us < w[1].arrival_us));
        for s in &jit {
            let t = trace_time_us(s);
            assert!(
                (t..t + j).contains(&s.arrival_us),
                "{} vs {t}",
                s.arrival_us
            );
        }
        // Same seed, same offsets; another seed, others.
        let again = build(&trace(50), 9, j).unwrap();
        let arrivals = |v: &[RequestSpec]| v.iter().map(|s| s.arrival_us).collect::<Vec<_>>();
        assert_eq!(arrivals(&jit), arrivals(&again));
        assert_ne!(arrivals(&jit), arrivals(&build(&trace(50), 10, j).unwrap()));
    }

    #[test]
    fn a_one_microsecond_jitter_draws_but_keeps_order_and_times() {
        // Every offset is 0, so the re-sort must keep ties in generation order.
        let key = |v: Vec<RequestSpec>| {
            v.into_iter()
                .map(|s| (s.arrival_us, s.max_tokens, s.prompt.len()))
                .collect::<Vec<_>>()
        };
        for w in [
            trace(200),
            cfg(PromptShape::Random, ArrivalProcess::Poisson),
        ] {
            assert_eq!(key(build(&w, 4, 0).unwrap()), key(build(&w, 4, 1).unwrap()));
        }
    }

    #[test]
    fn synthetic_jitter_moves_arrivals_but_not_prompts() {
        let w = cfg(
            PromptShape::SharedPrefix {
                groups: 4,
                prefix_len: 16,
            },
            ArrivalProcess::Constant,
        );
        let plain = build(&w, 5, 0).unwrap();
        let jit = build(&w, 5, 5_000).unwrap(); // 5 ms against 10 ms gaps: order kept
        assert_ne!(
            plain.iter().map(|s| s.arrival_us).collect::<Vec<_>>(),
            jit.iter().map(|s| s.arrival_us).collect::<Vec<_>>()
        );
        for (a, b) in plain.iter().zip(&jit) {
            assert!((a.arrival_us..a.arrival_us + 5_000).contains(&b.arrival_us));
            assert_eq!(a.max_tokens, b.max_tokens);
            assert_eq!(a.prompt.tokens(), b.prompt.tokens());
        }
    }

    #[test]
    fn poisson_and_gamma_rates_are_close_to_the_target() {
        for arrival in [
            ArrivalProcess::Poisson,
            ArrivalProcess::Gamma { shape: 0.25 },
            ArrivalProcess::Constant,
        ] {
            let specs = build(&cfg(PromptShape::Random, arrival), 1, 0).unwrap();
            let span_s = specs.last().unwrap().arrival_us as f64 / 1e6;
            let rate = 1999.0 / span_s;
            assert!((70.0..130.0).contains(&rate), "{arrival:?}: {rate}");
        }
    }

    #[test]
    fn shared_prefix_groups_share_exactly_the_prefix() {
        let shape = PromptShape::SharedPrefix {
            groups: 2,
            prefix_len: 32,
        };
        let specs = build(&cfg(shape, ArrivalProcess::Poisson), 3, 0).unwrap();
        let toks: Vec<Vec<u32>> = specs.iter().take(20).map(|s| s.prompt.tokens()).collect();
        let heads: std::collections::BTreeSet<&[u32]> = toks.iter().map(|t| &t[..32]).collect();
        assert_eq!(heads.len(), 2);
        assert!(toks.iter().all(|t| (32 + 32..=32 + 96).contains(&t.len())));
    }

    #[test]
    fn multi_turn_prompts_extend_the_previous_turn() {
        let shape = PromptShape::MultiTurn {
            turns: 3,
            think_time_us: 1_000_000,
        };
        let specs = build(&cfg(shape, ArrivalProcess::Constant), 3, 0).unwrap();
        assert_eq!(specs.len(), 2000);
        let mut by_stream: std::collections::BTreeMap<u64, Vec<Vec<u32>>> = Default::default();
        for s in specs.iter().take(900) {
            if let PromptSpec::Streams([(id, _), _]) = s.prompt {
                by_stream.entry(id).or_default().push(s.prompt.tokens());
            }
        }
        let turns = by_stream.values().find(|v| v.len() == 3).unwrap();
        assert!(turns[1].starts_with(&turns[0]) && turns[2].starts_with(&turns[1]));
    }
}
