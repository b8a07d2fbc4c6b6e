//! `meshless`: service load balancing without a service mesh.

mod progress;
mod simulate;

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
    /// Scale models: see how a policy behaves before it meets traffic.
    #[command(subcommand)]
    Simulate(simulate::SimulateCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(cmd) => simulate::run(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshless: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
