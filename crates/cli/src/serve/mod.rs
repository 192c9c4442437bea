//! `ditmem serve`: one page and a JSON API that is the CLI's `--json`, on a local HTTP server.
//!
//! The HTTP stack is `tiny_http` (blocking HTTP/1.1, no async runtime: light to build on two
//! cores; its accept thread hands parsed requests to us). Every request then goes through this
//! file's limits before any work: the URL and header sizes, a body limit, a JSON content type
//! for `POST`, the `Host` of a loopback server, and a bounded queue in front of a fixed pool of
//! workers (beyond it: 503 with `Retry-After`). A worker answers inside `catch_unwind`, so a
//! panic answers 500 and the worker lives on. Answers come from [`crate::api::call`] with
//! `allow_files: false`: no request reads or writes the file system. A plan's search is capped
//! at the server's `--time-limit`.

use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ditmem_budget::SpecError;
use serde_json::{json, Map, Value};

use crate::api::{self, ApiError, Options};
use crate::CliError;

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const STYLE_CSS: &str = include_str!("assets/style.css");

/// Largest request body: a diffusers `config.json` is a few KiB; 1 MiB is the CLI's own limit
/// on a spec or config file (`--config`).
pub const MAX_BODY_BYTES: u64 = 1 << 20;
/// Longest request URL (path and query), in bytes.
pub const MAX_URL_BYTES: usize = 2048;
/// Most header lines, and most bytes of all headers together.
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEADER_BYTES: usize = 16 << 10;
/// Requests waiting for a worker, per worker; beyond: 503.
pub const QUEUE_PER_WORKER: usize = 16;
/// A plan's search limit per request unless the server says otherwise (`--time-limit`).
pub const DEFAULT_PLAN_SECONDS: f64 = 10.0;

/// `ditmem serve`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// TCP port; 0 picks a free one (the URL printed says which).
    #[arg(long, default_value_t = 8765)]
    pub port: u16,
    /// Address to listen on: 127.0.0.1 (default, this machine only), or e.g. 0.0.0.0 to let
    /// other machines in (no authentication: anyone who reaches the port can ask).
    #[arg(long, default_value = "127.0.0.1", value_name = "ADDR")]
    pub bind: String,
    /// Worker threads that answer requests (1–64; default: the machine's cores, at most 8).
    #[arg(long, value_parser = workers, value_name = "N")]
    pub workers: Option<usize>,
    /// Most seconds one plan request may search (0.1 to 600); a request asking for more is
    /// refused, one asking for nothing gets this.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_PLAN_SECONDS,
          value_parser = plan_seconds, allow_hyphen_values = true)]
    pub time_limit: f64,
    /// Print `{"url": …}` (JSON) on start instead of a line of text.
    #[arg(long)]
    pub json: bool,
}

fn workers(text: &str) -> Result<usize, String> {
    in_range(text, 1..=64, "a count from 1 to 64")
}

fn plan_seconds(text: &str) -> Result<f64, String> {
    in_range(text, 0.1..=600.0, "a number of seconds from 0.1 to 600")
}

/// `text` as a number in `range`, or the flag's refusal: `"TEXT" is not WHAT`.
fn in_range<T: std::str::FromStr + PartialOrd>(
    text: &str,
    range: std::ops::RangeInclusive<T>,
    what: &str,
) -> Result<T, String> {
    match text.trim().parse::<T>() {
        Ok(v) if range.contains(&v) => Ok(v),
        _ => Err(format!("{} is not {what}", crate::flags::show(text))),
    }
}

/// What the server was started with that answers depend on.
#[derive(Debug, Clone)]
struct Settings {
    plan_seconds: f64,
    /// `Some(port)` when bound to a loopback address: only `Host: localhost|127.0.0.1|[::1]:port`
    /// is answered (a web page elsewhere cannot reach the server through DNS rebinding).
    loopback_port: Option<u16>,
}

