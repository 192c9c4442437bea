//! What every family's stages share: the family context ([`Fam`]: the spec's shapes, precision,
//! LoRA, the builders), and the pieces of the training script's step around the model.

use crate::denoiser;
use crate::families::{FamilyModel, Geometry};
use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::pytorch::ops::{Builder, LoraOn};
use crate::spec::Spec;

/// A family spec's step, as the builders read it.
pub struct Fam<'a> {
    pub rt: &'a PyTorch,
    pub spec: &'a Spec,
    pub geometry: Geometry,
    /// Microbatch b.
    pub b: u64,
    /// Image (video) tokens per sample.
    pub s: u64,
    /// Latent frames (1 for images), latent height and width (VAE pixels, before patching).
    pub frames: u64,
    pub latent_h: u64,
    pub latent_w: u64,
    /// Text tokens per text encoder, in the family's order.
    pub text: Vec<u64>,
    pub lora: Option<LoraOn>,
}

impl<'a> Fam<'a> {
    pub fn new(rt: &'a PyTorch, spec: &'a Spec, fm: &FamilyModel) -> Fam<'a> {
        let geometry = fm.geometry();
        let text = denoiser::text_tokens(spec, &geometry);
        let w = &spec.workload;
        let factor = u64::from(w.vae_factor.max(1));
        let lora = spec.recipe.lora.as_ref().map(|l| LoraOn {
            rank: u64::from(l.rank),
            modules: denoiser::lora_modules(spec),
            dtype: spec.recipe.trained_dtype(),
        });
        Fam {
            rt,
            spec,
            b: u64::from(w.microbatch),
            s: spec.tokens().unwrap_or(0),
            frames: spec.latent_frames().unwrap_or(1),
            latent_h: u64::from(w.height) / factor,
            latent_w: u64::from(w.width) / factor,
            text,
            lora,
            geometry,
        }
    }

    /// A graph builder under the spec's precision, attention mode and LoRA.
    pub fn builder(&self, name: &str) -> Builder<'a> {
        let mut bl = Builder::new(
            self.rt,
            self.spec.recipe.precision,
            self.spec.recipe.attention,
            name,
        );
        bl.lora = self.lora.clone();
        bl.threads = u64::from(self.spec.cpu().threads);
        bl
    }
}
