//! Compile proto/pdserve.proto with protox (pure Rust; no system protoc).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/pdserve.proto");
    let fds = protox::compile(["proto/pdserve.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