/// An answer: status, content type, body, extra headers.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    fn json(status: u16, value: &Value) -> Reply {
        Reply {
            status,
            content_type: "application/json; charset=utf-8",
            body: serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec()),
            headers: Vec::new(),
        }
    }

    /// A refusal by the server itself (not by a command): `{"error", "message", "exit_code"}`.
    fn refuse(status: u16, kind: &str, message: &str) -> Reply {
        Reply::json(
            status,
            &json!({"error": kind, "message": crate::flags::tidy(message), "exit_code": 2,
                    "json": null}),
        )
    }

    fn asset(content_type: &'static str, text: &'static str) -> Reply {
        Reply {
            status: 200,
            content_type,
            body: text.as_bytes().to_vec(),
            headers: Vec::new(),
        }
    }
}

/// A command's error as a reply: 400 invalid, 422 does not fit, 500 the rest.
fn error_reply(e: &ApiError) -> Reply {
    let status = match e {
        ApiError::Invalid(_) => 400,
        ApiError::DoesNotFit { .. } => 422,
        ApiError::Missing(_) | ApiError::Internal(_) => 500,
    };
    let json = match e {
        ApiError::DoesNotFit { json, .. } => json.clone().unwrap_or(Value::Null),
        _ => Value::Null,
    };
    Reply::json(
        status,
        &json!({"error": e.kind(), "message": e.message(), "exit_code": e.exit_code(),
                "json": json}),
    )
}

/// A request as the worker sees it: everything read, nothing left on the socket.
#[derive(Debug, Clone)]
pub struct Asked {
    pub method: String,
    pub url: String,
    pub body: Vec<u8>,
}

/// The answer to one request (the routes). Never touches the file system.
fn answer(asked: &Asked, settings: &Settings) -> Reply {
    let path = asked.url.split('?').next().unwrap_or("");
    let get = asked.method == "GET" || asked.method == "HEAD";
    match path {
        "/" | "/index.html" if get => Reply::asset("text/html; charset=utf-8", INDEX_HTML),
        "/assets/app.js" if get => Reply::asset("text/javascript; charset=utf-8", APP_JS),
        "/assets/style.css" if get => Reply::asset("text/css; charset=utf-8", STYLE_CSS),
        "/healthz" if get => Reply::json(200, &json!({"ok": true})),
        "/api/presets" if get => Reply::json(200, &presets()),
        "/" | "/index.html" | "/assets/app.js" | "/assets/style.css" | "/healthz"
        | "/api/presets" => not_allowed("GET"),
        _ => {
            if let Some(command) = path.strip_prefix("/api/args/") {
                if !get {
                    return not_allowed("GET");
                }
                return match api::argument_names(command) {
                    Ok(names) => Reply::json(200, &json!(names)),
                    Err(e) => {
                        let mut r = error_reply(&e);
                        r.status = 404;
                        r
                    }
                };
            }
            if let Some(command) = path.strip_prefix("/api/") {
                if api::COMMANDS.contains(&command) {
                    if asked.method != "POST" {
                        return not_allowed("POST");
                    }
                    return command_reply(command, &asked.body, settings);
                }
            }
            Reply::refuse(
                404,
                "not_found",
                &format!(
                    "not found: {}; the page is at /, the API at /api/{{{}}} (POST) and \
                     /api/presets, /api/args/<command> (GET)",
                    crate::flags::show(path),
                    api::COMMANDS.join(",")
                ),
            )
        }
    }
}

fn not_allowed(allow: &'static str) -> Reply {
    let mut r = Reply::refuse(
        405,
        "method_not_allowed",
        &format!("method not allowed; allowed: {allow}"),
    );
    r.headers.push(("Allow", allow.to_string()));
    r
}

