//! Compiles our trimmed etcd v3 protos (proto/etcd/) with protox: pure Rust, so building this
//! crate needs no system `protoc` (docs/CONVENTIONS.md §14). Client stubs only: we never serve etcd.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/etcd/rpc.proto");
    println!("cargo:rerun-if-changed=proto/etcd/kv.proto");
    let fds = protox::compile(["proto/etcd/rpc.proto"], ["proto/etcd"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
