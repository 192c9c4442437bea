//! The spec's `cpu` section through the binary: filled from the host only where the spec leaves it
//! out, printed with the estimate, followed by the budget, and refused by `run` when it does not
//! describe the process.

mod common;

use common::{argv, argv_with, ditmem, ditmem_env, exits_naming};

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("JSON: {e}\n{out}"))
}

#[test]
fn the_host_fills_only_what_the_spec_leaves_out() {
    // `spec` defaults to pytorch:cuda as `estimate` does: the engine's spec is asked for.
    // The pool's threads are the host value: RAYON_NUM_THREADS decides them.
    let (code, out, err) = ditmem_env(
        &[("RAYON_NUM_THREADS", "3")],
        &["spec", "--json", "--runtime", "ditmem-cpu"],
    );
    assert_eq!(code, 0, "{err}");
    let cpu = &json(&out)["cpu"];
    assert_eq!(cpu["threads"], 3);
    assert!(cpu["gemm_l2_bytes"].as_u64().unwrap() > 0);
    // DITMEM_BF16_GEMM=widen makes the filled-in path widen.
    let (_, out, _) = ditmem_env(
        &[("DITMEM_BF16_GEMM", "widen")],
        &["spec", "--json", "--runtime", "ditmem-cpu"],
    );
    assert_eq!(json(&out)["cpu"]["bf16_products"], "widen");
    // Flags win over the host.
    let (_, out, _) = ditmem_env(
        &[("RAYON_NUM_THREADS", "3")],
        &argv("spec --json --cpu-threads 5 --gemm-l2 2MiB --bf16-products widen"),
    );
    let cpu = &json(&out)["cpu"];
    assert_eq!(cpu["threads"], 5);
    assert_eq!(cpu["gemm_l2_bytes"], 2 << 20);
    assert_eq!(cpu["bf16_products"], "widen");
    // A spec file's section wins over the host: a file from another machine estimates as there.
    let d = common::temp_dir("cpu", "file");
    let p = d.join("xeon.toml");
    let (_, toml, _) = ditmem(&["spec", "--gemm-l2", "2MiB", "--cpu-threads", "2"]);
    std::fs::write(&p, toml).unwrap();
    let (code, out, err) = ditmem_env(
        &[("RAYON_NUM_THREADS", "1")],
        &["spec", "--json", "--config", p.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["cpu"]["threads"], 2);
    assert_eq!(json(&out)["cpu"]["gemm_l2_bytes"], 2 << 20);
    std::fs::remove_dir_all(&d).ok();
}

/// End to end: the same fp32 spec on the two CPUs' figures (AMD EPYC: 1 MiB L2 per core; Intel
/// Xeon Sapphire Rapids: 2 MiB) differs by the two threads' extra gemm slabs, and the recipe line
/// says which CPU the estimate describes.
#[test]
fn the_estimate_follows_the_cpu_section() {
    let est = |l2: &str| {
        let (code, out, err) = ditmem(&argv_with("estimate --preset dit-s-2 --batch 2 --precision fp32 --cpu-threads 2 --gemm-l2 {} --json", &[l2]));
        assert_eq!(code, 0, "{err}");
        json(&out)["peak_bytes"].as_u64().unwrap()
    };
    assert_eq!(est("2MiB") - est("1MiB"), 2 << 20);
    let (code, out, _) = ditmem(&argv(
        "estimate --preset dit-s-2 --cpu-threads 2 --gemm-l2 2MiB --bf16-products widen",
    ));
    assert_eq!(code, 0);
    // The recipe line wraps at the output's width: read it with its breaks as spaces.
    let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("runtime ditmem-cpu (2 threads, bf16 products widened to f32, gemm slab 2.00 MiB per thread)"),
        "{out}"
    );
}

#[test]
fn a_cpu_that_is_not_this_process_is_refused() {
    let (code, out, _) = ditmem(&["spec", "--json", "--runtime", "ditmem-cpu"]);
    assert_eq!(code, 0);
    let here = json(&out)["cpu"].clone();
    let threads = here["threads"].as_u64().unwrap() + 1;
    let l2 = here["gemm_l2_bytes"].as_u64().unwrap() * 2;
    let small = argv("run --preset dit-s-2 --resolution 64 --batch 1 --steps 1");
    for (flag, value, field) in [
        ("--cpu-threads", threads.to_string(), "cpu.threads"),
        ("--gemm-l2", l2.to_string(), "cpu.gemm_l2_bytes"),
    ] {
        let mut args = small.to_vec();
        args.extend([flag, value.as_str()]);
        let (code, _, err) = ditmem(&args);
        assert_eq!(code, 2, "{flag}: {err}");
        assert!(err.contains(field), "{flag}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // The section describes the engine's CPU: not with another runtime.
    exits_naming(
        &argv("estimate --runtime pytorch:cuda --cpu-threads 2"),
        2,
        "cpu",
    );
    // Out of range.
    for (flag, value) in [
        ("--gemm-l2", "0"),
        ("--cpu-threads", "0"),
        ("--bf16-products", "fast"),
    ] {
        let (code, _, err) = ditmem(&["estimate", flag, value]);
        assert_eq!(code, 2, "{flag} {value}: {err}");
    }
}
