//! The export's values: the [`Target`], the [`ExportOptions`] beyond the spec, the launch
//! [`Command`] and the [`Export`] itself (a leaf the target files use; `export.rs` re-exports it).

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::SpecError;
use crate::families::Family;
use crate::launch::Launcher;
use crate::sharding::{Offload, Sharder};
use crate::spec::Spec;

/// Which stack to export for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// `accelerate launch --config_file accelerate_config.yaml` (DeepSpeed plans name
    /// `ds_config.json`, the [`Target::Deepspeed`] export, beside it).
    Accelerate,
    /// A DeepSpeed config for accelerate: `"auto"` where accelerate fills values, no optimizer.
    Deepspeed,
    /// A DeepSpeed config on its own (`deepspeed` launcher, the script calls
    /// `deepspeed.initialize`): fixed values, valid at the plan's world size only.
    DeepspeedStandalone,
    /// The `accelerate launch` command of the diffusers script that trains the family.
    Diffusers,
}

impl Target {
    pub const ALL: [Target; 4] = [
        Target::Accelerate,
        Target::Deepspeed,
        Target::DeepspeedStandalone,
        Target::Diffusers,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Target::Accelerate => "accelerate",
            Target::Deepspeed => "deepspeed",
            Target::DeepspeedStandalone => "deepspeed-standalone",
            Target::Diffusers => "diffusers",
        }
    }

    /// The file name of the export (the accelerate config names `ds_config.json`).
    pub const fn file_name(self) -> &'static str {
        match self {
            Target::Accelerate => "accelerate_config.yaml",
            Target::Deepspeed => "ds_config.json",
            Target::DeepspeedStandalone => "ds_config_standalone.json",
            Target::Diffusers => "train.sh",
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Target {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "accelerate" => Ok(Target::Accelerate),
            "deepspeed" | "ds" => Ok(Target::Deepspeed),
            "deepspeed-standalone" | "ds-standalone" => Ok(Target::DeepspeedStandalone),
            "diffusers" => Ok(Target::Diffusers),
            _ => Err(SpecError::invalid(
                "plan.emit",
                format!(
                    "'{}' is not an export target; allowed: accelerate, deepspeed, \
                     deepspeed-standalone, diffusers",
                    s.chars().take(60).collect::<String>()
                ),
            )),
        }
    }
}

/// What the export needs beyond the spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ExportOptions {
    /// The model's family: which diffusers script trains it and which block class FSDP wraps.
    /// The spec does not carry it yet; [`Family::Dit`] (what the budget models) by default.
    pub family: Family,
    /// How a sharded plan launches; the default (deepspeed) defers to the plan's
    /// `recipe.sharder`.
    pub sharder: Sharder,
    /// What a sharded plan offloads; the default (none) defers to the plan's `recipe.offload`.
    pub offload: Offload,
    /// Who launches it: the family's diffusers script (default, where the family has one) or
    /// your own script ([`Launcher::Custom`]: a placeholder, with the code for what no flag does).
    pub launcher: Launcher,
    /// GPUs per node: the plan's ranks run on `ceil(ranks / gpus_per_node)` machines.
    pub gpus_per_node: u32,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            family: Family::Dit,
            sharder: Sharder::Deepspeed,
            offload: Offload::None,
            launcher: Launcher::Diffusers,
            gpus_per_node: 8,
        }
    }
}

impl ExportOptions {
    /// Machines of a launch of `ranks` processes.
    pub(crate) fn machines(&self, ranks: u32) -> u32 {
        ranks.div_ceil(self.gpus_per_node.max(1))
    }
}

/// A command line: `launcher… script script_args…`, each element one argument (unquoted).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Command {
    /// `accelerate launch` and its arguments.
    pub launcher: Vec<String>,
    /// The train script (a diffusers example's file name, or a placeholder for your own).
    pub script: String,
    /// Where the script lives in diffusers, with the tag it was read from; `None` for a
    /// placeholder.
    pub script_source: Option<String>,
    pub script_args: Vec<String>,
}

impl Command {
    /// The command as one shell line, continued over lines, arguments quoted where needed.
    pub fn render(&self) -> String {
        // `accelerate launch` on the first line (after any `NAME=value` environment settings),
        // then one flag (and its value) per line.
        let env = self
            .launcher
            .iter()
            .take_while(|a| !a.starts_with('-') && a.contains('='))
            .count();
        let head = self.launcher.len().min(env + 2);
        let shown: Vec<String> = self.launcher[..head]
            .iter()
            .enumerate()
            .map(|(i, a)| match a.split_once('=') {
                Some((name, value)) if i < env => format!("{name}={}", sh_quote(value)),
                _ => a.clone(),
            })
            .collect();
        let mut lines = vec![shown.join(" ")];
        pairs(&self.launcher[head..], &mut lines);
        lines.push(format!("  {}", sh_quote(&self.script)));
        pairs(&self.script_args, &mut lines);
        lines.join(" \\\n") + "\n"
    }
}

/// `--flag value` pairs (or lone switches), one per line, quoted for the shell.
fn pairs(args: &[String], lines: &mut Vec<String>) {
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        match args.get(i + 1) {
            Some(v) if !v.starts_with("--") => {
                lines.push(format!("  {} {}", sh_quote(a), sh_quote(v)));
                i += 2;
            }
            _ => {
                lines.push(format!("  {}", sh_quote(a)));
                i += 1;
            }
        }
    }
}

/// `s` as one shell word.
fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./,:=+@".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The exported text and what it could not express.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Export {
    pub target: Target,
    pub file_name: &'static str,
    pub text: String,
    /// Levers of the plan with no (or only an approximate) equivalent in the target.
    pub notes: Vec<String>,
    /// What the train script named by the command cannot do that the plan counts (EMA, …).
    pub cannot: Vec<String>,
    /// The launch command (`None` for the standalone DeepSpeed config).
    pub command: Option<Command>,
    pub options: ExportOptions,
}

/// `x` as a string (argument lists).
pub(super) fn s(x: impl ToString) -> String {
    x.to_string()
}

/// The first line of every exported file: the model, the image and the batch.
pub(super) fn header(spec: &Spec) -> String {
    let w = &spec.workload;
    format!(
        "{} at {}×{}: batch {} = microbatch {} × accumulation {} × {} processes",
        spec.model.name, w.height, w.width, w.batch, w.microbatch, w.accumulation, w.ranks
    )
}
