//! The command line: `nightshift <role> [options]`. Flags override the config file
//! and may also be given as environment variables.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::config::Config;

#[derive(Parser, Debug)]
#[command(name = "nightshift", version, about = "Self-hosted, OpenAI-compatible Batch and Files API")]
pub struct Cli {
    #[command(subcommand)]
    pub role: Role,
}

#[derive(Subcommand, Debug)]
pub enum Role {
    /// Run everything in one process on one machine, with local storage (the embedded default).
    Serve(ServeArgs),
    /// Print the CustomResourceDefinitions (Batch, Project) as YAML.
    Crd,
    /// The HTTP API on Kubernetes (Batch and Project resources, S3 storage).
    Api(crate::roles::api::ApiArgs),
    /// The Batch controller on Kubernetes: shard Jobs, finalize, leader-elected.
    Controller(crate::roles::controller::ControllerArgs),
    /// Run one shard of one batch (the entrypoint of a worker Job's pod).
    Worker(crate::roles::worker::WorkerArgs),
}

#[derive(Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// YAML configuration file (see docs/src/configuration.md for every key).
    #[arg(long, env = "NIGHTSHIFT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on; overrides `listen` (use port 0 for any free port).
    #[arg(long, env = "NIGHTSHIFT_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Address of `/metrics`; overrides `metrics.listen` (port 0 for any free port).
    #[arg(long, env = "NIGHTSHIFT_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Directory for local storage; overrides `storage` with `{dir: DIR}`.
    #[arg(long, env = "NIGHTSHIFT_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
}

impl ServeArgs {
    /// The configuration file with this command line's overrides applied.
    pub fn config(&self) -> anyhow::Result<Config> {
        let mut config = match &self.config {
            Some(path) => Config::load(path)?,
            None => Config::default(),
        };
        if let Some(listen) = self.listen {
            config.listen = listen;
        }
        if let Some(metrics) = self.metrics_listen {
            config.metrics.listen = Some(metrics);
        }
        if let Some(dir) = &self.data_dir {
            config.storage.dir = Some(dir.clone());
            config.storage.s3 = None;
        }
        Ok(config)
    }
}

impl Cli {
    pub fn run(self) -> ExitCode {
        crate::telemetry::init();
        let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
            Ok(runtime) => runtime,
            Err(error) => {
                eprintln!("nightshift: cannot start the async runtime: {error}");
                return ExitCode::FAILURE;
            }
        };
        let result = runtime.block_on(async {
            match self.role {
                Role::Serve(args) => crate::roles::serve::run(args.config()?).await,
                Role::Api(args) => crate::roles::api::run(args).await,
                Role::Controller(args) => crate::roles::controller::run(args).await,
                Role::Worker(args) => crate::roles::worker::run(args).await,
                Role::Crd => {
                    print!("{}", crate::k8s::crd::crds_yaml());
                    Ok(())
                }
            }
        });
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("nightshift: {error:#}");
                ExitCode::FAILURE
            }
        }
    }
}
