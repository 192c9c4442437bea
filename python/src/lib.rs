//! `ditmem._native`: the thin bridge between Python and [`ditmem::api`]. A request is a command
//! name and its keyword arguments as JSON; the answer is the CLI's `--json` value as JSON text,
//! or a `NativeError(kind, message, json)` with the CLI's one line. The Python layer
//! (`python/ditmem/__init__.py`) turns both into typed results and exceptions.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use ditmem::api::{self, ApiError, Options};

create_exception!(
    _native,
    NativeError,
    PyException,
    "A ditmem command failed: args are (kind, message, json or None); kind is invalid, \
     does_not_fit, missing or internal."
);

fn to_py_err(e: ApiError) -> PyErr {
    let json = match &e {
        ApiError::DoesNotFit { json: Some(v), .. } => Some(v.to_string()),
        _ => None,
    };
    NativeError::new_err((e.kind(), e.message().to_string(), json))
}

/// Run `command` (estimate, plan, params, gpus, oom, spec) with keyword arguments given as a
/// JSON object; returns the command's `--json` value as JSON text. Files may be named (the
/// caller's own machine): `model` as a path, `config`, `emit_out`, `plot`, `out`.
#[pyfunction]
fn call(py: Python<'_>, command: &str, kwargs_json: &str) -> PyResult<String> {
    let args = arguments(kwargs_json)?;
    let command = command.to_string();
    let out = py.detach(move || api::call_value(&command, &args, FILES_ALLOWED));
    out.map(|v| v.to_string()).map_err(to_py_err)
}

/// [`call`], answered with the text the CLI prints without `--json` (what a person reads).
#[pyfunction]
fn text(py: Python<'_>, command: &str, kwargs_json: &str) -> PyResult<String> {
    let args = arguments(kwargs_json)?;
    let command = command.to_string();
    let out = py.detach(move || api::text_value(&command, &args, FILES_ALLOWED));
    out.map_err(to_py_err)
}

/// The caller's own machine: arguments may name files.
const FILES_ALLOWED: Options = Options { allow_files: true };

/// The keyword arguments as JSON text, parsed.
fn arguments(kwargs_json: &str) -> PyResult<serde_json::Value> {
    serde_json::from_str(kwargs_json).map_err(|e| {
        NativeError::new_err((
            "invalid",
            format!("invalid input: arguments: not JSON: {e}"),
            None::<String>,
        ))
    })
}

/// The keyword arguments `command` takes (the CLI's long flags with underscores).
#[pyfunction]
fn argument_names(command: &str) -> PyResult<Vec<String>> {
    api::argument_names(command).map_err(to_py_err)
}

/// The commands [`call`] answers.
#[pyfunction]
fn commands() -> Vec<&'static str> {
    api::COMMANDS.to_vec()
}

/// Every model preset name: the original DiTs, then the diffusers checkpoints.
#[pyfunction]
fn preset_names() -> Vec<String> {
    let mut v = ditmem_budget::ModelSpec::preset_names();
    for name in ditmem_budget::family_preset_names() {
        if !v.contains(&name) {
            v.push(name);
        }
    }
    v
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(call, m)?)?;
    m.add_function(wrap_pyfunction!(text, m)?)?;
    m.add_function(wrap_pyfunction!(argument_names, m)?)?;
    m.add_function(wrap_pyfunction!(commands, m)?)?;
    m.add_function(wrap_pyfunction!(preset_names, m)?)?;
    m.add("NativeError", m.py().get_type::<NativeError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
