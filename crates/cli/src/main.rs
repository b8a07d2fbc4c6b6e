//! `meshless`: service load balancing without a service mesh.

mod bench;
mod kubernetes;
mod malloc_tuning;
mod serve;
mod simulate;
mod upgrade;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Service load balancing for Kubernetes-style clusters, without a service mesh.
#[derive(Debug, Parser)]
#[command(name = "meshless", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the L7 proxy from a YAML file.
    Proxy(serve::ProxyArgs),
    /// Run the control plane: registry, registration API, distribution stream.
    Control(serve::ControlArgs),
    /// Control plane, proxy and demo backends in one process, from one file.
    Up(serve::UpArgs),
    /// Run a small HTTP (and gRPC: health, echo) backend that names itself (for demos and tests).
    Backend(serve::BackendArgs),
    /// Start three backends and a proxy on 127.0.0.1:8080, and show what to try.
    Demo(serve::DemoArgs),
    /// A fake Kubernetes API server with demo workloads, to try
    /// `meshless control` with `kubernetes:` without a cluster.
    FakeKube(serve::FakeKubeArgs),
    /// Measurements that back the performance claims.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Scale models: see how a policy behaves before it meets traffic.
    #[command(subcommand)]
    Simulate(simulate::SimulateCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Measurements print their own report: only warnings in the log.
    let quiet = matches!(cli.command, Command::Bench(_) | Command::Simulate(_));
    init_logging(if quiet { "warn" } else { "info" });
    // The one crypto provider of the build (DESIGN.md), for every rustls
    // user that asks for the process default (kube's client).
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let result = match cli.command {
        Command::Proxy(args) => serve::proxy(args),
        Command::Control(args) => serve::control(args),
        Command::Up(args) => serve::up(args),
        Command::Backend(args) => serve::backend(args),
        Command::Demo(args) => serve::demo(&args),
        Command::FakeKube(args) => serve::fake_kube(args),
        Command::Simulate(cmd) => simulate::run(cmd),
        Command::Bench(cmd) => bench::run(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshless: error: {}", report(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, `: `-separated, leaving out a cause whose
/// text the message already ends with (an error that prints its source
/// in its own text would show it twice).
fn report(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// Logs to stderr; `RUST_LOG` filters (default `info`, `warn` for `bench`
/// and `simulate`), `MESHLESS_LOG=json`
/// switches to JSON lines.
fn init_logging(default_level: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if std::env::var("MESHLESS_LOG").is_ok_and(|v| v == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
