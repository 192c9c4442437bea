//! The tensors an error in a source tensor's gradient reaches upstream ([`with_upstream`]): a
//! cancellation's or a ReLU kink's term carried to every trained tensor the forward read before
//! the source, from the model's table.

use ditmem_budget::Spec;

use super::error::Result;

/// `sources` (a cancellation's or a kink's (tensor prefix, term), from [`amplified_tensors`])
/// with the same term, as the largest `max` of the sources that reach it, on every trained
/// tensor upstream of them: an error in a block's q or k gradient flows into the block's input
/// gradient, so into every tensor the forward read before it — the embed segment's (the family
/// schedule runs it before every block: patch, position, timestep, label and text embedders),
/// every earlier block's, and the block's own tensors that q and k are computed from
/// (`qk_inputs`: the family's
/// [`VerifyFamily::qk_inputs`](crate::families::VerifyFamily::qk_inputs)). Tensors after them (the block's v, out, cross-attention and
/// feed-forward, later blocks, the final layer) are not reached: the kink changes the q and k
/// gradient alone. The set follows from the model's table (module and block of each tensor),
/// never from names of the tensors that failed.
pub(crate) fn with_upstream<T: Copy>(
    spec: &Spec,
    qk_inputs: impl Fn(u32) -> Vec<String>,
    sources: Vec<(String, T)>,
    max: impl Fn(T, T) -> T,
) -> Result<Vec<(String, T)>> {
    use ditmem_budget::Module;
    if sources.is_empty() {
        return Ok(sources);
    }
    let table = ditmem_budget::denoiser::param_table(spec);
    let embed = |m: Module| {
        matches!(
            m,
            Module::PatchEmbed
                | Module::PosEmbed
                | Module::TimestepEmbed
                | Module::LabelEmbed
                | Module::TextEmbed
        )
    };
    let under = |name: &str, prefix: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
    };
    let mut reached: Vec<Option<T>> = vec![None; table.len()];
    for (prefix, v) in &sources {
        // The block of the source, from the table.
        let Some(block) = table
            .iter()
            .find(|t| under(&t.name, prefix))
            .and_then(|t| t.block)
        else {
            continue;
        };
        let own = qk_inputs(block);
        for (slot, t) in reached.iter_mut().zip(&table) {
            let upstream = embed(t.module)
                || (t.block.is_some_and(|b| b < block) && t.module != Module::FinalLayer)
                || own.contains(&t.name);
            if upstream {
                *slot = Some(slot.map_or(*v, |w| max(w, *v)));
            }
        }
    }
    let mut out = sources;
    out.extend(
        table
            .iter()
            .zip(reached)
            .filter_map(|(t, v)| Some((t.name.clone(), v?))),
    );
    Ok(out)
}
