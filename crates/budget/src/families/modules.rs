//! The diffusers building blocks the families share, one [`Table`] method per module class, each
//! pushing that module's tensors under a prefix in the order its `__init__` registers them.

use super::table::{Group, Table, TensorKind};

/// The projections of a diffusers attention module: what they read and write.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attn {
    /// `query_dim`: what `to_q` reads and `to_out.0` writes.
    pub query_dim: u64,
    /// `cross_attention_dim`: what `to_k` and `to_v` read (`query_dim` in self-attention).
    pub kv_dim: u64,
    /// heads × dim_head: what `to_q`, `to_k` and `to_v` write and `to_out.0` reads.
    pub inner: u64,
    /// `bias` of `to_q`, `to_k`, `to_v` (`to_out.0` always has one: `out_bias=True`).
    pub bias: bool,
    /// Width of the weight-only q/k RMSNorm: dim_head for `"rms_norm"`, heads × dim_head for
    /// `"rms_norm_across_heads"`; None: no q/k norm.
    pub qk_norm: Option<u64>,
}

impl Attn {
    /// Self-attention of `dim` (dim heads × dim_head = dim), no q/k norm.
    pub(crate) fn self_attn(dim: u64, bias: bool) -> Attn {
        Attn {
            query_dim: dim,
            kv_dim: dim,
            inner: dim,
            bias,
            qk_norm: None,
        }
    }
}

impl Table {
    /// diffusers/models/embeddings.py `PatchEmbed`: `proj` Conv2d(in_channels, dim, patch, stride
    /// patch). Its sin-cos `pos_embed` buffer is [`Table::patch_embed_pos_embed`]: buffers come
    /// after every parameter.
    pub(crate) fn patch_embed(&mut self, prefix: &str, in_channels: u64, dim: u64, patch: u64) {
        let shape = vec![dim, in_channels, patch, patch];
        self.conv(
            &format!("{prefix}.proj"),
            shape,
            true,
            Group::PatchEmbed,
            None,
        );
    }

    /// diffusers/models/embeddings.py `PatchEmbed`'s `pos_embed` buffer (get_2d_sincos_pos_embed):
    /// (1, side², dim), persistent only when `pos_embed_max_size` is set.
    pub(crate) fn patch_embed_pos_embed(
        &mut self,
        prefix: &str,
        side: u64,
        dim: u64,
        kind: TensorKind,
    ) {
        let shape = vec![1, side * side, dim];
        self.buffer(&format!("{prefix}.pos_embed"), shape, kind, Group::PosEmbed);
    }

    /// diffusers/models/embeddings.py `TimestepEmbedding(in_channels, time_embed_dim)`: `linear_1`
    /// (in → dim), `linear_2` (dim → dim).
    pub(crate) fn timestep_embedding(
        &mut self,
        prefix: &str,
        inp: u64,
        dim: u64,
        group: Group,
        block: Option<u32>,
    ) {
        self.linear(&format!("{prefix}.linear_1"), dim, inp, true, group, block);
        self.linear(&format!("{prefix}.linear_2"), dim, dim, true, group, block);
    }

    /// diffusers/models/embeddings.py `PixArtAlphaTextProjection(in_features, hidden_size)`:
    /// `linear_1` (in → dim), an activation, `linear_2` (dim → dim).
    pub(crate) fn pixart_alpha_text_projection(&mut self, prefix: &str, inp: u64, dim: u64) {
        let g = Group::TextEmbed;
        self.top_linear(&format!("{prefix}.linear_1"), dim, inp, g);
        self.top_linear(&format!("{prefix}.linear_2"), dim, dim, g);
    }

    /// diffusers/models/embeddings.py `CombinedTimestepTextProjEmbeddings(dim, pooled)` and, with
    /// `guidance`, `CombinedTimestepGuidanceTextProjEmbeddings`: `timestep_embedder`
    /// TimestepEmbedding(256, dim), `guidance_embedder` (the same), `text_embedder`
    /// PixArtAlphaTextProjection(pooled, dim).
    pub(crate) fn combined_timestep_text_proj_embeddings(
        &mut self,
        prefix: &str,
        dim: u64,
        pooled: u64,
        guidance: bool,
    ) {
        let g = Group::TimeEmbed;
        self.timestep_embedding(&format!("{prefix}.timestep_embedder"), 256, dim, g, None);
        if guidance {
            self.timestep_embedding(&format!("{prefix}.guidance_embedder"), 256, dim, g, None);
        }
        self.pixart_alpha_text_projection(&format!("{prefix}.text_embedder"), pooled, dim);
    }