/// `POST /api/<command>`: the body is a JSON object of arguments; the answer the `--json`.
fn command_reply(command: &str, body: &[u8], settings: &Settings) -> Reply {
    let args: Value = if body.iter().all(u8::is_ascii_whitespace) {
        Value::Object(Map::new())
    } else {
        match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => {
                return Reply::refuse(
                    400,
                    "invalid",
                    &format!("invalid input: the request body is not JSON: {e}"),
                )
            }
        }
    };
    let mut args =
        match args {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            _ => return Reply::refuse(
                400,
                "invalid",
                "invalid input: the request body: allowed: a JSON object of arguments named as \
                 the CLI's flags, e.g. {\"model\": \"flux.1-dev\", \"gpu\": \"rtx-4090\"}",
            ),
        };
    if command == "plan" {
        if let Err(r) = cap_time_limit(&mut args, settings.plan_seconds) {
            return *r;
        }
    }
    match api::call(command, &args, Options { allow_files: false }) {
        Ok(v) => Reply::json(200, &v),
        Err(e) => error_reply(&e),
    }
}

/// A plan's `time_limit`: the server's when none is asked, refused when more is asked.
fn cap_time_limit(args: &mut Map<String, Value>, cap: f64) -> Result<(), Box<Reply>> {
    let key = args
        .keys()
        .find(|k| k.replace('-', "_") == "time_limit")
        .cloned();
    let asked = key.as_ref().and_then(|k| args.get(k)).cloned();
    let seconds = match &asked {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => n.as_f64(),
        Some(Value::String(s)) => s.trim().parse::<f64>().ok(),
        Some(_) => None,
    };
    match (
        asked.is_some() && !matches!(asked, Some(Value::Null)),
        seconds,
    ) {
        (false, _) => {
            if let Some(k) = key {
                args.remove(&k);
            }
            args.insert("time_limit".into(), json!(cap));
            Ok(())
        }
        (true, Some(s)) if s > cap => Err(Box::new(Reply::refuse(
            400,
            "invalid",
            &format!(
                "invalid input: time_limit: {} s is more than this server searches per request \
                 ({} s, `ditmem serve --time-limit`); allowed: at most {} s, or the CLI \
                 `ditmem plan --time-limit` for a longer search",
                crate::flags::fmt_float(s),
                crate::flags::fmt_float(cap),
                crate::flags::fmt_float(cap)
            ),
        ))),
        // Within the cap, or not a number: the CLI's parser answers.
        _ => Ok(()),
    }
}

/// `GET /api/presets`: each preset's name, the checkpoint it describes, its config (the
/// diffusers ones) and whether it is a video model (frames).
fn presets() -> Value {
    let list: Vec<Value> = ditmem_budget::family_preset_names()
        .into_iter()
        .map(|name| {
            let config: Option<Value> = ditmem_budget::preset_config(&name)
                .and_then(|text| serde_json::from_str(text).ok());
            let class = config
                .as_ref()
                .and_then(|c| c.get("_class_name"))
                .and_then(Value::as_str)
                .unwrap_or("DiT")
                .to_string();
            json!({
                "name": name,
                "source": ditmem_budget::preset_source(&name),
                "class": class,
                "video": class.contains("3D"),
                "config": config,
            })
        })
        .collect();
    Value::Array(list)
}

