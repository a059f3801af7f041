//! deploy/local/run.sh: the topology as processes on this machine.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::common::cluster::{Metrics, wait_for};
use super::common::{self, http};
use super::deploy;

/// deploy/local/run.sh as a child in its own process group, killed with the group on drop.
struct Local {
    child: Child,
    dir: PathBuf,
}

impl Drop for Local {
    fn drop(&mut self) {
        use rustix::process::{Pid, Signal, kill_process_group};
        let pid = Pid::from_raw(self.child.id() as i32).unwrap();
        let _ = kill_process_group(pid, Signal::KILL);
        let _ = self.child.wait();
        if std::thread::panicking() {
            for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "log") {
                    let log = std::fs::read_to_string(&p).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(30).collect();
                    eprintln!("----- {} -----", p.display());
                    tail.iter().rev().for_each(|l| eprintln!("{l}"));
                }
            }
        }
    }
}

#[test]
fn local_topology_serves_through_every_frontend() {
    use std::os::unix::process::CommandExt;
    let dir = common::temp_dir("deploy-local");
    let log = std::fs::File::create(dir.join("run.sh.out")).unwrap();
    let child = Command::new("bash")
        .arg(deploy().join("local/run.sh"))
        .args([
            "--bin",
            env!("CARGO_BIN_EXE_tandem"),
            "--frontends",
            "2",
            "--prefill",
            "1",
            "--decode",
            "2",
            "--dir",
        ])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .process_group(0)
        .spawn()
        .expect("deploy/local/run.sh");
    let mut local = Local {
        child,
        dir: dir.to_path_buf(),
    };
    let started = Instant::now();
    let frontends: Vec<std::net::SocketAddr> =
        wait_for("deploy/local to be ready", Duration::from_secs(240), || {
            if let Some(status) = local.child.try_wait().unwrap() {
                panic!(
                    "run.sh exited during startup ({status}): {}",
                    std::fs::read_to_string(dir.join("run.sh.out")).unwrap()
                );
            }
            let text = std::fs::read_to_string(dir.join("frontends")).ok()?;
            Some(text.lines().map(|l| l.parse().unwrap()).collect())
        });
    assert_eq!(frontends.len(), 2);
    eprintln!("deploy/local ready in {:?}", started.elapsed());
    // Each frontend's status page and /metrics, on its admin listener.
    let admins: Vec<std::net::SocketAddr> = std::fs::read_to_string(dir.join("admins"))
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(admins.len(), 2);
    for (i, addr) in frontends.iter().enumerate() {
        wait_for(
            &format!("frontend {i} to see every worker"),
            Duration::from_secs(60),
            || {
                let r = http::get(admins[i], "/metrics")
                    .ok()
                    .filter(|r| r.status == 200)?;
                let m = Metrics::parse(&r.text());
                (m.0.get("tandem_workers{role=\"decode\"}") == Some(&2.0)
                    && m.0.get("tandem_workers{role=\"prefill\"}") == Some(&1.0))
                .then_some(())
            },
        );
        let body = json!({"messages": [{"role": "user", "content": format!("Hello from the test, frontend {i}")}], "max_tokens": 8});
        let r = http::post_json(*addr, "/v1/chat/completions", &body.to_string())
            .expect("chat completion");
        assert_eq!(r.status, 200, "frontend {i}: {}", r.text());
        let c: Value = r.json();
        assert_eq!(c["usage"]["completion_tokens"], 8, "frontend {i}: {c}");
        assert!(
            r.header("x-tandem-decode-worker").is_some(),
            "frontend {i}: no routing header"
        );
    }
    let pids: Vec<(String, i32)> = std::fs::read_to_string(dir.join("pids"))
        .unwrap()
        .lines()
        .map(|l| {
            let (n, p) = l.split_once(' ').unwrap();
            (n.to_string(), p.parse().unwrap())
        })
        .collect();
    assert_eq!(
        pids.len(),
        2 + 2 + 1 + 2,
        "etcd, nats, 2 frontends, 1 prefill, 2 decode: {pids:?}"
    );
    use rustix::process::{Pid, Signal, kill_process, test_kill_process};
    kill_process(
        Pid::from_raw(local.child.id() as i32).unwrap(),
        Signal::TERM,
    )
    .unwrap();
    let status = wait_for("run.sh to stop", Duration::from_secs(120), || {
        local.child.try_wait().unwrap()
    });
    assert!(status.success(), "run.sh exited with {status}");
    for (n, p) in pids {
        assert!(
            test_kill_process(Pid::from_raw(p).unwrap()).is_err(),
            "{n} (pid {p}) is still running"
        );
    }
}
