//! The commands as values: `ditmem serve`'s JSON API and the Python package call the very
//! commands the CLI runs, so every answer is the CLI's `--json`, byte for byte in meaning.
//!
//! A request is a command name and keyword arguments named as the CLI's flags (`lora_rank`,
//! `resolution`, `allow`, …; underscores or hyphens). The arguments become a command line that
//! the CLI's own parser reads (the same validation, caps and messages), the command runs with its
//! standard output captured ([`crate::output::capture`]), and its `--json` value is the answer.
//! Errors are the CLI's one line with its exit code, as a typed [`ApiError`].

use clap::{CommandFactory, Parser, Subcommand};
use serde_json::{Map, Value};

use crate::error::CliError;
use crate::estimate_cmd::EstimateArgs;
use crate::spec_cmd::SpecCmdArgs;
use crate::{estimate_cmd, gpus_cmd, oom_cmd, params_cmd, plan_cmd, spec_cmd};

/// The commands the API answers (the CLI's that need no tensors, no engine and no peer).
pub const COMMANDS: [&str; 6] = ["estimate", "plan", "params", "gpus", "oom", "spec"];

/// What a caller may let a request do.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Let arguments name files (`--config`, `--model PATH`, `--plot`, `--emit-out`, …). Off for
    /// `ditmem serve`: no request reads or writes the server's file system.
    pub allow_files: bool,
}

/// Why a request has no answer: the CLI's one line, typed by its exit code.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// Bad input (exit 2): an unknown or malformed argument, a value out of range.
    Invalid(String),
    /// Nothing fits (exit 3): the message, and the command's JSON (a plan's smallest reachable
    /// peak, its reason) when it printed one, or its text when it ran without `--json`.
    DoesNotFit {
        message: String,
        json: Option<Value>,
        text: Option<String>,
    },
    /// A needed external tool is missing (exit 5).
    Missing(String),
    /// Anything else (exit 1).
    Internal(String),
}

impl ApiError {
    /// The exit code the CLI gives the same failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            ApiError::Invalid(_) => 2,
            ApiError::DoesNotFit { .. } => 3,
            ApiError::Missing(_) => 5,
            ApiError::Internal(_) => 1,
        }
    }

    /// The one line the CLI prints after `ditmem: `.
    pub fn message(&self) -> &str {
        match self {
            ApiError::Invalid(m)
            | ApiError::Missing(m)
            | ApiError::Internal(m)
            | ApiError::DoesNotFit { message: m, .. } => m,
        }
    }

    /// A short name of the kind, for JSON error bodies: invalid, does_not_fit, missing, internal.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Invalid(_) => "invalid",
            ApiError::DoesNotFit { .. } => "does_not_fit",
            ApiError::Missing(_) => "missing",
            ApiError::Internal(_) => "internal",
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for ApiError {}

/// The API's parser: the CLI's own argument structs, so validation and messages are the CLI's.
#[derive(Debug, Parser)]
#[command(name = "ditmem", no_binary_name = true)]
struct ApiCli {
    #[command(subcommand)]
    command: ApiCommand,
}

// One value per request, parsed and consumed at once: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum ApiCommand {
    Estimate(EstimateArgs),
    Plan(plan_cmd::PlanArgs),
    Params(params_cmd::ParamsArgs),
    Gpus(gpus_cmd::GpusArgs),
    Oom(oom_cmd::OomArgs),
    Spec(SpecCmdArgs),
}

/// Run `command` with keyword arguments `args` and return its `--json` value.
///
/// `model` may be a preset name, a path (with [`Options::allow_files`]) or a diffusers
/// `config.json` as an object; `null` means "the default", `true`/`false` turn a switch on or
/// off (or give `on`/`off` to a flag that takes them), a list is joined with commas.
pub fn call(command: &str, args: &Map<String, Value>, options: Options) -> Result<Value, ApiError> {
    let captured = run(command, args, options, true)?;
    captured
        .json
        .ok_or_else(|| ApiError::Internal(format!("`{command} --json` printed no JSON")))
}

