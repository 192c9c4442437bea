//! `ditmem serve` in a real browser: headless Chromium loads the page, the form is filled for
//! several families, and the verdict and figures the page shows are held equal to the CLI's
//! `--json` for the same arguments (the release binary, as `cargo test --release` builds it).
//!
//! Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON
//! messages ending in NUL on file descriptors 3 and 4), with nothing but the standard library
//! and serde_json. Chromium missing or failing to start is a FAILURE with the fix named
//! (`scripts/browser_setup.sh` installs Debian's `chromium`), never a skip.
//!
//! `DITMEM_SCREENSHOT_DIR=docs/img cargo test --release -p ditmem --test browser` also writes
//! the screenshots of docs/serve.md.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

/// Where Chromium is: `DITMEM_CHROMIUM`, else the first of Debian's and others' names on PATH.
fn chromium_path() -> PathBuf {
    if let Some(p) = std::env::var_os("DITMEM_CHROMIUM") {
        return PathBuf::from(p);
    }
    for name in [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let p = dir.join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "the browser tests need Chromium and found none on PATH (chromium, chromium-browser, \
         google-chrome): run `scripts/browser_setup.sh` (apt-get install chromium) or set \
         DITMEM_CHROMIUM to the browser's path"
    );
}

/// A headless Chromium driven over the DevTools pipe, attached to one page.
struct Browser {
    child: Child,
    to: std::io::PipeWriter,
    from: Receiver<Value>,
    next_id: u64,
    session: String,
    profile: PathBuf,
}

