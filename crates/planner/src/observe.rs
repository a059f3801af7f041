//! From scrapes to one [`Observation`] per interval: counter deltas over each frontend's own
//! elapsed time, summed over the frontend replicas; latency quantiles from the summed bucket
//! deltas; worker gauges as the frontends agree on them.
//!
//! Rules: a frontend counts in an interval only when it answered both at the start and at
//! the end of it (a frontend that missed a scrape contributes from its next pair); a counter
//! that fell (a restarted frontend) counts its new total as the delta, as Prometheus'
//! `rate()` does. Every frontend sees the same workers, so worker counts are the largest any
//! frontend reports and waiting requests are counted once per worker, not once per frontend.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::Pool;
use crate::prom::{Histogram, Scrape};

/// The cluster over one interval.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Observation {
    /// Seconds the interval lasted (the mean over the frontends that answered).
    pub interval_s: f64,
    /// Frontends that contributed.
    pub frontends: usize,
    /// Generation requests arrived per second (finished, every status, plus the change of
    /// those in flight): the demand, refusals too. Counting arrivals, not completions, keeps
    /// a backlog served after a scale-up from looking like new load.
    pub rate: f64,
    /// Generation requests finished per second, every status.
    pub completed_rate: f64,
    /// Of those, per second, with a status other than 200.
    pub error_rate: f64,
    /// Mean prompt and completion tokens of the requests that got a 200 (None: none did).
    pub isl: Option<f64>,
    pub osl: Option<f64>,
    /// Prompt tokens served from cache, over prompt tokens (None: no prompt tokens).
    pub hit_rate: Option<f64>,
    /// Prompt tokens computed (not cached) per second: the prefill pool's load.
    pub prefill_load: f64,
    /// Completion tokens per second: the decode pool's load.
    pub decode_load: f64,
    /// TTFT and ITL quantiles of the interval, seconds (None: no observations).
    pub ttft_p50: Option<f64>,
    pub ttft_p99: Option<f64>,
    pub itl_p50: Option<f64>,
    pub itl_p99: Option<f64>,
    /// At the planner's SLO quantile.
    pub ttft_q: Option<f64>,
    pub itl_q: Option<f64>,
    /// Workers the frontends see, per pool.
    pub prefill_workers: u32,
    pub decode_workers: u32,
    /// Requests waiting inside the workers' engines, per pool.
    pub prefill_waiting: f64,
    pub decode_waiting: f64,
    /// Requests waiting in the frontends' queues.
    pub queue_depth: f64,
}

impl Observation {
    pub fn workers(&self, pool: Pool) -> u32 {
        match pool {
            Pool::Prefill => self.prefill_workers,
            Pool::Decode => self.decode_workers,
        }
    }

    pub fn load(&self, pool: Pool) -> f64 {
        match pool {
            Pool::Prefill => self.prefill_load,
            Pool::Decode => self.decode_load,
        }
    }
}

/// Keeps each frontend's previous scrape and turns the next round into an [`Observation`].
#[derive(Debug)]
pub struct Observer {
    quantile: f64,
    /// By frontend index: the last scrape and when it was taken (seconds, caller's clock).
    last: Vec<Option<(f64, Scrape)>>,
}

impl Observer {
    /// `quantile` (0–1) is the SLO's: `ttft_q` and `itl_q` are read at it.
    pub fn new(frontends: usize, quantile: f64) -> Self {
        Observer {
            quantile,
            last: vec![None; frontends],
        }
    }

