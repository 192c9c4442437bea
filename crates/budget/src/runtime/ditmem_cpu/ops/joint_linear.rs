//! The engine's joint linear (`ops/joint_linear.rs`): its workspace formula
//! [`joint_linear_workspace`] and the node [`joint_linear`].

use super::linear::linear_workspace;
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::spec::{CpuSpec, Dtype};

/// Workspace bytes (forward, backward) of the engine's joint linear
/// (`ops::joint_linear_*_scratch`) in compute dtype `cd`, weight gradients in `wd`, for
/// `(ra, rc, inp, out)`, da when `ta`, dc when `tc`, the weight gradients `wants` = (dWa, dba,
/// dWc, dbc). Forward, beyond the output: la's workspace less the output; ya with lc's
/// workspace less the output; ya and yc while joined (the output's size). Backward, beyond the
/// gradients it hands out: a's part of the gradient with la's backward and its gradients; c's
/// part with lc's backward beside every gradient.
/// With `gemm`'s per-call packing in each phase ([`linear_workspace`]): the node's workspace on
/// the spec's CPU.
pub(crate) fn joint_linear_workspace(
    cpu: &CpuSpec,
    (cd, wd): (Dtype, Dtype),
    dims: (u64, u64, u64, u64),
    (ta, tc, wants): (bool, bool, [bool; 4]),
    master: bool,
) -> (u64, u64) {
    let lin = |dims, t| linear_workspace(cpu, cd, dims, t, master);
    joint_linear_phases(lin, (cd, wd), dims, (ta, tc, wants))
}

/// The joint linear's phases over the workspace `lin(dims, tracks)` of each linear call.
fn joint_linear_phases(
    lin: impl Fn((u64, u64, u64), (bool, bool, bool)) -> (u64, u64),
    (cd, wd): (Dtype, Dtype),
    (ra, rc, inp, out): (u64, u64, u64, u64),
    (ta, tc, wants): (bool, bool, [bool; 4]),
) -> (u64, u64) {
    let (e, we) = (cd.size(), wd.size());
    let (ya, y) = (e * ra * out, e * (ra + rc) * out);
    let on = |b: bool, n: u64| if b { we * n } else { 0 };
    let dx = |t: bool, r: u64| if t { e * r * inp } else { 0 };
    let ga = dx(ta, ra) + on(wants[0], out * inp) + on(wants[1], out);
    let gc = dx(tc, rc) + on(wants[2], out * inp) + on(wants[3], out);
    let (fa, ba) = lin((ra, inp, out), (ta, wants[0], wants[1]));
    let (fc, bc) = lin((rc, inp, out), (tc, wants[2], wants[3]));
    let fwd = fa.saturating_sub(y).max((ya + fc).saturating_sub(y)).max(y);
    let pa = e * ra * out + ba + ga;
    let pc = ga + e * rc * out + bc + gc;
    (fwd, pa.max(pc) - ga - gc)
}

/// `ops::joint_linear` of the engine: `[la(a); lc(c)]` per sample as one node on a and c (the
/// weights `ws` = [Wa, ba, Wc, bc] are its other inputs here, sunk or frozen). A fresh
/// (ra + rc, out) output; nothing kept (its boxed op only, as every fused node's). Workspace:
/// [`joint_linear_workspace`]. Its backward returns da and dc only.
pub fn joint_linear(
    g: &mut Graph,
    name: &str,
    [a, c]: [Nid; 2],
    ws: [Nid; 4],
    (ra, rc, inp, out): (u64, u64, u64, u64),
    cpu: &CpuSpec,
) -> Nid {
    let (cd, wd) = (g.dtype(a), g.dtype(ws[0]));
    let wants = ws.map(|i| g.nodes[i].sunk);
    let (ta, tc) = (g.nodes[a].tracks, g.nodes[c].tracks);
    let master = wd == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    let (fwd, bwd) =
        joint_linear_workspace(cpu, (cd, wd), (ra, rc, inp, out), (ta, tc, wants), master);
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &[a, c, ws[0], ws[1], ws[2], ws[3]],
        (ra + rc) * out,
        cd,
    );
    g.nodes[y].fwd_scratch = fwd;
    y
}
