//! One rate of a bench run: every request of the workload sent at its arrival time (open
//! loop), finished requests collected while later ones are still being sent, and the progress
//! line.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tandem_workload::WorkloadConfig;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::{self, Call, Timed};
use crate::report::Collector;
use crate::{BenchConfig, BenchError, text};

/// Sends every request of `workload` at its arrival time; what they measured.
pub(crate) async fn run_rate(
    config: &BenchConfig,
    http: &reqwest::Client,
    base: &str,
    workload: &WorkloadConfig,
    salt: &str,
) -> Result<Collector, BenchError> {
    let specs = tandem_workload::build(workload, config.seed, config.arrival_jitter_us)?;
    let total = specs.len();
    let limit = Arc::new(Semaphore::new(
        config
            .max_concurrency
            .unwrap_or(Semaphore::MAX_PERMITS)
            .clamp(1, Semaphore::MAX_PERMITS),
    ));
    let done = Arc::new(AtomicUsize::new(0));
    let progress = (config.progress && std::io::stderr().is_terminal())
        .then(|| tokio::spawn(show_progress(done.clone(), total)));
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    let mut collected = Collector::default();
    for spec in specs {
        tokio::time::sleep_until((start + Duration::from_micros(spec.arrival_us)).into()).await;
        // The semaphore is never closed; were it, the request would be sent unthrottled.
        let permit = limit.clone().acquire_owned().await.ok();
        let call = Call {
            api: config.api,
            model: config.model.clone(),
            prompt: format!("{salt} {}", text::prompt_text(&spec.prompt.tokens())),
            max_tokens: spec.max_tokens,
            ignore_eos: config.ignore_eos,
            session: spec.session.map(|s| format!("{salt}-{s}")),
        };
        let (http, base, key) = (http.clone(), base.to_string(), config.api_key.clone());
        let (done, timeout) = (done.clone(), config.timeout);
        let sent_ms = start.elapsed().as_secs_f64() * 1000.0;
        tasks.spawn(async move {
            let r = client::send(&http, &base, key.as_deref(), &call, sent_ms, timeout).await;
            drop(permit);
            done.fetch_add(1, Ordering::Relaxed);
            r
        });
        // Take what has finished, so that finished requests' gaps do not pile up.
        while let Some(r) = tasks.try_join_next() {
            collected.add(joined(r)?);
        }
    }
    while let Some(r) = tasks.join_next().await {
        collected.add(joined(r)?);
    }
    if let Some(p) = progress {
        p.abort();
        eprintln!();
    }
    Ok(collected)
}

/// A request task's result; a task that panicked (nothing aborts them) is a bug of the
/// bench, and ends the run.
fn joined(r: Result<Timed, tokio::task::JoinError>) -> Result<Timed, BenchError> {
    r.map_err(BenchError::Task)
}

async fn show_progress(done: Arc<AtomicUsize>, total: usize) {
    let start = Instant::now();
    loop {
        let n = done.load(Ordering::Relaxed);
        let width = 30;
        let filled = n * width / total.max(1);
        eprint!(
            "\r[{}{}] {n}/{total} done, {:.0} s",
            "#".repeat(filled),
            " ".repeat(width - filled),
            start.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
