//! The ReLU kink behind the q and k gradients of Sana's linear attention: an error term that
//! grows with √u, not u, measured on the f64 replay's own q, k, v ([`super::probe`]).
//!
//! φ = ReLU is continuous, its derivative is not: the gradient of a component qₙ[c] is the full
//! dφ(qₙ)[c] where qₙ[c] > 0 and 0 elsewhere. A variant computes q with an error of a few u_c
//! of the terms of its dot product, so a component within that error of 0 lands on the other
//! side of the kink with a probability of Φ(−|qₙ[c]|/δ), and its gradient differs from the
//! reference's by the whole of dφ(qₙ)[c] — not by a rounding of it. The number of such
//! components is proportional to u_c, so this error grows with √u_c: 2.8× (√8) from fp16 to
//! bf16 where rounding grows 8×, which is why fp16-mixed showed it first (Sana block 0's `to_k`
//! at 3.5× what bf16-mixed's error scaled by u(f16)/u(bf16) predicts, unmoved by the loss scale
//! from 2^10 to 2^24, with no subnormal q, k or v).
//!
//! δ: q = h·Wᵀ + b with h (the block's normed input) carrying `roundings − 1` independent
//! roundings and W one. Rounding to nearest errs uniformly within half a spacing, which is
//! u_c·2/m of a value with mantissa m ∈ [1, 2); mantissas are log-uniform, so the mean square
//! relative error is u_c²/3 · E[(2/m)²]/4 = u_c²/3 · (3/8)/ln 2 = u_c²/(8·ln 2). The terms
//! hⱼ·W_cj of a dot product err independently, so the component errs by
//! δ = u_c·√(roundings/(8·ln 2))·√(Σⱼ hⱼ²·W_cj²) (the `spread` the probe computes per
//! component).
//!
//! The weight of a component is E[dφ(x)²] under a random dO independent across tokens (as the
//! cancellation's, [`super::cancellation`]):
//!
//! ```text
//! E dφ(qₙ)[c]² = Σₐ (KV[a][c] − z[c]·oₙ[a])² / dₙ²
//! E dφ(kₘ)[c]² = Σₙ φ(qₙ)[c]² · ‖vₘ − oₙ‖² / dₙ²
//! ```
//!
//! and the expected relative error of the `to_q` / `to_k` gradient is
//! √(Σ P_flip · E dφ² / Σ_{x > 0} E dφ²) (rows of the normed input have equal norms, so the
//! weight gradient's rows weigh alike and the bias shares the figure).
//!
//! That mean is a tolerance only where flips happen: its square is the sum over components of
//! P_flip·E dφ², and where the expected number of flipped components λ = Σ P_flip is small the
//! mean comes from rare events (fp32: λ ≈ 10⁻³ on Sana's tiny spec, a mean 100× the rounding
//! tolerance from one flip in a thousand runs). No flip happens with probability e^−λ ≥ 99 %
//! below [`RARE_FLIPS`]: there the term is 0, and a correct run exceeds its tolerance by a kink
//! with a probability below 1 %.

use ditmem_budget::Dtype;

use super::cancellation::{head_at, Head};

/// The compute dtypes the term is measured for, in the order of [`KinkSums`]' arrays.
pub(crate) const KINK_DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

/// Σ E dφ² over the components ReLU passes, Σ P_flip·E dφ² over all and λ = Σ P_flip (the
/// expected number of flipped components) of one projection's components, per dtype of
/// [`KINK_DTYPES`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct SideSums {
    pub all: f64,
    pub flip: [f64; 3],
    pub count: [f64; 3],
}

/// Below this expected number of flipped components (e^−λ ≥ 0.99: no flip in 99 % of runs) the
/// term is 0 (see the module docs).
pub(crate) const RARE_FLIPS: f64 = 0.01;

impl SideSums {
    /// The expected relative error of the gradient per dtype (0 where nothing passes ReLU or
    /// flips are rare).
    pub(crate) fn errors(&self) -> [f64; 3] {
        std::array::from_fn(|i| {
            if self.all > 0.0 && self.count[i] >= RARE_FLIPS {
                (self.flip[i] / self.all).sqrt()
            } else {
                0.0
            }
        })
    }

    pub(crate) fn add(&mut self, o: SideSums) {
        self.all += o.all;
        for i in 0..KINK_DTYPES.len() {
            self.flip[i] += o.flip[i];
            self.count[i] += o.count[i];
        }
    }

    /// Adds P_flip·w (per dtype) of a component of value `x` whose dot product's terms spread
    /// `spread`, P_flip to the count, and w to `all` where ReLU passes it.
    fn add_component(&mut self, x: f64, spread: f64, roundings: f64, w: f64) {
        if x > 0.0 {
            self.all += w;
        }
        for (i, d) in KINK_DTYPES.iter().enumerate() {
            let delta = super::roundoff::unit_roundoff(*d)
                * (roundings / MEAN_SQUARE_DIVISOR).sqrt()
                * spread;
            if delta > 0.0 {
                let p = normal_tail(x.abs() / delta);
                self.flip[i] += p * w;
                self.count[i] += p;
            }
        }
    }
}

