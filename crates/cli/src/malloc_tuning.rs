//! glibc's malloc, tuned for the control plane.
//!
//! Every subscriber's snapshot (a reset of each service it follows: about
//! 1 MB for a 20,000-endpoint service) is copied into its stream's encode
//! buffer for the write, then freed. glibc serves a block above its mmap
//! threshold (128 KiB) with its own mapping, unmapped on free, but by
//! default it raises that threshold to the size of each such block freed
//! (up to 32 MiB): from then on snapshot copies come from the heap, and
//! after a burst of connecting subscribers the freed copies stay in the
//! process's resident memory. Fixing the threshold at its default keeps
//! every snapshot copy a mapping of its own, returned on free.
//!
//! Measured (BENCHMARKS.md, issue 17's ninth round): memory per
//! subscriber at 1,000 subscribers of a 20,000-endpoint service, 71 KB
//! with the moving threshold, 53 KB fixed; CPU per message unchanged.

/// The threshold: glibc's own default, no longer moved.
pub const MMAP_THRESHOLD_BYTES: i32 = 128 * 1024;

/// What [`fix_mmap_threshold`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tuning {
    /// Fixed at [`MMAP_THRESHOLD_BYTES`].
    Fixed,
    /// The environment sets malloc's mmap threshold
    /// (`MALLOC_MMAP_THRESHOLD_`, or `glibc.malloc.mmap_threshold` in
    /// `GLIBC_TUNABLES`): the operator's value stands.
    FromEnvironment,
    /// Not glibc, or glibc refused the value.
    Unavailable,
}

/// Whether the environment already sets malloc's mmap threshold.
fn set_by_environment(
    threshold: Option<std::ffi::OsString>,
    tunables: Option<std::ffi::OsString>,
) -> bool {
    threshold.is_some()
        || tunables.is_some_and(|t| t.to_string_lossy().contains("glibc.malloc.mmap_threshold"))
}

/// Fixes glibc's mmap threshold at [`MMAP_THRESHOLD_BYTES`] unless the
/// environment sets it. Call before the runtime's threads start.
pub fn fix_mmap_threshold() -> Tuning {
    if set_by_environment(
        std::env::var_os("MALLOC_MMAP_THRESHOLD_"),
        std::env::var_os("GLIBC_TUNABLES"),
    ) {
        return Tuning::FromEnvironment;
    }
    set_threshold()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn set_threshold() -> Tuning {
    // SAFETY: `mallopt` only sets one of malloc's parameters (its own lock
    // guards them); it reads no memory of ours. Called once, at start.
    let ok = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) };
    if ok == 1 {
        Tuning::Fixed
    } else {
        Tuning::Unavailable
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_threshold() -> Tuning {
    Tuning::Unavailable
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operators_setting_stands() {
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        assert!(set_by_environment(os("262144"), None));
        assert!(set_by_environment(
            None,
            os("glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=65536")
        ));
        assert!(!set_by_environment(None, os("glibc.malloc.arena_max=2")));
        assert!(!set_by_environment(None, None));
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_threshold() {
        assert_eq!(set_threshold(), Tuning::Fixed);
    }
}