impl Browser {
    fn start() -> Browser {
        let exe = chromium_path();
        let profile = std::env::temp_dir().join(format!(
            "ditmem-browser-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&profile);
        // fd 3: the browser reads commands; fd 4: it writes answers and events.
        let (child_read, to) = std::io::pipe().expect("a pipe");
        let (from, child_write) = std::io::pipe().expect("a pipe");
        let (r, w) = (child_read.as_raw_fd(), child_write.as_raw_fd());
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--headless=new",
            "--remote-debugging-pipe",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-sync",
            "--mute-audio",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // SAFETY: between fork and exec the closure calls only async-signal-safe functions
        // (fcntl, dup2, close) on descriptors this process owns, and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                // Move both ends above 4 first, so that placing one cannot close the other.
                let r2 = libc::fcntl(r, libc::F_DUPFD, 10);
                let w2 = libc::fcntl(w, libc::F_DUPFD, 10);
                if r2 < 0 || w2 < 0 || libc::dup2(r2, 3) < 0 || libc::dup2(w2, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(r2);
                libc::close(w2);
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!(
                "could not start Chromium ({}): {e}; run `scripts/browser_setup.sh` or set \
                 DITMEM_CHROMIUM",
                exe.display()
            )
        });
        drop(child_read);
        drop(child_write);
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(from);
            loop {
                let mut buf = Vec::new();
                match reader.read_until(0, &mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        buf.pop();
                        if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                            if tx.send(v).is_err() {
                                return;
                            }
                        }
                    }
                }
            }
        });
        let mut b = Browser {
            child,
            to,
            from: rx,
            next_id: 1,
            session: String::new(),
            profile,
        };
        let target = b.send(None, "Target.createTarget", json!({"url": "about:blank"}));
        let target_id = target["targetId"].as_str().unwrap_or_default().to_string();
        let attached = b.send(
            None,
            "Target.attachToTarget",
            json!({"targetId": target_id, "flatten": true}),
        );
        b.session = attached["sessionId"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        b.call("Page.enable", json!({}));
        b.call("Runtime.enable", json!({}));
        b
    }

    /// One DevTools command; its result (panics with the browser's error).
    fn send(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap_or_default();
        bytes.push(0);
        if let Err(e) = self.to.write_all(&bytes) {
            panic!(
                "Chromium stopped reading its DevTools pipe ({e}): it did not start; run \
                 `scripts/browser_setup.sh`, or try `{} --headless=new --no-sandbox about:blank`",
                chromium_path().display()
            );
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = match self.from.recv_timeout(left) {
                Ok(v) => v,
                Err(_) => panic!(
                    "Chromium did not answer {method} within 60 s (it may have failed to \
                     start: run `scripts/browser_setup.sh`)"
                ),
            };
            if v["id"] == json!(id) {
                if let Some(err) = v.get("error") {
                    panic!("Chromium refused {method}: {err}");
                }
                return v["result"].clone();
            }
        }
    }

    fn call(&mut self, method: &str, params: Value) -> Value {
        let s = self.session.clone();
        self.send(Some(&s), method, params)
    }

    /// Evaluates `expr` in the page (awaiting a promise) and returns its JSON value.
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        if let Some(ex) = r.get("exceptionDetails") {
            panic!("the page threw evaluating {expr}: {ex}");
        }
        r["result"]["value"].clone()
    }

    /// Polls `expr` until it is `true` (panics after `secs`).
    fn wait(&mut self, expr: &str, secs: u64, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if self.eval(expr) == json!(true) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let body = self.eval("document.body ? document.body.innerText.slice(0, 600) : ''");
        panic!("timed out waiting for {what} ({expr}); the page shows: {body}");
    }

    fn viewport(&mut self, width: u32, height: u32, mobile: bool) {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": if mobile { 2 } else { 1 },
                   "mobile": mobile}),
        );
    }

    /// A PNG of `height` CSS pixels of the page from the top of element `from`, at `width`.
    fn screenshot_of(&mut self, path: &Path, width: u32, from: &str, height: u32) {
        self.viewport(width, 900, true);
        std::thread::sleep(Duration::from_millis(300));
        let top = self
            .eval(&format!(
                "Math.floor(document.getElementById('{from}').getBoundingClientRect().top + window.scrollY)"
            ))
            .as_f64()
            .unwrap_or(0.0);
        let r = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true,
                   "clip": {"x": 0, "y": top, "width": width, "height": height, "scale": 1}}),
        );
        let png = base64_decode(r["data"].as_str().unwrap_or_default());
        std::fs::write(path, png).expect("writing the screenshot");
    }

    /// A PNG of the whole page at `width` CSS pixels.
    fn screenshot(&mut self, path: &Path, width: u32, mobile: bool) {
        self.viewport(width, 800, mobile);
        std::thread::sleep(Duration::from_millis(300));
        let h = self
            .eval("Math.ceil(document.documentElement.scrollHeight)")
            .as_u64()
            .unwrap_or(800) as u32;
        self.viewport(width, h.clamp(400, 16000), mobile);
        std::thread::sleep(Duration::from_millis(300));
        let r = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true}),
        );
        let png = base64_decode(r["data"].as_str().unwrap_or_default());
        std::fs::write(path, png).expect("writing the screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

fn base64_decode(text: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for v in text.bytes().filter_map(val) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

/// `ditmem serve --port 0` (the release binary), stopped on drop.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start() -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ditmem"))
            .args(["serve", "--port", "0", "--json", "--time-limit", "300"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting ditmem serve");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("ditmem serve's first line");
        let v: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("ditmem serve --json printed {line:?}: {e}"));
        Server {
            child,
            url: v["url"].as_str().expect("url").to_string(),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The CLI's `--json` for the page's arguments (as the API spells them: `model` a preset).
fn cli_json(command: &str, args: &Map<String, Value>) -> Value {
    let mut argv = vec![command.to_string(), "--json".to_string()];
    for (k, v) in args {
        let flag = match (k.as_str(), v) {
            ("model", Value::Object(_)) => "--model".to_string(),
            ("model", _) => "--preset".to_string(),
            _ => format!("--{}", k.replace('_', "-")),
        };
        let text = match v {
            // A pasted config: the CLI reads it from a file.
            Value::Object(_) => {
                let path = std::env::temp_dir()
                    .join(format!("ditmem-browser-{}-config.json", std::process::id()));
                std::fs::write(&path, v.to_string()).expect("writing the config");
                path.display().to_string()
            }
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().map(str::to_string).unwrap_or(x.to_string()))
                .collect::<Vec<_>>()
                .join(","),
            other => panic!("no CLI spelling for {k} = {other}"),
        };
        argv.push(format!("{flag}={text}"));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ditmem"))
        .args(&argv)
        .output()
        .expect("running ditmem");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "ditmem {} gave no JSON ({e}): {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Sets the form's fields (by id) as a user would, firing `input`/`change`, and waits for the
/// estimate of exactly `want` (the arguments the page sends) to be on the page.
fn fill(b: &mut Browser, fields: &[(&str, &str)], want: &Value) {
    let set: Vec<Value> = fields.iter().map(|(k, v)| json!([k, v])).collect();
    b.eval(&format!(
        "(() => {{ for (const [id, v] of {}) {{ const e = document.getElementById(id); \
           e.value = v; e.dispatchEvent(new Event(e.tagName === 'SELECT' ? 'change' : 'input', \
           {{bubbles: true}})); }} return true; }})()",
        Value::Array(set)
    ));
    let expr = format!(
        "document.body.dataset.state !== 'loading' && document.body.dataset.args !== undefined \
         && (() => {{ const a = JSON.parse(document.body.dataset.args); const w = {want}; \
         return JSON.stringify(Object.keys(a).sort().map(k => [k, a[k]])) === \
         JSON.stringify(Object.keys(w).sort().map(k => [k, w[k]])); }})()"
    );
    b.wait(&expr, 60, &format!("the estimate of {want}"));
}

/// [`fill`], then what the page shows (returned) held against the CLI's estimate of `want`.
fn fill_and_check(b: &mut Browser, fields: &[(&str, &str)], want: &Value, what: &str) -> Value {
    fill(b, fields, want);
    let page = b.eval(READ_PAGE);
    let cli = cli_json("estimate", want.as_object().expect("object"));
    check_against_cli(&page, &cli, what);
    page
}

/// What the page shows, read from the DOM.
const READ_PAGE: &str = r##"(() => {
  const $ = (id) => document.getElementById(id);
  return {
    state: document.body.dataset.state,
    error: $("error").hidden ? null : $("error").textContent,
    fits: $("verdict").dataset.fits,
    verdict: $("verdict").textContent,
    need: $("need").dataset.bytes, need_text: $("need").textContent,
    capacity: $("capacity").dataset.bytes, capacity_text: $("capacity").textContent,
    phase: $("peak-where").dataset.phase,
    conditions: $("conditions").textContent,
    title: $("title").textContent,
    breakdown: [...document.querySelectorAll("#breakdown tbody tr[data-key]")]
      .map((r) => [r.dataset.key, r.dataset.bytes, r.children[1].textContent]),
    levers: [...document.querySelectorAll("#levers li")].map((l) => l.textContent),
    timeline_areas: document.querySelectorAll("#timeline polygon").length,
    limit_line: document.querySelectorAll("#timeline line.limit").length,
  };
})()"##;

fn gib(bytes: u64) -> String {
    ditmem_budget::fmt_bytes(bytes)
}

/// The page's figures equal the CLI's for the same arguments.
fn check_against_cli(page: &Value, cli: &Value, what: &str) {
    assert_eq!(page["state"], "ready", "{what}: {page}");
    assert!(page["error"].is_null(), "{what}: error shown: {page}");
    let need = cli["need_bytes"].as_u64().expect("need_bytes");
    assert_eq!(page["need"], json!(need.to_string()), "{what}: need");
    assert_eq!(page["need_text"], json!(gib(need)), "{what}: need text");
    let cap = cli["cuda"]["capacity_bytes"].as_u64().expect("a card");
    assert_eq!(page["capacity"], json!(cap.to_string()), "{what}: capacity");
    assert!(
        page["capacity_text"]
            .as_str()
            .unwrap_or("")
            .starts_with(&gib(cap)),
        "{what}: {page}"
    );
    let fits = cli["fits"].as_bool().expect("fits");
    assert_eq!(page["fits"], json!(fits.to_string()), "{what}: verdict");
    let verdict = page["verdict"].as_str().unwrap_or("");
    assert!(
        verdict.contains(if fits { ": yes" } else { ": no" }),
        "{what}: {verdict}"
    );
    if !fits {
        assert!(verdict.contains(&gib(need - cap)), "{what}: {verdict}");
    }
    assert_eq!(page["phase"], cli["peak"]["phase"], "{what}: phase");
    // Every category at the peak, bytes and text.
    let bd = cli["peak"]["breakdown"].as_object().expect("breakdown");
    let shown: Vec<(String, String, String)> = page["breakdown"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            (
                r[0].as_str().unwrap_or("").to_string(),
                r[1].as_str().unwrap_or("").to_string(),
                r[2].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let nonzero: Vec<(&String, u64)> = bd
        .iter()
        .map(|(k, v)| (k, v.as_u64().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect();
    assert_eq!(shown.len(), nonzero.len(), "{what}: rows {shown:?}");
    for (k, v) in nonzero {
        let row = shown
            .iter()
            .find(|r| &r.0 == k)
            .unwrap_or_else(|| panic!("{what}: {k} missing from the page's breakdown"));
        assert_eq!(row.1, v.to_string(), "{what}: {k}");
        assert_eq!(row.2, gib(v), "{what}: {k} text");
    }
    // The levers: as many as the CLI's, each with its device peak.
    let levers = cli["levers"].as_array().expect("levers");
    let shown = page["levers"].as_array().expect("levers");
    assert_eq!(shown.len(), levers.len(), "{what}: levers");
    for (l, s) in levers.iter().zip(shown) {
        let s = s.as_str().unwrap_or("");
        assert!(
            s.contains(&gib(l["device_peak_bytes"].as_u64().unwrap_or(0))),
            "{what}: lever {s}"
        );
        assert!(
            s.contains(l["flags"].as_str().unwrap_or("?")),
            "{what}: {s}"
        );
    }
    assert!(page["timeline_areas"].as_u64().unwrap_or(0) >= 2, "{what}");
    assert_eq!(page["limit_line"], json!(1), "{what}: the capacity line");
    let cond = page["conditions"].as_str().unwrap_or("");
    assert!(
        cond.starts_with("Predicted, not measured"),
        "{what}: {cond}"
    );
    assert!(
        cond.contains(cli["cuda"]["gpu"].as_str().unwrap_or("?")),
        "{what}: {cond}"
    );
}

/// `ditmem serve`, and a browser on its page once the page shows its first estimate.
fn opened() -> (Server, Browser) {
    let server = Server::start();
    let mut b = Browser::start();
    b.viewport(1280, 900, false);
    b.call("Page.navigate", json!({"url": server.url}));
    b.wait(
        "document.readyState === 'complete' && document.body.dataset.state === 'ready'",
        60,
        "the page's first estimate",
    );
    (server, b)
}

/// The page's defaults: FLUX.1-dev LoRA rank 16 on an RTX 4090 (the README's first question).
fn page_defaults() -> Value {
    json!({"model": "flux.1-dev", "gpu": "rtx-4090", "lora_rank": 16})
}

#[test]
fn the_page_shows_what_the_cli_answers_for_three_families_and_bad_configs() {
    let (_server, mut b) = opened();

    let page = fill_and_check(&mut b, &[], &page_defaults(), "flux.1-dev LoRA on rtx-4090");
    assert_eq!(
        page["fits"], "false",
        "the README says it does not fit: {page}"
    );

    // SD3.5-medium full fine-tune on an A100-80GB, batch 2, every block recomputed.
    let want = json!({"model": "sd3.5-medium", "gpu": "a100-80gb", "batch": 2, "recompute": "all"});
    fill_and_check(
        &mut b,
        &[
            ("preset", "sd3.5-medium"),
            ("gpu", "a100-80gb"),
            ("lora_rank", ""),
            ("batch", "2"),
            ("recompute", "all"),
        ],
        &want,
        "sd3.5-medium on a100-80gb",
    );

    // Wan 2.1 1.3B (video: frames) LoRA on an H100, 8-bit AdamW, text encoders online.
    let want = json!({"model": "wan2.1-1.3b", "gpu": "h100-sxm", "lora_rank": 32, "frames": 33,
                      "resolution": "480x832", "optimizer": "adamw-8bit",
                      "text_encoders": "online"});
    let page = fill_and_check(
        &mut b,
        &[
            ("preset", "wan2.1-1.3b"),
            ("gpu", "h100-sxm"),
            ("batch", ""),
            ("recompute", ""),
            ("lora_rank", "32"),
            ("frames", "33"),
            ("resolution", "480x832"),
            ("optimizer", "adamw-8bit"),
            ("text_encoders", "online"),
        ],
        &want,
        "wan2.1-1.3b LoRA on h100-sxm",
    );
    assert!(
        page["title"].as_str().unwrap_or("").contains("33 frames"),
        "{page}"
    );

    // PixArt-Σ at 1024², batch 4, on an A100-40GB (a README quick answer).
    let want = json!({"model": "pixart-sigma-1024", "gpu": "a100-40gb", "batch": 4});
    fill_and_check(
        &mut b,
        &[
            ("preset", "pixart-sigma-1024"),
            ("gpu", "a100-40gb"),
            ("lora_rank", ""),
            ("frames", ""),
            ("resolution", ""),
            ("optimizer", ""),
            ("text_encoders", ""),
            ("batch", "4"),
        ],
        &want,
        "pixart-sigma-1024 on a100-40gb",
    );

    // Any other flag, typed as on the command line.
    let want = json!({"model": "pixart-sigma-1024", "gpu": "a100-40gb", "batch": 4, "ema": "on",
                      "accumulation": "2"});
    fill_and_check(
        &mut b,
        &[("extra", "--ema on --accumulation=2")],
        &want,
        "pixart-sigma-1024 with EMA and accumulation 2",
    );
    b.eval("(() => { document.getElementById('extra').value = ''; return true; })()");

    // A pasted config answers as the CLI given that config.json (`--model FILE`)…
    let config = ditmem_budget::preset_config("pixart-sigma-1024").expect("preset");
    let config: Value = serde_json::from_str(config).expect("json");
    let want = json!({"model": config, "gpu": "a100-40gb", "batch": 4});
    fill_and_check(
        &mut b,
        &[("config", &config.to_string())],
        &want,
        "a pasted pixart-sigma config.json on a100-40gb",
    );

    // …a bad one shows the API's one line, as the CLI words it.
    let bad = json!({"_class_name": "PixArtTransformer2DModel", "num_layers": -3});
    let want = json!({"model": bad, "gpu": "a100-40gb", "batch": 4});
    fill(&mut b, &[("config", &bad.to_string())], &want);
    let page = b.eval(READ_PAGE);
    assert_eq!(page["state"], "error", "{page}");
    let expected = ditmem::api::call(
        "estimate",
        want.as_object().expect("object"),
        ditmem::api::Options::default(),
    )
    .expect_err("a negative num_layers is refused");
    let shown = page["error"].as_str().unwrap_or("");
    assert_eq!(shown, expected.message(), "{page}");
    assert!(shown.starts_with("invalid input"), "{shown}");
    assert!(!shown.contains('\n'), "one line: {shown:?}");

    // Text that is not JSON: one line, without asking the server.
    b.eval(
        "(() => { const e = document.getElementById('config'); e.value = '{\"_class_name\": '; \
         e.dispatchEvent(new Event('input', {bubbles: true})); return true; })()",
    );
    b.wait(
        "document.body.dataset.state === 'error' && !document.getElementById('error').hidden \
         && document.getElementById('error').textContent.includes('not JSON')",
        30,
        "the not-JSON error",
    );
    let page = b.eval(READ_PAGE);
    let shown = page["error"].as_str().unwrap_or("");
    assert!(
        shown.starts_with("invalid input: config.json is not JSON"),
        "{shown}"
    );
    assert!(!shown.contains('\n'), "{shown:?}");
}

#[test]
fn the_plan_and_its_export_are_the_clis() {
    let (server, mut b) = opened();
    let want = page_defaults();
    fill(&mut b, &[], &want);
    b.eval(
        "(() => { for (const v of ['8bit', 'quant']) \
           document.querySelector(`#allow input[value='${v}']`).checked = true; \
           document.getElementById('launcher').value = 'custom'; \
           document.getElementById('plan-button').click(); return true; })()",
    );
    b.wait(
        "document.getElementById('plan').dataset.state === 'ready'",
        120,
        "the plan",
    );
    let page = b.eval(
        r##"(() => ({
          feasible: document.getElementById("plan-verdict").dataset.feasible,
          verdict: document.getElementById("plan-verdict").textContent,
          reason: document.getElementById("plan-reason").textContent,
          points: document.querySelectorAll("#pareto circle").length,
          chosen: document.querySelectorAll("#pareto circle.chosen").length,
          names: document.querySelectorAll("#pareto li").length,
          export_name: document.getElementById("export-name").textContent,
          export_text: document.getElementById("export-text").textContent,
          launch: document.getElementById("launch").textContent,
          conditions: document.getElementById("plan-conditions").textContent,
        }))()"##,
    );
    let mut args = want.as_object().expect("object").clone();
    args.insert("allow".into(), json!(["8bit", "quant"]));
    args.insert("emit".into(), json!("accelerate"));
    args.insert("emit_family".into(), json!("flux"));
    // The diffusers script keeps T5-XXL resident and has no NF4 base: only a custom launch fits
    // FLUX.1-dev LoRA on a 24 GiB card.
    args.insert("launcher".into(), json!("custom"));
    args.insert("time_limit".into(), json!(300));
    let cli = cli_json("plan", &args);
    assert_eq!(cli["feasible"], json!(true), "{cli}");
    assert_eq!(page["feasible"], "true", "{page}");
    let verdict = page["verdict"].as_str().unwrap_or("");
    assert!(
        verdict.contains(&gib(cli["predicted_peak_bytes"].as_u64().unwrap_or(0))),
        "{verdict}"
    );
    assert!(
        verdict.contains(&format!(
            "{:.2} s",
            cli["predicted_step_time_s"].as_f64().unwrap_or(0.0)
        )),
        "{verdict}"
    );
    assert_eq!(
        page["reason"],
        json!(format!("Why: {}", cli["reason"].as_str().unwrap_or(""))),
    );
    let front = cli["pareto"].as_array().expect("pareto").len() as u64;
    assert_eq!(page["points"], json!(front), "{page}");
    assert_eq!(page["names"], json!(front), "{page}");
    assert_eq!(page["chosen"], json!(1), "the plan is ringed: {page}");
    assert_eq!(page["export_name"], cli["export"]["file_name"]);
    assert_eq!(page["export_text"], cli["export"]["text"]);
    let launch = page["launch"].as_str().unwrap_or("");
    assert!(launch.contains("accelerate launch"), "{launch}");
    assert!(
        launch.contains(cli["export"]["command"]["script"].as_str().unwrap_or("?")),
        "{launch}"
    );
    assert!(
        page["conditions"]
            .as_str()
            .unwrap_or("")
            .starts_with("Predicted, not measured"),
        "{page}"
    );

    // On a phone's width (390 CSS px) nothing is wider than the screen.
    b.viewport(390, 800, true);
    std::thread::sleep(Duration::from_millis(300));
    let wide = b.eval(
        "[document.documentElement.scrollWidth, ...[...document.querySelectorAll('body *')]\
         .filter(e => e.getBoundingClientRect().right > 391).slice(0, 5)\
         .map(e => e.tagName + '#' + e.id + '.' + e.className)]",
    );
    assert_eq!(
        wide[0],
        json!(390),
        "the page is wider than a phone: {wide}"
    );
    b.viewport(1280, 900, false);

    if let Some(dir) = std::env::var_os("DITMEM_SCREENSHOT_DIR") {
        // Relative to the workspace (cargo runs a test in its package's folder).
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(dir);
        std::fs::create_dir_all(&dir).expect("screenshot dir");
        b.screenshot(&dir.join("serve-flux-lora-4090.png"), 1280, false);
        // A phone: the answer's first screens (the form is above it).
        b.screenshot_of(
            &dir.join("serve-flux-lora-4090-phone.png"),
            390,
            "result",
            1400,
        );
    }
    // The server is still answering after all of it.
    let host = server
        .url
        .trim_start_matches("http://")
        .trim_end_matches('/');
    let mut conn = std::net::TcpStream::connect(host).expect("connect");
    write!(
        conn,
        "GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut text = String::new();
    conn.read_to_string(&mut text).expect("read");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}