    /// diffusers/models/normalization.py `AdaLayerNormZero(dim, num_embeddings)`: with
    /// `num_embeddings` (DiT) `emb` CombinedTimestepLabelEmbeddings (a TimestepEmbedding on the
    /// 256-d sinusoid; a LabelEmbedding whose table has a null row, class_dropout_prob=0.1), then
    /// `linear` Linear(dim, 6·dim).
    pub(crate) fn ada_layer_norm_zero(
        &mut self,
        prefix: &str,
        dim: u64,
        num_embeddings: Option<u64>,
        group: Group,
        block: Option<u32>,
    ) {
        if let Some(classes) = num_embeddings {
            let emb = format!("{prefix}.emb");
            self.timestep_embedding(&format!("{emb}.timestep_embedder"), 256, dim, group, block);
            self.push(
                format!("{emb}.class_embedder.embedding_table.weight"),
                vec![classes + 1, dim],
                group,
                block,
            );
        }
        self.modulation_linear(prefix, 6, dim, (group, block));
    }

    /// An adaptive norm's modulation `{prefix}.linear`: Linear(dim, `k`·dim) with its bias.
    fn modulation_linear(&mut self, prefix: &str, k: u64, dim: u64, at: (Group, Option<u32>)) {
        let name = format!("{prefix}.linear");
        self.linear(&name, k * dim, dim, true, at.0, at.1);
    }

    /// diffusers/models/normalization.py `SD35AdaLayerNormZeroX(dim)`: `linear` Linear(dim, 9·dim).
    pub(crate) fn sd35_ada_layer_norm_zero_x(
        &mut self,
        prefix: &str,
        dim: u64,
        group: Group,
        block: Option<u32>,
    ) {
        self.modulation_linear(prefix, 9, dim, (group, block));
    }

    /// diffusers/models/normalization.py `AdaLayerNormZeroSingle(dim)`: `linear` Linear(dim, 3·dim).
    pub(crate) fn ada_layer_norm_zero_single(
        &mut self,
        prefix: &str,
        dim: u64,
        group: Group,
        block: Option<u32>,
    ) {
        self.modulation_linear(prefix, 3, dim, (group, block));
    }

    /// diffusers/models/normalization.py `AdaLayerNormContinuous(dim, dim, elementwise_affine=False)`:
    /// `linear` Linear(dim, 2·dim), a LayerNorm without weights.
    pub(crate) fn ada_layer_norm_continuous(
        &mut self,
        prefix: &str,
        dim: u64,
        group: Group,
        block: Option<u32>,
    ) {
        self.modulation_linear(prefix, 2, dim, (group, block));
    }

    /// diffusers/models/normalization.py `AdaLayerNormSingle(dim, use_additional_conditions)`: `emb`
    /// PixArtAlphaCombinedTimestepSizeEmbeddings (`timestep_embedder` TimestepEmbedding(256, dim);
    /// with the additional conditions `resolution_embedder` and `aspect_ratio_embedder`
    /// TimestepEmbedding(256, dim / 3)), then `linear` Linear(dim, 6·dim).
    pub(crate) fn ada_layer_norm_single(&mut self, prefix: &str, dim: u64, additional: bool) {
        let g = Group::TimeEmbed;
        let emb = format!("{prefix}.emb");
        self.timestep_embedding(&format!("{emb}.timestep_embedder"), 256, dim, g, None);
        if additional {
            let size = dim / 3;
            for e in ["resolution_embedder", "aspect_ratio_embedder"] {
                self.timestep_embedding(&format!("{emb}.{e}"), 256, size, g, None);
            }
        }
        self.top_linear(&format!("{prefix}.linear"), 6 * dim, dim, g);
    }

    /// Weight-only `RMSNorm(width)`s `prefix.{name}` for each name (attention q/k norms).
    pub(crate) fn rms_norms(
        &mut self,
        prefix: &str,
        names: &[&str],
        width: u64,
        group: Group,
        block: Option<u32>,
    ) {
        for n in names {
            self.norm(&format!("{prefix}.{n}"), width, false, group, block);
        }
    }

