//! Compiles the health and echo protocols with the pure-Rust `protox` (no
//! system `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/grpc/health/v1/health.proto",
        "proto/meshless/echo/v1/echo.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
