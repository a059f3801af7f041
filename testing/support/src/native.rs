//! `tandem up --model` on the SmolLM2-135M GGUF (scripts/test.sh fetches it into
//! target/models), for the tests that serve the real model.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::cluster::wait_for;
use super::http;
use super::proc::Proc;

#[derive(Debug)]
pub struct Up {
    pub proc: Proc,
    pub addr: SocketAddr,
    /// The frontend's admin listener: its status page, `/status.json`, `/metrics`.
    pub admin: SocketAddr,
    /// Its log's directory, removed after the process stops (fields drop after `drop`).
    pub dir: super::TestDir,
}

impl Drop for Up {
    fn drop(&mut self) {
        self.proc.signal("INT");
        if self.proc.wait_exit(Duration::from_secs(60)).is_none() {
            self.proc.kill9();
        }
    }
}

pub fn model_path() -> PathBuf {
    let model = super::repo().join("target/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        model.exists(),
        "{} is missing: scripts/test.sh fetches it",
        model.display()
    );
    model
}

/// `tandem up --model MODEL` with one prefill and one decode worker, once the frontend sees
/// both.
pub fn up(tag: &str, model: &str, extra: &[&str]) -> Up {
    let dir = super::temp_dir(tag);
    // In one process, port 0 for both listeners: `tandem up` prints the addresses it bound,
    // so no other process can take a port between its choice and its use. With --processes
    // the frontend is a child that binds them: free ports, chosen here.
    let processes = extra.contains(&"--processes");
    let (port, admin_port) = if processes {
        let free = || tandem_runtime::external::free_port().unwrap();
        (free(), free())
    } else {
        (0, 0)
    };
    let mut args: Vec<String> = vec![
        "up".into(),
        "--port".into(),
        port.to_string(),
        format!("--admin-listen=127.0.0.1:{admin_port}"),
        "--model".into(),
        model.to_string(),
        "--prefill".into(),
        "1".into(),
        "--decode".into(),
        "1".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut proc = Proc::spawn(tag, "up", &args, &dir.join("up.log"));
    let (addr, admin) = if processes {
        let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
        (at(port), at(admin_port))
    } else {
        wait_for(
            "tandem up to print its addresses",
            Duration::from_secs(120),
            || {
                assert!(proc.is_running(), "tandem up exited:\n{}", proc.log());
                bound_addresses(&proc.log())
            },
        )
    };
    // Both workers in the frontend's view: a request sent before the prefill worker
    // registers is prefilled on the decode worker whatever --disagg says.
    wait_for(
        "tandem up's frontend to see both workers",
        Duration::from_secs(120),
        || {
            assert!(proc.is_running(), "tandem up exited:\n{}", proc.log());
            let m = http::get(admin, "/metrics")
                .ok()
                .filter(|r| r.status == 200)?;
            let m = super::metrics::Metrics::parse(&m.text());
            let seen =
                |role: &str| m.0.get(&format!("tandem_workers{{role=\"{role}\"}}")) == Some(&1.0);
            (seen("decode") && seen("prefill")).then_some(())
        },
    );
    Up {
        proc,
        addr,
        admin,
        dir,
    }
}

/// The frontend's and its admin listener's addresses, once `tandem up` has printed both
/// (`tandem up: http://ADDR/v1 …`, `tandem up: status page and /metrics on http://ADDR/`).
pub fn bound_addresses(log: &str) -> Option<(SocketAddr, SocketAddr)> {
    let after = |prefix: &str, end: char| -> Option<SocketAddr> {
        let line = log.lines().find(|l| l.starts_with(prefix))?;
        line[prefix.len()..].split(end).next()?.parse().ok()
    };
    Some((
        after("tandem up: http://", '/')?,
        after("tandem up: status page and /metrics on http://", '/')?,
    ))
}