    /// diffusers/models/attention_processor.py `Attention` (no added projections): `norm_q`,
    /// `norm_k` (with a qk_norm), `to_q`, `to_k`, `to_v`, `to_out.0`.
    pub(crate) fn attention(&mut self, prefix: &str, a: Attn, group: Group, block: Option<u32>) {
        if let Some(w) = a.qk_norm {
            self.rms_norms(prefix, &["norm_q", "norm_k"], w, group, block);
        }
        let (q, kv, inner, bias) = (a.query_dim, a.kv_dim, a.inner, a.bias);
        self.linear(&format!("{prefix}.to_q"), inner, q, bias, group, block);
        for proj in ["to_k", "to_v"] {
            self.linear(&format!("{prefix}.{proj}"), inner, kv, bias, group, block);
        }
        self.linear(&format!("{prefix}.to_out.0"), q, inner, true, group, block);
    }

    /// diffusers/models/transformers/transformer_flux.py `FluxAttention` (dim heads × dim_head =
    /// dim, biases everywhere, `rms_norm` q/k norms of `head_dim`): `norm_q`, `norm_k`, `to_q`,
    /// `to_k`, `to_v`; in the double-stream block (`joint`: `added_kv_proj_dim` set, not
    /// `pre_only`) then `to_out.0`, `norm_added_q`, `norm_added_k`, `add_q_proj`, `add_k_proj`,
    /// `add_v_proj`, `to_add_out`. The single-stream block's is `pre_only`: no `to_out`.
    pub(crate) fn flux_attention(
        &mut self,
        prefix: &str,
        dim: u64,
        head_dim: u64,
        joint: bool,
        group: Group,
        block: Option<u32>,
    ) {
        self.rms_norms(prefix, &["norm_q", "norm_k"], head_dim, group, block);
        let projs: &[&str] = if joint {
            &["to_q", "to_k", "to_v", "to_out.0"]
        } else {
            &["to_q", "to_k", "to_v"]
        };
        for proj in projs {
            self.linear(&format!("{prefix}.{proj}"), dim, dim, true, group, block);
        }
        if joint {
            let norms = ["norm_added_q", "norm_added_k"];
            self.rms_norms(prefix, &norms, head_dim, group, block);
            for proj in ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"] {
                self.linear(&format!("{prefix}.{proj}"), dim, dim, true, group, block);
            }
        }
    }

    /// diffusers/models/transformers/transformer_wan.py `WanAttention(dim, qk_norm=
    /// "rms_norm_across_heads")` without image conditioning: `to_q`, `to_k`, `to_v`, `to_out.0`,
    /// then `norm_q`, `norm_k` of `dim`.
    pub(crate) fn wan_attention(
        &mut self,
        prefix: &str,
        dim: u64,
        group: Group,
        block: Option<u32>,
    ) {
        for proj in ["to_q", "to_k", "to_v", "to_out.0"] {
            self.linear(&format!("{prefix}.{proj}"), dim, dim, true, group, block);
        }
        self.rms_norms(prefix, &["norm_q", "norm_k"], dim, group, block);
    }

    /// diffusers/models/attention.py `FeedForward(dim, inner_dim=inner)` with a GELU: `net.0.proj`
    /// (dim → inner), `net.2` (inner → dim).
    pub(crate) fn feed_forward(
        &mut self,
        prefix: &str,
        dim: u64,
        inner: u64,
        group: Group,
        block: Option<u32>,
    ) {
        let proj = format!("{prefix}.net.0.proj");
        self.linear(&proj, inner, dim, true, group, block);
        self.linear(&format!("{prefix}.net.2"), dim, inner, true, group, block);
    }

    /// diffusers/models/transformers/sana_transformer.py `GLUMBConv(dim, dim, expand_ratio)` with
    /// `hidden` = int(expand_ratio · dim): `conv_inverted` 1×1 (dim → 2·hidden), `conv_depth`
    /// depthwise 3×3 on 2·hidden, `conv_point` 1×1 (hidden → dim) without a bias.
    pub(crate) fn glumb_conv(
        &mut self,
        prefix: &str,
        dim: u64,
        hidden: u64,
        group: Group,
        block: Option<u32>,
    ) {
        let h2 = 2 * hidden;
        let (g, blk) = (group, block);
        self.conv(
            &format!("{prefix}.conv_inverted"),
            vec![h2, dim, 1, 1],
            true,
            g,
            blk,
        );
        self.conv(
            &format!("{prefix}.conv_depth"),
            vec![h2, 1, 3, 3],
            true,
            g,
            blk,
        );
        self.conv(
            &format!("{prefix}.conv_point"),
            vec![dim, hidden, 1, 1],
            false,
            g,
            blk,
        );
    }
}
