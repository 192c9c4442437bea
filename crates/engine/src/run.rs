//! The measuring loop: W warm-up steps, then M measured steps on fresh synthetic batches (or a
//! latent directory), with the high-water mark reset at the start of every step so warm-up never
//! counts. The CLI adds conditions, a progress bar and percentiles on top.

use std::path::PathBuf;
use std::time::Instant;

use ditmem_spec::Spec;
use serde::Serialize;

use crate::diffusion::{load_latent_dir, SyntheticData};
use crate::error::{EngineError, Result};
use crate::measure::{MemoryProbe, Phase, PhasePeaks, TimelinePoint};
use crate::trainer::{TrainOptions, Trainer};

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOptions {
    pub warmup: u32,
    pub steps: u32,
    /// Seed of the weights and dropout.
    pub seed: u64,
    /// Seed of the synthetic data.
    pub data_seed: u64,
    pub lr: f64,
    pub weight_decay: f64,
    /// Read latents from this directory instead of synthesising them (cycled over).
    pub latents_dir: Option<PathBuf>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            warmup: 1,
            steps: 3,
            seed: 0,
            data_seed: 1,
            lr: 1e-4,
            weight_decay: 0.0,
            latents_dir: None,
        }
    }
}

/// Reported after every step; return `false` from the callback to stop the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Progress {
    /// 1-based step number over warm-up and measured steps.
    pub step: u32,
    pub total: u32,
    pub warmup: bool,
    pub loss: f64,
    pub step_time_s: f64,
    pub skipped: bool,
}

/// The result of a run, measured steps only.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measurement {
    /// Highest live bytes over the measured steps (0 without a probe).
    pub peak_bytes: u64,
    pub phase_peak_bytes: PhasePeaks,
    pub step_times_s: Vec<f64>,
    /// CPU seconds of the process during each measured step, all threads
    /// ([`crate::measure::process_cpu_s`]): on a shared machine, what other load moves least.
    pub step_cpu_s: Vec<f64>,
    /// Wall seconds of each measured step's forward, backward (recomputed forwards included)
    /// and optimizer, from its timeline ([`PhaseTimes::of`]).
    pub phase_times_s: Vec<PhaseTimes>,
    pub losses: Vec<f64>,
    pub skipped_steps: u32,
    /// Live bytes at each segment boundary of the last measured step.
    pub timeline: Vec<TimelinePoint>,
    /// Live bytes just before the last measured step began (weights, optimizer state, EMA).
    pub resident_bytes: u64,
    pub param_count: u64,
    pub trainable_params: u64,
}

/// Wall seconds one step spent in each phase, from its timeline: a phase runs from the previous
/// phase's last point (the step's start for the forward) to its own last point. Without a
/// probe the timeline is empty and every phase reads 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PhaseTimes {
    pub forward: f64,
    pub backward: f64,
    pub optimizer: f64,
}

impl PhaseTimes {
    pub fn of(timeline: &[TimelinePoint]) -> PhaseTimes {
        let end = |ph: Phase| {
            timeline
                .iter()
                .filter(|p| p.phase == ph)
                .map(|p| p.at_s)
                .reduce(f64::max)
        };
        let f = end(Phase::Forward).unwrap_or(0.0);
        let b = end(Phase::Backward).unwrap_or(f);
        let o = end(Phase::Optimizer).unwrap_or(b);
        PhaseTimes {
            forward: f,
            backward: (b - f).max(0.0),
            optimizer: (o - b).max(0.0),
        }
    }
}

/// Run `spec` for `opts.warmup + opts.steps` optimizer steps.
pub fn run(
    spec: &Spec,
    opts: &RunOptions,
    probe: Option<&dyn MemoryProbe>,
    progress: &mut dyn FnMut(&Progress) -> bool,
) -> Result<Measurement> {
    if opts.steps == 0 {
        return Err(EngineError::bad_input(
            "steps",
            "is 0; allowed: at least one measured step",
        ));
    }
    let mut trainer = Trainer::new(
        spec,
        TrainOptions {
            seed: opts.seed,
            lr: opts.lr,
            weight_decay: opts.weight_decay,
            ..TrainOptions::default()
        },
    )?;
    let data = SyntheticData::new(spec, opts.data_seed)?;
    let disk = match &opts.latents_dir {
        Some(dir) => Some(load_latent_dir(dir, &data)?),
        None => None,
    };
    let total = opts.warmup + opts.steps;
    let mut m = Measurement {
        peak_bytes: 0,
        phase_peak_bytes: PhasePeaks::default(),
        step_times_s: Vec::new(),
        step_cpu_s: Vec::new(),
        phase_times_s: Vec::new(),
        losses: Vec::new(),
        skipped_steps: 0,
        timeline: Vec::new(),
        resident_bytes: 0,
        param_count: crate::model::param_count(spec)?,
        trainable_params: crate::model::trainable_count(spec)?,
    };
    for step in 0..total {
        let batch = match &disk {
            Some(all) => {
                let n = data.per_step;
                if all.n < n {
                    return Err(EngineError::Data {
                        path: opts
                            .latents_dir
                            .as_ref()
                            .map(|p| p.display().to_string())
                            .unwrap_or_default(),
                        why: format!("{} latents found; one step needs {n}", all.n),
                    });
                }
                let start = (step as usize * n) % (all.n - n + 1);
                all.slice(start, n)?
            }
            None => data.step_batch(u64::from(step)),
        };
        let measured = step >= opts.warmup;
        let resident = probe.map_or(0, |p| p.live());
        let (t0, c0) = (Instant::now(), crate::measure::process_cpu_s());
        let r = trainer.step(&batch, probe)?;
        let dt = t0.elapsed().as_secs_f64();
        let dc = crate::measure::process_cpu_s() - c0;
        if measured {
            m.peak_bytes = m.peak_bytes.max(r.phase_peaks.max());
            m.phase_peak_bytes.merge(&r.phase_peaks);
            m.step_times_s.push(dt);
            m.step_cpu_s.push(dc);
            m.phase_times_s.push(PhaseTimes::of(&r.timeline));
            m.losses.push(r.loss);
            m.skipped_steps += u32::from(r.skipped);
            m.timeline = r.timeline;
            m.resident_bytes = resident;
        }
        let go_on = progress(&Progress {
            step: step + 1,
            total,
            warmup: !measured,
            loss: r.loss,
            step_time_s: dt,
            skipped: r.skipped,
        });
        if !go_on {
            return Err(EngineError::Interrupted {
                after_steps: step + 1,
            });
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(phase: Phase, at_s: f64) -> TimelinePoint {
        TimelinePoint {
            phase,
            label: String::new(),
            live_bytes: 0,
            at_s,
        }
    }

    /// Each phase runs from the previous phase's last point to its own; a phase without points
    /// takes no time.
    #[test]
    fn phase_times_are_the_spans_between_phase_ends() {
        let t = [
            point(Phase::Forward, 0.5),
            point(Phase::Forward, 1.0),
            point(Phase::Backward, 1.5),
            point(Phase::Backward, 3.25),
            point(Phase::Optimizer, 3.5),
        ];
        let p = PhaseTimes::of(&t);
        assert_eq!((p.forward, p.backward, p.optimizer), (1.0, 2.25, 0.25));
        let p = PhaseTimes::of(&t[..2]);
        assert_eq!((p.forward, p.backward, p.optimizer), (1.0, 0.0, 0.0));
        assert_eq!(PhaseTimes::of(&[]), PhaseTimes::default());
    }
}
