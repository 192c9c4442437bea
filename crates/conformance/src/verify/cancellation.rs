//! The cancellation behind the q and k gradients of Sana's ReLU linear attention, measured on
//! the f64 replay's own q, k, v ([`super::probe`]).
//!
//! Per sample and head, with φ = ReLU, KV = Σₘ vₘ φ(kₘ)ᵀ, z = Σₘ φ(kₘ), dₙ = z·φ(qₙ) and
//! oₙ = KV·φ(qₙ) / dₙ, the output is invariant to the scale of each φ(qₙ) (and of φ(k) per
//! head), so the exact gradients are differences of larger terms:
//!
//! ```text
//! dφ(qₙ) = (KVᵀ·dOₙ − z·(oₙ·dOₙ)) / dₙ
//! dφ(kₘ) = Σₙ φ(qₙ)·((vₘ − oₙ)·dOₙ) / dₙ
//! ```
//!
//! Rounding errs on the terms (KVᵀ·dO and z·(o·dO); vₘ and oₙ), so the relative error of the
//! result is the terms' times ‖terms‖ / ‖result‖. That ratio depends on dO, which a forward
//! replay does not have: it is taken over a random dO (E‖J·dO‖² = ‖J‖_F²), i.e. as the
//! Frobenius norms of the Jacobians' two parts over the parts' difference, on the components
//! ReLU passes (qₙ, kₘ > 0), summed over samples, heads and tokens: the amplification of the
//! whole `to_q` / `to_k` gradient, which sums those rows. The k gradient sums over the queries
//! n, so how its terms add depends on how dOₙ varies with n: independent across tokens (the
//! sum of squares above) or one direction for every token (a loss whose gradient is alike
//! over the image: the sums Σₙ φ(qₙ)/dₙ and Σₙ φ(qₙ)·oₙᵀ/dₙ first, then the Frobenius norms).
//! Both extremes are measured; the larger is the amplification.

/// Σ ‖terms‖² and Σ ‖result‖² of the q and of the k gradient of one linear attention (the k
/// gradient's for a dO independent across tokens and for one common to all of them).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Sums {
    pub q_terms: f64,
    pub q_result: f64,
    pub k_terms: f64,
    pub k_result: f64,
    pub k_common_terms: f64,
    pub k_common_result: f64,
}

impl Sums {
    /// ‖terms‖ / ‖result‖ of the q and of the k gradient (1 where the result is 0).
    pub(crate) fn amplification(&self) -> (f64, f64) {
        let a = |t: f64, r: f64| {
            if r > 0.0 {
                (t / r).sqrt().max(1.0)
            } else {
                1.0
            }
        };
        (
            a(self.q_terms, self.q_result),
            a(self.k_terms, self.k_result).max(a(self.k_common_terms, self.k_common_result)),
        )
    }

    pub(crate) fn add(&mut self, o: Sums) {
        self.q_terms += o.q_terms;
        self.q_result += o.q_result;
        self.k_terms += o.k_terms;
        self.k_result += o.k_result;
        self.k_common_terms += o.k_common_terms;
        self.k_common_result += o.k_common_result;
    }
}

/// One head of one sample of the linear attention, replayed in f64: φ(q) and v per token,
/// KV, z, the denominators dₙ and the outputs oₙ (see the module docs).
pub(crate) struct Head {
    pub fq: Vec<Vec<f64>>,
    pub v: Vec<Vec<f64>>,
    /// kv[a][c] = Σₘ vₘ[a]·φ(kₘ)[c].
    pub kv: Vec<Vec<f64>>,
    /// z[c] = Σₘ φ(kₘ)[c].
    pub z: Vec<f64>,
    pub den: Vec<f64>,
    pub out: Vec<Vec<f64>>,
}

/// Where row `n` of head `h` of sample `bi` starts in a (b·s, heads·dh) row-major operand.
pub(crate) fn head_at(
    bi: usize,
    h: usize,
    n: usize,
    (s, heads, dh): (usize, usize, usize),
) -> usize {
    (bi * s + n) * heads * dh + h * dh
}

