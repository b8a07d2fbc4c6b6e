//! Opening a flow's upstream connection: the endpoint its key hashes to,
//! then, after a failed connect, others chosen by keys derived from the
//! flow's, so every instance retries a flow the same way. A failed connect
//! is recorded against its endpoint (`ConnectFailed`: a gateway error for
//! outlier detection) and counted.

use meshless_balance::{InFlight, Outcome, PickContext, hash_key};
use tokio::net::TcpStream;

use crate::config::NodeConfig;
use crate::snapshot::UpstreamCluster;
use crate::state::ProxyState;

/// Keys tried per attempt before an endpoint already tried is taken again.
const DRAWS: u64 = 8;

/// The endpoint for attempt `attempt` of the flow with `key`, avoiding
/// those in `tried` while other draws are left. `None` when the cluster
/// has no usable endpoint.
pub fn pick(
    cluster: &UpstreamCluster,
    key: u64,
    attempt: u32,
    tried: &[usize],
    node: &NodeConfig,
) -> Option<InFlight> {
    let ctx = PickContext::new().with_locality(node.name.as_deref(), node.zone.as_deref());
    let mut last = None;
    for draw in 0..DRAWS {
        let k = match (attempt, draw) {
            (0, 0) => key,
            _ => {
                let salt = u64::from(attempt) * DRAWS + draw;
                let mut bytes = [0u8; 16];
                bytes[..8].copy_from_slice(&key.to_le_bytes());
                bytes[8..].copy_from_slice(&salt.to_le_bytes());
                hash_key(&bytes)
            }
        };
        let guard = cluster.lb.pick(&ctx.with_key(k))?;
        if !tried.contains(&guard.index()) {
            return Some(guard);
        }
        last = Some(guard);
    }
    last
}

/// Connects to the flow's endpoint, trying up to `attempts` endpoints;
/// returns the connection and the guard of its endpoint.
pub async fn open(
    state: &ProxyState,
    cluster: &UpstreamCluster,
    key: u64,
    attempts: u32,
    node: &NodeConfig,
) -> Option<(TcpStream, InFlight)> {
    let mut tried = Vec::new();
    let socket = &cluster.config.socket;
    for attempt in 0..attempts.max(1) {
        let guard = pick(cluster, key, attempt, &tried, node)?;
        let index = guard.index();
        tried.push(index);
        let endpoint = &cluster.lb.endpoints()[index];
        let connected = match endpoint.socket_addr() {
            Some(addr) => socket
                .connect(addr, cluster.config.timeouts.connect)
                .await
                .map_err(|e| e.to_string()),
            None => Err("no address".to_owned()),
        };
        match connected {
            Ok(stream) => return Some((stream, guard)),
            Err(error) => {
                tracing::debug!(cluster = %cluster.name, endpoint = %endpoint.id, %error, "connect failed");
                cluster
                    .series(index, &state.metrics.endpoint_series)
                    .connect_failure();
                guard.finish(Outcome::ConnectFailed);
            }
        }
    }
    None
}
