//! The partial cancellation of a key bias's gradient in a softmax attention whose q and k
//! projections share their input, measured on the reference's own gradients.
//!
//! A softmax ignores a shift of a row's scores: a shift of every key by the same vector
//! changes nothing, so Σⱼ dkⱼ over all keys is 0 ([`ditmem_engine::families::zero_gradient`] names the
//! biases where that sum is exactly the bias's gradient). Where the bias shifts only part of
//! the keys (SD3's and Flux's joint attention: `to_k.bias` the image keys, `add_k_proj.bias`
//! the text keys) or enters before a q/k RMSNorm (Flux, Wan, SD3.5), its gradient is a
//! remainder of that sum: small beside its terms dkⱼ, whose rounding it carries. So its
//! relative error exceeds the policy's tolerance, the weight's does not (fp64 SD3: 1.84× on
//! `to_k.bias`, 0.65× on the query biases, over five seeds).
//!
//! Measure: a bias is the weight of a constant input, so the bias and weight gradients of one
//! projection sum the same rows dY: ‖Δg_b‖ / ‖ΔG_W‖ is the same figure for every projection of
//! the same input X (√N / ‖X‖_F with random-sign errors). The query projection of the same
//! attention reads the same X and its bias does not cancel, so its bias and weight err alike
//! relative to their own norms: ‖Δg_b,q‖ / ‖ΔG_W,q‖ = ρ_q := ‖g_b,q‖ / ‖G_W,q‖. With the key
//! weight's relative error the policy's, the key bias errs by tol·‖G_W,k‖·ρ_q, i.e.
//! tol · ρ_q / ρ_k of its own norm: the amplification is ρ_q / ρ_k (at least 1).

/// The query sibling of a key bias in a self- or joint attention (q and k from one stream).
pub(crate) const SELF_ATTENTION: &[(&str, &str)] = &[
    ("to_k.bias", "to_q.bias"),
    ("add_k_proj.bias", "add_q_proj.bias"),
];

/// The sibling of a key bias in a cross-attention whose k and v both read the caption: the
/// value bias (v's bias sums dO over the queries and cancels nothing).
pub(crate) const CROSS_ATTENTION: &[(&str, &str)] = &[("to_k.bias", "to_v.bias")];

/// The bias whose projection reads the same input as the key bias `name` and does not cancel,
/// among the family's `pairs` for `name`
/// ([`VerifyFamily::key_bias_pairs`](crate::families::VerifyFamily::key_bias_pairs)): the query
/// bias of a softmax self- or joint attention (SD3's and Flux's `attn`, both streams, Wan's and
/// PixArt's `attn1`), the value bias of Wan's cross-attention `attn2`. None elsewhere: Sana's
/// `attn1` is the linear attention (its own cancellation, `cancellation.rs`); the DiT's key bias
/// is a third of the fused `qkv.bias`; PixArt's and Sana's cross-attention key biases get an
/// exact zero gradient ([`ditmem_engine::families::zero_gradient`]).
pub(super) fn query_sibling(pairs: &[(&str, &str)], name: &str) -> Option<String> {
    pairs.iter().find_map(|(k, q)| {
        name.strip_suffix(k)
            .filter(|head| head.ends_with('.'))
            .map(|head| format!("{head}{q}"))
    })
}

/// The amplification of tensor `name`'s gradient if it is a key bias with a query sibling
/// ([`query_sibling`]; 1 otherwise), from the reference gradient norms `norm_of` gives.
pub(super) fn of(
    pairs: &[(&str, &str)],
    name: &str,
    mut norm_of: impl FnMut(&str) -> super::Result<f64>,
) -> super::Result<f64> {
    let Some(query) = query_sibling(pairs, name) else {
        return Ok(1.0);
    };
    let weight = |bias: &str| format!("{}.weight", bias.strip_suffix(".bias").unwrap_or(bias));
    Ok(amplification(
        (norm_of(name)?, norm_of(&weight(name))?),
        (norm_of(&query)?, norm_of(&weight(&query))?),
    ))
}

/// ρ_q / ρ_k from the gradient norms of the key bias and weight and the query bias and weight
/// (see the module docs); 1 where a norm is 0 or not finite, or the key bias does not cancel.
pub(super) fn amplification(
    (key_bias, key_weight): (f64, f64),
    (query_bias, query_weight): (f64, f64),
) -> f64 {
    let a = (query_bias / query_weight) / (key_bias / key_weight);
    if a.is_finite() {
        a.max(1.0)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ditmem_engine::families::Arch;

    fn sibling(arch: &Arch, name: &str) -> Option<String> {
        query_sibling(crate::families::of(arch).key_bias_pairs(name), name)
    }

    #[test]
    fn siblings_are_the_same_attentions_query_biases() {
        let sd3 =
            Arch::of(&ditmem_engine::families::sd3::tiny_spec(3, 2, false, 5, 6).unwrap()).unwrap();
        assert_eq!(
            sibling(&sd3, "transformer_blocks.1.attn.add_k_proj.bias").as_deref(),
            Some("transformer_blocks.1.attn.add_q_proj.bias")
        );
        assert_eq!(
            sibling(&sd3, "transformer_blocks.1.attn.to_k.bias").as_deref(),
            Some("transformer_blocks.1.attn.to_q.bias")
        );
        assert_eq!(sibling(&sd3, "transformer_blocks.1.attn.to_k.weight"), None);
        let wan = Arch::of(&ditmem_engine::families::wan::tiny_spec(2, 2, 5, 7).unwrap()).unwrap();
        assert!(sibling(&wan, "blocks.0.attn1.to_k.bias").is_some());
        assert_eq!(
            sibling(&wan, "blocks.0.attn2.to_k.bias").as_deref(),
            Some("blocks.0.attn2.to_v.bias")
        );
        let pixart =
            Arch::of(&ditmem_engine::families::pixart::tiny_spec(2, 4, 13).unwrap()).unwrap();
        assert_eq!(
            sibling(&pixart, "transformer_blocks.0.attn2.to_k.bias"),
            None
        );
    }

    #[test]
    fn amplification_is_the_ratio_of_bias_shares() {
        assert_eq!(amplification((0.06, 1.0), (0.18, 1.0)), 3.0);
        assert_eq!(amplification((0.3, 1.0), (0.1, 1.0)), 1.0);
        assert_eq!(amplification((0.0, 1.0), (0.1, 1.0)), 1.0);
    }
}
