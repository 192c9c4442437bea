//! A tiny deterministic random source (SplitMix64) used for weight init, synthetic data, label
//! dropout and dropout masks.
//!
//! Every random stream is derived from a seed and a few integer tags with [`derive_seed`], so a
//! dropout mask of block `i` in microbatch `m` of step `n` is the same whenever it is drawn again
//! (on recompute) and independent of the order streams are created in. Values are produced in f64
//! and cast, which makes the data identical across precision policies.

/// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit state, one add and a mix per draw.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seed for a sub-stream identified by `tags` (e.g. `[step, microbatch, block, kind]`).
pub fn derive_seed(seed: u64, tags: &[u64]) -> u64 {
    let mut h = mix64(seed ^ 0x0005_EED0_FD17_u64);
    for &t in tags {
        h = mix64(
            h.wrapping_add(GOLDEN)
                .wrapping_add(mix64(t.wrapping_add(GOLDEN))),
        );
    }
    h
}

/// A seed derived from a string (parameter names).
pub(crate) fn seed_from_str(seed: u64, s: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64; // FNV-1a
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    derive_seed(seed, &[h])
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// The stream of `seed` advanced by `n` draws: SplitMix64's state is a counter, so a kernel can
    /// draw element `n` of a mask without drawing the ones before it.
    pub fn skip(seed: u64, n: u64) -> Self {
        SplitMix64 {
            state: seed.wrapping_add(n.wrapping_mul(GOLDEN)),
        }
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [0, n); `n` must be positive.
    pub fn below(&mut self, n: u64) -> u64 {
        // Multiply-shift; the bias is below 2^-32 for the n used here.
        ((u128::from(self.next_u64()) * u128::from(n.max(1))) >> 64) as u64
    }

    /// Standard normal (Box–Muller, one value per call).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = {
            let mut r = SplitMix64::new(derive_seed(7, &[1, 2]));
            (0..4).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = SplitMix64::new(derive_seed(7, &[1, 2]));
            (0..4).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = SplitMix64::new(derive_seed(7, &[2, 1]));
            (0..4).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn normal_has_unit_variance() {
        let mut r = SplitMix64::new(3);
        let n = 20000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
    }
}