/// Run `command` with keyword arguments `args` and return the text the CLI prints for it
/// without `--json` (the answer as a person reads it: what the Python package shows). A plan
/// where nothing fits is an answer too: its text is what the CLI prints before its exit-3 line.
pub fn text(
    command: &str,
    args: &Map<String, Value>,
    options: Options,
) -> Result<String, ApiError> {
    match run(command, args, options, false) {
        Ok(captured) => Ok(captured.text),
        Err(ApiError::DoesNotFit {
            text: Some(text), ..
        }) => Ok(text),
        Err(e) => Err(e),
    }
}

/// The command's captured output, `--json` or text; a failure as the CLI's one line.
fn run(
    command: &str,
    args: &Map<String, Value>,
    options: Options,
    json: bool,
) -> Result<crate::output::Captured, ApiError> {
    let (argv, model_json) = command_line(command, args, options, json)?;
    let parsed = ApiCli::try_parse_from(&argv).map_err(|e| {
        ApiError::Invalid(format!(
            "invalid input: {}",
            crate::flags::tidy(&crate::flags::clap_line(&e, command))
        ))
    })?;
    let job = move || -> Result<(), CliError> {
        match parsed.command {
            ApiCommand::Estimate(mut a) => {
                a.spec.model_json = model_json;
                estimate_cmd::estimate(a)
            }
            ApiCommand::Plan(mut a) => {
                a.spec.model_json = model_json;
                plan_cmd::run(a)
            }
            ApiCommand::Params(mut a) => {
                a.model_json = model_json;
                params_cmd::run(a)
            }
            ApiCommand::Gpus(a) => gpus_cmd::run(a),
            ApiCommand::Oom(mut a) => {
                a.spec.model_json = model_json;
                oom_cmd::run(a)
            }
            ApiCommand::Spec(mut a) => {
                a.spec.model_json = model_json;
                spec_cmd::spec(a)
            }
        }
    };
    let (result, captured) = crate::output::capture(job);
    match result {
        Ok(()) => Ok(captured),
        Err(e) => {
            let (code, message) = crate::error::error_line(&e);
            Err(match code {
                2 => ApiError::Invalid(message),
                3 => ApiError::DoesNotFit {
                    message,
                    json: captured.json,
                    text: (!json).then_some(captured.text),
                },
                5 => ApiError::Missing(message),
                _ => ApiError::Internal(message),
            })
        }
    }
}

/// [`call`] with the arguments as a JSON value (an object, or `null` for none).
pub fn call_value(command: &str, args: &Value, options: Options) -> Result<Value, ApiError> {
    call(command, &object(args)?, options)
}

/// [`text`] with the arguments as a JSON value (an object, or `null` for none).
pub fn text_value(command: &str, args: &Value, options: Options) -> Result<String, ApiError> {
    text(command, &object(args)?, options)
}

/// The arguments of a request given as a JSON value: an object, or `null` for none.
fn object(args: &Value) -> Result<Map<String, Value>, ApiError> {
    match args {
        Value::Object(map) => Ok(map.clone()),
        Value::Null => Ok(Map::new()),
        other => Err(ApiError::Invalid(format!(
            "invalid input: arguments: {} given; allowed: an object of flag names and values",
            kind_of(other)
        ))),
    }
}

/// The argument names `command` takes (the flags' long names with underscores), for errors,
/// the web form and the Python signatures.
pub fn argument_names(command: &str) -> Result<Vec<String>, ApiError> {
    let cli = ApiCli::command();
    let sub = subcommand(&cli, command)?;
    Ok(sub
        .get_arguments()
        .filter(|a| !is_hidden_for_api(a))
        .map(|a| a.get_id().as_str().to_string())
        .collect())
}

fn subcommand<'a>(cli: &'a clap::Command, command: &str) -> Result<&'a clap::Command, ApiError> {
    cli.find_subcommand(command).ok_or_else(|| {
        ApiError::Invalid(format!(
            "invalid input: command: '{}' is not one the API answers; allowed: {}",
            crate::flags::tidy(command),
            COMMANDS.join(", ")
        ))
    })
}