    /// One round of scrapes at `now` (seconds; `None` for a frontend that did not answer).
    /// None until some frontend has answered twice in a row.
    pub fn observe(&mut self, now: f64, scrapes: Vec<Option<Scrape>>) -> Option<Observation> {
        let mut o = Observation::default();
        let (mut ttft, mut itl) = (Histogram::default(), Histogram::default());
        let (mut ok, mut prompt, mut completion, mut cached) = (0.0, 0.0, 0.0, 0.0);
        let mut waiting: BTreeMap<(Pool, String), f64> = BTreeMap::new();
        let mut elapsed = 0.0;
        for (slot, scrape) in self.last.iter_mut().zip(scrapes) {
            let Some(cur) = scrape else {
                *slot = None;
                continue;
            };
            if let Some((then, prev)) = slot.as_ref() {
                let dt = now - then;
                if dt > 0.0 {
                    let d = |c: f64, p: f64| if c >= p { c - p } else { c };
                    let d_ok = d(cur.requests_ok, prev.requests_ok);
                    let d_failed = d(cur.requests_failed, prev.requests_failed);
                    let d_prompt = d(cur.prompt_tokens, prev.prompt_tokens);
                    let d_cached = d(cur.cached_tokens, prev.cached_tokens).min(d_prompt);
                    let d_completion = d(cur.completion_tokens, prev.completion_tokens);
                    o.frontends += 1;
                    elapsed += dt;
                    let arrived = (d_ok + d_failed + cur.in_flight - prev.in_flight).max(0.0);
                    o.rate += arrived / dt;
                    o.completed_rate += (d_ok + d_failed) / dt;
                    o.error_rate += d_failed / dt;
                    o.prefill_load += (d_prompt - d_cached) / dt;
                    o.decode_load += d_completion / dt;
                    ok += d_ok;
                    prompt += d_prompt;
                    cached += d_cached;
                    completion += d_completion;
                    ttft.add(&cur.ttft.since(&prev.ttft));
                    itl.add(&cur.itl.since(&prev.itl));
                }
            }
            o.prefill_workers = o.prefill_workers.max(cur.prefill_workers as u32);
            o.decode_workers = o.decode_workers.max(cur.decode_workers as u32);
            for (k, v) in &cur.waiting {
                let e = waiting.entry(k.clone()).or_insert(0.0);
                *e = e.max(*v);
            }
            o.queue_depth += cur.queue_depth;
            *slot = Some((now, cur));
        }
        if o.frontends == 0 {
            return None;
        }
        o.interval_s = elapsed / o.frontends as f64;
        o.isl = (ok > 0.0).then(|| prompt / ok);
        o.osl = (ok > 0.0).then(|| completion / ok);
        o.hit_rate = (prompt > 0.0).then(|| cached / prompt);
        o.ttft_p50 = ttft.quantile(0.5);
        o.ttft_p99 = ttft.quantile(0.99);
        o.ttft_q = ttft.quantile(self.quantile);
        o.itl_p50 = itl.quantile(0.5);
        o.itl_p99 = itl.quantile(0.99);
        o.itl_q = itl.quantile(self.quantile);
        for ((pool, _), v) in waiting {
            match pool {
                Pool::Prefill => o.prefill_waiting += v,
                Pool::Decode => o.decode_waiting += v,
            }
        }
        Some(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(ok: f64, prompt: f64, cached: f64, completion: f64, ttft: &[(f64, f64)]) -> Scrape {
        Scrape {
            requests_ok: ok,
            prompt_tokens: prompt,
            cached_tokens: cached,
            completion_tokens: completion,
            ttft: Histogram {
                buckets: ttft.to_vec(),
            },
            decode_workers: 2.0,
            prefill_workers: 1.0,
            ..Scrape::default()
        }
    }

    const INF: f64 = f64::INFINITY;

    #[test]
    fn two_frontends_sum_and_the_workers_count_once() {
        let mut obs = Observer::new(2, 0.9);
        let mut a0 = scrape(10.0, 1000.0, 0.0, 100.0, &[(0.1, 10.0), (INF, 10.0)]);
        a0.waiting.insert((Pool::Decode, "7".into()), 2.0);
        let b0 = scrape(0.0, 0.0, 0.0, 0.0, &[(0.1, 0.0), (INF, 0.0)]);
        assert_eq!(obs.observe(0.0, vec![Some(a0.clone()), Some(b0)]), None);
        // Over 2 s: A finishes 10 requests (1000 prompt tokens, 400 cached, 200 completion),
        // B 6 (600, 0, 120) of which 2 were refused.
        let mut a1 = scrape(20.0, 2000.0, 400.0, 300.0, &[(0.1, 15.0), (INF, 20.0)]);
        a1.waiting = a0.waiting.clone();
        let mut b1 = scrape(4.0, 600.0, 0.0, 120.0, &[(0.1, 4.0), (INF, 4.0)]);
        b1.requests_failed = 2.0;
        // B also has 4 more requests in flight than at the start: arrived, not finished.
        b1.in_flight = 4.0;
        b1.waiting = a0.waiting.clone();
        let o = obs.observe(2.0, vec![Some(a1), Some(b1)]).unwrap();
        assert_eq!(o.frontends, 2);
        assert_eq!(o.completed_rate, 10.0 / 2.0 + 6.0 / 2.0);
        assert_eq!(o.rate, 10.0 / 2.0 + 10.0 / 2.0);
        assert_eq!(o.error_rate, 1.0);
        assert_eq!(o.isl, Some(1600.0 / 14.0));
        assert_eq!(o.osl, Some(320.0 / 14.0));
        assert_eq!(o.hit_rate, Some(400.0 / 1600.0));
        assert_eq!(o.prefill_load, (1000.0 - 400.0) / 2.0 + 600.0 / 2.0);
        assert_eq!(o.decode_load, 160.0);
        // 14 TTFTs: 9 ≤ 0.1 s, 5 above. p90 is in +Inf: the highest finite bound.
        assert_eq!(o.ttft_q, Some(0.1));
        assert_eq!((o.prefill_workers, o.decode_workers), (1, 2));
        // The same worker's gauge seen through two frontends counts once.
        assert_eq!(o.decode_waiting, 2.0);
    }

    #[test]
    fn a_missed_scrape_and_a_restart() {
        let mut obs = Observer::new(1, 0.5);
        let s = |ok| scrape(ok, ok * 100.0, 0.0, ok * 10.0, &[(1.0, ok), (INF, ok)]);
        obs.observe(0.0, vec![Some(s(100.0))]);
        // A missed scrape: no observation, and the next one only starts a new pair.
        assert_eq!(obs.observe(1.0, vec![None]), None);
        assert_eq!(obs.observe(2.0, vec![Some(s(110.0))]), None);
        let o = obs.observe(3.0, vec![Some(s(113.0))]).unwrap();
        assert_eq!(o.rate, 3.0);
        // Restarted: counters at 4 are 4 new requests, not −109.
        let o = obs.observe(4.0, vec![Some(s(4.0))]).unwrap();
        assert_eq!(o.rate, 4.0);
        assert_eq!(o.prefill_load, 400.0);
    }
}