/// [`SideSums`] of the q and of the k components of a linear attention.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct KinkSums {
    pub q: SideSums,
    pub k: SideSums,
}

impl KinkSums {
    pub(crate) fn add(&mut self, o: KinkSums) {
        self.q.add(o.q);
        self.k.add(o.k);
    }
}

/// u_c² over the mean square relative error of one rounding to nearest: 8·ln 2 (module docs).
const MEAN_SQUARE_DIVISOR: f64 = 8.0 * std::f64::consts::LN_2;

/// Φ(−x) for x ≥ 0: ½·erfc(x/√2), Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7, far
/// below the factor-of-two spread the term is held to).
fn normal_tail(x: f64) -> f64 {
    let y = x / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * y);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    0.5 * poly * (-y * y).exp()
}

/// [`KinkSums`] of the linear attention of q, k, v ((b·s, heads·dh) row-major, f64) whose
/// components' dot products spread `(sq, sk)` (same layout), each input carrying `roundings`
/// roundings (see the module docs), for `b` samples of `s` tokens, added to `into`.
pub(crate) fn add_kink_sums(
    (q, k, v): (&[f64], &[f64], &[f64]),
    (sq, sk): (&[f64], &[f64]),
    roundings: f64,
    (b, s, heads, dh): (usize, usize, usize, usize),
    into: &mut KinkSums,
) {
    for bi in 0..b {
        for h in 0..heads {
            let at = |n: usize| head_at(bi, h, n, (s, heads, dh));
            let hd = Head::of((q, k, v), (bi, h), (s, heads, dh));
            let mut sums = KinkSums::default();
            for n in 0..s {
                let d2 = hd.den[n] * hd.den[n];
                for c in 0..dh {
                    let w: f64 = (0..dh)
                        .map(|a| (hd.kv[a][c] - hd.z[c] * hd.out[n][a]).powi(2))
                        .sum::<f64>()
                        / d2;
                    let i = at(n) + c;
                    sums.q.add_component(q[i], sq[i], roundings, w);
                }
            }
            for m in 0..s {
                // ‖vₘ − oₙ‖² / dₙ² per query n, then weighted by φ(qₙ)[c]² per component.
                let diff: Vec<f64> = (0..s)
                    .map(|n| {
                        (0..dh)
                            .map(|a| (hd.v[m][a] - hd.out[n][a]).powi(2))
                            .sum::<f64>()
                            / (hd.den[n] * hd.den[n])
                    })
                    .collect();
                for c in 0..dh {
                    let w: f64 = (0..s).map(|n| hd.fq[n][c].powi(2) * diff[n]).sum();
                    let i = at(m) + c;
                    sums.k.add_component(k[i], sk[i], roundings, w);
                }
            }
            into.add(sums);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_tail_matches_known_values() {
        assert!((normal_tail(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_tail(1.0) - 0.158_655_25).abs() < 1e-7);
        assert!((normal_tail(3.0) - 0.001_349_9).abs() < 1e-7);
    }

    /// A component far from the kink never flips, one at it flips half the time, and the
    /// flips grow with the dtype's unit roundoff.
    /// One component's sums (spread 1, 3 roundings).
    fn one(x: f64, w: f64) -> SideSums {
        let mut side = SideSums::default();
        side.add_component(x, 1.0, 3.0, w);
        side
    }

    #[test]
    fn flips_follow_the_distance_to_the_kink() {
        let far = one(1.0, 2.0);
        assert_eq!(far.all, 2.0);
        assert!(far.flip.iter().all(|&f| f < 1e-12), "{far:?}");
        // At the kink: half the time on the other side, whatever the dtype.
        let at = one(-1e-12, 2.0);
        assert_eq!(at.all, 0.0);
        assert!(at.flip.iter().all(|&f| (f - 1.0).abs() < 1e-3), "{at:?}");
        assert!(at.count.iter().all(|&c| (c - 0.5).abs() < 1e-3), "{at:?}");
        // Near it, the flips grow with the dtype's unit roundoff: f32 < f16 < bf16.
        let near = one(2e-3, 1.0).flip;
        assert!(near[0] < near[2] && near[2] < near[1], "{near:?}");
    }

    /// Where flips are rare the term is 0; where they are not, it is the root of the shares.
    #[test]
    fn rare_flips_leave_no_term() {
        let mut s = SideSums {
            all: 4.0,
            flip: [1e-6, 1.0, 0.25],
            count: [1e-3, 5.0, 0.5],
        };
        assert_eq!(s.errors(), [0.0, 0.5, 0.25]);
        assert_eq!(SideSums::default().errors(), [0.0; 3]);
        s.add(s);
        assert_eq!(s.errors(), [0.0, 0.5, 0.25]);
    }
}
