//! The answer first: `estimate` and `plan` say in their first five lines whether the step fits,
//! what the device would show, what takes the memory and what to change; their output fits 100
//! columns when piped; and they behave as Unix filters when stdout goes away or fails.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};

use common::{argv, assert_fits_100, ditmem};

/// The extra words of `estimate` command lines (each split as [`argv`] splits a line).
const ESTIMATES: &[&str] = &[
    "",
    "--gpu h100",
    "--preset flux.1-dev --resolution 1024 --batch 1 --lora-rank 16 --gpu rtx-4090",
    "--preset sd3.5-medium --resolution 1024 --batch 8 --ranks 8 --gpu a100-80gb",
    "--preset wan2.1-1.3b --frames 81 --resolution 480x832 --batch 1 --lora-rank 16",
    "--preset dit-s-2 --runtime ditmem-cpu",
];

#[test]
fn estimate_answers_in_its_first_five_lines() {
    for extra in ESTIMATES {
        let mut args = vec!["estimate"];
        args.extend(argv(extra));
        let (code, out, err) = ditmem(&args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert_fits_100(&format!("{args:?}"), &out);
        let lines: Vec<&str> = out.lines().take(5).collect();
        assert_eq!(lines.len(), 5, "{args:?}: {out}");
        assert!(
            lines[1].starts_with("fits"),
            "{args:?}: line 2 {}",
            lines[1]
        );
        assert!(
            lines[2].starts_with("device peak:") || lines[2].starts_with("peak:"),
            "{args:?}: line 3 {}",
            lines[2]
        );
        assert!(
            lines[3].starts_with("biggest: ") && lines[3].contains(" % · "),
            "{args:?}: line 4 {}",
            lines[3]
        );
        assert!(
            lines[4].starts_with("change: "),
            "{args:?}: line 5 {}",
            lines[4]
        );
        // Details come on request only.
        assert!(!out.contains("op inventory"), "{args:?}");
        let mut verbose = args.clone();
        verbose.push("--verbose");
        let (code, long, _) = ditmem(&verbose);
        assert_eq!(code, 0);
        assert!(long.len() > out.len() && long.contains("phase"), "{args:?}");
        assert_fits_100(&format!("{verbose:?}"), &long);
    }
}

/// The line that says whether it fits names the card, and a change that fits says so.
#[test]
fn the_fit_and_the_change_name_the_card() {
    let mut args = vec!["estimate"];
    args.extend(argv(ESTIMATES[2]));
    let (code, out, _) = ditmem(&args);
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[1].starts_with("fits rtx-4090 ("), "{}", lines[1]);
    assert!(
        lines[1].contains(": no"),
        "Flux LoRA at 1024² without recompute: {}",
        lines[1]
    );
    // After a simulated OOM the report says where the replay stopped.
    assert!(
        out.contains("out of memory: the caching allocator's replay fails"),
        "{out}"
    );
    // The change is a flag with what the step then needs.
    assert!(lines[4].contains("--recompute all → "), "{}", lines[4]);

    let (code, out, _) = ditmem(&["estimate", "--gpu", "h100"]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[1].starts_with("fits h100-sxm (") && lines[1].contains(": yes"));
    assert!(lines[4].starts_with("change: none needed"), "{}", lines[4]);
}

/// A change chosen as the least that fits the card to the byte says how little it leaves: the
/// planner keeps 5 % of the card free, the change line shows when a lever keeps less.
#[test]
fn a_change_that_barely_fits_says_how_much_is_free() {
    let args = argv("estimate --preset sd3.5-large --lora-rank 16 --gpu rtx-4090 --json");
    let (code, out, err) = ditmem(&args);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let cap = v["cuda"]["capacity_bytes"].as_u64().unwrap();
    let first = &v["levers"][0];
    let peak = first["device_peak_bytes"].as_u64().unwrap();
    assert!(first["fits"] == true && peak <= cap, "{first}");
    // The least recompute that fits leaves under 5 % of the card.
    assert!(((cap - peak) as f64) < 0.05 * cap as f64, "{cap} {peak}");
    let (_, text, _) = ditmem(&args[..args.len() - 1]);
    let line = text.lines().nth(4).unwrap();
    assert!(
        line.contains(", fits with ") && line.contains(" free, step ×"),
        "{line}"
    );
    // A lever with room to spare says only that it fits.
    let (_, text, _) = ditmem(&argv(
        "estimate --preset pixart-sigma-1024 --batch 4 --gpu a100-40gb",
    ));
    let line = text.lines().nth(4).unwrap();
    assert!(line.contains(", fits, step ×"), "{line}");
}

