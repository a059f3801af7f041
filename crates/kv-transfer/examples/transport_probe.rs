//! Prints which transport `default_kind()` picks on this machine and why: the UCX probe's
//! outcome (UCX's version, or the error, e.g. "UCX not found (libucp.so.0: ...)" where libucx0
//! is not installed) and the crate's own log line.
//!
//! `cargo run -p tandem-kv-transfer --example transport_probe`

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    #[cfg(feature = "ucx")]
    match tandem_kv_transfer::ucx::probe(&tandem_kv_transfer::UcxConfig::default()) {
        Ok(version) => println!("ucx probe: UCX {version}"),
        Err(e) => println!("ucx probe: {e} (class {:?})", e.class()),
    }
    println!("default_kind: {}", tandem_kv_transfer::default_kind());
}
