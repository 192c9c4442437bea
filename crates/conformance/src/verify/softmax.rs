//! The cancellation in the backward of a softmax attention whose rows saturate, measured on the
//! f64 replay's own q and k ([`super::probe`]).
//!
//! Per row i with probabilities P = softmax(sᵢ) the score gradient is
//!
//! ```text
//! dSᵢ = J·dPᵢ,   J = diag(P) − P·Pᵀ
//! ```
//!
//! a difference of two terms, P ⊙ dP and P·(P·dP). Where the row saturates (large logits: P
//! near one-hot at the peak j*), the two nearly cancel: (dS)_{j*} = P_{j*}·(dP_{j*} − Σₖ Pₖ dPₖ)
//! is of the size of 1 − P_{j*}, while each term is of dP's. Rounding errs on the terms (P in
//! the compute dtype, each product, the row sum), so the relative error of dS, and of the q and
//! k gradients it forms (dq = scale·dS·k, dk = scale·dSᵀ·q), is the terms' times
//! ‖terms‖ / ‖result‖. As in [`super::cancellation`] the ratio depends on dP, which a forward
//! replay does not have: it is taken over a random dP (E‖J·dP‖² = ‖J‖_F²), i.e. as
//!
//! ```text
//! ‖terms‖² = ‖diag(P)‖_F² + ‖P·Pᵀ‖_F² = ΣP² + (ΣP²)²
//! ‖result‖² = ‖J‖_F² = Σⱼ Pⱼ²(1 − Pⱼ)² + Σ_{j≠k} Pⱼ² Pₖ²
//! ```
//!
//! summed over the rows of one group of queries of one attention — every head and sample; a
//! joint attention's text and image queries are two groups, since a projection's gradient
//! sums the rows of its own stream (a uniform row of n gives √((n + 1)/(n − 1)), a one-hot
//! row → ∞). The result is formed without the cancellation itself: 1 − P_{j*} as
//! Σ_{k≠j*} Pₖ, and Σ_{k≠j} Pₖ² by excluding j from the sum.
//!
//! Where it enters: the error reaches every gradient upstream of the scores (q and k, their
//! norms and projections, and through the residual stream and the modulation every tensor of
//! the blocks before and the embedders), which in these models is nearly every tensor; the
//! largest ratio over the groups is applied to all of them (a bound, not an estimate: for the
//! tensors after the last attention, and for the groups less saturated than the worst).

/// Σ ‖terms‖² and Σ ‖result‖² of the softmax backward of the attentions replayed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Sums {
    pub terms: f64,
    pub result: f64,
}

impl Sums {
    /// ‖terms‖ / ‖result‖ (at least 1; 1 where no row was added or the result is 0).
    pub(crate) fn amplification(&self) -> f64 {
        if self.result > 0.0 && self.terms.is_finite() {
            (self.terms / self.result).sqrt().max(1.0)
        } else {
            1.0
        }
    }

    pub(crate) fn add(&mut self, o: Sums) {
        self.terms += o.terms;
        self.result += o.result;
    }
}

/// The layout of a (b·s_q, ·) query and a (b·s_k, ·) key operand: `b` samples, `heads` heads of
/// width `dh`, row strides `q_stride` and `k_stride` (values per token row).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub heads: usize,
    pub dh: usize,
    pub q_stride: usize,
    pub k_stride: usize,
}

/// The [`Sums`] of one row of probabilities `p` (summing to 1).
pub(crate) fn row_sums(p: &[f64]) -> Sums {
    let Some(peak) = (0..p.len()).max_by(|&a, &b| p[a].total_cmp(&p[b])) else {
        return Sums::default();
    };
    let p2: f64 = p.iter().map(|x| x * x).sum();
    // Σₖ Pₖ² without the peak, and 1 − P_peak, summed directly (no cancellation).
    let rest2: f64 = (0..p.len())
        .filter(|&k| k != peak)
        .map(|k| p[k] * p[k])
        .sum();
    let rest: f64 = (0..p.len()).filter(|&k| k != peak).map(|k| p[k]).sum();
    let mut result = 0.0;
    for (j, &pj) in p.iter().enumerate() {
        let (one_minus, others2) = if j == peak {
            (rest, rest2)
        } else {
            (1.0 - pj, p2 - pj * pj)
        };
        result += pj * pj * (one_minus * one_minus + others2);
    }
    Sums {
        terms: p2 + p2 * p2,
        result,
    }
}

/// [`Sums`] of the query rows `rows` (of each sample's `l.sq`) of the softmax attention of q
/// and k (f64, laid out as `l`; the scores are `scale`·qᵢ·kⱼ per sample and head), added to
/// `into`.
pub(crate) fn add_sums(
    q: &[f64],
    k: &[f64],
    l: Layout,
    rows: std::ops::Range<usize>,
    scale: f64,
    into: &mut Sums,
) {
    let mut p = vec![0.0; l.sk];
    for bi in 0..l.b {
        for h in 0..l.heads {
            for i in rows.clone() {
                let qi = &q[(bi * l.sq + i) * l.q_stride + h * l.dh..][..l.dh];
                for (j, pj) in p.iter_mut().enumerate() {
                    let kj = &k[(bi * l.sk + j) * l.k_stride + h * l.dh..][..l.dh];
                    *pj = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                }
                let m = p.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                p.iter_mut().for_each(|x| *x = (*x - m).exp());
                let z: f64 = p.iter().sum();
                p.iter_mut().for_each(|x| *x /= z);
                into.add(row_sums(&p));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uniform_row_barely_cancels_a_saturated_one_does() {
        let n = 8;
        let uniform = row_sums(&vec![1.0 / n as f64; n]);
        let a = uniform.amplification();
        // terms 1/n + 1/n², result 1/n − 1/n²: √((n + 1)/(n − 1)).
        assert!((a - (9.0f64 / 7.0).sqrt()).abs() < 1e-12, "{a}");
        let eps = 1e-6;
        let mut p = vec![eps / 7.0; 8];
        p[3] = 1.0 - eps;
        let s = row_sums(&p);
        assert!(s.amplification() > 1e5, "{}", s.amplification());
        // The result as the Frobenius norm of diag(P) − P·Pᵀ, summed term by term.
        let direct: f64 = (0..8)
            .flat_map(|j| (0..8).map(move |k| (j, k)))
            .map(|(j, k)| {
                let d = if j == k { p[j] } else { 0.0 } - p[j] * p[k];
                d * d
            })
            .sum();
        assert!((s.result - direct).abs() < 1e-9 * direct.max(1e-300) + 1e-20);
    }

    #[test]
    fn sums_follow_the_scores_scale() {
        // Two tokens, one head of width 2: scores ×1 stay soft, ×100 saturate.
        let q = [1.0, 0.0, 0.0, 1.0];
        let k = [1.0, 0.0, 0.0, 1.0];
        let l = Layout {
            b: 1,
            sq: 2,
            sk: 2,
            heads: 1,
            dh: 2,
            q_stride: 2,
            k_stride: 2,
        };
        let mut soft = Sums::default();
        add_sums(&q, &k, l, 0..2, 1.0, &mut soft);
        let mut hard = Sums::default();
        add_sums(&q, &k, l, 0..2, 100.0, &mut hard);
        assert!(soft.amplification() < 3.0, "{}", soft.amplification());
        assert!(hard.amplification() > 1e10, "{}", hard.amplification());
    }
}
