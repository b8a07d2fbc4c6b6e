//! Start-up and shutdown of the control plane: opens the store, loads the
//! registry, registers the file's services, binds both addresses and starts
//! the registration API ([`crate::http`]), the distribution stream
//! ([`crate::grpc`]), the background tasks ([`crate::tasks`]) and one
//! scaling loop per autoscaled service ([`crate::scaling`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::ControlConfig;
use crate::metrics::ControlMetrics;
use crate::registry::{Registry, RegistryError};
use crate::state::Auth;
pub use crate::state::PlaneState;
use crate::store::{Storage, Store};

/// Why the control plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum PlaneError {
    #[error("{what} {address}: cannot bind: {source}")]
    Bind {
        what: &'static str,
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("token_file {path}: {source}")]
    Token {
        path: String,
        source: std::io::Error,
    },
    #[error("token_file {path}: empty: the file must hold the bearer token")]
    EmptyToken { path: String },
    #[error("services[{index}]: {source}")]
    StaticService { index: usize, source: RegistryError },
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// A running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    pub state: Arc<PlaneState>,
    api_addr: SocketAddr,
    grpc_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl ControlPlane {
    /// Opens the store, registers the file's services, binds both addresses
    /// and starts serving.
    pub async fn start(config: ControlConfig) -> Result<Self, PlaneError> {
        let store = config
            .data_dir
            .as_deref()
            .map(Store::open)
            .transpose()
            .map_err(RegistryError::from)?
            .map(|s| Box::new(s) as Box<dyn Storage>);
        Self::start_with_storage(config, store).await
    }

    /// [`ControlPlane::start`] on `store` instead of the one `data_dir`
    /// names (`None`: memory only): for embedding, and for tests that
    /// inject a store that fails or stalls.
    pub async fn start_with_storage(
        config: ControlConfig,
        store: Option<Box<dyn Storage>>,
    ) -> Result<Self, PlaneError> {
        let token = match &config.token_file {
            Some(p) => {
                let token = std::fs::read_to_string(p)
                    .map_err(|source| PlaneError::Token {
                        path: p.display().to_string(),
                        source,
                    })?
                    .trim()
                    .to_owned();
                // An empty token would refuse every call whatever it sent.
                if token.is_empty() {
                    return Err(PlaneError::EmptyToken {
                        path: p.display().to_string(),
                    });
                }
                Some(token)
            }
            None => None,
        };
        let registry = Arc::new(Mutex::new(Registry::open_with(
            store,
            config.max_endpoints_per_slice,
        )?));
        let metrics = Arc::new(ControlMetrics::new());
        let state = Arc::new(PlaneState::new(
            registry,
            metrics,
            config.clone(),
            Auth::new(token.as_deref()),
        ));
        for (index, s) in config.services.iter().enumerate() {
            let key = s.spec().key();
            // The file seeds the registry: a service the store already
            // holds keeps what was stored (its API changes, deletions and
            // drains survive a restart).
            if state.lock().view(&key).is_some() {
                tracing::info!(service = %key, "kept as stored; the file's services only seed an empty registry");
                continue;
            }
            state
                .write(|r| {
                    r.put_service(s.spec())?;
                    if !s.endpoints.is_empty() {
                        r.put_endpoints(&key, s.endpoints.clone())?;
                    }
                    Ok(())
                })
                .map_err(|source| PlaneError::StaticService { index, source })?;
        }
        let bind = |what: &'static str, address: SocketAddr| async move {
            TcpListener::bind(address)
                .await
                .map_err(|source| PlaneError::Bind {
                    what,
                    address,
                    source,
                })
        };
        let api = bind("api_address", config.api_address).await?;
        let grpc = bind("grpc_address", config.grpc_address).await?;
        let api_addr = api.local_addr().unwrap_or(config.api_address);
        let grpc_addr = grpc.local_addr().unwrap_or(config.grpc_address);
        let _ = state.api_address.set(api_addr);
        let (stop, stopped) = watch::channel(false);
        let mut tasks = vec![
            tokio::spawn(crate::http::serve(api, Arc::clone(&state), stopped.clone())),
            tokio::spawn(crate::grpc::serve(
                grpc,
                Arc::clone(&state),
                stopped.clone(),
            )),
            tokio::spawn(crate::tasks::housekeeping(
                Arc::clone(&state),
                stopped.clone(),
            )),
        ];
        for s in &config.services {
            if let Some(scaling) = &s.autoscaling {
                tasks.push(tokio::spawn(crate::scaling::run(
                    Arc::clone(&state),
                    s.spec().key(),
                    scaling.clone(),
                    stopped.clone(),
                )));
            }
        }
        if !config.batch_period.is_zero() {
            tasks.push(tokio::spawn(crate::tasks::batches(
                Arc::clone(&state),
                stopped,
            )));
        }
        tracing::info!(api = %api_addr, grpc = %grpc_addr, "control plane listening");
        Ok(Self {
            state,
            api_addr,
            grpc_addr,
            stop,
            tasks,
        })
    }

    /// Bound registration API address.
    pub fn api_addr(&self) -> SocketAddr {
        self.api_addr
    }

    /// Bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// Stops serving and closes the store. Subscriber streams end first,
    /// so the gRPC server's graceful shutdown does not wait on them; a
    /// write arriving after the store closed is refused, not kept in
    /// memory only.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        self.state.distributor.close();
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
        }
        self.state.lock().close_store();
    }
}
