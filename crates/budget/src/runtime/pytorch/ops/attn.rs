//! The geometry of one attention call, which the builders and the CPU scratch rules read.

/// The geometry of one attention call: q (b, heads, sq, dh), k and v (b, heads, skv, dh).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attn {
    pub b: u64,
    pub heads: u64,
    pub sq: u64,
    pub skv: u64,
    pub dh: u64,
}

impl Attn {
    /// Self-attention of `b` samples over `s` tokens in `heads` heads of `dh` (a cross-attention:
    /// `Attn { skv, ..Attn::over(…) }`).
    pub(crate) fn over(b: u64, heads: u64, s: u64, dh: u64) -> Attn {
        Attn {
            b,
            heads,
            sq: s,
            skv: s,
            dh,
        }
    }

    pub(crate) fn q_elems(&self) -> u64 {
        self.b * self.heads * self.sq * self.dh
    }
    pub(crate) fn kv_elems(&self) -> u64 {
        self.b * self.heads * self.skv * self.dh
    }
    pub(crate) fn scores(&self) -> u64 {
        self.b * self.heads * self.sq * self.skv
    }
}
