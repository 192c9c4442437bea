//! `ditmem spec`: the resolved spec, to edit and pass to `--config`.

use crate::args::SpecArgs;
use crate::{output, CliError};

/// `ditmem spec`'s flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct SpecCmdArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Print JSON instead of TOML.
    #[arg(long)]
    pub json: bool,
}

/// `ditmem spec`: the resolved spec as TOML (or JSON). The runtime `estimate` and `plan`
/// default to (pytorch:cuda), so that `spec … > s.toml; estimate --config s.toml` answers as
/// `estimate …` does.
pub(crate) fn spec(args: SpecCmdArgs) -> Result<(), CliError> {
    let spec = args.spec.to_gpu_spec()?;
    if args.json {
        output::print_json(&spec)?;
    } else {
        output::say(&spec.to_toml()?)?;
    }
    Ok(())
}