/// Checks a request before a worker takes it: URL and header sizes, the `Host` of a loopback
/// server, the body's declared size and the content type of a `POST`.
fn precheck(request: &tiny_http::Request, settings: &Settings) -> Result<(), Reply> {
    if request.url().len() > MAX_URL_BYTES {
        return Err(Reply::refuse(
            414,
            "uri_too_long",
            &format!(
                "the URL is {} bytes; allowed: at most {MAX_URL_BYTES}",
                request.url().len()
            ),
        ));
    }
    let headers = request.headers();
    let header_bytes: usize = headers
        .iter()
        .map(|h| h.field.as_str().as_str().len() + h.value.as_str().len() + 4)
        .sum();
    if headers.len() > MAX_HEADERS || header_bytes > MAX_HEADER_BYTES {
        return Err(Reply::refuse(
            431,
            "headers_too_large",
            &format!(
                "{} headers, {header_bytes} bytes; allowed: at most {MAX_HEADERS} headers and \
                 {MAX_HEADER_BYTES} bytes",
                headers.len()
            ),
        ));
    }
    let header = |name: &'static str| {
        headers
            .iter()
            .find(|h| h.field.equiv(name))
            .map(|h| h.value.as_str().to_string())
    };
    if let Some(port) = settings.loopback_port {
        let host = header("Host").unwrap_or_default();
        let ok = ["localhost", "127.0.0.1", "[::1]"]
            .iter()
            .any(|h| host == *h || host == format!("{h}:{port}"));
        if !ok {
            return Err(Reply::refuse(
                403,
                "forbidden_host",
                &format!(
                    "Host {} is not this server's; allowed: localhost:{port}, 127.0.0.1:{port} \
                     (ditmem serve --bind 0.0.0.0 answers any host)",
                    crate::flags::show(&host)
                ),
            ));
        }
    }
    if let Some(n) = request.body_length() {
        if n as u64 > MAX_BODY_BYTES {
            return Err(body_too_large());
        }
    }
    if request.method() == &tiny_http::Method::Post {
        let ct = header("Content-Type").unwrap_or_default();
        let media = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if media != "application/json" {
            return Err(Reply::refuse(
                415,
                "unsupported_media_type",
                &format!(
                    "Content-Type {}; allowed: application/json",
                    crate::flags::show(&ct)
                ),
            ));
        }
    }
    Ok(())
}

fn body_too_large() -> Reply {
    Reply::refuse(
        413,
        "body_too_large",
        &format!("the request body is over {MAX_BODY_BYTES} bytes (1 MiB); allowed: at most that"),
    )
}

/// Reads the body, at most [`MAX_BODY_BYTES`] of it (a chunked body may not say its size).
fn read_body(request: &mut tiny_http::Request) -> Result<Vec<u8>, Reply> {
    let mut body = Vec::new();
    match request
        .as_reader()
        .take(MAX_BODY_BYTES + 1)
        .read_to_end(&mut body)
    {
        Ok(_) if body.len() as u64 > MAX_BODY_BYTES => Err(body_too_large()),
        Ok(_) => Ok(body),
        Err(e) => Err(Reply::refuse(
            400,
            "invalid",
            &format!("reading the request body: {e}"),
        )),
    }
}

/// The answer, or 500 when answering panicked (the worker lives on).
pub fn answer_caught(f: impl FnOnce() -> Reply) -> Reply {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Reply::json(
                500,
                &json!({"error": "internal", "exit_code": 1, "json": null,
                        "message": crate::flags::tidy(&format!(
                            "internal error: the answer panicked ({what}); please report it"))}),
            )
        }
    }
}

/// Sends `reply` for `request`; a client that has gone is not an error.
fn send(request: tiny_http::Request, reply: Reply) {
    let head = request.method() == &tiny_http::Method::Head;
    let mut response = tiny_http::Response::from_data(if head { Vec::new() } else { reply.body })
        .with_status_code(reply.status);
    let mut headers: Vec<(&str, String)> = vec![
        ("Content-Type", reply.content_type.to_string()),
        ("X-Content-Type-Options", "nosniff".into()),
        ("Cache-Control", "no-store".into()),
        (
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; \
             script-src 'self'; connect-src 'self'; frame-ancestors 'none'"
                .into(),
        ),
        ("Referrer-Policy", "no-referrer".into()),
    ];
    headers.extend(reply.headers);
    for (k, v) in headers {
        if let Ok(h) = tiny_http::Header::from_bytes(k.as_bytes(), v.as_bytes()) {
            response.add_header(h);
        }
    }
    let _ = request.respond(response);
}

/// Set by Ctrl-C: the server stops taking requests, finishes those it has and exits 0.
static STOP: AtomicBool = AtomicBool::new(false);

