//! Issue 19, hostile input: no file destroyed, no memory blow-up, one line and the documented
//! exit code (docs/spec.md, "Bad input and exit codes"). Each test reproduces one finding of the issue.
//!
//! Nothing here touches a real /dev file: FIFOs and symbolic links are made in temp folders, and
//! every run of the binary has a deadline (a FIFO opened by mistake would block forever).

mod common;

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{argv, argv_with, strs, temp_dir};

/// Run `ditmem` with `args` (through `wrapper`, a shell line with `"$@"`, when given), killed
/// after `secs`: (exit code, stdout, stderr, elapsed). A kill fails the test.
fn run_within(args: &[&str], secs: u64, wrapper: Option<&str>) -> (i32, String, String, Duration) {
    let bin = env!("CARGO_BIN_EXE_ditmem");
    let mut cmd = match wrapper {
        Some(line) => {
            let mut c = Command::new("bash");
            c.arg("-c").arg(line).arg("ditmem").arg(bin).args(args);
            c
        }
        None => {
            let mut c = Command::new(bin);
            c.args(args);
            c
        }
    };
    let dir = temp_dir("hostile", "capture");
    // Tests run on several threads at once: the clock alone gave two of them one id (its
    // resolution here is coarser than a nanosecond), and each read the other's stderr.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = format!(
        "{}-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let (out_p, err_p) = (dir.join(format!("{id}.out")), dir.join(format!("{id}.err")));
    let t0 = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_p).unwrap())
        .stderr(std::fs::File::create(&err_p).unwrap())
        .spawn()
        .expect("the binary starts");
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ditmem {args:?} still ran after {secs} s (blocked?)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = t0.elapsed();
    let out = std::fs::read_to_string(&out_p).unwrap_or_default();
    let err = std::fs::read_to_string(&err_p).unwrap_or_default();
    let _ = std::fs::remove_file(&out_p);
    let _ = std::fs::remove_file(&err_p);
    (status.code().unwrap_or(-1), out, err, elapsed)
}

fn run(args: &[&str]) -> (i32, String, String) {
    let (c, o, e, _) = run_within(args, 120, None);
    (c, o, e)
}

/// Exit `code`, nothing on stdout, one line on stderr that contains every word of `needles`.
fn rejects(args: &[&str], code: i32, needles: &[&str]) -> String {
    let (c, out, err) = run(args);
    assert_eq!(c, code, "{args:?}: exit code; stderr: {err}");
    assert!(out.is_empty(), "{args:?}: nothing on stdout, got {out}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: one line: {err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{args:?}: '{}' should contain {n}",
            err.trim_end()
        );
    }
    assert!(
        !err.contains("panicked") && !err.contains("Usage"),
        "{args:?}: {err}"
    );
    err
}

