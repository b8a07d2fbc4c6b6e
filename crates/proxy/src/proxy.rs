//! The running proxy: starts listeners, the admin server and background
//! tasks from a config; reloads it atomically; shuts down gracefully.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use std::os::fd::AsFd;

use crate::access_log::AccessLogger;
use crate::config::ProxyConfig;
use crate::connection::Drain;
use crate::handoff::{Inherited, SocketInfo};
use crate::listener::ListenerHandle;
use crate::metrics::{Metrics, ReloadLabels};
use crate::snapshot::{ClusterError, Snapshot, SnapshotError};
use crate::state::ProxyState;
use crate::tls::{ListenerTls, TlsError};

/// Why the proxy could not start or reload.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("{what} {address}: cannot bind: {source}")]
    Bind {
        what: String,
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("access_log: {0}")]
    AccessLog(std::io::Error),
    /// A config file that cannot be read or is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigFileError),
    /// A cluster of the new config cannot be built.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// A cluster cannot take the endpoints it has now.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A certificate or key refused, or TLS that cannot be set up.
    #[error("{what}: {source}")]
    Tls {
        what: String,
        source: crate::tls::TlsError,
    },
    /// A change the running proxy cannot make, or a setting it cannot use.
    #[error("{0}")]
    Invalid(String),
}

/// A running proxy.
#[derive(Debug)]
pub struct Proxy {
    state: Arc<ProxyState>,
    listeners: Mutex<HashMap<String, ListenerHandle>>,
    admin_addr: SocketAddr,
    stop: watch::Sender<bool>,
    /// Stops the admin server's accept loop (before the rest on a
    /// hand-over: the new process answers the shared admin socket).
    admin_stop: watch::Sender<bool>,
    admin_task: Mutex<Option<JoinHandle<()>>>,
    /// Drains of listeners a reload removed: a shutdown waits for them too.
    draining: std::sync::Mutex<Vec<JoinHandle<()>>>,
    /// The services `service:` clusters reference; the control link follows it.
    watched: watch::Sender<crate::snapshot::Watched>,
    tasks: Vec<JoinHandle<()>>,
    reloading: Mutex<()>,
    /// A copy of the admin server's listening socket, to hand over.
    admin_socket: Option<std::os::fd::OwnedFd>,
}

impl Proxy {
    /// Binds the admin address and every listener, then serves.
    pub async fn start(config: ProxyConfig) -> Result<Self, ProxyError> {
        Self::start_with(config, &mut Inherited::default()).await
    }

