//! The float64 reference (module docs, 1. and 4.): computed once into a safetensors file with its
//! spec and seeds as metadata ([`compute_reference`]), read back one tensor at a time
//! ([`Reference::open`]); the options of a run ([`VerifyOptions`]).

use super::error::{bad, reference_error};
use super::error::{Result, VerifyError};
use super::metrics::to_f64;
use super::variant::Variant;
use crate::diffusion::SyntheticData;
use crate::trainer::{TrainOptions, Trainer};
use ditmem_budget::{Dtype, Spec};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Learning rate of the drift run: large enough that 50 AdamW steps move every weight by
/// ~50·lr (≈ 5 % of a 64-wide Xavier weight), so the trajectories actually separate.
pub(crate) const DEFAULT_LR: f64 = 1e-3;

/// Settings of a verification that are not part of the spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyOptions {
    /// Seed of the initial weights (and dropout masks).
    pub seed: u64,
    /// Seed of the synthetic data (latents, noise, timesteps, labels, label dropout).
    pub data_seed: u64,
    /// Learning rate of the drift run.
    pub lr: f64,
    pub weight_decay: f64,
    /// Optimizer steps of the drift run (0: one-step comparison only).
    pub steps: u32,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            seed: 0,
            data_seed: 1,
            lr: DEFAULT_LR,
            weight_decay: 0.0,
            steps: 50,
        }
    }
}

impl VerifyOptions {
    pub(super) fn train(&self) -> TrainOptions {
        TrainOptions {
            seed: self.seed,
            lr: self.lr,
            weight_decay: self.weight_decay,
            loss_scale_growth_interval: 2000,
            keep_gradients: false,
        }
    }

    pub(super) fn check(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(bad("lr", format!("{} is not a positive number", self.lr)));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(bad(
                "weight decay",
                format!("{} is not a number ≥ 0", self.weight_decay),
            ));
        }
        Ok(())
    }
}

/// The fp64 reference: what comparison needs and nothing more. The loss and the drift losses are
/// held here; the gradients and the trajectory (parameters, and EMA weights when the recipe keeps
/// one, after 0..=K steps) lie in a file (`store`) read one tensor at a time.
#[derive(Debug)]
pub struct Reference {
    /// The reference spec: the base spec under fp64 / no recompute / materialized attention.
    pub spec: Spec,
    pub options: VerifyOptions,
    /// Version of ditmem that computed it.
    pub version: String,
    pub loss: f64,
    /// Loss of each drift step (before its update), `steps` values.
    pub losses: Vec<f64>,
    /// Trained tensors (name, shape) in the order they are compared.
    pub tensors: Vec<(String, Vec<usize>)>,
    /// Whether the trajectory holds EMA weights.
    pub ema: bool,
    /// S, the attention-score bound of the first step (see [`Growth::score_bound`]).
    pub score_bound: f64,
    /// (tensor prefix, ‖terms‖ / ‖result‖): the cancellations the tensors' gradients come out
    /// of, measured on the first step's replay (Sana's linear attention; empty elsewhere).
    pub amplification: Vec<(String, f64)>,
    /// ‖terms‖ / ‖result‖ of the softmax attentions' backward on the first step's replay
    /// ([`softmax`]: saturated rows cancel), applied to every tensor's gradient (≥ 1).
    pub softmax_amplification: f64,
    /// (tensor prefix, expected relative error per dtype of [`super::kink::KINK_DTYPES`]): the
    /// gradients behind a ReLU kink, measured on the first step's replay (Sana's linear
    /// attention; empty elsewhere).
    pub kink: Vec<(String, [f64; 3])>,
    /// The file's name; None for a reference computed into a file without one.
    path: Option<PathBuf>,
    file: std::sync::Mutex<std::fs::File>,
    layout: super::store::Layout,
    /// The named file is deleted when dropped (computed to be persisted, and not yet).
    temporary: bool,
}