/// `ditmem serve`.
pub fn run(args: ServeArgs) -> Result<(), CliError> {
    let (server, ip, port) = listen(&args)?;
    let url = format!("http://{}:{port}/", url_host(ip));
    let workers = args.workers.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(2, 8)
    });
    let settings = Settings {
        plan_seconds: args.time_limit,
        loopback_port: ip.is_loopback().then_some(port),
    };
    if args.json {
        // Straight to stdout, flushed: a test or a script reads the port from it.
        let line = serde_json::to_string(&json!({"url": url, "workers": workers,
            "plan_time_limit_s": args.time_limit}))
        .map_err(anyhow::Error::from)?;
        crate::output::say(&format!("{line}\n"))?;
    } else {
        crate::output::say(&format!(
            "ditmem serve: {url} ({workers} workers; Ctrl-C stops it)\n"
        ))?;
    }
    let _ = ctrlc::set_handler(|| {
        if STOP.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
    });

    let (tx, rx) = sync_channel::<(tiny_http::Request, Vec<u8>)>(workers * QUEUE_PER_WORKER);
    let rx = Arc::new(Mutex::new(rx));
    let pool: Vec<_> = (0..workers)
        .map(|i| {
            let rx = Arc::clone(&rx);
            let settings = settings.clone();
            std::thread::Builder::new()
                .name(format!("serve-{i}"))
                .spawn(move || worker(&rx, &settings))
        })
        .collect::<Result<_, _>>()
        .map_err(|e| CliError::Other(anyhow::anyhow!("starting the workers: {e}")))?;
    accept(&server, &tx, &settings);
    drop(tx);
    for t in pool {
        let _ = t.join();
    }
    crate::output::note("ditmem serve: stopped\n");
    Ok(())
}

/// The server on `--bind` and `--port`, the address and the port it listens on (the one picked
/// for port 0).
fn listen(args: &ServeArgs) -> Result<(tiny_http::Server, IpAddr, u16), CliError> {
    let ip: IpAddr = args.bind.trim().parse().map_err(|_| {
        SpecError::invalid(
            "--bind",
            format!(
                "{} is not an IP address; allowed: e.g. 127.0.0.1, ::1, 0.0.0.0",
                crate::flags::show(&args.bind)
            ),
        )
    })?;
    let server = tiny_http::Server::http(SocketAddr::new(ip, args.port)).map_err(|e| {
        CliError::Other(anyhow::anyhow!(
            "cannot listen on {}: {e}",
            SocketAddr::new(ip, args.port)
        ))
    })?;
    let port = server
        .server_addr()
        .to_ip()
        .map(|a| a.port())
        .unwrap_or(args.port);
    Ok((server, ip, port))
}

/// The host of the printed URL: the address, or this machine's loopback for "any".
fn url_host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V6(v6) if v6.is_unspecified() => "[::1]".to_string(),
        IpAddr::V4(v4) if v4.is_unspecified() => "127.0.0.1".to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
        IpAddr::V4(v4) => v4.to_string(),
    }
}

/// Takes requests until Ctrl-C: each checked, its body read, then queued for a worker (503
/// when the queue is full).
fn accept(
    server: &tiny_http::Server,
    tx: &SyncSender<(tiny_http::Request, Vec<u8>)>,
    settings: &Settings,
) {
    while !STOP.load(Ordering::SeqCst) {
        let mut request = match server.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(_) => {
                // The listener failed (accept error): do not spin.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if let Err(reply) = precheck(&request, settings) {
            send(request, reply);
            continue;
        }
        // The body is read here (bounded), so a worker never waits on a slow client's upload.
        let body = match read_body(&mut request) {
            Ok(b) => b,
            Err(reply) => {
                send(request, reply);
                continue;
            }
        };
        match tx.try_send((request, body)) {
            Ok(()) => {}
            Err(TrySendError::Full((request, _)))
            | Err(TrySendError::Disconnected((request, _))) => {
                let mut reply = Reply::refuse(
                    503,
                    "busy",
                    "the server is busy (every worker and its queue are taken); retry shortly",
                );
                reply.headers.push(("Retry-After", "1".into()));
                send(request, reply);
            }
        }
    }
}