    /// As [`Proxy::start`], taking the listening sockets that match from
    /// `inherited` (a binary upgrade) instead of binding them.
    pub async fn start_with(
        config: ProxyConfig,
        inherited: &mut Inherited,
    ) -> Result<Self, ProxyError> {
        let access_log = AccessLogger::open(&config.access_log).map_err(ProxyError::AccessLog)?;
        let admin_address = config.admin.address;
        let admin = bind_or_take(inherited, ADMIN, admin_address, &Default::default()).map_err(
            |source| ProxyError::Bind {
                what: "admin.address".into(),
                address: admin_address,
                source,
            },
        )?;
        let admin_socket = admin.as_fd().try_clone_to_owned().ok();
        let admin_addr = admin.local_addr().unwrap_or(admin_address);
        let listener_configs = config.listeners.clone();
        let control = config.control.clone();
        let node = config.node.clone();
        let metrics = Metrics::new();
        let tracer = config.tracing.as_ref().and_then(|t| {
            meshless_trace::Tracer::start(t, metrics.trace.clone())
                .inspect_err(|e| tracing::error!(error = %e, "tracing: off"))
                .ok()
        });
        let snapshot = Snapshot::build(config, None, &Default::default())?;
        let watched = snapshot.watched();
        let activations: Arc<crate::activation_queue::ActivationQueue> = Arc::default();
        let state = Arc::new(ProxyState {
            snapshot: ArcSwap::from_pointee(snapshot),
            metrics,
            access_log: ArcSwap::from_pointee(access_log),
            ready: AtomicBool::new(false),
            control_synced: AtomicBool::new(control.is_none()),
            services: std::sync::Mutex::new(Default::default()),
            activate: Arc::clone(&activations),
            endpoints_changed: tokio::sync::Notify::new(),
            flows: Default::default(),
            activation_errors: std::sync::Mutex::new(Default::default()),
            probing: Default::default(),
            tracer,
            placements: Default::default(),
            peer_address: Default::default(),
        });
        let tls = prepare_tls(&listener_configs, &HashMap::new())?;
        // Every socket bound or taken, and every other step that can fail
        // passed, before any listener accepts: a start that fails (a busy
        // address, an unreadable token) has accepted nothing, so a failed
        // takeover costs the old process's clients nothing.
        let mut sockets = Vec::with_capacity(listener_configs.len());
        for (i, l) in listener_configs.iter().enumerate() {
            let socket = bind_or_take(inherited, &l.name, l.address, &l.socket)
                .and_then(crate::listener::listening)
                .map_err(|source| ProxyError::Bind {
                    what: format!("listeners[{i}].address"),
                    address: l.address,
                    source,
                })?;
            sockets.push(socket);
        }
        let token = match control.as_ref().and_then(|l| l.token_file.as_ref()) {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|e| {
                        ProxyError::Invalid(format!("control.token_file {}: {e}", p.display()))
                    })?
                    .trim()
                    .to_owned(),
            ),
            None => None,
        };
        let mut listeners = HashMap::new();
        for ((l, tls), socket) in listener_configs.iter().zip(tls).zip(sockets) {
            let handle = ListenerHandle::serve(
                Arc::from(l.name.as_str()),
                l.address,
                socket,
                Arc::clone(&state),
                l.settings(),
                tls,
            );
            tracing::info!(listener = %l.name, address = %handle.local_addr, "listening");
            listeners.insert(l.name.clone(), handle);
        }
        let (stop, stopped) = watch::channel(false);
        let (admin_stop, admin_stopped) = watch::channel(false);
        let (watch_tx, watch_rx) = watch::channel(watched);
        let admin_task = tokio::spawn(crate::admin::serve(
            admin,
            Arc::clone(&state),
            admin_stopped,
        ));
        let mut tasks = vec![tokio::spawn(crate::health::run(
            Arc::clone(&state),
            stopped.clone(),
        ))];
        if let Some(link) = control {
            let peer = link.peer_listener.as_ref().and_then(|name| {
                let bound = listeners.get(name).map(|h| h.local_addr);
                link.peer_address.or(bound)
            });
            if let Some(addr) = peer {
                let _ = state.peer_address.set(addr);
            }
            if !link.initial_fetch_timeout.is_zero() {
                let (state, wait) = (Arc::clone(&state), link.initial_fetch_timeout);
                let mut stopped = stopped.clone();
                tasks.push(tokio::spawn(async move {
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        _ = stopped.changed() => return,
                    }
                    if !state.control_synced.swap(true, Ordering::AcqRel) {
                        tracing::warn!(after = ?wait, "no snapshot from the control plane yet; ready with the endpoints at hand");
                    }
                }));
            } else {
                state.control_synced.store(true, Ordering::Release);
            }
            tasks.push(tokio::spawn(crate::control_link::run(
                Arc::clone(&state),
                link.address,
                token,
                link.update_merge_window,
                node,
                watch_rx,
                activations,
                stopped,
            )));
        }
        tracing::info!(address = %admin_addr, "admin listening");
        state.ready.store(true, Ordering::Release);
        Ok(Self {
            state,
            listeners: Mutex::new(listeners),
            admin_addr,
            stop,
            admin_stop,
            admin_task: Mutex::new(Some(admin_task)),
            draining: Default::default(),
            watched: watch_tx,
            tasks,
            reloading: Mutex::new(()),
            admin_socket,
        })
    }

    /// Hands every listening socket (and the admin server's) to the new
    /// process on `stream` and waits for it to accept on them. `Ok(true)`:
    /// it does; call [`Proxy::shutdown_handed_over`]. `Ok(false)`: it went
    /// away first; this proxy serves on as before. No reload runs meanwhile.
    pub async fn hand_over(
        &self,
        stream: std::os::unix::net::UnixStream,
    ) -> Result<bool, std::io::Error> {
        let _no_reload = self.reloading.lock().await;
        let mut sockets = Vec::new();
        for (name, h) in self.listeners.lock().await.iter() {
            let info = SocketInfo {
                name: name.clone(),
                configured: h.address,
                local: h.local_addr,
            };
            sockets.push((info, h.socket().as_fd().try_clone_to_owned()?));
        }
        if let Some(admin) = &self.admin_socket {
            let admin_address = self.state.snapshot.load().config.admin.address;
            let info = SocketInfo {
                name: ADMIN.into(),
                configured: admin_address,
                local: self.admin_addr,
            };
            sockets.push((info, admin.try_clone()?));
        }
        tokio::task::spawn_blocking(move || {
            let mut stream = stream;
            stream.set_nonblocking(false)?;
            let borrowed: Vec<_> = sockets
                .iter()
                .map(|(i, fd)| (i.clone(), fd.as_fd()))
                .collect();
            crate::handoff::send(&mut stream, &borrowed)
        })
        .await
        .map_err(std::io::Error::other)?
    }

    /// The bound admin address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The bound address of listener `name`.
    pub async fn listener_addr(&self, name: &str) -> Option<SocketAddr> {
        self.listeners.lock().await.get(name).map(|l| l.local_addr)
    }

    /// The shared state (metrics, current snapshot).
    pub fn state(&self) -> &Arc<ProxyState> {
        &self.state
    }

    /// Replaces the running config: builds the new snapshot (keeping the
    /// state of clusters and endpoints that stay), binds new listeners,
    /// swaps atomically, then drains listeners that left. On any error the
    /// running config stays and the error is returned. Counted in metrics.
    pub async fn reload(&self, config: ProxyConfig) -> Result<(), ProxyError> {
        let result = self.reload_inner(config).await;
        let label = if result.is_ok() { "success" } else { "failure" };
        self.state
            .metrics
            .reloads
            .get_or_create(&ReloadLabels {
                result: label.into(),
            })
            .inc();
        match &result {
            Ok(()) => tracing::info!("configuration reloaded"),
            Err(e) => {
                tracing::error!(error = %e, "reload rejected; the running configuration stays")
            }
        }
        result
    }

    /// Reads and validates the file at `path`, then [`Proxy::reload`]s it.
    /// A file that cannot be read or is invalid is a failed reload too:
    /// counted and logged the same way, and the running config stays.
    pub async fn reload_from(&self, path: &std::path::Path) -> Result<(), ProxyError> {
        match ProxyConfig::load(path) {
            Ok(config) => self.reload(config).await,
            Err(e) => {
                self.state
                    .metrics
                    .reloads
                    .get_or_create(&ReloadLabels {
                        result: "failure".into(),
                    })
                    .inc();
                tracing::error!(error = %e, "reload rejected; the running configuration stays");
                Err(e.into())
            }
        }
    }

    async fn reload_inner(&self, config: ProxyConfig) -> Result<(), ProxyError> {
        let _one_at_a_time = self.reloading.lock().await;
        let current = self.state.snapshot.load_full();
        if config.control != current.config.control {
            return Err(ProxyError::Invalid(
                "control: cannot change on reload; restart the proxy".into(),
            ));
        }
        if config.admin.address != current.config.admin.address {
            return Err(ProxyError::Invalid(
                "admin.address: cannot change on reload; restart the proxy".into(),
            ));
        }
        // Another target, or the same file path naming a new file (the
        // old one renamed by logrotate): reopened.
        let reopen = {
            let running = self.state.access_log.load();
            config.access_log != *running.target() || running.moved()
        };
        let new_logger = if reopen {
            Some(AccessLogger::open(&config.access_log).map_err(ProxyError::AccessLog)?)
        } else {
            None
        };
        let snapshot =
            Snapshot::build(config.clone(), Some(&current), &self.state.service_feeds())?;
        let watched = snapshot.watched();
        let mut listeners = self.listeners.lock().await;
        // Certificates read and checked, and new listeners bound, before
        // anything changes.
        let mut tls = prepare_tls(&config.listeners, &listeners)?.into_iter();
        let mut fresh = Vec::new();
        let mut kept = Vec::new();
        for (i, l) in config.listeners.iter().enumerate() {
            let tls = tls.next().flatten();
            if listeners.get(&l.name).is_some_and(|h| h.serves(l.address)) {
                kept.push((l.name.clone(), l.settings(), tls));
                continue;
            }
            let moved_here = l.address.port() != 0
                && !l.socket.reuse_port
                && listeners.values().any(|h| h.serves(l.address));
            if moved_here {
                return Err(ProxyError::Invalid(format!(
                    "listeners[{i}].address: {} is in use by another listener; rename in two reloads",
                    l.address
                )));
            }
            match ListenerHandle::bind(l.address, &l.socket) {
                Ok((socket, _)) => {
                    fresh.push((l.name.clone(), l.address, socket, l.settings(), tls))
                }
                Err(source) => {
                    return Err(ProxyError::Bind {
                        what: format!("listeners[{i}].address"),
                        address: l.address,
                        source,
                    });
                }
            }
        }
        {
            // Endpoints that arrived while this reload was being prepared.
            let services = self
                .state
                .services
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut snapshot = snapshot;
            for service in &watched.services {
                snapshot = snapshot.with_service(service, &services)?;
            }
            self.state.snapshot.store(Arc::new(snapshot));
        }
        for (name, settings, tls) in kept {
            if let Some(h) = listeners.get(&name) {
                h.update(settings);
                h.update_tls(tls);
            }
        }
        // TCP flows whose endpoint left start draining.
        self.state.endpoints_swapped();
        self.watched.send_if_modified(|w| {
            let changed = *w != watched;
            *w = watched;
            changed
        });
        if let Some(logger) = new_logger {
            self.state.access_log.store(Arc::new(logger));
        }
        let wanted: HashMap<&str, SocketAddr> = config
            .listeners
            .iter()
            .map(|l| (l.name.as_str(), l.address))
            .collect();
        let leaving: Vec<String> = listeners
            .iter()
            .filter(|(name, h)| !wanted.get(name.as_str()).is_some_and(|a| h.serves(*a)))
            .map(|(name, _)| name.clone())
            .collect();
        let drain = config.drain_timeout;
        {
            let mut draining = self
                .draining
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            draining.retain(|d| !d.is_finished());
            for name in leaving {
                if let Some(h) = listeners.remove(&name) {
                    tracing::info!(listener = %name, "closing listener");
                    draining.push(tokio::spawn(h.shutdown(drain)));
                }
            }
        }
        for (name, address, socket, settings, tls) in fresh {
            let h = ListenerHandle::serve(
                Arc::from(name.as_str()),
                address,
                socket,
                Arc::clone(&self.state),
                settings,
                tls,
            );
            tracing::info!(listener = %name, address = %h.local_addr, "listening");
            listeners.insert(name, h);
        }
        Ok(())
    }

    /// Reopens a file access log at its configured path (SIGUSR1, after
    /// logrotate renamed it): lines from now on go to the file there,
    /// created if need be. On error the open file stays.
    pub fn reopen_access_log(&self) -> Result<(), ProxyError> {
        let running = self.state.access_log.load_full();
        if !matches!(running.target(), crate::config::AccessLog::File(_)) {
            return Ok(());
        }
        let fresh = AccessLogger::open(running.target()).map_err(ProxyError::AccessLog)?;
        self.state.access_log.store(Arc::new(fresh));
        tracing::info!("access log reopened");
        Ok(())
    }

    /// After [`Proxy::hand_over`]: the new process accepts on the same
    /// sockets, so this one stops accepting at once (no `drain_delay`),
    /// answers each HTTP/1 connection's next request with `connection:
    /// close`, sends HTTP/2 a GOAWAY, lets tunnels finish, all for up to
    /// `drain_timeout`, then closes what is left and stops.
    pub async fn shutdown_handed_over(self) {
        // The admin socket is shared too: only the new process answers it
        // from now on (no `/ready` flapping, no `/metrics` alternating).
        // Admin requests already accepted here finish.
        self.stop_admin().await;
        self.state.ready.store(false, Ordering::Release);
        self.stop_listeners(Drain::OnNextResponse).await;
        self.stop_tasks().await;
    }

    /// Fails `/ready`, keeps serving for the config's `drain_delay` while
    /// telling clients to leave (HTTP/1 responses say `connection: close`,
    /// HTTP/2 connections get a GOAWAY), then stops accepting on every
    /// listener, closes idle connections, lets in-flight requests and
    /// tunnels finish for up to `drain_timeout`, closes what is left, and
    /// stops the admin server.
    pub async fn shutdown(self) {
        self.state.ready.store(false, Ordering::Release);
        let config = Arc::clone(&self.state.snapshot.load().config);
        // `/ready` fails first; listeners keep serving while load balancers
        // in front notice, and keep-alive clients are told to reconnect
        // (to another proxy) so that none is idle here when they close.
        if !config.drain_delay.is_zero() {
            for h in self.listeners.lock().await.values() {
                h.drain_connections();
            }
            tokio::time::sleep(config.drain_delay).await;
        }
        self.stop_listeners(Drain::Now).await;
        self.stop_tasks().await;
    }

    /// Stops accepting on every listener and drains them (`mode`); waits
    /// too, within the same `drain_timeout`, for the drains of listeners
    /// earlier reloads removed.
    async fn stop_listeners(&self, mode: Drain) {
        let drain = self.state.snapshot.load().config.drain_timeout;
        let until = tokio::time::Instant::now() + drain;
        let earlier = std::mem::take(
            &mut *self
                .draining
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let listeners: Vec<ListenerHandle> = self
            .listeners
            .lock()
            .await
            .drain()
            .map(|(_, h)| h)
            .collect();
        let draining: Vec<_> = listeners
            .into_iter()
            .map(|h| tokio::spawn(h.shutdown_with(drain, mode)))
            .collect();
        for d in draining {
            let _ = d.await;
        }
        let earlier = async {
            for d in earlier {
                let _ = d.await;
            }
        };
        let _ = tokio::time::timeout_at(until, earlier).await;
    }

    /// Stops the admin server's accept loop; resolves once it has.
    async fn stop_admin(&self) {
        let _ = self.admin_stop.send(true);
        if let Some(t) = self.admin_task.lock().await.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), t).await;
        }
    }

    /// Stops the admin server and the background tasks.
    async fn stop_tasks(self) {
        self.stop_admin().await;
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(1), t).await;
        }
    }
}

