//! The stand-in engine (`tandem-standin`, a vLLM / SGLang stand-in) behind a worker of a
//! test cluster ([`super::cluster::Cluster::spawn_engine`] starts it).

use std::net::SocketAddr;

use super::http;
use super::metrics::Metrics;
use super::proc::Proc;

/// A stand-in engine process behind a worker.
#[derive(Debug)]
pub struct Engine {
    pub id: u64,
    /// Its HTTP API.
    pub addr: SocketAddr,
    pub kv_events: String,
    pub kv_replay: String,
    pub proc: Proc,
}

impl Engine {
    /// The engine's own `/metrics`.
    pub fn metrics(&self) -> Metrics {
        let r = http::get(self.addr, "/metrics").expect("engine /metrics");
        Metrics::parse(&r.text())
    }

    /// Fault injection: the engine's next KV event batch is not published (only replayable).
    pub fn drop_next_event(&self) {
        let r = http::post_json(self.addr, "/standin/drop-next-event", "{}").unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
}
