//! Compiles the protocol with the pure-Rust `protox` (no system `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/meshless/v1/distribution.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .bytes(".meshless.v1.ServerMessage")
        .compile_fds(fds)?;
    Ok(())
}