/// The name an inherited admin socket goes by.
const ADMIN: &str = "(admin)";

/// The socket for `name` at `address`: inherited when one matches, else bound.
fn bind_or_take(
    inherited: &mut Inherited,
    name: &str,
    address: SocketAddr,
    options: &crate::sockopt::SocketOptions,
) -> std::io::Result<tokio::net::TcpListener> {
    match inherited.take(name, address) {
        Some(socket) => {
            socket.set_nonblocking(true)?;
            tracing::info!(name, address = %socket.local_addr()?, "listening socket taken over");
            tokio::net::TcpListener::from_std(socket)
        }
        None => options.bind(address),
    }
}

/// The TLS side of each listener in `configs` (in order), certificates
/// read and checked now: a listener that keeps its name in `running`
/// keeps its session cache and ticket keys. Any refused file fails all.
/// The file checks a start makes, without starting (`--check`): every
/// listener's certificates and keys are read and checked, and every
/// cluster's `tls.ca_file` is read and built into a TLS client.
pub fn check_files(config: &ProxyConfig) -> Result<(), ProxyError> {
    prepare_tls(&config.listeners, &HashMap::new())?;
    for (index, c) in config.clusters.iter().enumerate() {
        let Some(tls) = &c.tls else { continue };
        crate::upstream::read_ca(tls)
            .and_then(|ca| crate::upstream::TlsClient::new(tls, &ca, c.upstream_protocol))
            .map_err(|e| SnapshotError {
                index,
                source: e.into(),
            })?;
    }
    Ok(())
}

fn prepare_tls(
    configs: &[crate::config::ListenerConfig],
    running: &HashMap<String, ListenerHandle>,
) -> Result<Vec<Option<ListenerTls>>, ProxyError> {
    let now = std::time::SystemTime::now();
    let mut out = Vec::with_capacity(configs.len());
    for (i, l) in configs.iter().enumerate() {
        let Some(settings) = &l.tls else {
            out.push(None);
            continue;
        };
        let error = |source: TlsError| ProxyError::Tls {
            what: format!("listeners[{i}].tls"),
            source,
        };
        let table = crate::tls::load_table(settings, now).map_err(|e| error(e.into()))?;
        let previous = running
            .get(&l.name)
            .filter(|h| h.serves(l.address))
            .and_then(ListenerHandle::tls);
        let tls = match previous {
            Some(p) => p.reloaded(settings, table),
            None => ListenerTls::new(settings, table),
        };
        out.push(Some(tls.map_err(error)?));
    }
    Ok(out)
}
