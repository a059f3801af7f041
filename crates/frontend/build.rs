//! Compiles the trimmed Envoy ext_proc protos (proto/envoy/) with protox: pure Rust, so no
//! system `protoc` is needed (docs/CONVENTIONS.md §14). Server stubs for `tandem epp`; the well-known
//! `google.protobuf.Struct` comes from prost-types.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(
        ["envoy/service/ext_proc/v3/external_processor.proto"],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(fds)?;
    Ok(())
}
