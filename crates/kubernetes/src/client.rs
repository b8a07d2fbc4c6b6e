//! The API client: from a kubeconfig file (with an optional context), or
//! inferred (`$KUBECONFIG`, `~/.kube/config`, then the pod's service account).

use kube::config::{KubeConfigOptions, Kubeconfig};
use meshless_control::kubernetes::KubernetesSource;

/// Why no client could be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("no kubeconfig and not in a cluster: {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("client: {0}")]
    Client(#[from] kube::Error),
}

/// A client for the cluster `cfg` names.
pub async fn client(cfg: &KubernetesSource) -> Result<kube::Client, ClientError> {
    let config = match &cfg.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)?;
            let options = KubeConfigOptions {
                context: cfg.context.clone(),
                ..KubeConfigOptions::default()
            };
            kube::Config::from_custom_kubeconfig(file, &options).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}
