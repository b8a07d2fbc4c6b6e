//! Key popularity of a simulated workload, and sampling from it.

use std::fmt;
use std::str::FromStr;

use crate::SimError;

/// How often each distinct key is requested.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeyDistribution {
    /// Every key equally often.
    Uniform,
    /// Key of rank r with probability proportional to 1 / r^s.
    Zipf(f64),
}

impl FromStr for KeyDistribution {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "uniform" {
            return Ok(Self::Uniform);
        }
        let Some(exp) = s.strip_prefix("zipf:") else {
            return Err(SimError::new(
                "keys",
                format!("expected `uniform` or `zipf:S`, got {s:?}"),
            ));
        };
        let v: f64 = exp
            .parse()
            .map_err(|_| SimError::new("keys", format!("zipf exponent {exp:?} is not a number")))?;
        if !(v > 0.0 && v.is_finite()) {
            return Err(SimError::new(
                "keys",
                format!("zipf exponent must be > 0, got {v}"),
            ));
        }
        Ok(Self::Zipf(v))
    }
}

impl fmt::Display for KeyDistribution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Uniform => f.write_str("uniform"),
            Self::Zipf(s) => write!(f, "zipf:{s}"),
        }
    }
}

/// Draws key ids `0..distinct` under a distribution, by inverse CDF.
#[derive(Debug)]
pub(crate) struct KeySampler {
    distinct: u64,
    /// Cumulative probabilities for zipf; empty for uniform.
    cdf: Vec<f64>,
}

impl KeySampler {
    pub(crate) fn new(dist: KeyDistribution, distinct: u64) -> Self {
        let cdf = match dist {
            KeyDistribution::Uniform => Vec::new(),
            KeyDistribution::Zipf(s) => {
                let mut acc = 0.0;
                let mut cdf: Vec<f64> = (1..=distinct)
                    .map(|r| {
                        acc += 1.0 / (r as f64).powf(s);
                        acc
                    })
                    .collect();
                cdf.iter_mut().for_each(|c| *c /= acc);
                cdf
            }
        };
        Self { distinct, cdf }
    }

    pub(crate) fn sample(&self, rng: &mut fastrand::Rng) -> u64 {
        if self.cdf.is_empty() {
            return rng.u64(..self.distinct);
        }
        let u = rng.f64();
        (self.cdf.partition_point(|&c| c < u) as u64).min(self.distinct - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_rank_one_is_drawn_most_and_uniform_covers_every_key() {
        let mut rng = fastrand::Rng::with_seed(3);
        let zipf = KeySampler::new(KeyDistribution::Zipf(1.1), 100);
        let mut counts = [0u32; 100];
        for _ in 0..20_000 {
            counts[zipf.sample(&mut rng) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c <= counts[0]), "{counts:?}");
        let uniform = KeySampler::new(KeyDistribution::Uniform, 10);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            seen[uniform.sample(&mut rng) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
