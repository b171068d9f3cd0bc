//! Compile proto/pdserve.proto with protox (pure Rust; no system protoc).
#![allow(clippy::unwrap_used, clippy::expect_used)]

fn main() {
    println!("cargo:rerun-if-changed=proto/pdserve.proto");
    let fds = protox::compile(["proto/pdserve.proto"], ["proto"]).expect("compile pdserve.proto");
    tonic_prost_build::configure()
        .compile_fds(fds)
        .expect("generate gRPC code");
}
