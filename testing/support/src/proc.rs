//! A child process of a test, with its output in a log file: signalled, waited for, killed
//! and reaped on drop (the clusters, the stand-ins and `tandem up` all run as these).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A child process with its output in a log file; killed and reaped on drop.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    /// The worker id, for workers.
    pub worker_id: Option<u64>,
    pub role: &'static str,
    child: Child,
    log: PathBuf,
    exit: Option<ExitStatus>,
}

impl Proc {
    /// Starts the `tandem` binary with `args`, stdout and stderr into `log`.
    pub fn spawn(name: &str, role: &'static str, args: &[String], log: &Path) -> Proc {
        Proc::spawn_bin(super::bin("tandem"), name, role, args, log)
    }

    /// Starts `bin` with `args`, stdout and stderr into `log`.
    pub fn spawn_bin(
        bin: impl AsRef<std::ffi::OsStr>,
        name: &str,
        role: &'static str,
        args: &[String],
        log: &Path,
    ) -> Proc {
        let out = std::fs::File::create(log).unwrap();
        let err = out.try_clone().unwrap();
        let child = Command::new(bin)
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        Proc {
            name: name.to_string(),
            worker_id: None,
            role,
            child,
            log: log.to_path_buf(),
            exit: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`TERM`, `INT`, `STOP`, `CONT`).
    pub fn signal(&self, sig: &str) {
        use rustix::process::{Pid, Signal, kill_process};
        let signal = match sig {
            "TERM" => Signal::TERM,
            "INT" => Signal::INT,
            "STOP" => Signal::STOP,
            "CONT" => Signal::CONT,
            other => panic!("no signal {other} here"),
        };
        let pid = Pid::from_raw(self.pid() as i32).expect("a child's pid");
        kill_process(pid, signal)
            .unwrap_or_else(|e| panic!("kill -{sig} {} failed: {e}", self.name));
    }

    /// SIGKILL, and reaps it: a crash, as far as the rest of the cluster can tell.
    pub fn kill9(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            self.exit = self.child.wait().ok();
        }
    }

    /// The exit status, once it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().ok().flatten();
        }
        self.exit
    }

    pub fn is_running(&mut self) -> bool {
        self.exited().is_none()
    }

    /// Waits up to `timeout` for it to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub(crate) fn print_tail(&self) {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let from = lines.len().saturating_sub(80);
        eprintln!(
            "----- {} ({}), last lines -----",
            self.name,
            self.log.display()
        );
        for l in &lines[from..] {
            eprintln!("{l}");
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}
