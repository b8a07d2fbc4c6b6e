//! A `service:` cluster's settings from the control plane (Kubernetes
//! Service annotations, the registration API): applied where the
//! cluster's own block is absent. The file wins per block: a `balancer:`
//! block ignores the service's policy, hash key and load factor; a
//! `locality:` block its locality; an `activation:` block its
//! scale-to-zero.

use meshless_balance::LocalityMode;
use meshless_model::{FieldError, HashKeySource, LocalityChoice, ServiceSettings};

use super::activation::Activation;
use super::balancer::{BalancerYaml, HashKey, LocalityYaml};
use super::cluster::ClusterConfig;

impl From<&HashKeySource> for HashKey {
    fn from(k: &HashKeySource) -> Self {
        match k {
            HashKeySource::Header(n) => HashKey::Header(n.clone()),
            HashKeySource::Cookie(n) => HashKey::Cookie(n.clone()),
            HashKeySource::Query(n) => HashKey::Query(n.clone()),
            HashKeySource::Path => HashKey::Path,
            HashKeySource::SourceIp => HashKey::ClientAddress,
        }
    }
}

fn locality(choice: LocalityChoice) -> Option<LocalityYaml> {
    let mode = match choice {
        LocalityChoice::Any => return None,
        LocalityChoice::Node => LocalityMode::Prefer,
        LocalityChoice::Zone => LocalityMode::Zone,
        LocalityChoice::LocalOnly => LocalityMode::LocalOnly,
    };
    Some(LocalityYaml {
        mode,
        ..LocalityYaml::default()
    })
}

impl ClusterConfig {
    /// This cluster with `settings` applied where the file said nothing;
    /// `has_node` says whether this proxy knows its node (`local-only`
    /// needs it). The error names the setting that cannot apply; the
    /// caller then keeps the file's config.
    pub fn with_service_settings(
        &self,
        settings: &ServiceSettings,
        has_node: bool,
    ) -> Result<ClusterConfig, FieldError> {
        let mut c = self.clone();
        if settings.is_empty() {
            return Ok(c);
        }
        if !self.balancer.declared {
            let mut b = BalancerYaml::default();
            if let Some(p) = &settings.policy {
                b.policy = p.clone();
            }
            b.hash_key = settings.hash_key.as_ref().map(HashKey::from);
            if let Some(f) = settings.load_factor {
                b.load_factor = f;
            }
            b.policy_kind()
                .map_err(|e| FieldError::new("policy", e.reason))?;
            c.balancer = b;
        }
        if self.locality.is_none()
            && let Some(choice) = settings.locality
        {
            if choice == LocalityChoice::LocalOnly && !has_node {
                return Err(FieldError::new(
                    "locality",
                    "local-only needs this proxy's node.name",
                ));
            }
            c.locality = locality(choice);
        }
        if self.activation.is_none() && settings.scale_to_zero == Some(true) {
            c.activation = Some(Activation::default());
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service_cluster(extra: &str) -> ClusterConfig {
        let yaml = format!("name: web\nservice: shop/web\n{extra}");
        meshless_model::yaml::from_str(&yaml).expect("cluster yaml")
    }

    fn settings() -> ServiceSettings {
        ServiceSettings {
            policy: Some("maglev".into()),
            hash_key: Some(HashKeySource::Header("x-user".into())),
            load_factor: Some(1.5),
            locality: Some(LocalityChoice::Zone),
            scale_to_zero: Some(true),
        }
    }

    #[test]
    fn settings_fill_what_the_file_leaves_out() {
        let c = service_cluster("")
            .with_service_settings(&settings(), false)
            .expect("applies");
        assert_eq!(c.balancer.policy, "maglev");
        assert_eq!(c.balancer.hash_key, Some(HashKey::Header("x-user".into())));
        assert_eq!(c.balancer.load_factor, 1.5);
        assert_eq!(
            c.locality.as_ref().map(|l| l.mode),
            Some(LocalityMode::Zone)
        );
        assert!(c.activation.is_some());
        assert!(c.balance_config().is_ok());
    }

    #[test]
    fn the_file_wins_per_block() {
        let file = service_cluster(
            "balancer: { policy: least_request }\nlocality: { mode: prefer }\nactivation: { max_queued: 7 }\n",
        );
        let c = file
            .with_service_settings(&settings(), false)
            .expect("applies");
        assert_eq!(c.balancer.policy, "least_request");
        assert_eq!(c.balancer.hash_key, None);
        assert_eq!(
            c.locality.as_ref().map(|l| l.mode),
            Some(LocalityMode::Prefer)
        );
        assert_eq!(c.activation.as_ref().map(|a| a.max_queued), Some(7));
        // No settings: the file as it is, balancer defaults included.
        let plain = service_cluster("");
        assert_eq!(
            plain.with_service_settings(&ServiceSettings::default(), false),
            Ok(plain.clone())
        );
    }

    #[test]
    fn settings_that_cannot_apply_are_refused_with_their_name() {
        let local_only = ServiceSettings {
            locality: Some(LocalityChoice::LocalOnly),
            ..ServiceSettings::default()
        };
        let e = service_cluster("")
            .with_service_settings(&local_only, false)
            .expect_err("no node");
        assert_eq!(e.path, "locality");
        assert!(
            service_cluster("")
                .with_service_settings(&local_only, true)
                .is_ok()
        );
        let unknown = ServiceSettings {
            policy: Some("fastest".into()),
            ..ServiceSettings::default()
        };
        let e = service_cluster("")
            .with_service_settings(&unknown, true)
            .expect_err("unknown policy");
        assert_eq!(e.path, "policy");
        let any = ServiceSettings {
            locality: Some(LocalityChoice::Any),
            ..ServiceSettings::default()
        };
        let c = service_cluster("")
            .with_service_settings(&any, true)
            .expect("any");
        assert!(c.locality.is_none());
    }
}
