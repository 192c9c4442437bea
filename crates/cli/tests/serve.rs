//! `ditmem serve` on a real socket: the limits a hostile request meets before any work (body,
//! URL, headers, content type, Host), the bounded queue (503 with Retry-After), the JSON of
//! the API equal to the CLI's, and Ctrl-C stopping it with exit 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ditmem"))
            .args(["serve", "--port", "0", "--json"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting ditmem serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the first line");
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        let url = v["url"].as_str().expect("url");
        Server {
            child,
            addr: url
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string(),
        }
    }

    /// Sends raw bytes; the status and the body of the answer.
    fn raw(&self, request: &[u8]) -> (u16, String, String) {
        let mut s = TcpStream::connect(&self.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(120))).ok();
        let _ = s.write_all(request);
        let mut text = Vec::new();
        let _ = s.read_to_end(&mut text);
        split(&text)
    }

    fn post(&self, path: &str, ctype: &str, body: &str) -> (u16, String, String) {
        self.raw(
            format!(
                "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: {ctype}\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                self.addr,
                body.len()
            )
            .as_bytes(),
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn split(text: &[u8]) -> (u16, String, String) {
    let at = text
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(text.len());
    let head = String::from_utf8_lossy(&text[..at]).to_string();
    let body = text.get(at + 4..).unwrap_or_default();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_vec()
    };
    (status, head, String::from_utf8_lossy(&body).to_string())
}

/// A chunked body's data (tiny_http chunks a large answer).
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&rest[..eol]).trim().to_string();
        let n = usize::from_str_radix(&size, 16).unwrap_or(0);
        let tail = &rest[eol + 2..];
        if n == 0 || tail.len() < n {
            break;
        }
        out.extend_from_slice(&tail[..n]);
        rest = tail[n..].strip_prefix(b"\r\n").unwrap_or(&tail[n..]);
    }
    out
}

fn error_of(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{body:?}: {e}"));
    assert!(v["message"].as_str().is_some_and(|m| !m.contains('\n')));
    v["error"].as_str().unwrap_or("").to_string()
}

#[test]
fn hostile_requests_are_refused_before_any_work() {
    let s = Server::start(&[]);
    let host = s.addr.clone();
    // A body over 1 MiB, declared.
    let (st, _, body) = s.raw(
        format!(
            "POST /api/estimate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
             Content-Length: 2000000\r\nConnection: close\r\n\r\n{{"
        )
        .as_bytes(),
    );
    assert_eq!((st, error_of(&body).as_str()), (413, "body_too_large"));
    // A chunked body over 1 MiB: read up to the limit only.
    let chunk = "x".repeat(0x10000);
    let mut req = format!(
        "POST /api/estimate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    for _ in 0..20 {
        req.push_str(&format!("10000\r\n{chunk}\r\n"));
    }
    req.push_str("0\r\n\r\n");
    let (st, _, body) = s.raw(req.as_bytes());
    assert_eq!((st, error_of(&body).as_str()), (413, "body_too_large"));
    // A long URL.
    let (st, _, body) = s.raw(
        format!(
            "GET /{} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
            "a".repeat(5000)
        )
        .as_bytes(),
    );
    assert_eq!((st, error_of(&body).as_str()), (414, "uri_too_long"));
    // Too many headers.
    let many: String = (0..100).map(|i| format!("X-H{i}: v\r\n")).collect();
    let (st, _, body) = s.raw(
        format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\n{many}Connection: close\r\n\r\n")
            .as_bytes(),
    );
    assert_eq!((st, error_of(&body).as_str()), (431, "headers_too_large"));
    // A form post (what another web site could send).
    let (st, _, body) = s.post(
        "/api/estimate",
        "application/x-www-form-urlencoded",
        "model=x",
    );
    assert_eq!(
        (st, error_of(&body).as_str()),
        (415, "unsupported_media_type")
    );
    // Another Host (DNS rebinding).
    let (st, _, body) =
        s.raw(b"GET /healthz HTTP/1.1\r\nHost: attacker.example\r\nConnection: close\r\n\r\n");
    assert_eq!((st, error_of(&body).as_str()), (403, "forbidden_host"));
    // A file argument, and a plan asking for more time than the server gives.
    let (st, _, body) = s.post(
        "/api/estimate",
        "application/json",
        r#"{"config": "/etc/passwd"}"#,
    );
    assert_eq!((st, error_of(&body).as_str()), (400, "invalid"));
    assert!(body.contains("names a file"), "{body}");
    let (st, _, body) = s.post(
        "/api/plan",
        "application/json",
        r#"{"model": "dit-s-2", "budget": "8GiB", "time_limit": 3600}"#,
    );
    assert_eq!(st, 400, "{body}");
    assert!(body.contains("--time-limit"), "{body}");
    // Methods.
    let (st, head, _) = s.raw(
        format!("GET /api/plan HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    );
    assert_eq!(st, 405);
    assert!(head.to_ascii_lowercase().contains("allow: post"), "{head}");
    // Still answering.
    let (st, _, body) = s.raw(
        format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    );
    assert_eq!((st, body.as_str()), (200, r#"{"ok":true}"#));
}

#[test]
fn the_api_answers_the_clis_json_and_ctrl_c_stops_it() {
    let mut s = Server::start(&[]);
    let (st, _, body) = s.post(
        "/api/estimate",
        "application/json",
        r#"{"model": "pixart-sigma-1024", "gpu": "a100-40gb", "batch": 4}"#,
    );
    assert_eq!(st, 200, "{body}");
    let api: Value = serde_json::from_str(&body).expect("json");
    let out = Command::new(env!("CARGO_BIN_EXE_ditmem"))
        .args([
            "estimate",
            "--preset",
            "pixart-sigma-1024",
            "--gpu",
            "a100-40gb",
            "--batch",
            "4",
            "--json",
        ])
        .output()
        .expect("ditmem estimate");
    let cli: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(api, cli);

    let status = Command::new("kill")
        .args(["-INT", &s.child.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(status.success());
    let code = s.child.wait().expect("wait");
    assert_eq!(code.code(), Some(0), "Ctrl-C: a clean stop");
    let mut err = String::new();
    if let Some(mut e) = s.child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    assert!(err.contains("stopped"), "{err}");
}

#[test]
fn beyond_the_queue_a_request_gets_503_with_retry_after() {
    // One worker and its queue of 16; each plan searches up to 2 s.
    let s = Server::start(&["--workers", "1", "--time-limit", "2"]);
    let body = r#"{"model": "flux.1-dev", "gpu": "rtx-4090", "lora_rank": 16, "allow": ["8bit", "quant"]}"#;
    let mut conns = Vec::new();
    for _ in 0..40 {
        let mut c = TcpStream::connect(&s.addr).expect("connect");
        c.write_all(
            format!(
                "POST /api/plan HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                s.addr,
                body.len()
            )
            .as_bytes(),
        )
        .expect("write");
        conns.push(c);
    }
    let mut busy = 0;
    for mut c in conns {
        c.set_read_timeout(Some(Duration::from_secs(1))).ok();
        let mut text = Vec::new();
        let _ = c.read_to_end(&mut text);
        let (st, head, body) = split(&text);
        if st == 503 {
            busy += 1;
            assert!(head.contains("Retry-After: 1"), "{head}");
            assert_eq!(error_of(&body), "busy");
        }
    }
    // 40 at once, 1 working and 16 waiting: the rest are told to come back.
    assert!(busy >= 40 - 17 - 3, "{busy} answered 503");
}