/// A worker: takes requests until the queue closes; each answer is caught.
fn worker(rx: &Mutex<Receiver<(tiny_http::Request, Vec<u8>)>>, settings: &Settings) {
    loop {
        let next = match rx.lock() {
            Ok(guard) => guard.recv(),
            Err(poisoned) => poisoned.into_inner().recv(),
        };
        let Ok((request, body)) = next else { return };
        let asked = Asked {
            method: request.method().as_str().to_string(),
            url: request.url().to_string(),
            body,
        };
        let reply = answer_caught(|| answer(&asked, settings));
        send(request, reply);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            plan_seconds: 2.0,
            loopback_port: None,
        }
    }

    fn post(url: &str, body: &str) -> Reply {
        answer(
            &Asked {
                method: "POST".into(),
                url: url.into(),
                body: body.as_bytes().to_vec(),
            },
            &settings(),
        )
    }

    fn body(r: &Reply) -> Value {
        serde_json::from_slice(&r.body).unwrap_or(Value::Null)
    }

    #[test]
    fn a_panic_answers_500_and_the_thread_lives_on() {
        let r = answer_caught(|| panic!("boom"));
        assert_eq!(r.status, 500);
        assert!(body(&r)["message"].as_str().unwrap_or("").contains("boom"));
        // The same thread answers the next request.
        let r = answer_caught(|| post("/api/estimate", r#"{"model": "dit-s-2"}"#));
        assert_eq!(r.status, 200);
    }

    #[test]
    fn errors_are_typed_with_their_status() {
        let r = post("/api/estimate", r#"{"model": "dit-s-2", "batch": 0}"#);
        assert_eq!(r.status, 400);
        assert_eq!(body(&r)["error"], "invalid");
        assert_eq!(body(&r)["exit_code"], 2);
        let r = post("/api/estimate", "{not json");
        assert_eq!(r.status, 400);
        let r = post("/api/estimate", "[1, 2]");
        assert_eq!(r.status, 400);
        let r = post("/api/estimate", r#"{"config": "/etc/passwd"}"#);
        assert_eq!(r.status, 400);
        assert!(body(&r)["message"]
            .as_str()
            .unwrap_or("")
            .contains("names a file"));
        let r = post("/api/plan", r#"{"model": "flux.1-dev", "budget": "4GiB"}"#);
        assert_eq!(r.status, 422);
        assert_eq!(body(&r)["error"], "does_not_fit");
        assert!(body(&r)["json"].is_object());
        let r = post("/api/launch", "{}");
        assert_eq!(r.status, 404);
    }

    #[test]
    fn a_plan_gets_the_server_time_limit_and_no_more() {
        let r = post(
            "/api/plan",
            r#"{"model": "dit-s-2", "budget": "8GiB", "time_limit": 60}"#,
        );
        assert_eq!(r.status, 400);
        assert!(
            body(&r)["message"].as_str().unwrap_or("").contains("2 s"),
            "{:?}",
            body(&r)
        );
        let mut args = Map::new();
        cap_time_limit(&mut args, 2.0).unwrap();
        assert_eq!(args["time_limit"], json!(2.0));
        let mut args = Map::new();
        args.insert("time-limit".into(), json!(1));
        cap_time_limit(&mut args, 2.0).unwrap();
        assert_eq!(args["time-limit"], json!(1));
    }

    #[test]
    fn routes_and_methods() {
        let get = |url: &str| {
            answer(
                &Asked {
                    method: "GET".into(),
                    url: url.into(),
                    body: Vec::new(),
                },
                &settings(),
            )
        };
        assert_eq!(get("/").status, 200);
        assert_eq!(get("/assets/app.js").status, 200);
        assert_eq!(get("/assets/../../etc/passwd").status, 404);
        assert_eq!(get("/api/estimate").status, 405);
        assert_eq!(post("/", "").status, 405);
        let p = body(&get("/api/presets"));
        assert!(p
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["name"] == "flux.1-dev")));
        let a = body(&get("/api/args/estimate"));
        assert!(a
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == "lora_rank")));
        assert_eq!(get("/api/args/run").status, 404);
    }
}