/// Flags the API sets itself or that make no sense there (help, the output format).
fn is_hidden_for_api(arg: &clap::Arg) -> bool {
    matches!(arg.get_id().as_str(), "json" | "help" | "version")
}

/// Whether a flag names a file to read or write (its value name says so).
fn names_a_file(arg: &clap::Arg) -> bool {
    arg.get_value_names().is_some_and(|names| {
        names
            .iter()
            .any(|n| matches!(n.as_str(), "FILE" | "PATH" | "DIR"))
    })
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

type ModelJson = Option<Map<String, Value>>;

/// The command line for `command` with `args`, and a `model` given as an object.
fn command_line(
    command: &str,
    args: &Map<String, Value>,
    options: Options,
    json: bool,
) -> Result<(Vec<String>, ModelJson), ApiError> {
    let cli = ApiCli::command();
    let sub = subcommand(&cli, command)?;
    let mut argv = vec![command.to_string()];
    let mut model_json = None;
    // A positional goes last, after `--`: the arguments come in key order, and a flag after
    // `--` would read as the positional's value.
    let mut positional = None;
    for (key, value) in args {
        let id = key.replace('-', "_");
        if value.is_null() {
            continue;
        }
        // `model`: a preset name, a config path, or the config itself.
        if id == "model" && sub.get_arguments().any(|a| a.get_id() == "preset") {
            match model_value(key, value)? {
                Model::Config(map) => {
                    model_json = Some(map);
                    continue;
                }
                Model::Preset(name) => {
                    argv.extend(["--preset".into(), name]);
                    continue;
                }
                Model::Path => {} // the flag below, if files are allowed
            }
        }
        let arg = api_argument(sub, command, key, &id, options)?;
        match flag_value(arg, key, value)? {
            Flag::Switch(on) => {
                if on {
                    argv.push(flag_of(arg));
                }
            }
            Flag::Value(text) if arg.is_positional() => positional = Some(text),
            Flag::Value(text) => argv.push(format!("{}={text}", flag_of(arg))),
        }
    }
    if let Some(text) = positional {
        // `--` keeps a message that starts with '-' a value.
        argv.push("--".into());
        argv.push(text);
    }
    if command == "oom" && !has_oom_message(args) {
        // The CLI would read stdin; a request has none.
        return Err(ApiError::Invalid(
            "invalid input: message: missing; allowed: the out-of-memory message as text".into(),
        ));
    }
    if json && sub.get_arguments().any(|a| a.get_id() == "json") {
        // `--` (for a positional) must stay last: the flag goes before it.
        let at = argv.iter().position(|a| a == "--").unwrap_or(argv.len());
        argv.insert(at, "--json".into());
    }
    Ok((argv, model_json))
}

/// A refusal of argument `key`: `invalid input: KEY: WHAT`.
fn invalid(key: &str, what: String) -> ApiError {
    ApiError::Invalid(format!(
        "invalid input: {}: {what}",
        crate::flags::tidy(key)
    ))
}

/// What a `model` argument is.
enum Model {
    /// A diffusers `config.json` given as an object.
    Config(Map<String, Value>),
    /// A preset's name (`--preset`).
    Preset(String),
    /// Anything else a string says: a path (`--model`).
    Path,
}

fn model_value(key: &str, value: &Value) -> Result<Model, ApiError> {
    match value {
        Value::Object(map) => Ok(Model::Config(map.clone())),
        Value::String(name) if is_preset(name) => Ok(Model::Preset(name.clone())),
        Value::String(_) => Ok(Model::Path),
        other => Err(invalid(
            key,
            format!(
                "{} given; allowed: a preset name, a config.json path or a config object",
                kind_of(other)
            ),
        )),
    }
}

/// The flag `key` (spelled `id`) names in `sub`: refused when there is none, or when it names
/// a file and files are not allowed.
fn api_argument<'a>(
    sub: &'a clap::Command,
    command: &str,
    key: &str,
    id: &str,
    options: Options,
) -> Result<&'a clap::Arg, ApiError> {
    let Some(arg) = sub
        .get_arguments()
        .find(|a| a.get_id() == id && !is_hidden_for_api(a))
    else {
        let mut names = argument_names(command)?;
        names.sort();
        return Err(invalid(
            key,
            format!(
                "not an argument of {command}; allowed: {}",
                names.join(", ")
            ),
        ));
    };
    if names_a_file(arg) && !options.allow_files {
        return Err(invalid(
            key,
            "names a file, which this server does not read or write; allowed: the values \
             themselves (e.g. `model` as a config object)"
                .into(),
        ));
    }
    Ok(arg)
}