impl Head {
    /// Head `h` of sample `bi` of q, k, v ((b·s, heads·dh) row-major, f64).
    pub(crate) fn of(
        (q, k, v): (&[f64], &[f64], &[f64]),
        (bi, h): (usize, usize),
        (s, heads, dh): (usize, usize, usize),
    ) -> Head {
        let at = |n: usize| head_at(bi, h, n, (s, heads, dh));
        let row = |x: &[f64], n: usize| x[at(n)..at(n) + dh].to_vec();
        let phi = |x: &[f64]| -> Vec<Vec<f64>> {
            (0..s)
                .map(|n| row(x, n).into_iter().map(|y| y.max(0.0)).collect())
                .collect()
        };
        let (fq, fk) = (phi(q), phi(k));
        let vv: Vec<Vec<f64>> = (0..s).map(|n| row(v, n)).collect();
        let mut kv = vec![vec![0.0; dh]; dh];
        let mut z = vec![0.0; dh];
        for m in 0..s {
            for c in 0..dh {
                z[c] += fk[m][c];
                for a in 0..dh {
                    kv[a][c] += vv[m][a] * fk[m][c];
                }
            }
        }
        let den: Vec<f64> = (0..s)
            .map(|n| {
                (0..dh).map(|c| z[c] * fq[n][c]).sum::<f64>()
                    + crate::ops::linear_attention::LINEAR_ATTN_EPS
            })
            .collect();
        let out: Vec<Vec<f64>> = (0..s)
            .map(|n| {
                (0..dh)
                    .map(|a| (0..dh).map(|c| kv[a][c] * fq[n][c]).sum::<f64>() / den[n])
                    .collect()
            })
            .collect();
        Head {
            fq,
            v: vv,
            kv,
            z,
            den,
            out,
        }
    }
}

/// [`Sums`] of the linear attention of q, k, v ((b·s, heads·dh) row-major, f64) for `b`
/// samples of `s` tokens, added to `into`.
pub(crate) fn add_sums(
    (q, k, v): (&[f64], &[f64], &[f64]),
    (b, s, heads, dh): (usize, usize, usize, usize),
    into: &mut Sums,
) {
    for bi in 0..b {
        for h in 0..heads {
            let at = |n: usize| head_at(bi, h, n, (s, heads, dh));
            let Head {
                fq,
                v: vv,
                kv,
                z,
                den,
                out,
            } = Head::of((q, k, v), (bi, h), (s, heads, dh));
            let mut sums = Sums::default();
            // q: J[c][a] = (KV[a][c] − z[c]·oₙ[a]) / dₙ on the components qₙ[c] > 0.
            for n in 0..s {
                let d2 = den[n] * den[n];
                for c in (0..dh).filter(|&c| q[at(n) + c] > 0.0) {
                    for a in 0..dh {
                        let (t1, t2) = (kv[a][c], z[c] * out[n][a]);
                        sums.q_terms += (t1 * t1 + t2 * t2) / d2;
                        sums.q_result += (t1 - t2) * (t1 - t2) / d2;
                    }
                }
            }
            // k: the block of dOₙ is φ(qₙ)·(vₘ − oₙ)ᵀ / dₙ on the components kₘ[c] > 0.
            for m in 0..s {
                let vm2: f64 = vv[m].iter().map(|x| x * x).sum();
                for n in 0..s {
                    let fq2: f64 = (0..dh)
                        .filter(|&c| k[at(m) + c] > 0.0)
                        .map(|c| fq[n][c] * fq[n][c])
                        .sum();
                    if fq2 == 0.0 {
                        continue;
                    }
                    let w = fq2 / (den[n] * den[n]);
                    let on2: f64 = out[n].iter().map(|x| x * x).sum();
                    let diff2: f64 = (0..dh).map(|a| (vv[m][a] - out[n][a]).powi(2)).sum();
                    sums.k_terms += w * (vm2 + on2);
                    sums.k_result += w * diff2;
                }
            }
            // k with one dO for every token: A = Σₙ φ(qₙ)/dₙ, B = Σₙ φ(qₙ)·oₙᵀ/dₙ; the block
            // of dO is A·vₘᵀ − B on the components kₘ[c] > 0.
            let mut av = vec![0.0; dh];
            let mut bm = vec![vec![0.0; dh]; dh];
            for n in 0..s {
                for c in 0..dh {
                    let w = fq[n][c] / den[n];
                    av[c] += w;
                    for a in 0..dh {
                        bm[c][a] += w * out[n][a];
                    }
                }
            }
            for m in 0..s {
                for c in (0..dh).filter(|&c| k[at(m) + c] > 0.0) {
                    for a in 0..dh {
                        let (t1, t2) = (av[c] * vv[m][a], bm[c][a]);
                        sums.k_common_terms += t1 * t1 + t2 * t2;
                        sums.k_common_result += (t1 - t2) * (t1 - t2);
                    }
                }
            }
            into.add(sums);
        }
    }
}
