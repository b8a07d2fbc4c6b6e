//! The one validation error of meshless: the path of the field at fault
//! (`clusters[3].balancer.policy`, `endpoints[0].weight`) and the reason.
//! Validators return the path relative to what they were given; callers
//! prefix it with where that value sits ([`FieldError::at`]).

use std::fmt;

/// A value rejected by validation: where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct FieldError {
    /// Dotted path with indices; `(top level)` when no field is at fault.
    pub path: String,
    pub reason: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

/// The path of a value with no field at fault.
pub const TOP_LEVEL: &str = "(top level)";

impl FieldError {
    /// The field at `path` is wrong because of `reason`.
    pub fn new(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// The same error seen from the value that holds this one at `prefix`:
    /// `FieldError::new("weight", r).at("endpoints[0]")` is at
    /// `endpoints[0].weight`. An index prefix joins without a dot
    /// (`at("[2]")`), and a top-level error takes the prefix as its path.
    pub fn at(mut self, prefix: impl AsRef<str>) -> Self {
        let prefix = prefix.as_ref();
        if prefix.is_empty() {
            return self;
        }
        self.path = if self.path.is_empty() || self.path == TOP_LEVEL {
            prefix.to_owned()
        } else if self.path.starts_with('[') {
            format!("{prefix}{}", self.path)
        } else {
            format!("{prefix}.{}", self.path)
        };
        self
    }
}

/// Prefixes the path of a [`FieldError`] in a `Result`.
pub trait AtPath<T> {
    /// [`FieldError::at`] on the error, if any.
    fn at(self, prefix: impl AsRef<str>) -> Result<T, FieldError>;
}

impl<T> AtPath<T> for Result<T, FieldError> {
    fn at(self, prefix: impl AsRef<str>) -> Result<T, FieldError> {
        self.map_err(|e| e.at(prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_join_with_dots_and_indices_without() {
        let e = FieldError::new("weight", "must be 1..=1000").at("endpoints[0]");
        assert_eq!(e.path, "endpoints[0].weight");
        assert_eq!(e.to_string(), "endpoints[0].weight: must be 1..=1000");
        assert_eq!(
            FieldError::new("[2].port", "r").at("ports").path,
            "ports[2].port"
        );
        assert_eq!(FieldError::new(TOP_LEVEL, "r").at("proxy").path, "proxy");
        assert_eq!(FieldError::new("a", "r").at("").path, "a");
        let r: Result<(), FieldError> = Err(FieldError::new("tick", "r"));
        assert_eq!(
            r.at("autoscaling").expect_err("err").path,
            "autoscaling.tick"
        );
    }
}