/// What one argument puts on the command line.
enum Flag {
    /// A switch (a flag without a value): given when on.
    Switch(bool),
    /// A flag's value (or the positional's).
    Value(String),
}

/// `value` as `arg` takes it: a boolean turns a switch on or off (or is `on`/`off`), numbers
/// and strings as they are, a list joined with commas.
fn flag_value(arg: &clap::Arg, key: &str, value: &Value) -> Result<Flag, ApiError> {
    let takes_value = arg.get_action().takes_values();
    let text = match value {
        Value::Bool(on) if !takes_value => return Ok(Flag::Switch(*on)),
        Value::Bool(on) => (if *on { "on" } else { "off" }).to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        Value::Array(items) => list_value(key, items)?,
        Value::Object(_) | Value::Null => {
            return Err(invalid(
                key,
                format!(
                    "{} given; allowed: a string, a number, a boolean or a list",
                    kind_of(value)
                ),
            ))
        }
    };
    if !takes_value {
        return Err(invalid(
            key,
            format!(
                "'{}' given; allowed: true or false",
                crate::flags::tidy(&text)
            ),
        ));
    }
    Ok(Flag::Value(text))
}

/// A list of strings or numbers, joined with commas.
fn list_value(key: &str, items: &[Value]) -> Result<String, ApiError> {
    let mut parts = Vec::with_capacity(items.len());
    for item in items {
        match item {
            Value::String(s) => parts.push(s.clone()),
            Value::Number(n) => parts.push(n.to_string()),
            other => {
                return Err(invalid(
                    key,
                    format!(
                        "a list holding {}; allowed: strings or numbers",
                        kind_of(other)
                    ),
                ))
            }
        }
    }
    Ok(parts.join(","))
}

fn has_oom_message(args: &Map<String, Value>) -> bool {
    args.iter()
        .any(|(k, v)| (k == "message" || k == "file") && !v.is_null())
}

fn flag_of(arg: &clap::Arg) -> String {
    match arg.get_long() {
        Some(long) => format!("--{long}"),
        None => format!("--{}", arg.get_id().as_str().replace('_', "-")),
    }
}