impl Drop for Reference {
    fn drop(&mut self) {
        if let (true, Some(p)) = (self.temporary, &self.path) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The reference spec of a base spec.
pub(crate) fn reference_spec(base: &Spec) -> Spec {
    Variant::reference().apply(base)
}

/// Bytes of the stored reference of `base` with `opts` (header excluded): 8 B per trained
/// parameter for the gradients and for each of the K + 1 trajectory points (twice with an EMA),
/// plus the K + 1 losses.
pub fn reference_file_bytes(base: &Spec, opts: &VerifyOptions) -> Result<u64> {
    let n = crate::trainable_count(base)?;
    Ok(super::store::data_bytes(
        n,
        opts.steps,
        base.recipe.ema.enabled,
    ))
}

pub(super) const FORMAT: &str = "ditmem-verify-reference/6";

/// The metadata of a reference file.
pub(super) fn reference_meta(
    spec: &Spec,
    opts: &VerifyOptions,
    names: &[String],
    score_bound: f64,
    softmax_amplification: f64,
    amplification: &[(String, f64)],
    kink: &[(String, [f64; 3])],
) -> Result<HashMap<String, String>> {
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("spec".to_string(), json(spec)?);
    meta.insert("options".to_string(), json(opts)?);
    meta.insert("names".to_string(), json(&names)?);
    meta.insert("ema".to_string(), spec.recipe.ema.enabled.to_string());
    meta.insert("score_bound".to_string(), json(&score_bound)?);
    meta.insert(
        "softmax_amplification".to_string(),
        json(&softmax_amplification)?,
    );
    meta.insert("amplification".to_string(), json(&amplification)?);
    meta.insert("kink".to_string(), json(&kink)?);
    meta.insert("version".to_string(), env!("CARGO_PKG_VERSION").to_string());
    Ok(meta)
}

/// The size in bytes of the file [`compute_reference`] writes for `base` and `opts`, header
/// included, predicted before it runs: the data ([`reference_file_bytes`]) and the header of the
/// same tensors and metadata, with the one figure not known before the run (S) at its longest
/// JSON form — an upper bound by at most a few bytes.
pub fn reference_file_size(base: &Spec, opts: &VerifyOptions) -> Result<u64> {
    let spec = reference_spec(base);
    let tensors: Vec<(String, Vec<usize>)> = crate::model::param_shapes(&spec)?
        .into_iter()
        .filter(|p| p.trainable)
        .map(|p| (p.name, p.shape))
        .collect();
    let names: Vec<String> = tensors.iter().map(|t| t.0.clone()).collect();
    let amplification: Vec<(String, f64)> = super::probe::amplified_tensors(&spec)?
        .into_iter()
        .map(|n| (n, -f64::MAX))
        .collect();
    let kink: Vec<(String, [f64; 3])> = amplification
        .iter()
        .map(|(n, _)| (n.clone(), [-f64::MAX; 3]))
        .collect();
    // The same tensors as the probe's lists: each source and what it reaches upstream.
    let arch = ditmem_engine::families::Arch::of(&spec)?;
    let qk_inputs = |block| crate::families::of(&arch).qk_inputs(block);
    let amplification = super::upstream::with_upstream(&spec, qk_inputs, amplification, f64::max)?;
    let kink = super::upstream::with_upstream(&spec, qk_inputs, kink, |a, _| a)?;
    let meta = reference_meta(
        &spec,
        opts,
        &names,
        -f64::MAX,
        -f64::MAX,
        &amplification,
        &kink,
    )?;
    let ema = spec.recipe.ema.enabled;
    super::store::file_len(&meta, &super::store::keys(&tensors, opts.steps, ema))
}

pub(super) static TEMP_COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Compute the reference for `base` (its recipe's precision, recompute and attention are replaced
/// by fp64 / none / materialized) into a file without a name in the system's temporary folder:
/// its blocks are freed when the reference is dropped or the process ends, however it ends.
/// `progress(step)` is called after each drift step.
pub fn compute_reference(
    base: &Spec,
    opts: &VerifyOptions,
    progress: &mut dyn FnMut(u32),
) -> Result<Reference> {
    compute_reference_into(
        Target::Anonymous(&std::env::temp_dir()),
        base,
        opts,
        progress,
    )
}

/// [`compute_reference`] into a named temporary file in `dir`, to be [`Reference::persist`]ed
/// there (a rename, not a copy); deleted when dropped before that.
pub fn compute_reference_in(
    dir: &Path,
    base: &Spec,
    opts: &VerifyOptions,
    progress: &mut dyn FnMut(u32),
) -> Result<Reference> {
    compute_reference_into(Target::Named(dir), base, opts, progress)
}

/// Where a reference is computed to.
pub(super) enum Target<'a> {
    Anonymous(&'a Path),
    Named(&'a Path),
}

/// The reference's writes in the order the file holds them: the probe's bounds in the
/// metadata, the one step's gradients ([`put_gradients`]), the drift steps' states
/// ([`drift`]); one writer throughout.
pub(super) fn compute_reference_into(
    target: Target<'_>,
    base: &Spec,
    opts: &VerifyOptions,
    progress: &mut dyn FnMut(u32),
) -> Result<Reference> {
    opts.check()?;
    let spec = reference_spec(base);
    let path = match target {
        Target::Named(dir) => Some(dir.join(format!(
            ".ditmem-verify-reference-{}-{}.tmp",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ))),
        Target::Anonymous(_) => None,
    };
    // From here on the file is ours: removed on every error path by the guard's drop.
    let mut cleanup = Cleanup(None);
    let data = SyntheticData::new(&spec, opts.data_seed)?;
    // One-step gradients.
    let mut t = Trainer::new(&spec, opts.train())?;
    let names = t.trained_names();
    let mut tensors = Vec::with_capacity(names.len());
    for n in &names {
        tensors.push((n.clone(), t.parameter(n)?.dims().to_vec()));
    }
    let ema = spec.recipe.ema.enabled;
    let batch = data.step_batch(0);
    // The probe first, while the trainer holds only its weights (its forward stays below the
    // step's peak), then checked against the step's loss.
    let super::replay::Probe {
        score_bound,
        softmax: softmax_amplification,
        loss: probe_loss,
        amplification,
        kink,
    } = super::probe::probe(&spec, &t, opts.seed, &batch)?;
    let loss = t.compute_gradients(&batch)?;
    super::probe::check_loss(probe_loss, loss)?;
    drop(batch);
    let meta = reference_meta(
        &spec,
        opts,
        &names,
        score_bound,
        softmax_amplification,
        &amplification,
        &kink,
    )?;
    let keys = super::store::keys(&tensors, opts.steps, ema);
    let mut w = match (&path, target) {
        (Some(p), _) => {
            let w = super::store::Writer::create(p, meta, keys)?;
            cleanup.0 = Some(p.clone());
            w
        }
        (None, Target::Anonymous(dir) | Target::Named(dir)) => {
            super::store::Writer::anonymous(dir, meta, keys)?
        }
    };
    put_gradients(&mut w, &t, &tensors)?;
    let losses = drift(&mut w, t, &data, &tensors, (opts.steps, loss), progress)?;
    w.put("drift/losses", &losses)?;
    w.put("loss", &[loss])?;
    let file = w.finish()?;
    let layout = super::store::read_layout(&file)?;
    let temporary = cleanup.0.take().is_some();
    Ok(Reference {
        spec,
        options: opts.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        loss,
        losses,
        tensors,
        ema,
        score_bound,
        softmax_amplification,
        amplification,
        kink,
        path,
        file: std::sync::Mutex::new(file),
        layout,
        temporary,
    })
}

/// The trained tensors `names` of a reference file's `layout` with their shapes (those of
/// their gradients), once every tensor that `steps` drift steps (and EMA when `ema`) store is
/// checked present, with its shape, and nothing else is in the file.
fn check_entries(
    layout: &super::store::Layout,
    names: &[String],
    steps: u32,
    ema: bool,
) -> Result<Vec<(String, Vec<usize>)>> {
    let mut tensors = Vec::with_capacity(names.len());
    for n in names {
        let e = layout
            .entries
            .get(&format!("grad/{n}"))
            .ok_or_else(|| reference_error(format!("tensor 'grad/{n}' is missing")))?;
        tensors.push((n.clone(), e.shape.clone()));
    }
    let want = super::store::keys(&tensors, steps, ema);
    if want.len() != layout.entries.len() {
        return Err(reference_error(format!(
            "{} tensors; {} steps of {} trained tensors need {}",
            layout.entries.len(),
            steps,
            names.len(),
            want.len()
        )));
    }
    for (k, shape) in &want {
        match layout.entries.get(k) {
            Some(e) if &e.shape == shape => {}
            Some(e) => {
                return Err(reference_error(format!(
                    "tensor '{k}' has shape {:?}; expected {shape:?}",
                    e.shape
                )))
            }
            None => return Err(reference_error(format!("tensor '{k}' is missing"))),
        }
    }
    Ok(tensors)
}

/// A named reference file being written: removed when dropped still holding its path (every
/// error path of [`compute_reference_into`]).
struct Cleanup(Option<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The one step's gradient of each trained tensor (zeros for one no gradient reached).
fn put_gradients(
    w: &mut super::store::Writer,
    t: &Trainer,
    tensors: &[(String, Vec<usize>)],
) -> Result<()> {
    for (n, shape) in tensors {
        let g = match t.gradient(n)? {
            Some(g) => to_f64(&g)?,
            None => vec![0.0; shape.iter().product()],
        };
        w.put(&format!("grad/{n}"), &g)?;
    }
    Ok(())
}

/// The trajectory of `steps` steps on the trainer `t` that holds the first step's gradients
/// (whose loss is `loss`), each state stored after its step; the losses. Its first step is the
/// update from the gradients just stored (`step(batch 0)` is `compute_gradients(batch 0)` +
/// `apply_gradients()`, bit for bit; the probe only reads the trainer), so the reference runs
/// one forward/backward fewer and never holds two models. AdamW's moments are needed only by a
/// later step: the last step frees each tensor's right after its update, so with one drift
/// step the reference holds weights and gradients, and one tensor's moments at a time
/// (`plan_memory`). The trainer is dropped before the losses are returned.
fn drift(
    w: &mut super::store::Writer,
    mut t: Trainer,
    data: &SyntheticData,
    tensors: &[(String, Vec<usize>)],
    (steps, loss): (u32, f64),
    progress: &mut dyn FnMut(u32),
) -> Result<Vec<f64>> {
    let mut losses = Vec::with_capacity(steps as usize);
    let put_state = |w: &mut super::store::Writer, t: &Trainer, step: u32| -> Result<()> {
        for (n, _) in tensors {
            w.put(&format!("param/{step}/{n}"), &to_f64(&t.parameter(n)?)?)?;
        }
        if let Some(e) = t.ema_parameters() {
            for (n, v) in e {
                w.put(&format!("ema/{step}/{n}"), &to_f64(&v)?)?;
            }
        }
        Ok(())
    };
    put_state(w, &t, 0)?;
    for i in 0..steps {
        if i + 1 == steps {
            t.release_optimizer_state_after_next_step();
        }
        if i == 0 {
            // fp64 has no loss scaler: the step is never skipped.
            t.apply_gradients()?;
            losses.push(loss);
        } else {
            let r = t.step(&data.step_batch(u64::from(i)), None)?;
            losses.push(r.loss);
        }
        put_state(w, &t, i + 1)?;
        progress(i + 1);
    }
    drop(t);
    Ok(losses)
}

impl Reference {
    /// The file the reference lies in; None when it has no name ([`compute_reference`]).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Size of the reference file in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.file
            .lock()
            .ok()
            .and_then(|f| f.metadata().ok())
            .map_or(0, |m| m.len())
    }

    /// Keep the reference at `to` (a rename: `to` must be on the file system of the temporary
    /// file, see [`compute_reference_in`]); it is no longer deleted when dropped. A reference
    /// without a name ([`compute_reference`]) cannot be kept.
    pub fn persist(&mut self, to: &Path) -> Result<()> {
        let from = self.path.as_ref().ok_or_else(|| {
            reference_error("this reference was computed into a file without a name; compute it with a folder to keep it")
        })?;
        std::fs::rename(from, to).map_err(|e| {
            reference_error(format!(
                "cannot move the reference to '{}': {e}",
                to.display()
            ))
        })?;
        self.path = Some(to.to_path_buf());
        self.temporary = false;
        Ok(())
    }

    /// Open a reference file written by [`compute_reference`] and [`Reference::persist`]: its
    /// header is read and checked (every tensor the layout needs, f64, of the right shape, the
    /// data exactly as long as the file); the loss and the drift losses are read.
    pub fn open(path: &Path) -> Result<Reference> {
        let file = std::fs::File::open(path)
            .map_err(|e| reference_error(format!("cannot open '{}': {e}", path.display())))?;
        let layout = super::store::read_layout(&file)?;
        let field = |k: &str| {
            layout.meta.get(k).ok_or_else(|| {
                reference_error(format!(
                    "metadata has no '{k}'; not a ditmem verify reference"
                ))
            })
        };
        if field("format")? != FORMAT {
            return Err(reference_error(format!(
                "format '{}' is not {FORMAT}",
                field("format")?
            )));
        }
        let spec: Spec = serde_json::from_str(field("spec")?)
            .map_err(|e| reference_error(format!("metadata 'spec': {e}")))?;
        spec.validate()
            .map_err(|e| reference_error(format!("metadata 'spec': {e}")))?;
        let options: VerifyOptions = serde_json::from_str(field("options")?)
            .map_err(|e| reference_error(format!("metadata 'options': {e}")))?;
        let names: Vec<String> = serde_json::from_str(field("names")?)
            .map_err(|e| reference_error(format!("metadata 'names': {e}")))?;
        let ema = field("ema")? == "true";
        let score_bound: f64 = serde_json::from_str(field("score_bound")?)
            .ok()
            .filter(|s: &f64| s.is_finite() && *s >= 0.0)
            .ok_or_else(|| reference_error("metadata 'score_bound' is not a number ≥ 0"))?;
        let softmax_amplification: f64 = serde_json::from_str(field("softmax_amplification")?)
            .ok()
            .filter(|s: &f64| s.is_finite() && *s >= 1.0)
            .ok_or_else(|| {
                reference_error("metadata 'softmax_amplification' is not a number ≥ 1")
            })?;
        let amplification: Vec<(String, f64)> = serde_json::from_str(field("amplification")?)
            .ok()
            .filter(|a: &Vec<(String, f64)>| a.iter().all(|x| x.1.is_finite() && x.1 >= 1.0))
            .ok_or_else(|| {
                reference_error("metadata 'amplification' is not a list of [tensor, number ≥ 1]")
            })?;
        let kink: Vec<(String, [f64; 3])> = serde_json::from_str(field("kink")?)
            .ok()
            .filter(|a: &Vec<(String, [f64; 3])>| {
                a.iter()
                    .all(|x| x.1.iter().all(|e| e.is_finite() && *e >= 0.0))
            })
            .ok_or_else(|| {
                reference_error("metadata 'kink' is not a list of [tensor, [3 numbers ≥ 0]]")
            })?;
        let version = field("version")?.clone();
        let tensors = check_entries(&layout, &names, options.steps, ema)?;
        let mut r = Reference {
            spec,
            options,
            version,
            loss: 0.0,
            losses: Vec::new(),
            tensors,
            ema,
            score_bound,
            softmax_amplification,
            amplification,
            kink,
            path: Some(path.to_path_buf()),
            file: std::sync::Mutex::new(file),
            layout,
            temporary: false,
        };
        let mut rd = r.reader()?;
        let loss = rd.read("loss")?[0];
        let losses = rd.read("drift/losses")?;
        drop(rd);
        r.loss = loss;
        r.losses = losses;
        Ok(r)
    }

    /// The amplification of the cancellation `tensor`'s gradient comes out of (1: none).
    pub(crate) fn amplification_of(&self, tensor: &str) -> f64 {
        self.amplification
            .iter()
            .filter(|(prefix, _)| is_under(tensor, prefix))
            .map(|x| x.1)
            .fold(1.0, f64::max)
    }

    /// The expected relative error of `tensor`'s gradient from components crossing a ReLU
    /// kink when computed in `dtype` ([`kink`]; 0 when none, and for dtypes not measured).
    pub(crate) fn kink_of(&self, tensor: &str, dtype: Dtype) -> f64 {
        let Some(i) = super::kink::KINK_DTYPES.iter().position(|d| *d == dtype) else {
            return 0.0;
        };
        self.kink
            .iter()
            .filter(|(prefix, _)| is_under(tensor, prefix))
            .map(|x| x.1[i])
            .fold(0.0, f64::max)
    }

    pub(super) fn reader(&self) -> Result<super::store::Reader<'_>> {
        Ok(super::store::Reader::new(&self.file, &self.layout))
    }

    /// The reference gradient of one trained tensor (f64, flattened).
    pub fn gradient(&self, name: &str) -> Result<Vec<f64>> {
        self.reader()?.read(&format!("grad/{name}"))
    }

    /// Refuse a reference computed for another spec or other settings than `base` and `opts`.
    pub fn check_matches(&self, base: &Spec, opts: &VerifyOptions) -> Result<()> {
        let want = serde_json::to_value(reference_spec(base))
            .map_err(|e| reference_error(e.to_string()))?;
        let have = serde_json::to_value(&self.spec).map_err(|e| reference_error(e.to_string()))?;
        if let Some((path, stored, current)) = first_difference("", &have, &want) {
            return Err(VerifyError::Mismatch {
                what: format!("spec field {path}"),
                stored,
                current,
            });
        }
        let o = &self.options;
        let checks: [(&str, String, String); 5] = [
            ("seed", o.seed.to_string(), opts.seed.to_string()),
            (
                "data seed",
                o.data_seed.to_string(),
                opts.data_seed.to_string(),
            ),
            ("lr", o.lr.to_string(), opts.lr.to_string()),
            (
                "weight decay",
                o.weight_decay.to_string(),
                opts.weight_decay.to_string(),
            ),
            ("steps", o.steps.to_string(), opts.steps.to_string()),
        ];
        for (what, stored, current) in checks {
            if stored != current {
                return Err(VerifyError::Mismatch {
                    what: what.into(),
                    stored,
                    current,
                });
            }
        }
        Ok(())
    }
}

/// The first leaf where two JSON values differ: (dotted path, a, b).
/// Whether `tensor` is one of the module `prefix`'s (`prefix.` starts its name).
pub(super) fn is_under(tensor: &str, prefix: &str) -> bool {
    tensor == prefix
        || tensor
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
}

pub(super) fn first_difference(
    path: &str,
    a: &serde_json::Value,
    b: &serde_json::Value,
) -> Option<(String, String, String)> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                let (va, vb) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                if let Some(d) = first_difference(&p, va, vb) {
                    return Some(d);
                }
            }
            None
        }
        _ if a == b => None,
        _ => Some((path.to_string(), a.to_string(), b.to_string())),
    }
}

pub(super) fn json<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| reference_error(e.to_string()))
}

// ---------------------------------------------------------------------------------------------
// Comparisons.
