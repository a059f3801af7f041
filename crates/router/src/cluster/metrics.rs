//! The cluster view's gauges on the frontend's `/metrics`: workers known per pool, the KV
//! index's size, and the feed's counters (events applied, gaps, repairs, dumps, purges).
//! Refreshed from the view every [`REFRESH`] by one task, so a scrape never takes the
//! index lock.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::view::ClusterView;

const REFRESH: Duration = Duration::from_millis(250);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabel {
    role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CounterLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// What the backend counts per request: how prompts were prefilled (from the decode worker's
/// first chunk), re-routes before the first token, migrations after it.
#[derive(Debug, Default)]
pub struct RouteCounters {
    prefill: Family<OutcomeLabel, Counter>,
    reroutes: Counter,
    migrations: Counter,
}

impl RouteCounters {
    /// `prefill` as reported on a first chunk (`tandem.v1.PrefillOutcome`).
    pub fn prefill(&self, outcome: i32) {
        use tandem_protocol::grpc::PrefillOutcome;
        let outcome = match PrefillOutcome::try_from(outcome) {
            Ok(PrefillOutcome::Local) => "local",
            Ok(PrefillOutcome::Remote) => "remote",
            Ok(PrefillOutcome::Fallback) => "fallback",
            _ => "unknown",
        };
        self.prefill.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    pub fn reroute(&self) {
        self.reroutes.inc();
    }

    pub fn migration(&self) {
        self.migrations.inc();
    }

    pub fn register(registry: &mut Registry) -> Arc<Self> {
        let c = Arc::new(RouteCounters::default());
        registry.register(
            "tandem_prefills",
            "Requests by how their prompt was prefilled: local, remote, or fallback (a remote \
             prefill that failed and was done locally)",
            c.prefill.clone(),
        );
        registry.register(
            "tandem_reroutes",
            "Decode workers that failed a request before its first token (it went elsewhere)",
            c.reroutes.clone(),
        );
        registry.register(
            "tandem_migrations",
            "Requests moved to another decode worker after their worker failed mid-stream",
            c.migrations.clone(),
        );
        c
    }
}

/// Registers the gauges and starts the task that refreshes them.
pub fn register(
    registry: &mut Registry,
    view: Arc<ClusterView>,
    tasks: &TaskTracker,
    cancel: CancellationToken,
) {
    let workers = Family::<RoleLabel, Gauge>::default();
    let index_workers = Gauge::<i64>::default();
    let index_entries = Gauge::<i64>::default();
    let feed = Family::<CounterLabel, Gauge>::default();
    registry.register(
        "tandem_workers",
        "Workers in discovery, by pool",
        workers.clone(),
    );
    registry.register(
        "tandem_index_workers",
        "Workers the KV index tracks (dumped when they join, purged when they leave), with or \
         without blocks",
        index_workers.clone(),
    );
    registry.register(
        "tandem_index_entries",
        "(block, worker) entries in the KV index",
        index_entries.clone(),
    );
    registry.register(
        "tandem_index_feed",
        "KV index feed counters since start: events_applied, gaps, repairs, dumps, purges",
        feed.clone(),
    );
    let gauges = ViewGauges {
        workers,
        index_workers,
        index_entries,
        feed,
    };
    // Once now, so that every series is on `/metrics` from the first scrape.
    gauges.refresh(&view);
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(REFRESH);
        loop {
            tokio::select! {
                _ = tick.tick() => gauges.refresh(&view),
                _ = cancel.cancelled() => return,
            }
        }
    });
}

/// The view's gauges, set from the view on each refresh.
struct ViewGauges {
    workers: Family<RoleLabel, Gauge>,
    index_workers: Gauge<i64>,
    index_entries: Gauge<i64>,
    feed: Family<CounterLabel, Gauge>,
}

impl ViewGauges {
    fn refresh(&self, view: &ClusterView) {
        let (d, p) = {
            let reg = view.registry();
            (reg.decode.len(), reg.prefill.len())
        };
        self.workers
            .get_or_create(&RoleLabel { role: "decode" })
            .set(d as i64);
        self.workers
            .get_or_create(&RoleLabel { role: "prefill" })
            .set(p as i64);
        let (w, e) = view.index_size();
        self.index_workers.set(w as i64);
        self.index_entries.set(e as i64);
        let s = view.feed_stats();
        for (kind, v) in [
            ("events_applied", s.events_applied),
            ("gaps", s.gaps),
            ("repairs", s.repairs),
            ("dumps", s.dumps_applied),
            ("purges", s.workers_purged),
        ] {
            self.feed
                .get_or_create(&CounterLabel { kind })
                .set(v as i64);
        }
    }
}
