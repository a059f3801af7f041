//! The async shell: every interval, scrape the frontends, observe, decide, actuate, log the
//! decision (and append it as one JSON line to `decisions_out`).

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::Pool;
use crate::actuate::Actuator;
use crate::decide::{DecideConfig, Decision, Planner};
use crate::error::PlannerError;
use crate::observe::Observer;
use crate::prom::Scrape;

/// The loop's settings.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Base URLs of the frontends' admin listeners (`http://host:port`); their `/metrics`
    /// is read.
    pub frontends: Vec<String>,
    /// The frontends' admin key, sent with every scrape (`Authorization: Bearer`).
    pub admin_key: Option<AdminKey>,
    pub interval: Duration,
    pub scrape_timeout: Duration,
    /// The quantile (0–1) the TTFT and ITL SLOs are set at.
    pub slo_quantile: f64,
    pub decide: DecideConfig,
    /// Appends one JSON [`Decision`] per interval.
    pub decisions_out: Option<PathBuf>,
}

/// A frontend admin key; `Debug` does not show it.
#[derive(Clone)]
pub struct AdminKey(pub String);

impl std::str::FromStr for AdminKey {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(AdminKey(s.to_string()))
    }
}

impl std::fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminKey(hidden)")
    }
}

/// Runs until `shutdown` is cancelled, then lets the actuator release its workers.
pub async fn run(
    cfg: RunConfig,
    mut actuator: Box<dyn Actuator>,
    shutdown: CancellationToken,
) -> Result<(), PlannerError> {
    cfg.decide.validate().map_err(PlannerError::Config)?;
    if cfg.frontends.is_empty() {
        return Err(PlannerError::Config(
            "no frontend to read metrics from".into(),
        ));
    }
    if !(cfg.slo_quantile > 0.0 && cfg.slo_quantile <= 1.0) {
        return Err(PlannerError::Config(
            "the SLO quantile must be in (0, 1]".into(),
        ));
    }
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(AdminKey(key)) = &cfg.admin_key {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| PlannerError::Config("the admin key is not a header value".into()))?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let http = reqwest::Client::builder()
        .timeout(cfg.scrape_timeout)
        .default_headers(headers)
        .build()
        .map_err(|source| PlannerError::Http {
            method: "build",
            url: String::new(),
            source,
        })?;
    let mut out = match &cfg.decisions_out {
        Some(path) => Some((
            path.clone(),
            std::fs::File::create(path).map_err(|source| PlannerError::Decisions {
                path: path.clone(),
                source,
            })?,
        )),
        None => None,
    };
    let mut planner = Planner::new(cfg.decide.clone());
    // Start within the bounds before the first observation (two scrapes away).
    for pool in Pool::ALL {
        let now = actuator.replicas(pool).await?;
        let want = planner.bounded(pool, now);
        if want != now {
            tracing::info!(%pool, from = now, to = want, "starting within the bounds");
            actuator.set(pool, want).await?;
        }
    }
    let urls: Vec<String> = cfg
        .frontends
        .iter()
        .map(|u| format!("{}/metrics", u.trim_end_matches('/')))
        .collect();
    let mut observer = Observer::new(urls.len(), cfg.slo_quantile);
    let start = Instant::now();
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        tokio::select! {
            () = shutdown.cancelled() => break Ok(()),
            _ = tick.tick() => {}
        }
        let scrapes = futures::future::join_all(urls.iter().map(|u| scrape(&http, u))).await;
        let now = start.elapsed().as_secs_f64();
        let scrapes = scrapes
            .into_iter()
            .map(|s| {
                s.map_err(|e| tracing::warn!(error = %e, "scrape failed"))
                    .ok()
            })
            .collect();
        let Some(obs) = observer.observe(now, scrapes) else {
            continue;
        };
        let current = match (
            actuator.replicas(Pool::Prefill).await,
            actuator.replicas(Pool::Decode).await,
        ) {
            (Ok(p), Ok(d)) => [p, d],
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot read the replica counts; skipping");
                continue;
            }
        };
        let decision = planner.step(now, &obs, current);
        for pool in Pool::ALL {
            let d = decision.pool(pool);
            if d.applied != d.current {
                tracing::info!(%pool, from = d.current, to = d.applied, reason = %d.reason, "scaling");
                if let Err(e) = actuator.set(pool, d.applied).await {
                    tracing::warn!(%pool, error = %e, "scaling failed");
                }
            }
        }
        log(&decision);
        if let Some((path, file)) = &mut out {
            let line = serde_json::to_string(&decision).expect("a decision serializes");
            if let Err(source) = writeln!(file, "{line}").and_then(|()| file.flush()) {
                break Err(PlannerError::Decisions {
                    path: path.clone(),
                    source,
                });
            }
        }
    };
    actuator.shutdown().await?;
    result
}

async fn scrape(http: &reqwest::Client, url: &str) -> Result<Scrape, PlannerError> {
    let err = |source| PlannerError::Scrape {
        url: url.to_string(),
        source,
    };
    let resp = http.get(url).send().await.map_err(err)?;
    let status = resp.status();
    let text = resp.text().await.map_err(err)?;
    if !status.is_success() {
        return Err(PlannerError::Status {
            method: "GET",
            url: url.to_string(),
            status: status.as_u16(),
            body: text.chars().take(200).collect(),
        });
    }
    Scrape::from_text(&text)
}

fn log(d: &Decision) {
    let o = &d.observed;
    let ms = |v: Option<f64>| v.map_or(-1.0, |s| (s * 1e4).round() / 10.0);
    tracing::info!(
        t = format!("{:.1}", d.t),
        rate = format!("{:.2}", o.rate),
        isl = format!("{:.0}", o.isl.unwrap_or(0.0)),
        osl = format!("{:.0}", o.osl.unwrap_or(0.0)),
        hit = format!("{:.2}", o.hit_rate.unwrap_or(0.0)),
        ttft_ms = ms(o.ttft_q),
        itl_ms = ms(o.itl_q),
        predicted_rate = format!("{:.2}", d.predicted.rate),
        prefill = format!(
            "load {:.0} → {:.0} tok/s, f {:.2}, ready {}, {} → wanted {} → {} ({})",
            d.prefill.observed_load,
            d.prefill.predicted_load,
            d.prefill.correction,
            d.prefill.ready,
            d.prefill.current,
            d.prefill.wanted,
            d.prefill.applied,
            d.prefill.reason
        ),
        decode = format!(
            "load {:.0} → {:.0} tok/s, f {:.2}, ready {}, {} → wanted {} → {} ({})",
            d.decode.observed_load,
            d.decode.predicted_load,
            d.decode.correction,
            d.decode.ready,
            d.decode.current,
            d.decode.wanted,
            d.decode.applied,
            d.decode.reason
        ),
        "decision"
    );
}