fn mkfifo(p: &Path) {
    let ok = Command::new("mkfifo").arg(p).status().expect("mkfifo runs");
    assert!(ok.success());
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Finding 1: an output never replaces a FIFO or a symbolic link (nor the link's target); a
/// regular file or a new path is written.
#[test]
fn outputs_never_replace_fifos_or_symlinks() {
    let dir = temp_dir("hostile", "outputs");
    let fifo = dir.join("pipe.svg");
    mkfifo(&fifo);
    let target = dir.join("target.txt");
    std::fs::write(&target, "keep me").unwrap();
    let link = dir.join("link.svg");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let small = argv("--preset dit-s-2 --resolution 128 --batch 2 --precision fp32");
    let commands: Vec<(Vec<&str>, &str)> = vec![
        (vec!["estimate"], "--plot"),
        (vec!["plan", "--budget", "24GiB"], "--out"),
        (vec!["plan", "--budget", "24GiB"], "--plot"),
        (
            vec!["plan", "--budget", "24GiB", "--emit", "accelerate"],
            "--emit-out",
        ),
        (vec!["run"], "--out"),
        (vec!["compare"], "--plot"),
        (vec!["verify", "--steps", "0"], "--save-reference"),
        (vec!["verify"], "--plot"),
    ];
    for (cmd, flag) in &commands {
        for (path, kind) in [(&fifo, "FIFO"), (&link, "symbolic link")] {
            let mut args = cmd.clone();
            if cmd[0] != "verify" {
                args.extend_from_slice(&small);
            }
            args.extend_from_slice(&[flag, s(path)]);
            let (c, out, err, _) = run_within(&args, 60, None);
            assert_eq!(c, 2, "{args:?}: {err}");
            assert!(out.is_empty(), "{args:?}: no work before the refusal");
            assert!(err.contains(flag) && err.contains(kind), "{args:?}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{err}");
            let ft = std::fs::symlink_metadata(&fifo).unwrap().file_type();
            assert!(ft.is_fifo(), "{args:?}: the FIFO is still a FIFO");
            let lt = std::fs::symlink_metadata(&link).unwrap().file_type();
            assert!(lt.is_symlink(), "{args:?}: the link is still a link");
            assert_eq!(std::fs::read_link(&link).unwrap(), target);
            assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
        }
    }
    // A directory is not replaced either.
    rejects(
        &["estimate", "--plot", s(&dir)],
        2,
        &["--plot", "directory"],
    );
    // A new path and an existing regular file are written (and no temporary file is left).
    let fresh = dir.join("fresh.svg");
    let (c, _, err) = run(&["estimate", "--plot", s(&fresh)]);
    assert_eq!(c, 0, "{err}");
    assert!(std::fs::read_to_string(&fresh).unwrap().contains("<svg"));
    let (c, _, err) = run(&["estimate", "--plot", s(&target)]);
    assert_eq!(c, 0, "{err}");
    assert!(std::fs::read_to_string(&target).unwrap().contains("<svg"));
    let leftovers = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .count();
    assert_eq!(leftovers, 0);
    std::fs::remove_dir_all(&dir).ok();
}

/// Finding 5: every output path is checked before any work: no plan printed, no step run.
#[test]
fn bad_output_paths_fail_before_any_work() {
    let dir = temp_dir("hostile", "early");
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("out.svg");
    let cases: Vec<Vec<&str>> = vec![
        vec!["plan", "--budget", "24GiB", "--out", "/nonexistent/p.toml"],
        vec!["plan", "--budget", "24GiB", "--plot", "/nonexistent/p.svg"],
        argv("plan --budget 24GiB --emit deepspeed --emit-out /nonexistent/ds.json"),
        vec!["estimate", "--plot", s(&under_file)],
        // The default XL step would take minutes (or be refused for memory, exit 3) if the path
        // were checked after the work.
        vec!["run", "--out", "/nonexistent/r.json"],
        vec!["compare", "--plot", "/nonexistent/c.svg"],
        vec!["verify", "--save-reference", "/nonexistent/ref.safetensors"],
        vec!["verify", "--plot", "/nonexistent/drift.svg"],
    ];
    for args in cases {
        let flag = args
            .iter()
            .find(|a| ["--out", "--plot", "--emit-out", "--save-reference"].contains(a))
            .unwrap()
            .to_string();
        let (c, out, err, took) = run_within(&args, 60, None);
        assert_eq!(c, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: printed before failing: {out}");
        assert!(
            err.contains(&flag) && err.contains("folder"),
            "{args:?}: {err}"
        );
        assert!(took < Duration::from_secs(20), "{args:?}: took {took:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Finding 3: `--config` (and `--profile`) only from regular files of at most 1 MiB, checked
/// before opening (a FIFO would block), and JSON in a `.txt` file gets a hint.
#[test]
fn config_files_are_capped_and_regular() {
    let dir = temp_dir("hostile", "config");
    let fifo = dir.join("spec.toml");
    mkfifo(&fifo);
    let (c, _, err, took) = run_within(&["estimate", "--config", s(&fifo)], 20, None);
    assert_eq!(c, 2, "{err}");
    assert!(err.contains("--config") && err.contains("FIFO"), "{err}");
    assert!(took < Duration::from_secs(10));
    rejects(
        &["estimate", "--config", "/dev/zero"],
        2,
        &["--config", "character device"],
    );
    rejects(
        &["estimate", "--config", s(&dir)],
        2,
        &["--config", "directory"],
    );
    rejects(
        &["plan", "--budget", "24GiB", "--profile", s(&fifo)],
        2,
        &["--profile", "FIFO"],
    );
    // A comment-only file just over the cap is refused by its size, not parsed.
    let big = dir.join("big.toml");
    let mut text = "# padding\n".repeat((1 << 20) / 10 + 1);
    text.push_str("[model]\n");
    std::fs::write(&big, &text).unwrap();
    rejects(
        &["estimate", "--config", s(&big)],
        2,
        &["--config", "1048576"],
    );
    // A valid spec with some comments reads fine.
    let (c, spec_text, _) = run(&["spec", "--preset", "dit-s-2", "--batch", "4"]);
    assert_eq!(c, 0);
    let ok = dir.join("ok.toml");
    std::fs::write(&ok, format!("# a comment\n{spec_text}")).unwrap();
    let (c, _, err) = run(&["estimate", "--config", s(&ok)]);
    assert_eq!(c, 0, "{err}");
    // JSON in a .txt file: parsed as TOML, and the error says what to do.
    let (c, json_text, _) = run(&["spec", "--preset", "dit-s-2", "--json"]);
    assert_eq!(c, 0);
    let txt = dir.join("spec.txt");
    std::fs::write(&txt, &json_text).unwrap();
    rejects(
        &["estimate", "--config", s(&txt)],
        2,
        &["looks like JSON; name the file .json"],
    );
    let json = dir.join("spec.json");
    std::fs::write(&json, &json_text).unwrap();
    assert_eq!(run(&["estimate", "--config", s(&json)]).0, 0);
    std::fs::remove_dir_all(&dir).ok();
}

fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Finding 4: under an address-space limit, a step predicted above it is refused at once
/// (exit 3, naming the limit and both numbers), never started and aborted (exit 134); `--force`
/// does not lift a hard limit.
#[test]
fn the_resource_guard_sees_the_address_space_limit() {
    // 2,000,000 KiB ≈ 1.91 GiB; DiT-B/2 at 256², batch 8, fp32 is predicted at ≈ 3.7 GiB.
    const KIB: u64 = 2_000_000;
    let wrapper = format!("ulimit -v {KIB} && exec \"$@\"");
    let spec = argv("--preset dit-b-2 --resolution 256 --batch 8 --precision fp32 --steps 1");
    let named = mem_available().is_some_and(|m| m > KIB * 1024);
    for (cmd, extra) in [
        ("run", &[][..]),
        ("run", &["--force"][..]),
        ("compare", &[][..]),
    ] {
        let mut args = vec![cmd];
        args.extend_from_slice(&spec);
        args.extend_from_slice(extra);
        let (c, out, err, took) = run_within(&args, 60, Some(&wrapper));
        assert_ne!(c, 134, "{args:?}: aborted: {err}");
        assert_eq!(c, 3, "{args:?}: {err}");
        assert!(out.is_empty());
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(
            err.contains("GiB") && err.contains(" B)"),
            "both numbers: {err}"
        );
        if named {
            assert!(err.contains("address-space limit"), "{err}");
        }
        assert!(
            took < Duration::from_secs(20),
            "refused at once, took {took:?}"
        );
    }
    // verify runs fp64 variants side by side: the guard counts them.
    let (c, _, err, _) = run_within(
        &argv("verify --preset dit-b-2 --resolution 256 --batch 8"),
        60,
        Some(&wrapper),
    );
    assert_eq!(c, 3, "{err}");
    // A small step still runs under the same limit.
    let (c, _, err, _) = run_within(
        &argv("run --preset dit-s-2 --resolution 128 --batch 2 --precision fp32 --steps 1 --warmup 0 --json"),
        120,
        Some(&wrapper),
    );
    assert_eq!(c, 0, "{err}");
}

/// Finding 6: nonsense values are refused, naming the flag and what is allowed.
#[test]
fn nonsense_values_are_refused() {
    for lr in [
        "NaN", "inf", "-inf", "-1", "0", "1e400", "5e-324", "1e308", "2",
    ] {
        rejects(
            &["run", "--lr", lr],
            2,
            &["--lr", "allowed: a number from 1e-8 to 1"],
        );
        rejects(&["verify", "--lr", lr], 2, &["--lr", "allowed"]);
    }
    for h in ["NaN", "-1e308", "0.95", "inf"] {
        let err = rejects(
            &["plan", "--budget", "24GiB", "--headroom", h],
            2,
            &["--headroom", "allowed"],
        );
        assert!(!err.contains("00000000"), "no 309 digits: {err}");
    }
    rejects(
        &["estimate", "--recompute", "blocks:"],
        2,
        &["recipe.recompute", "names no block"],
    );
    for z in ["1", "2", "3"] {
        rejects(
            &["estimate", "--zero", z, "--ranks", "1"],
            2,
            &["recipe.zero_stage", "allowed: 0 with one rank"],
        );
    }
    let (c, _, err) = run(&["estimate", "--zero", "2", "--ranks", "4", "--batch", "32"]);
    assert_eq!(c, 0, "ZeRO with several ranks is fine: {err}");
    for b in [
        "18446744073709551616",
        "16EiB",
        "99999999999999999999999TiB",
    ] {
        rejects(&["plan", "--budget", b], 2, &["--budget", "allowed"]);
    }
}

/// Finding 7: `run` executes only the engine's runtime; PyTorch goes through `compare`.
#[test]
fn run_refuses_a_runtime_the_engine_does_not_execute() {
    for rt in ["pytorch", "pytorch:cuda:sdpa-math"] {
        rejects(
            &argv_with("run --runtime {} --preset dit-s-2 --batch 2", &[rt]),
            2,
            &["runtime", "compare --runtime pytorch"],
        );
    }
    // compare --runtime pytorch is still the way, and a missing peer is exit 5.
    rejects(
        &argv("compare --runtime pytorch --preset dit-s-2 --resolution 128 --batch 2 --python /nonexistent/python"),
        5,
        &["PyTorch peer", "setup.sh"],
    );
}

/// A recipe field the engine does not execute is refused by `run` and `compare` by name, before
/// anything runs: a LoRA base stored quantized (the run would measure a bf16 base under an "nf4
/// base" label) and text encoders in the step (the budget would count encoders the run never holds).
#[test]
fn run_refuses_a_quantized_base_and_text_encoders_it_does_not_hold() {
    let tiny = "--preset pixart-alpha-1024 --depth 1 --resolution 64 --text-tokens 8 --steps 1";
    let quant = "use base_quant = none";
    let encoders = "use text_encoders = cached";
    for (extra, field, allowed) in [
        (
            "--lora-rank 4 --base-quant nf4",
            "recipe.base_quant = nf4",
            quant,
        ),
        (
            "--lora-rank 4 --base-quant fp8",
            "recipe.base_quant = fp8",
            quant,
        ),
        (
            "--text-encoders online",
            "recipe.text_encoders = online",
            encoders,
        ),
        (
            "--text-encoders offloaded",
            "recipe.text_encoders = offloaded",
            encoders,
        ),
    ] {
        for cmd in ["run", "compare"] {
            let line = format!("{cmd} {tiny} {extra}");
            rejects(
                &line.split_whitespace().collect::<Vec<_>>(),
                2,
                &[field, "not supported by the engine", allowed],
            );
        }
    }
}

/// Finding 8: exit codes by the README's table, one line naming the flag for every rejection of
/// the argument parser, values echoed short and escaped.
#[test]
fn exit_codes_and_one_line_messages() {
    let small = ["--preset", "dit-s-2", "--resolution", "128", "--batch", "2"];
    // An unsupported recipe (ZeRO needs ranks; the engine runs one) and a missing latents folder
    // are bad input, before the model is built.
    let mut a = vec!["run", "--zero", "3", "--ranks", "2"];
    a.extend_from_slice(&small);
    rejects(&a, 2, &["zero_stage"]);
    let mut a = vec!["run", "--latents-dir", "/nonexistent/latents"];
    a.extend_from_slice(&small);
    let (c, _, err, took) = run_within(&a, 60, None);
    assert_eq!(c, 2, "{err}");
    assert!(err.contains("--latents-dir"), "{err}");
    assert!(took < Duration::from_secs(10));

    let parser: [(&[&str], &str, &str); 11] = [
        (&["run", "--batch", ""], "--batch", "positive integer"),
        (&["run", "--batch", "x"], "--batch", "positive integer"),
        (&["run", "--batch", "-1"], "--batch", "positive integer"),
        (
            &["run", "--batch", "99999999999"],
            "--batch",
            "positive integer",
        ),
        (&["run", "--batch", "1", "--batch", "2"], "--batch", "once"),
        (&["run", "--steps", "0"], "--steps", "positive integer"),
        (&["estimate", "--frobnicate"], "--frobnicate", "allowed"),
        (&["estimate", "--zero", "7"], "--zero", "ZeRO stage"),
        (&["plan"], "--budget", "required"),
        (&["estimate", "--resolution", "-1"], "resolution", "allowed"),
        (&["plan", "--budget", "-3G"], "--budget", "allowed"),
    ];
    for (args, flag, allowed) in parser {
        let err = rejects(args, 2, &[flag, allowed]);
        assert!(!err.contains("unexpected argument"), "{err}");
    }
    for args in [&["--help"][..], &["--version"], &["run", "--help"]] {
        let (c, out, _) = run(args);
        assert_eq!(c, 0, "{args:?}");
        assert!(!out.is_empty());
    }
    let (c, help, _) = run(&["estimate", "--help"]);
    assert_eq!(c, 0);
    assert!(help.contains("1 MiB"), "--help states the config cap");

    // The README's runtime spellings.
    for rt in [
        "pytorch:cuda:efficient",
        "pytorch:cuda:math",
        "pytorch:cuda:flash",
    ] {
        let (c, _, err) = run(&["estimate", "--runtime", rt, "--json"]);
        assert_eq!(c, 0, "{rt}: {err}");
    }

    // Long and escape-laden values are shortened and escaped.
    let long = "a".repeat(5000);
    for v in [long.as_str(), "dit\u{1b}[2J\u{7}-xl"] {
        let err = rejects(&["estimate", "--preset", v], 2, &["--preset", "flux.1-dev"]);
        assert!(err.len() < 600, "shortened: {} chars", err.len());
        assert!(
            !err.trim_end().chars().any(char::is_control),
            "escaped: {err:?}"
        );
    }
    let err = rejects(&["estimate", "--batch", &long], 2, &["--batch"]);
    assert!(err.len() < 300, "{err}");
}

/// Finding 8: the plan's point count matches the rows listed.
#[test]
fn plan_counts_the_points_it_lists() {
    let (c, out, err) = run(&argv(
        "plan --budget 24GiB --resolution 512 --allow lora,8bit",
    ));
    assert_eq!(c, 0, "{err}");
    let head = out
        .lines()
        .find(|l| l.starts_with("Pareto front"))
        .expect("a front");
    let inside = &head[head.find('(').unwrap() + 1..];
    let total: usize = inside.split(' ').next().unwrap().parse().unwrap();
    let shown = match inside.find(" of them shown") {
        Some(i) => inside[..i].rsplit(' ').next().unwrap().parse().unwrap(),
        None => total,
    };
    let rows = out
        .lines()
        .skip_while(|l| !l.starts_with("Pareto front"))
        .skip(3)
        .take_while(|l| !l.starts_with("searched"))
        .count();
    assert_eq!(rows, shown, "{head}");
    assert!(shown <= total);
}

/// Finding 8: a device profile with a rate too small to give numbers is refused.
#[test]
fn tiny_profile_rates_are_refused() {
    let dir = temp_dir("hostile", "profile");
    let profile = |matmul: &str| {
        format!(
            "name = \"t\"\nmatmul_f64 = 1e9\nmatmul_f32 = {matmul}\nmatmul_bf16 = 1e9\n\
             matmul_f16 = 1e9\nelementwise_f64 = 1e9\nelementwise_f32 = 1e9\n\
             elementwise_half = 1e9\nmicrobatch_overhead_s = 0.001\nlink_bytes_per_s = 1e10\n"
        )
    };
    let p = dir.join("tiny.toml");
    std::fs::write(&p, profile("1e-300")).unwrap();
    let err = rejects(
        &["plan", "--budget", "24GiB", "--profile", s(&p)],
        2,
        &["--profile matmul_f32", "allowed"],
    );
    assert!(!err.contains("inf s") && !err.contains("NaN"), "{err}");
    let ok: PathBuf = dir.join("ok.toml");
    std::fs::write(&ok, profile("1e11")).unwrap();
    let (c, out, err) = run(&["plan", "--budget", "24GiB", "--profile", s(&ok)]);
    assert_eq!(c, 0, "{err}");
    assert!(!out.contains("inf s") && !out.contains("NaN"), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Finding 2: inputs that exhausted memory are refused, or budgeted at a cost that does not grow
/// with them. Under a 1 GiB address space, 100,000 and 1,048,576 accumulated microbatches are
/// estimated and planned (the timeline lays out two and says the others repeat the second);
/// 4,294,967,295 and a depth of 16,777,216 are refused with the field and its range.
#[test]
fn sizes_that_exhausted_memory_are_refused_or_budgeted_in_bounded_memory() {
    let limited = "ulimit -v 1048576 && exec \"$@\"";
    for acc in ["100000", "1048576"] {
        let args = [
            "estimate",
            "--batch",
            acc,
            "--microbatch",
            "1",
            "--accumulation",
            acc,
            "--json",
        ];
        let (c, out, err, _) = run_within(&args, 60, Some(limited));
        assert_eq!(c, 0, "accumulation {acc}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        let tl = &v["timeline"];
        assert_eq!(tl["laid_out"], 2);
        assert_eq!(tl["microbatches"].as_u64(), acc.parse::<u64>().ok());
        assert_eq!(tl["repeated"]["as_microbatch"], 1);
        assert!(tl["events"].as_array().unwrap().len() < 1000);
        let (c, _, err, _) = run_within(
            &argv_with(
                "plan --budget 80GiB --batch {} --microbatch 1 --accumulation {}",
                &[acc, acc],
            ),
            60,
            Some(limited),
        );
        assert!(c == 0 || c == 3, "plan accumulation {acc}: exit {c}: {err}");
    }
    // The table says which microbatches repeat.
    let (c, out, _) = run(&argv(
        "estimate --batch 100000 --microbatch 1 --accumulation 100000 --verbose",
    ));
    assert_eq!(c, 0);
    assert!(
        out.contains("microbatches 2..=99999 repeat microbatch 1"),
        "{out}"
    );

    rejects(
        &argv("estimate --batch 4294967295 --microbatch 1 --accumulation 4294967295"),
        2,
        &["workload.accumulation", "1..=1048576"],
    );
    let dir = temp_dir("hostile", "depth");
    let cfg = dir.join("deep.toml");
    let mut text = ditmem_budget::Spec::default_xl().to_toml().unwrap();
    text = text.replace("depth = 28", "depth = 16777216");
    assert!(text.contains("depth = 16777216"));
    std::fs::write(&cfg, text).unwrap();
    for cmd in ["estimate", "plan", "spec"] {
        let mut args = vec![cmd, "--config", s(&cfg)];
        if cmd == "plan" {
            args.extend(["--budget", "24GiB"]);
        }
        rejects(&args, 2, &["model.depth", "1..=1024"]);
    }
}

/// Finding 2: plan time no longer grows with the square of the depth: at the depth cap it
/// evaluates a number of timelines that does not depend on the depth beyond its logarithm.
#[test]
fn plan_at_the_depth_cap_evaluates_few_timelines() {
    let dir = temp_dir("hostile", "deep-plan");
    let cfg = dir.join("deep.toml");
    let text = ditmem_budget::Spec::default_xl()
        .to_toml()
        .unwrap()
        .replace("depth = 28", "depth = 1024");
    std::fs::write(&cfg, text).unwrap();
    let (c, out, err, _) = run_within(
        &argv_with(
            "plan --config {} --budget 200GiB --allow lora,8bit,bf16-pure --json",
            &[s(&cfg)],
        ),
        120,
        None,
    );
    assert!(c == 0 || c == 3, "exit {c}: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let evaluated = v["evaluated"].as_u64().unwrap();
    let combos = v["combinations"].as_u64().unwrap();
    // At most: all, two placements below, attention-only, none, and two placements per
    // bisection step (log2 1024 = 10) for every combination, plus the base.
    assert!(
        evaluated <= 1 + combos * (5 + 2 * 10),
        "{evaluated} timelines for {combos}"
    );
}

/// Found by the argument fuzzer: ranks × accumulation past u32 wrapped to 0 and divided the
/// batch by it (a panic); now the sizes are refused by validation, one line, exit 2.
#[test]
fn products_past_u32_are_refused_not_divided_by() {
    rejects(
        &argv("estimate --batch 5 --ranks 65536 --accumulation 65536"),
        2,
        &["workload.", "allowed"],
    );
    rejects(
        &argv("estimate --microbatch 65536 --ranks 1048576 --accumulation 1048576"),
        2,
        &["workload.batch", "allowed"],
    );
}

/// Issue 50, finding 1 and 2: a latents folder whose `.npy` declares a shape past usize
/// ("capacity overflow" before) or holds a FIFO named `a.npy` (blocked forever before) is one
/// line and exit 2: every file is checked before it is opened, every size before it sizes an
/// allocation.
#[test]
fn latent_folders_are_checked_before_anything_is_opened() {
    let dir = temp_dir("hostile", "latents");
    let npy = |name: &str, shape: &str, data: &[u8]| {
        let header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend((header.len() as u16).to_le_bytes());
        b.extend(header.as_bytes());
        b.extend(data);
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("a.npy"), b).unwrap();
        d
    };
    let spec = argv("run --preset dit-s-2 --resolution 32 --batch 1");
    let cases = [
        (
            npy("huge", "(18446744073709551615,4,4,4)", &[]),
            "overflows",
        ),
        (npy("short", "(1000,4,4,4)", &[0; 16]), "data bytes"),
    ];
    let fifo = dir.join("fifo");
    std::fs::create_dir_all(&fifo).unwrap();
    mkfifo(&fifo.join("a.npy"));
    for (d, why) in cases.iter().map(|(d, w)| (d, *w)).chain([(&fifo, "FIFO")]) {
        let mut args = spec.to_vec();
        args.extend(["--steps", "1", "--latents-dir", s(d)]);
        let (c, out, err, _) = run_within(&args, 60, None);
        assert_eq!(c, 2, "{args:?}: {err}");
        assert!(out.is_empty());
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains("--latents-dir") && err.contains(why), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 50, finding 3: under address-space limits that aborted (exit 134: the heap grew in
/// 256 MiB steps) or panicked in rayon (a thread stack that could not be mapped), `run`,
/// `compare` and `verify` refuse with one line and exit 3 naming the limit; below what the
/// process needs before any step, the line names that need.
#[test]
fn low_address_space_limits_are_refused_not_aborted() {
    let spec = argv("--preset dit-s-2 --resolution 32 --batch 1 --steps 1");
    for kib in [30_000u64, 100_000, 200_000, 290_000] {
        let wrapper = format!("ulimit -v {kib} && exec \"$@\"");
        for cmd in ["run", "compare", "verify"] {
            let mut args = vec![cmd];
            args.extend_from_slice(&spec);
            let (c, out, err, _) = run_within(&args, 60, Some(&wrapper));
            assert_eq!(c, 3, "{kib} KiB {args:?}: {err}");
            assert!(out.is_empty());
            assert_eq!(err.trim_end().lines().count(), 1, "{err}");
            assert!(err.contains("address-space limit"), "{err}");
            if kib == 30_000 {
                assert!(err.contains("needs at least"), "{err}");
            }
        }
    }
}

/// Issue 50, finding 4: an output that names a folder (`out/new/`, `file.txt/`) is refused
/// before the work (exit 2, not exit 1 "Not a directory" after it), and a new 250-character
/// file name is written (its temporary name stays within 255 bytes).
#[test]
fn outputs_naming_a_folder_are_refused_and_long_names_written() {
    let dir = temp_dir("hostile", "slash");
    let d = s(&dir).to_string();
    let new = format!("{d}/new/");
    let file = format!("{d}/file.txt/");
    std::fs::write(dir.join("file.txt"), b"kept").unwrap();
    for args in [
        vec!["estimate", "--plot", &new],
        vec!["estimate", "--plot", &file],
        vec!["plan", "--budget", "24GiB", "--out", &file],
        vec![
            "plan",
            "--budget",
            "24GiB",
            "--emit",
            "deepspeed",
            "--emit-out",
            &new,
        ],
        vec!["verify", "--steps", "1", "--save-reference", &new],
    ] {
        let (c, out, err, took) = run_within(&args, 60, None);
        assert_eq!(c, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}");
        assert!(err.contains("names a folder"), "{err}");
        assert!(
            took < Duration::from_secs(10),
            "{args:?} before the work: {took:?}"
        );
    }
    assert_eq!(std::fs::read(dir.join("file.txt")).unwrap(), b"kept");
    let long = dir.join("n".repeat(250));
    let (c, _, err) = run(&["estimate", "--plot", s(&long)]);
    assert_eq!(c, 0, "{err}");
    assert!(std::fs::read_to_string(&long).unwrap().contains("<svg"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 50, finding 5: `compare --snapshot` with no flags, or only `--preset` or `--config`,
/// moves the spec to pytorch:cuda by itself (exit 0), as its help says.
#[test]
fn a_snapshot_alone_moves_the_spec_to_cuda() {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/snapshots/");
    let pickle = format!("{data}dit-s2-fp32-recompute.pickle");
    let config = format!("{data}dit-s2-fp32-recompute.spec.json");
    for extra in [
        vec![],
        vec!["--preset", "dit-s-2"],
        vec!["--config", &config],
    ] {
        let mut args = vec!["compare", "--snapshot", &pickle, "--json"];
        args.extend(extra);
        let (c, out, err) = run(&args);
        assert_eq!(c, 0, "{args:?}: {err}");
        assert!(out.contains("max_allocated"), "{args:?}");
    }
    rejects(
        &["compare", "--snapshot", &pickle, "--cpu-threads", "2"],
        2,
        &["--cpu-threads", "allowed"],
    );
    rejects(
        &["compare", "--snapshot", &pickle, "--device", "x"],
        2,
        &["--device", "allowed"],
    );
    rejects(
        &["compare", "--snapshot", &pickle, "--device", "7"],
        2,
        &["--device", "allowed: 0"],
    );
}

/// Issue 50, finding 6: `--python` that is a device, a folder, a FIFO or not executable is bad
/// input (exit 2) before any work; a missing one is a missing tool (exit 5).
#[test]
fn the_peer_python_is_checked_up_front() {
    let dir = temp_dir("hostile", "python");
    let fifo = dir.join("python-fifo");
    mkfifo(&fifo);
    let plain = dir.join("python-plain");
    std::fs::write(&plain, b"#!/bin/sh\n").unwrap();
    for (p, why) in [
        ("/dev/null", "character device"),
        (s(&dir), "directory"),
        (s(&fifo), "FIFO"),
        (s(&plain), "not executable"),
    ] {
        rejects(
            &["compare", "--runtime", "pytorch", "--python", p],
            2,
            &["--python", why, "allowed"],
        );
    }
    rejects(
        &argv_with(
            "compare --runtime pytorch --python {}",
            &[&format!("{}/none", s(&dir))],
        ),
        5,
        &["--python"],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 50, finding 2 (plan's search bounded by time) and issue 44 item 5 (progress only on a
/// terminal): a search cut by `--time-limit` returns at once and says what it did not search,
/// in JSON and in a line; stderr (a file here, never a terminal) holds no progress line.
#[test]
fn plan_is_bounded_by_time_and_says_what_it_left() {
    let base = argv("plan --preset flux.1-dev --gpu rtx-4090 --allow all --time-limit 0.1");
    let mut args = base.to_vec();
    args.push("--json");
    let (c, out, err, took) = run_within(&args, 120, None);
    // Nothing that fits is found in 0.1 s (flux needs LoRA and a quantized base on 24 GB).
    assert_eq!(c, 3, "{err}");
    assert!(took < Duration::from_secs(30), "{took:?}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let n = &v["not_searched"];
    assert_eq!(n["time_limit_s"], 0.1, "{n}");
    assert!(
        n["combinations"].as_u64().unwrap() > 0 || !n["stages"].as_array().unwrap().is_empty(),
        "{n}"
    );
    assert!(
        err.contains("time limit") && err.contains("--time-limit"),
        "{err}"
    );
    let (c, out, err, _) = run_within(&base, 120, None);
    assert_eq!(c, 3, "{err}");
    assert!(out.contains("not searched: the search stopped at its time limit (0.1 s)"));
    assert!(!err.contains("plan: stage") && !err.contains('\r'), "{err}");
    rejects(
        &["plan", "--budget", "24GiB", "--time-limit", "0"],
        2,
        &["--time-limit", "allowed"],
    );
}

/// Issue 50, finding 2: the faster search (the allocator's free blocks indexed, points shared
/// between stages) gives the same plan: a CUDA plan with partial recompute, a split microbatch
/// and expandable segments under max_split_size, its answer recorded before the change.
#[test]
fn a_fixed_plan_keeps_its_answer() {
    let (c, out, err) = run(&argv("plan --preset dit-xl-2 --gpu t4 --batch 256 --alloc-conf max_split_size_mb:128 --allow all --time-limit 600 --json"));
    assert_eq!(c, 0, "{err}");
    assert!(!err.contains("plan: stage"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["not_searched"].is_null());
    assert_eq!(v["predicted_peak_bytes"], 15_034_482_688u64);
    assert_eq!(v["predicted_step_time_s"], 43.0082008379963);
    let changes = strs(&v["changes"]);
    assert_eq!(
        changes,
        [
            "precision bf16-mixed → bf16-pure",
            "recompute 3 of 28 blocks (blocks:0,1,3)",
            "attention materialized → memory-efficient",
            "microbatch 256 → 4 with accumulation 64",
            "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128,expandable_segments:True (the \
             allocated peak fits, the cached segments do not)",
        ]
    );
}
