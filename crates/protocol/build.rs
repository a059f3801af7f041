//! Compiles proto/tandem.proto with protox (pure Rust: no protoc needed for our own protos),
//! when the `grpc` feature is on.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(feature = "grpc")]
    {
        println!("cargo:rerun-if-changed=proto/tandem.proto");
        let fds = protox::compile(["proto/tandem.proto"], ["proto"])?;
        tonic_prost_build::configure().compile_fds(fds)?;
    }
    Ok(())
}