/// When no one flag makes the step fit, the change line sends the user to the planner with the
/// levers it leaves out by default let in, and following it finds a recipe that fits.
#[test]
fn when_no_one_flag_fits_the_change_line_leads_to_a_plan_that_does() {
    let spec = "--preset flux.1-dev --lora-rank 16 --gpu rtx-4090";
    let (code, text, err) = ditmem(&argv(&format!("estimate {spec}")));
    assert_eq!(code, 0, "{err}");
    let line = text.lines().nth(4).unwrap();
    assert_eq!(
        line,
        "change: no one flag is enough (the most: --recompute all → 25.3 GiB); try ditmem plan \
         --allow all"
    );
    let (code, _, err) = ditmem(&argv(&format!("plan {spec}")));
    assert_eq!(code, 3, "without --allow nothing fits: {err}");
    let (code, plan, err) = ditmem(&argv(&format!("plan {spec} --allow all")));
    assert_eq!(code, 0, "{err}");
    assert!(
        plan.lines().nth(1).unwrap().starts_with("fits: yes"),
        "{plan}"
    );
}

/// `--json` carries the answer too: what has to fit and each lever.
#[test]
fn estimate_json_has_the_levers() {
    let mut args = vec!["estimate", "--json"];
    args.extend(argv(ESTIMATES[2]));
    let (code, out, _) = ditmem(&args);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let need = v["need_bytes"].as_u64().unwrap();
    assert!(need >= v["peak_bytes"].as_u64().unwrap());
    let levers = v["levers"].as_array().unwrap();
    assert!(!levers.is_empty());
    for l in levers {
        assert!(l["device_peak_bytes"].as_u64().unwrap() < need, "{l}");
        assert!(l["flags"].as_str().unwrap().starts_with("--"), "{l}");
    }
}

#[test]
fn plan_answers_in_its_first_five_lines() {
    for args in [
        &["plan", "--budget", "20GiB"][..],
        &argv("plan --preset flux.1-dev --resolution 1024 --batch 1 --lora-rank 16 --gpu rtx-4090 --allow 8bit,quant")[..],
        &["plan", "--budget", "1GiB"][..],
    ] {
        let (code, out, err) = ditmem(args);
        assert!(code == 0 || code == 3, "{args:?}: {err}");
        assert_fits_100(&format!("{args:?}"), &out);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("plan for "), "{}", lines[0]);
        assert!(lines[1].starts_with("fits: "), "{}", lines[1]);
        // The fits line may take two lines in a narrow terminal; the rest follow in order.
        let rest = &out[out.find("\nstep: ").expect("a step line")..];
        let b = rest.find("\nbiggest: ").expect("a biggest line");
        let c = rest.find("\nchanges: ").expect("a changes line");
        let w = rest.find("\nwhy: ").expect("a why line");
        assert!(b < c && c < w, "{out}");
        // `why:` in at most three lines.
        let why_lines = rest[w + 1..]
            .lines()
            .take_while(|l| l.starts_with("why: ") || l.starts_with("  "))
            .count();
        assert!(
            (1..=3).contains(&why_lines),
            "{why_lines} lines of why: {out}"
        );
        if code == 3 {
            assert!(lines[1].starts_with("fits: no"), "{}", lines[1]);
        }
    }
}

/// Run with stdout to a pipe whose reader reads `keep` bytes and then closes it.
fn with_reader_closing(args: &[&str], keep: usize) -> (i32, String, String) {
    let mut child = common::spawn_piped(args, Stdio::inherit());
    let mut stdout = child.stdout.take().unwrap();
    let mut buf = vec![0u8; keep];
    let mut got = 0;
    while got < keep {
        match stdout.read(&mut buf[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    drop(stdout);
    let out = child.wait_with_output().expect("waits");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&buf[..got]).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `ditmem estimate | head -1`, `ditmem plan … | head -3`, `ditmem estimate --inventory | head
/// -c1`: the reader goes away; ditmem ends quietly (exit 0, nothing on stderr), as a Unix
/// filter does — no panic.
#[test]
fn a_closed_pipe_ends_quietly() {
    for (args, keep) in [
        (&["estimate"][..], 1usize),
        (&["estimate", "--inventory", "--verbose"][..], 1),
        (&["plan", "--budget", "20GiB"][..], 40),
        (&["gpus"][..], 1),
        (&["spec", "--json"][..], 1),
        (&["params", "--preset", "flux.1-dev"][..], 1),
    ] {
        let (code, _, err) = with_reader_closing(args, keep);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(err.is_empty(), "{args:?}: {err}");
    }
}

/// `ditmem gpus > /dev/full`: a write that fails is one line and exit 1, never a panic.
#[test]
fn a_failed_write_is_one_line() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        return; // no /dev/full on this system
    };
    for args in [
        &["gpus"][..],
        &["estimate"][..],
        &["spec"][..],
        &["params", "--preset", "sd3-medium"][..],
        &["estimate", "--json"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ditmem"))
            .args(args)
            .stdout(full.try_clone().unwrap())
            .output()
            .expect("the binary runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains("writing to stdout"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