/// A name `--preset` takes: a diffusers checkpoint's or an original DiT's.
fn is_preset(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    ditmem_budget::preset_config(&lower).is_some() || ditmem_budget::ModelSpec::preset(name).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    /// [`call`] of `command` with the object `args` and the default options.
    fn call_json(command: &str, args: Value) -> Result<Value, ApiError> {
        call(command, &obj(args), Options::default())
    }

    #[test]
    fn command_line_spells_flags_as_the_cli() {
        let (argv, model) = command_line(
            "plan",
            &obj(
                json!({"model": "flux.1-dev", "lora_rank": 16, "allow": ["lora", "8bit"],
                        "gpu": "rtx-4090", "verbose": true, "ema": false, "batch": null}),
            ),
            Options::default(),
            true,
        )
        .unwrap();
        assert!(model.is_none());
        assert_eq!(argv[0], "plan");
        for want in [
            "--preset",
            "flux.1-dev",
            "--lora-rank=16",
            "--allow=lora,8bit",
            "--gpu=rtx-4090",
            "--verbose",
            "--ema=off",
            "--json",
        ] {
            assert!(
                argv.iter().any(|a| a == want),
                "{want} missing from {argv:?}"
            );
        }
        assert!(!argv.iter().any(|a| a.starts_with("--batch")));
    }

    #[test]
    fn unknown_and_file_arguments_are_refused_by_name() {
        let e = call_json("estimate", json!({"lora_rnk": 4})).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.message().contains("lora_rnk"), "{e}");
        assert!(e.message().contains("lora_rank"), "{e}");
        let e = call_json("estimate", json!({"config": "/etc/passwd"})).unwrap_err();
        assert!(e.message().contains("names a file"), "{e}");
        let e = call_json("estimate", json!({"model": "/tmp/x"})).unwrap_err();
        assert!(e.message().contains("names a file"), "{e}");
        let e = call_json("launch", json!({})).unwrap_err();
        assert!(e.message().contains("allowed: estimate"), "{e}");
    }

    #[test]
    fn values_go_through_the_cli_parser() {
        let e = call_json("estimate", json!({"preset": "dit-s-2", "batch": 0})).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(e.message().contains("--batch"), "{e}");
        let e =
            call_json("estimate", json!({"preset": "dit-s-2", "precision": "fp8"})).unwrap_err();
        assert!(e.message().contains("fp32"), "{e}");
    }

    #[test]
    fn an_estimate_is_the_json_of_the_cli() {
        let v = call_json(
            "estimate",
            json!({"model": "dit-s-2", "resolution": 64, "batch": 2}),
        )
        .unwrap();
        assert!(v.get("need_bytes").and_then(Value::as_u64).unwrap_or(0) > 0);
        assert!(v.get("levers").is_some());
    }

    #[test]
    fn a_model_object_reads_as_its_config() {
        let config = ditmem_budget::preset_config("pixart-sigma-1024").unwrap();
        let map: Value = serde_json::from_str(config).unwrap();
        let by_value = call_json("params", json!({ "model": map })).unwrap();
        let by_name = call_json("params", json!({"model": "pixart-sigma-1024"})).unwrap();
        assert_eq!(by_value["params"]["total"], by_name["params"]["total"]);
        let e = call_json(
            "params",
            json!({"model": {"_class_name": "PixArtTransformer2DModel", "num_layers": -3}}),
        )
        .unwrap_err();
        assert_eq!(e.exit_code(), 2, "{e}");
    }

    #[test]
    fn an_infeasible_plan_carries_its_json() {
        let e = call_json("plan", json!({"model": "flux.1-dev", "budget": "4GiB"})).unwrap_err();
        match e {
            ApiError::DoesNotFit { json, message, .. } => {
                assert!(
                    message.contains("infeasible") || message.contains("nothing"),
                    "{message}"
                );
                assert!(json.is_some());
            }
            other => panic!("expected DoesNotFit, got {other:?}"),
        }
        // Its text is the answer a person reads: the plan's lines, nothing fitting.
        let args = object(&json!({"model": "flux.1-dev", "budget": "4GiB"})).unwrap();
        let text = text("plan", &args, Options::default()).unwrap();
        assert!(text.starts_with("plan for flux.1-dev"), "{text}");
        assert!(
            text.lines().nth(1).unwrap().starts_with("fits: no"),
            "{text}"
        );
    }

    #[test]
    fn oom_message_stays_last_whatever_the_key_order() {
        let msg = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of \
                   23.65 GiB of which 1.20 GiB is free. Of the allocated memory 20.30 GiB is \
                   allocated by PyTorch, and 1.60 GiB is reserved by PyTorch but unallocated.";
        // "message" sorts before "model": the preset must still be a flag.
        let v = call_json(
            "oom",
            json!({"model": "flux.1-dev", "lora_rank": 16, "message": msg}),
        )
        .unwrap();
        assert_eq!(v["message"]["requested_bytes"], 2147483648u64);
    }

    #[test]
    fn oom_needs_its_message() {
        let e = call_json("oom", json!({})).unwrap_err();
        assert!(e.message().contains("message"), "{e}");
    }
}
